#!/usr/bin/env python3
"""Instructions per proxied request under callgrind: ultrafast vs a bare
Pingora proxy, in one run.

Wall-clock ratios on these VMs move by +-20%, and they have no hardware
counters (`perf stat -e instructions` is "not supported"), so instructions
are counted by valgrind's callgrind. Each proxy runs under callgrind twice,
serving N1 and N2 requests on one keepalive connection (a Python client,
GET / with a small fixed answer from an nginx origin); the per-request cost
is (I(N2) - I(N1)) / (N2 - N1), which cancels start-up and shutdown. Both
proxies run one worker thread. ultrafast runs the plain proxy path with
what production has on: forwarding headers, request ids and the access log
(to a file). The top functions of the difference are listed from
callgrind_annotate, per function the N2 run less the N1 run, per request.

usage: benches/scripts/instructions_per_request.py [--n1 500] [--n2 3000]
       [--repeat 1] [--bin target/release/ultrafast] [--bare target/release/bare-pingora]
       [--featured]

With --featured, the bare proxy is also measured with the least of what
the target keeps on (forwarding headers, request id, access log; see
benches/src/bare_pingora.rs): what those features cost by themselves on
Pingora's filter API.

With --repeat R each proxy is measured R times, alternately, and the
median per-request figure is reported (runs of one build differ by about
1,000 instructions per request: jemalloc's time-based page purging and
the event loop's polling under valgrind's slow clock).
Build first: cargo build --release -p ultrafast -p ultrafast-benches;
needs valgrind and nginx. Loopback only; every process is stopped by PID.
"""
import argparse, os, re, shutil, signal, socket, subprocess, sys, tempfile, time
from benchlib import ROOT, callgrind, callgrind_costs, callgrind_stop, free_port, spawn, stop_tree, wait_port


def origin(tmp):
    port = free_port()
    conf = os.path.join(tmp, "origin.conf")
    with open(conf, "w") as f:
        f.write(f"daemon off; pid {tmp}/o.pid; error_log {tmp}/o.err; worker_processes 1; "
                f"events {{ worker_connections 1024; }} http {{ access_log off; keepalive_requests 100000; "
                f"server {{ listen 127.0.0.1:{port}; location / {{ return 200 ok; }} }} }}")
    p = spawn(["nginx", "-p", tmp, "-c", conf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return p, port


def proxy_cmd(kind, a, tmp, port, oport):
    if kind == "bare":
        return [a.bare, f"127.0.0.1:{port}", f"127.0.0.1:{oport}", "1"]
    if kind == "featured":
        return [a.bare, f"127.0.0.1:{port}", f"127.0.0.1:{oport}", "1", f"{tmp}/bare-access-{port}.log"]
    cfg = os.path.join(tmp, f"uf-{port}.toml")
    with open(cfg, "w") as f:
        f.write(f'[server]\nthreads = 1\npid_file = "{tmp}/uf-{port}.pid"\nupgrade_sock = "{tmp}/uf-{port}.sock"\n'
                f'[admin]\nlisten = ""\n[log]\naccess_log = "{tmp}/access-{port}.log"\n'
                f'[[listeners]]\naddress = "127.0.0.1:{port}"\n'
                f'[pools.o]\nmembers = [{{ addr = "127.0.0.1:{oport}" }}]\n'
                '[[routes]]\npath = "/"\npool = "o"\n')
    return [a.bin, "serve", "-c", cfg]


def drive(port, n):
    s = socket.create_connection(("127.0.0.1", port), 30)
    s.settimeout(60)
    req = b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n"
    buf = b""
    for _ in range(n):
        s.sendall(req)
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                m = re.search(rb"(?i)content-length:\s*(\d+)", buf[:end])
                total = end + 4 + (int(m.group(1)) if m else 0)
                if len(buf) >= total:
                    buf = buf[total:]
                    break
            chunk = s.recv(65536)
            if not chunk:
                sys.exit("the proxy closed the connection")
            buf += chunk
    s.close()


def one(kind, a, tmp, oport, n):
    port = free_port()
    out = os.path.join(tmp, f"cg-{kind}-{n}.out")
    p = callgrind(proxy_cmd(kind, a, tmp, port, oport), out, os.path.join(tmp, f"vg-{kind}-{n}.log"))
    try:
        wait_port(port, limit=120)
        drive(port, n)
    finally:
        total = callgrind_stop(p, out)
    return total, out


def per_request(f1, f2, dn):
    """Per-function instructions per request: the N2 run less the N1 run."""
    a, b = callgrind_costs(f1), callgrind_costs(f2)
    return {k: (b.get(k, 0) - a.get(k, 0)) / dn for k in set(a) | set(b)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n1", type=int, default=500)
    ap.add_argument("--n2", type=int, default=3000)
    ap.add_argument("--repeat", type=int, default=1, help="measurements per proxy; the median is kept")
    ap.add_argument("--top", type=int, default=25, help="functions of the difference listed")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/release/ultrafast"))
    ap.add_argument("--bare", default=os.path.join(ROOT, "target/release/bare-pingora"))
    ap.add_argument("--keep", help="keep the callgrind files in this folder, and list ultrafast's "
                    "own functions by inclusive instructions per request")
    ap.add_argument("--only", choices=("bare", "ultrafast", "featured"), help="measure one proxy")
    ap.add_argument("--featured", action="store_true",
                    help="also measure the bare proxy with the least of ultrafast's features (forwarding "
                    "headers, request id, access log) written directly on Pingora's API")
    a = ap.parse_args()
    for need in ("valgrind", "nginx", "callgrind_annotate"):
        if not shutil.which(need):
            sys.exit(f"needs {need}")
    tmp = tempfile.mkdtemp(prefix="uf-cg-")
    o, oport = origin(tmp)
    try:
        per, funcs, runs = {}, {}, {}
        kinds = [a.only] if a.only else ["bare", "ultrafast"] + (["featured"] if a.featured else [])
        for r in range(a.repeat):
            for kind in kinds:
                i1, f1 = one(kind, a, tmp, oport, a.n1)
                i2, f2 = one(kind, a, tmp, oport, a.n2)
                runs.setdefault(kind, []).append(((i2 - i1) / (a.n2 - a.n1), f1, f2))
                print(f"{kind:9s} I({a.n1}) = {i1:,}  I({a.n2}) = {i2:,}  -> {runs[kind][-1][0]:,.0f} "
                      f"instructions/request", flush=True)
                if r + 1 < a.repeat:
                    # Keep this run's files apart from the next run's.
                    for f in (f1, f2):
                        os.replace(f, f"{f}.{r}")
                    runs[kind][-1] = (runs[kind][-1][0], f"{f1}.{r}", f"{f2}.{r}")
        for kind in kinds:
            ordered = sorted(runs[kind])
            per[kind], f1, f2 = ordered[len(ordered) // 2]
            if a.repeat > 1:
                print(f"{kind:9s} median of {a.repeat}: {per[kind]:,.0f} "
                      f"(runs: {', '.join(f'{x[0]:,.0f}' for x in runs[kind])})", flush=True)
            funcs[kind] = per_request(f1, f2, a.n2 - a.n1)
            if a.keep:
                os.makedirs(a.keep, exist_ok=True)
                for f in (f1, f2):
                    shutil.copy(f, a.keep)
                if kind == "ultrafast":
                    c1, c2 = callgrind_costs(f1, True), callgrind_costs(f2, True)
                    own = sorted(((c2.get(k, 0) - c1.get(k, 0)) / (a.n2 - a.n1), k)
                                 for k in c2 if "ultrafast::" in k)
                    print("\n| ultrafast's functions (inclusive) | instructions per request |\n|---|---|")
                    for d, k in reversed(own[-40:]):
                        print(f"| `{k}` | {d:,.0f} |")
        if a.only:
            return
        print(f"\n| proxy | instructions per request | vs bare Pingora |\n|---|---|---|")
        print(f"| bare Pingora | {per['bare']:,.0f} | 1.00x |")
        print(f"| ultrafast | {per['ultrafast']:,.0f} | {per['ultrafast'] / per['bare']:.2f}x |")
        if "featured" in per:
            print(f"| bare Pingora + forwarding headers, request id, access log | {per['featured']:,.0f} | "
                  f"{per['featured'] / per['bare']:.2f}x |")
        u, b = funcs["ultrafast"], funcs["bare"]
        diff = sorted(((u.get(k, 0) - b.get(k, 0), k) for k in set(u) | set(b)), reverse=True)
        print(f"\n| function (exclusive, inlined callees included) | ultrafast | bare | difference |\n|---|---|---|---|")
        for d, k in diff[:a.top]:
            print(f"| `{k}` | {u.get(k, 0):,.0f} | {b.get(k, 0):,.0f} | {d:+,.0f} |")
    finally:
        stop_tree(o)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
