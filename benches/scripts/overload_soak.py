#!/usr/bin/env python3
"""Overload soak: ultrafast at 3x its capacity for 60 s, RSS sampled every second.

A slow origin (fixed service time) sits behind ultrafast with a pool
concurrency limit, so capacity = slots / service time. After a warm-up and
an idle baseline, the load runs open-loop (constant arrival rate, latency
from each request's planned send time, so no coordinated omission) at 3x
capacity for --duration seconds; then the load stops and RSS is watched for
--recover seconds more. Reported: RSS of the ultrafast process every second
(before, during, after), p50/p99 of admitted requests, the refusals
(429/503) and errors, and the time from the end of the load until RSS is
back within 5% (or 2 MiB) of the idle baseline.

usage: benches/scripts/overload_soak.py [--duration 60] [--recover 10]
       [--service-ms 50] [--slots 8] [--bin target/release/ultrafast]
Build first: cargo build --release -p ultrafast
"""
import argparse, asyncio, os, socket, subprocess, sys, tempfile, time
from benchlib import ROOT, free_port, pct_ms, spawn, stop_tree

CONFIG = """[server]
threads = 1
pid_file = "{tmp}/soak.pid"
upgrade_sock = "{tmp}/soak.sock"
shutdown_grace_period_s = 0
[admin]
listen = ""
[log]
access_log = "off"
[[listeners]]
address = "127.0.0.1:{port}"
[lanes.standard]
rank = 1
queue_len = 64
max_wait_ms = 500
[pools.o]
members = [{{ addr = "127.0.0.1:{origin}" }}]
max_concurrency = {slots}
retry = {{ attempts = 1 }}
[[routes]]
path = "/"
pool = "o"
"""


async def origin(port, service_s):
    async def handle(r, w):
        try:
            while True:
                await r.readuntil(b"\r\n\r\n")
                await asyncio.sleep(service_s)
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await w.drain()
        except (Exception, asyncio.CancelledError):
            pass
        finally:
            w.close()
    return await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)


async def one(port, planned, results, limit_s):
    await asyncio.sleep(max(0, planned - time.monotonic()))
    try:
        r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), limit_s)
        w.write(b"GET / HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n")
        data = await asyncio.wait_for(r.read(), limit_s)
        w.close()
        status = int(data.split(b" ", 2)[1])
    except Exception:
        status = 0
    results.append((status, time.monotonic() - planned))


async def load(port, rate, duration, results, limit_s=30):
    start = time.monotonic() + 0.1
    tasks = [asyncio.create_task(one(port, start + i / rate, results, limit_s))
             for i in range(int(rate * duration))]
    await asyncio.gather(*tasks)


def rss_kb(pid, key="Rss"):
    """A memory figure of `pid` in KiB: `Rss` and `Anonymous` (and `File`,
    their difference) exactly from smaps_rollup, which walks the page
    tables; others (`VmHWM`, `Threads`) from /proc/PID/status. Since Linux
    6.2 the status file's VmRSS/RssAnon are per-CPU counters read without
    summing the CPUs' pending deltas, off by up to a few MiB, which is the
    size of what this soak looks for."""
    if key in ("Rss", "Anonymous", "File"):
        vals = {}
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("Rss", "Anonymous"):
                    vals[k] = int(v.split()[0])
        if key == "File":
            return vals.get("Rss", 0) - vals.get("Anonymous", 0)
        return vals.get(key, 0)
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    return 0


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=60)
    ap.add_argument("--recover", type=int, default=10)
    ap.add_argument("--service-ms", type=int, default=50)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/release/ultrafast"))
    args = ap.parse_args()
    if not os.path.exists(args.bin):
        sys.exit(f"no binary at {args.bin}: cargo build --release -p ultrafast (or pass --bin)")
    tmp = tempfile.mkdtemp(prefix="uf-soak-")
    op, port = free_port(), free_port()
    srv = await origin(op, args.service_ms / 1000)
    cfg = os.path.join(tmp, "soak.toml")
    with open(cfg, "w") as f:
        f.write(CONFIG.format(port=port, origin=op, tmp=tmp, slots=args.slots))
    capacity = args.slots / (args.service_ms / 1000)
    rate = 3 * capacity
    print(f"# binary: {args.bin}")
    print(f"# load average before: {os.getloadavg()}")
    p = spawn([args.bin, "serve", "-c", cfg], stdout=subprocess.DEVNULL,
              stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), 0.1).close(); break
            except OSError:
                await asyncio.sleep(0.05)
        # Warm-up under capacity, then an idle baseline.
        await load(port, capacity / 2, 3, [])
        await asyncio.sleep(2)
        baseline = rss_kb(p.pid)
        base_split = (rss_kb(p.pid, "Anonymous"), rss_kb(p.pid, "File"), rss_kb(p.pid, "Threads"))
        samples = []  # (seconds since load start, phase, rss KiB)
        t0 = time.monotonic()
        stop = asyncio.Event()

        phase = {"now": "load"}

        async def sample():
            while not stop.is_set():
                samples.append((time.monotonic() - t0, phase["now"], rss_kb(p.pid),
                                rss_kb(p.pid, "Anonymous"), rss_kb(p.pid, "File"),
                                rss_kb(p.pid, "Threads")))
                await asyncio.sleep(1.0 - (time.monotonic() - t0) % 1.0)
        s = asyncio.create_task(sample())
        results = []
        await load(port, rate, args.duration, results)
        load_end = time.monotonic() - t0
        phase["now"] = "after"
        await asyncio.sleep(args.recover)
        stop.set()
        await s
        peak = rss_kb(p.pid, "VmHWM")
    finally:
        stop_tree(p)
        srv.close()
    ok = [x[1] for x in results if x[0] == 200]
    shed = [x for x in results if x[0] in (429, 503)]
    err = [x for x in results if x[0] not in (200, 429, 503)]
    tol = max(baseline * 0.05, 2048)
    after = [(t, r) for t, ph, r, *_ in samples if ph == "after"]
    recovered = next((t - load_end for t, r in after if r <= baseline + tol), None)
    print(f"## overload soak: capacity {capacity:.0f} req/s ({args.slots} slots x "
          f"{args.service_ms} ms), offered {rate:.0f} req/s (3x) for {args.duration} s "
          f"(the load ended at {load_end:.1f} s)")
    print(f"requests {len(results)}: admitted {len(ok)}, refused 429/503 {len(shed)}, errors {len(err)}")
    print(f"admitted latency: p50 {pct_ms(ok, 0.5):.1f} ms, p99 {pct_ms(ok, 0.99):.1f} ms")
    print(f"RSS KiB: idle baseline {baseline}, max during load "
          f"{max((r for _, ph, r, *_ in samples if ph == 'load'), default=0)}, VmHWM {peak}, "
          f"last {samples[-1][2] if samples else 0}")
    print("recovered to baseline (+max(5%, 2 MiB)): "
          + (f"{recovered:.1f} s after the load" if recovered is not None
             else f"not within {args.recover} s"))
    print("RSS over time (s since load start: KiB):")
    print(" ".join(f"{t:.0f}{'*' if ph == 'after' else ''}:{r}" for t, ph, r, *_ in samples))
    print(f"anon/file KiB, threads (idle: {base_split[0]}/{base_split[1]}/{base_split[2]}):")
    print(" ".join(f"{t:.0f}{'*' if ph == 'after' else ''}:{a}/{fl}/{th}"
                   for t, ph, _, a, fl, th in samples))
    print("(* = after the load ended)")
    print(f"# load average after: {os.getloadavg()}")


if __name__ == "__main__":
    asyncio.run(main())
