#!/usr/bin/env python3
"""gRPC unary calls per second through ultrafast and through nginx
(`grpc_pass`), side by side in one run, as a ratio.

The same origin for both: the official grpcio server of the tests
(proxy/tests/py/grpc_origin.py, `test.Echo/Unary`, plaintext). The same load
tool for both: h2load (nghttp2), --conns connections with --streams calls in
flight on each, POSTing one framed 5-byte message with `content-type:
application/grpc` and `te: trailers`. Each proxy: one worker, its listener
HTTP/2 with prior knowledge (h2c), HTTP/2 to the origin with keepalive
(ultrafast `protocol = "h2c"`, nginx `grpc_pass grpc://` with `keepalive`).
The origin alone is measured too (its ceiling). --rounds rounds, the
servers alternating; the median of each. Loopback only; every server is
stopped at the end, every load is bounded by --calls.

usage: benches/scripts/grpc_vs_nginx.py [--calls 20000] [--conns 4]
       [--streams 16] [--rounds 3] [--bin target/release/ultrafast]
Build first: cargo build --release -p ultrafast; needs nginx, h2load, grpcio.
"""
import argparse, os, re, shutil, statistics, subprocess, sys, tempfile, time
from benchlib import ROOT, free_port, spawn, stop_tree, wait_port
from proxy_vs_nginx import nginx

ORIGIN = os.path.join(ROOT, "proxy/tests/py/grpc_origin.py")


def start_origin():
    p = subprocess.Popen([sys.executable, ORIGIN], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    line = p.stdout.readline().decode()
    if not line.startswith("PORT "):
        sys.exit(f"grpc_origin.py said {line!r}")
    return p, int(line.split()[1])


def start_ultrafast(binary, tmp, port, origin):
    cfg = os.path.join(tmp, "uf.toml")
    with open(cfg, "w") as f:
        f.write(f'[server]\nthreads = 1\npid_file = "{tmp}/uf.pid"\nupgrade_sock = "{tmp}/uf.sock"\n'
                f'[admin]\nlisten = ""\n[log]\naccess_log = "off"\n'
                f'[[listeners]]\naddress = "127.0.0.1:{port}"\nh2c = true\n'
                f'[pools.o]\nmembers = [{{ addr = "127.0.0.1:{origin}" }}]\nprotocol = "h2c"\n'
                '[[routes]]\npath = "/"\npool = "o"\n')
    return spawn([binary, "serve", "-c", cfg], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                 env={**os.environ, "RUST_LOG": "error"})


def start_nginx(tmp, port, origin):
    # proxy_vs_nginx's launcher (`user root`: a worker of the default user
    # could not create a temporary file in the run's 0700 directory,
    # RESULTS section 29).
    return nginx(tmp, "nginx", f"worker_processes 1; "
                 f"events {{ worker_connections 8192; }} http {{ access_log off; "
                 f"client_body_temp_path {tmp}/body; "
                 f"upstream o {{ server 127.0.0.1:{origin}; keepalive 32; }} "
                 # nginx closes a client connection after 1,000 requests
                 # (`keepalive_requests`), which h2load does not reopen.
                 f"keepalive_requests 1000000; "
                 f"server {{ listen 127.0.0.1:{port} http2; "
                 f"location / {{ grpc_pass grpc://o; }} }} }}")


def h2load(port, msg, a):
    out = subprocess.run(
        ["h2load", "-n", str(a.calls), "-c", str(a.conns), "-m", str(a.streams), "-d", msg,
         "-H", "content-type: application/grpc", "-H", "te: trailers",
         f"http://127.0.0.1:{port}/test.Echo/Unary"],
        capture_output=True, text=True, timeout=300).stdout
    rps = re.search(r"finished in [\d.]+\w*, ([\d.]+) req/s", out)
    done = re.search(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded", out)
    status = re.search(r"status codes: (\d+) 2xx", out)
    if not (rps and done and status) or int(done.group(2)) != a.calls or int(status.group(1)) != a.calls:
        sys.exit(f"h2load on {port} did not complete every call:\n{out}")
    return float(rps.group(1))


def check_grpc_status(port, msg):
    """One call with nghttp, to see the gRPC status (h2load counts HTTP only)."""
    out = subprocess.run(["nghttp", "-v", "-d", msg, "-H", "content-type: application/grpc",
                          "-H", "te: trailers", f"http://127.0.0.1:{port}/test.Echo/Unary"],
                         capture_output=True, text=True, timeout=30).stdout
    if "grpc-status: 0" not in out:
        sys.exit(f"a call through {port} did not end with grpc-status 0:\n{out[-2000:]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--conns", type=int, default=4)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/release/ultrafast"))
    a = ap.parse_args()
    for need in ("nginx", "h2load", "nghttp"):
        if not shutil.which(need):
            sys.exit(f"needs {need}")
    if not os.path.exists(a.bin):
        sys.exit("needs the ultrafast binary: cargo build --release -p ultrafast")
    tmp = tempfile.mkdtemp(prefix="uf-grpc-")
    msg = os.path.join(tmp, "hello.bin")
    with open(msg, "wb") as f:
        f.write(b"\x00\x00\x00\x00\x05hello")
    origin, oport = start_origin()
    uport, nport = free_port(), free_port()
    uf = start_ultrafast(a.bin, tmp, uport, oport)
    ngx = start_nginx(tmp, nport, oport)
    res = {"origin": [], "ultrafast": [], "nginx": []}
    try:
        wait_port(uport)
        wait_port(nport)
        for port in (oport, uport, nport):
            check_grpc_status(port, msg)
            h2load(port, msg, argparse.Namespace(**{**vars(a), "calls": 500}))  # warm-up
        for r in range(a.rounds):
            for name, port in (("origin", oport), ("ultrafast", uport), ("nginx", nport)):
                res[name].append(h2load(port, msg, a))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in res.items()), flush=True)
    finally:
        for p in (uf, ngx, origin):
            stop_tree(p)
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"\n| target ({a.calls} unary calls, {a.conns} connections x {a.streams} streams) "
          f"| calls/s (median of {a.rounds}) | vs nginx |")
    print("|---|---|---|")
    for k in ("origin", "ultrafast", "nginx"):
        print(f"| {k} | {med[k]:.0f} | {med[k] / med['nginx']:.2f}x |")


if __name__ == "__main__":
    main()
