#!/usr/bin/env python3
"""Admission benchmark: lanes + shedding vs plain FIFO, in one run.

A slow origin (fixed service time) behind ultrafast with a pool concurrency
limit is driven open-loop (constant arrival rate, latency measured from each
request's planned send time, so no coordinated omission) at 3x its capacity
with a mixed lane load (10% ultra, 90% standard), for a bounded time. The same
load runs twice: lanes and shedding on, then off (one FIFO lane, unbounded
wait). Reported per lane: admitted p50/p99 latency, shed count,
time-to-refusal p99; the unloaded ultra p50; ultrafast's RSS over the run.

usage: benches/scripts/admission_bench.py [--duration 10] [--service-ms 50] [--slots 8]
Build first: cargo build --release -p ultrafast
"""
import argparse, asyncio, os, socket, subprocess, sys, tempfile, time
from benchlib import ROOT, free_port, pct_ms, spawn, stop_tree









async def origin(port, service_s):
    async def handle(r, w):
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                if not head:
                    return
                await asyncio.sleep(service_s)
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await w.drain()
        except (Exception, asyncio.CancelledError):
            pass
        finally:
            w.close()
    return await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)


async def one(port, lane, planned, results, limit_s, tag):
    await asyncio.sleep(max(0, planned - time.monotonic()))
    try:
        r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), limit_s)
        prio = f"X-Request-Priority: {lane}\r\n" if tag else ""
        w.write(f"GET / HTTP/1.1\r\nHost: b\r\n{prio}Connection: close\r\n\r\n".encode())
        data = await asyncio.wait_for(r.read(), limit_s)
        w.close()
        status = int(data.split(b" ", 2)[1])
    except Exception:
        status = 0
    results.append((lane, status, time.monotonic() - planned))


async def load(port, rate, duration, ultra_frac, results, tag=True, limit_s=30):
    start = time.monotonic() + 0.1
    n = int(rate * duration)
    tasks = []
    for i in range(n):
        lane = "ultra" if (i * 7919) % 100 < ultra_frac * 100 else "standard"
        tasks.append(asyncio.create_task(one(port, lane, start + i / rate, results, limit_s, tag)))
    await asyncio.gather(*tasks)



def rss_kb(pid, key="VmRSS"):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    return 0


async def run_mode(name, cfg_text, tmp, args, origin_port, tag=True):
    port = free_port()
    cfg = os.path.join(tmp, f"{name}.toml")
    with open(cfg, "w") as f:
        f.write(cfg_text.format(port=port, origin=origin_port, tmp=tmp, name=name, slots=args.slots))
    p = spawn([os.path.join(ROOT, "target/release/ultrafast"), "serve", "-c", cfg],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), 0.1).close(); break
            except OSError:
                await asyncio.sleep(0.05)
        unloaded = []
        await load(port, 5, 2, 1.0, unloaded, tag)
        capacity = args.slots / (args.service_ms / 1000)
        rate = 3 * capacity
        results, rss = [], []
        async def sample():
            while True:
                rss.append(rss_kb(p.pid)); await asyncio.sleep(0.5)
        s = asyncio.create_task(sample())
        await load(port, rate, args.duration, 0.1, results, tag)
        s.cancel()
        peak = rss_kb(p.pid, "VmHWM")
    finally:
        stop_tree(p)
    print(f"\n## {name}: capacity {capacity:.0f} req/s, offered {rate:.0f} req/s for {args.duration} s")
    print(f"unloaded ultra p50: {pct_ms([x[2] for x in unloaded if x[1] == 200], 0.5):.1f} ms")
    print("| lane | admitted | admitted p50 ms | admitted p99 ms | shed (429/503) | time-to-refusal p99 ms | errors |")
    print("|---|---|---|---|---|---|---|")
    for lane in ("ultra", "standard"):
        ok = [x[2] for x in results if x[0] == lane and x[1] == 200]
        shed = [x[2] for x in results if x[0] == lane and x[1] in (429, 503)]
        err = [x for x in results if x[0] == lane and x[1] not in (200, 429, 503)]
        print(f"| {lane} | {len(ok)} | {pct_ms(ok, 0.5):.1f} | {pct_ms(ok, 0.99):.1f} | {len(shed)} | {pct_ms(shed, 0.99):.1f} | {len(err)} |")
    print(f"RSS KiB over the run: first {rss[0] if rss else 0}, last {rss[-1] if rss else 0}, max {max(rss) if rss else 0}; VmHWM {peak}")
    return pct_ms([x[2] for x in unloaded if x[1] == 200], 0.5), results


LANES = """[server]
threads = 1
pid_file = "{tmp}/{name}.pid"
upgrade_sock = "{tmp}/{name}.sock"
shutdown_grace_period_s = 0
[admin]
listen = ""
[log]
access_log = "off"
[[listeners]]
address = "127.0.0.1:{port}"
[lanes.ultra]
rank = 0
queue_len = 64
max_wait_ms = 500
reserved_share = 0.25
preempt = true
[lanes.standard]
rank = 1
queue_len = 64
max_wait_ms = 1000
high_watermark = 0.75
[pools.o]
members = [{{ addr = "127.0.0.1:{origin}" }}]
max_concurrency = {slots}
retry = {{ attempts = 1 }}
[[routes]]
path = "/"
pool = "o"
"""

FIFO = """[server]
threads = 1
pid_file = "{tmp}/{name}.pid"
upgrade_sock = "{tmp}/{name}.sock"
shutdown_grace_period_s = 0
[admin]
listen = ""
[log]
access_log = "off"
[[listeners]]
address = "127.0.0.1:{port}"
# FIFO: the client sends no priority header, so every request lands in the
# one default lane: no reservation, no shedding, no max wait that matters.
[lanes.standard]
rank = 1
queue_len = 100000
max_wait_ms = 600000
[pools.o]
members = [{{ addr = "127.0.0.1:{origin}" }}]
max_concurrency = {slots}
retry = {{ attempts = 1 }}
[[routes]]
path = "/"
pool = "o"
"""


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--service-ms", type=int, default=50)
    ap.add_argument("--slots", type=int, default=8)
    args = ap.parse_args()
    if not os.path.exists(os.path.join(ROOT, "target/release/ultrafast")):
        sys.exit("build first: cargo build --release -p ultrafast")
    tmp = tempfile.mkdtemp(prefix="uf-adm-")
    op = free_port()
    srv = await origin(op, args.service_ms / 1000)
    print(f"# load average before: {os.getloadavg()}")
    await run_mode("lanes_and_shedding", LANES, tmp, args, op)
    await run_mode("fifo", FIFO, tmp, args, op, tag=False)
    srv.close()
    print(f"# load average after: {os.getloadavg()}")


if __name__ == "__main__":
    asyncio.run(main())
