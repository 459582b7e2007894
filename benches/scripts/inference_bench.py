#!/usr/bin/env python3
"""Inference front benchmark, in one run:

 (1) SSE pass-through overhead: client -> fake upstream directly, client ->
     ultrafast -> fake, client -> nginx (proxy_buffering off) -> fake, the
     three interleaved request by request in one load; time to first token
     p50/p99 and what each proxy adds over direct.
 (2) Mixed load, lanes vs FIFO: short interactive "ultra" requests among
     long "standard" ones at about 2x the fake's capacity; ultra TTFT p99
     against the unloaded ultra p50.
 (3) Cadence on vs off: a bursty fake (4 tokens per 160 ms), the ultra lane
     paced at a fixed 40 ms; delivered inter-token interval mean, stddev, p99
     measured at the client.

The load is open-loop: requests start at planned times (constant arrival
rate) for a bounded duration, latency counts from the planned start, so a
slow server cannot slow the load down (no coordinated omission). Every
process started is stopped at the end.

usage: benches/scripts/inference_bench.py [--rounds 3] [--duration 8] [--only pass,mixed,cadence] [--bare]
(--bare: (1) also through a bare Pingora proxy, benches/src/bare_pingora.rs)
Build first: cargo build --release -p ultrafast -p ultrafast-benches
"""
import argparse, asyncio, json, os, statistics, subprocess, sys, tempfile, time
from benchlib import ROOT, free_port, pct_ms, spawn, stop_tree, wait_port

REL = os.path.join(ROOT, "target", "release")


def fake(args):
    p = spawn([os.path.join(REL, "fake-openai"), *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline().strip()
    port = int(line.rsplit(":", 1)[1])
    return p, port


def ultrafast_conf(tmp, name, body):
    """Write a one-worker config with an inference route `/v1/` and `body`
    (pools, models, lanes); returns (its path, the listener's port)."""
    port, admin = free_port(), free_port()
    conf = os.path.join(tmp, f"{name}.toml")
    with open(conf, "w") as f:
        f.write(f"""[server]\nthreads = 1\npid_file = "{tmp}/{name}.pid"\nupgrade_sock = "{tmp}/{name}.sock"\n
[admin]\nlisten = "127.0.0.1:{admin}"\n[log]\naccess_log = "off"\n
[[listeners]]\nname = "http"\naddress = "127.0.0.1:{port}"\n
[[routes]]\nname = "openai"\npath = "/v1/"\ninference = true\n\n{body}\n""")
    return conf, port


def ultrafast(tmp, name, body):
    conf, port = ultrafast_conf(tmp, name, body)
    p = spawn([os.path.join(REL, "ultrafast"), "serve", "-c", conf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return p, port


def pass_body(upstream_port):
    """The pass-through case: model `m` on the fake at `upstream_port`,
    lane `standard` unpaced, no concurrency limit."""
    return (f"[pools.f]\nmembers = [{{ addr = \"127.0.0.1:{upstream_port}\" }}]\nkeepalive_idle_s = 60\n"
            "[models.m]\nbackend = \"upstream\"\npool = \"f\"\nmax_concurrency = 0\n"
            "[lanes.standard]\nrank = 1\npace = \"off\"\n")


def reference_cmd(which, port, upstream_port):
    """A reference proxy on `port` in front of `upstream_port`: `bare`, the
    bare Pingora proxy (benches/src/bare_pingora.rs, one thread), or
    `floor`, the least a Tokio program does (benches/src/tokio_floor.rs)."""
    addrs = [f"127.0.0.1:{port}", f"127.0.0.1:{upstream_port}"]
    if which == "bare":
        return [os.path.join(REL, "bare-pingora"), *addrs, "1"]
    return [os.path.join(REL, "tokio-floor"), *addrs]


def reference(which, upstream_port):
    """Start `reference_cmd(which, ...)` on a free port: (process, port)."""
    port = free_port()
    p = spawn(reference_cmd(which, port, upstream_port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return p, port


def nginx_cmd(tmp, upstream_port, single=False):
    """nginx streaming to `upstream_port` with one worker (with `single`,
    in one process: `master_process off`); returns (its command, its port)."""
    port = free_port()
    d = os.path.join(tmp, "nginx"); os.makedirs(d, exist_ok=True)
    conf = os.path.join(d, "nginx.conf")
    master = "master_process off; " if single else ""
    with open(conf, "w") as f:
        f.write(f"daemon off; {master}pid {d}/nginx.pid; error_log {d}/error.log warn; user root; worker_processes 1;\n"
                f"events {{}} http {{ access_log off; upstream up {{ server 127.0.0.1:{upstream_port}; keepalive 64; }}\n"
                f"server {{ listen 127.0.0.1:{port}; location / {{ proxy_pass http://up; proxy_http_version 1.1;\n"
                f"proxy_set_header Connection \"\"; proxy_buffering off; }} }} }}\n")
    return ["nginx", "-p", d, "-c", conf], port


def nginx(tmp, upstream_port):
    cmd, port = nginx_cmd(tmp, upstream_port)
    p = spawn(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return p, port


async def one(port, body, headers, planned, res):
    """One streaming request on its own connection: TTFT (first content
    chunk), delivered content arrival times, E2E, status."""
    r = {"status": 0, "ttft": None, "times": [], "e2e": None}
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        data = json.dumps(body).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n{extra}Connection: close\r\n\r\n".encode() + data)
        await writer.drain()
        status = await reader.readline()
        r["status"] = int(status.split()[1])
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        buf, done = b"", False
        while not done:
            chunk = await reader.read(65536)
            if not chunk:
                break
            now = time.perf_counter()
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                for line in ev.split(b"\n"):
                    line = line.split(b"\r\n")[-1]
                    if line == b"data: [DONE]":
                        done = True
                    if line.startswith(b"data: {") and b'"content"' in line and b'"content":""' not in line:
                        r["times"].append(now)
                        if r["ttft"] is None:
                            r["ttft"] = now - planned
        r["e2e"] = time.perf_counter() - planned
        writer.close()
    except Exception as e:  # a refused or broken request counts as such
        r["error"] = str(e)
    res.append(r)


async def load(port, rate, duration, make):
    """Open-loop: request i starts at t0 + i/rate, for `duration` seconds.
    `port` is one port, or a dict from a request's tag to its port."""
    res, tasks = [], []
    t0 = time.perf_counter() + 0.05
    n = int(rate * duration)
    for i in range(n):
        planned = t0 + i / rate
        await asyncio.sleep(max(0, planned - time.perf_counter()))
        body, headers, tag = make(i)
        rec = []
        to = port[tag] if isinstance(port, dict) else port
        tasks.append((tag, rec, asyncio.create_task(one(to, body, headers, planned, rec))))
    await asyncio.wait_for(asyncio.gather(*(t for _, _, t in tasks)), timeout=duration + 60)
    out = {}
    for tag, rec, _ in tasks:
        out.setdefault(tag, []).extend(rec)
    return out


def chat(max_tokens, content="hi"):
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "stream": True}


def passthrough(tmp, rounds, duration, bare=False):
    fp, fport = fake(["--tokens", "16", "--itl-ms", "1", "--ttft-ms", "5", "--capacity", "1000"])
    up, uport = ultrafast(tmp, "pass", pass_body(fport))
    np_, nport = nginx(tmp, fport)
    bp = None
    try:
        # The three paths interleaved in one load (request i goes to path
        # i mod 3), so that they share the VM's moments: measured one after
        # the other, a path's p99 moved by milliseconds with whatever else
        # the machine did in its seconds (benches/RESULTS.md section 15).
        paths = {"direct": fport, "ultrafast": uport, "nginx": nport}
        if bare:
            # Pingora by itself (benches/src/bare_pingora.rs, nothing but
            # `upstream_peer`): what any proxy on it starts from.
            bp, paths["bare Pingora"] = reference("bare", fport)
        names = list(paths)
        rows = {k: [] for k in names}
        pooled = {k: [] for k in names}
        for _ in range(rounds):
            res = asyncio.run(load(paths, 20 * len(names), duration, lambda i: (chat(16), {}, names[i % len(names)])))
            for name in names:
                ok = [r["ttft"] for r in res[name] if r["ttft"] is not None]
                pooled[name].extend(ok)
                rows[name].append((pct_ms(ok, 0.5), pct_ms(ok, 0.99), len(res[name]) - len(ok)))
        med = {k: (statistics.median(v[0] for v in rs), statistics.median(v[1] for v in rs), sum(v[2] for v in rs)) for k, rs in rows.items()}
        print(f"\n(1) SSE pass-through, {20 * len(names)} req/s interleaved over the {len(names)} paths (20 each), "
              "16 tokens, medians of", rounds, "rounds")
        print("| path | TTFT p50 ms | TTFT p99 ms | added p50 ms | added p99 ms | failed |")
        print("|---|---|---|---|---|---|")
        for k in names:
            p50, p99, f = med[k]
            print(f"| {k} | {p50:.3f} | {p99:.3f} | {p50 - med['direct'][0]:+.3f} | {p99 - med['direct'][1]:+.3f} | {f} |")
        d99 = pct_ms(pooled["direct"], 0.99)
        print(f"\nAll rounds pooled ({len(pooled['direct'])} requests per path): p99 direct {d99:.3f} ms, "
              + ", ".join(f"{k} {pct_ms(pooled[k], 0.99) - d99:+.3f}" for k in names[1:])
              + f"; ultrafast's added p99 over nginx's: "
              f"{pct_ms(pooled['ultrafast'], 0.99) - pct_ms(pooled['nginx'], 0.99):+.3f} ms")
    finally:
        for p in (fp, up, np_, bp):
            if p:
                stop_tree(p)


def mixed(tmp, rounds, duration):
    # The fake has 8 slots (a loaded vLLM); ultrafast holds the queue.
    fp, fport = fake(["--tokens", "400", "--itl-ms", "5", "--ttft-ms", "20", "--capacity", "8"])
    pool = f"[pools.f]\nmembers = [{{ addr = \"127.0.0.1:{fport}\" }}]\nkeepalive_idle_s = 60\n"
    lanes_on = (pool + "[models.m]\nbackend = \"upstream\"\npool = \"f\"\nmax_concurrency = 8\n"
                "[lanes.ultra]\nrank = 0\nreserved_share = 0.25\nqueue_len = 64\nmax_wait_ms = 2000\npreempt = true\npace = \"off\"\n"
                "[lanes.standard]\nrank = 1\nqueue_len = 256\nmax_wait_ms = 3000\n")
    fifo = (pool + "[models.m]\nbackend = \"upstream\"\npool = \"f\"\nmax_concurrency = 8\n"
            "[lanes.standard]\nrank = 1\nqueue_len = 100000\nmax_wait_ms = 600000\n")
    try:
        def make(lanes):
            def m(i):
                if i % 5 == 0:
                    return chat(8), ({"x-request-priority": "ultra"} if lanes else {}), "ultra"
                return chat(200), ({"x-request-priority": "standard"} if lanes else {}), "standard"
            return m
        print("\n(2) mixed load: 20% ultra (8 tokens) among standard (200 tokens), fake capacity 8 x 5 ms/token")
        print("| mode | ultra TTFT p50 ms | ultra TTFT p99 ms | p99 / unloaded p50 | standard TTFT p99 ms | shed (503) |")
        print("|---|---|---|---|---|---|")
        for name, body in (("lanes", lanes_on), ("fifo", fifo)):
            up, uport = ultrafast(tmp, "mixed-" + name, body)
            try:
                base = asyncio.run(load(uport, 5, 3, lambda i: (chat(8), {"x-request-priority": "ultra"} if name == "lanes" else {}, "ultra")))["ultra"]
                unloaded = pct_ms([r["ttft"] for r in base if r["ttft"]], 0.5)
                p50s, p99s, sp99, shed = [], [], [], 0
                for _ in range(rounds):
                    # ~2x capacity: 8 slots x (1 / (200 x 5 ms)) = 8 req/s of long work.
                    res = asyncio.run(load(uport, 20, duration, make(name == "lanes")))
                    u = [r["ttft"] for r in res["ultra"] if r["ttft"]]
                    s = [r["ttft"] for r in res["standard"] if r["ttft"]]
                    p50s.append(pct_ms(u, 0.5)); p99s.append(pct_ms(u, 0.99)); sp99.append(pct_ms(s, 0.99))
                    shed += sum(1 for rs in res.values() for r in rs if r["status"] in (429, 503))
                    time.sleep(3)
                p99 = statistics.median(p99s)
                print(f"| {name} | {statistics.median(p50s):.1f} | {p99:.1f} | {p99 / unloaded:.2f}x (unloaded p50 {unloaded:.1f}) | {statistics.median(sp99):.1f} | {shed} |")
            finally:
                stop_tree(up)
    finally:
        stop_tree(fp)


def cadence(tmp, rounds):
    fp, fport = fake(["--tokens", "48", "--itl-ms", "40", "--burst", "4", "--ttft-ms", "30"])
    body = (f"[pools.f]\nmembers = [{{ addr = \"127.0.0.1:{fport}\" }}]\n[models.m]\nbackend = \"upstream\"\npool = \"f\"\n"
            "[lanes.ultra]\nrank = 0\npace = \"fixed\"\npace_interval_ms = 40\n[lanes.standard]\nrank = 1\npace = \"off\"\n")
    up, uport = ultrafast(tmp, "cadence", body)
    try:
        print("\n(3) cadence: fake sends 4 tokens per 160 ms (40 ms/token average); ultra paced at 40 ms, standard unpaced")
        print("| lane | TTFT p50 ms | interval mean ms | interval stddev ms | interval p99 ms |")
        print("|---|---|---|---|---|")
        for lane in ("standard", "ultra"):
            gaps, ttft = [], []
            for _ in range(rounds):
                res = asyncio.run(load(uport, 4, 4, lambda i: (chat(48), {"x-request-priority": lane}, "x")))["x"]
                for r in res:
                    t = r["times"][:-4]  # the last burst ends the stream and is flushed at once by design
                    gaps += [b - a for a, b in zip(t, t[1:])]
                    ttft.append(r["ttft"])
            sd = statistics.pstdev(gaps) * 1000
            print(f"| {lane} | {pct_ms(ttft, 0.5):.1f} | {statistics.mean(gaps) * 1000:.1f} | {sd:.2f} | {pct_ms(gaps, 0.99):.1f} |")
    finally:
        stop_tree(up); stop_tree(fp)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=8)
    ap.add_argument("--only", default="pass,mixed,cadence")
    ap.add_argument("--bare", action="store_true", help="(1) also through a bare Pingora proxy")
    a = ap.parse_args()
    for b in ("ultrafast", "fake-openai"):
        if not os.path.exists(os.path.join(REL, b)):
            sys.exit(f"missing target/release/{b}: cargo build --release -p ultrafast -p ultrafast-benches")
    with tempfile.TemporaryDirectory() as tmp:
        only = a.only.split(",")
        if "pass" in only:
            passthrough(tmp, a.rounds, a.duration, a.bare)
        if "mixed" in only:
            mixed(tmp, a.rounds, a.duration)
        if "cadence" in only:
            cadence(tmp, a.rounds)


if __name__ == "__main__":
    main()
