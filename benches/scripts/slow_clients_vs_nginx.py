#!/usr/bin/env python3
"""Slow clients against ultrafast and nginx 1.22, side by side in one run.

Each server proxies to the same origin (a threaded Python HTTP/1.1 server
that reads each body whole and answers it), one worker each, nginx's
default deadlines on both (60 s head, body and send timeouts; request
buffering on, 16 KiB in memory). Three `slowhttptest` attacks run against
each, one after the other, --conns connections each for --length seconds:

  slowloris  a header line every 10 s, never the end of the head
  slow body  a 64 KiB POST body, a few bytes every 5 s
  slow read  a 4 MB response read through a window of a few bytes

Each server is warmed (three whole requests on each route) before its idle
RSS is taken. During every attack a normal client sends a GET every 100 ms on a fresh
connection (latency, failures) to a fixed 200 of the server itself (`/probe`),
so that it times the edge, not the Python origin the attack keeps busy. Measured: for slowloris and slow
read, RSS per attack connection (exact RSS from smaps_rollup, process and
workers, peak minus idle); for slow body and slow read, the origin
connections held (the origin's ESTABLISHED sockets, /proc/net/tcp, sampled
every 100 ms); the normal client's p99 for each. Each attack runs against a
freshly started server, so that its idle RSS is not the heap an earlier
attack left behind (an allocator keeps freed memory, and the next attack's
peak reused it: nginx's slow read once read 0.4 KiB per connection so).
Response buffering is on for both (nginx's `proxy_buffering`, ultrafast's
`response_buffering`, their defaults), temporary files in the run's
directory. Loopback only; every attacker, server and socket is stopped at
the end, and every loop is bounded by --length.

nginx runs with `user root`: a worker of the default user cannot enter
the run's 0700 directory, fails every temporary file and closes each slow
reader once its socket buffer is full (every nginx slow-read figure before
RESULTS section 29 was that). --origin-concurrency N gives ultrafast's
origin pool `max_concurrency = N`: the rest of a burst waits at the edge,
where nginx, which has no such queue, holds few origin connections only by
accepting slowly.

usage: benches/scripts/slow_clients_vs_nginx.py [--conns 500] [--length 20]
       [--bin target/release/ultrafast] [--attacks "slow body,..."]
       [--servers ultrafast,nginx] [--no-request-buffering] [--no-response-buffering]
       [--origin-concurrency N]
Build first: cargo build --release -p ultrafast; needs nginx, slowhttptest.
"""
import argparse, http.server, os, shutil, socket, subprocess, sys, tempfile, threading, time
from benchlib import ROOT, exact_rss_kb, free_port, pct_ms, spawn, stop_tree, wait_port, with_children
from proxy_vs_nginx import nginx


class Origin(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _answer(self, body):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.startswith("/big"):
            n = 4_000_000
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            chunk = b"x" * 65536
            try:
                while n > 0:
                    self.wfile.write(chunk[: min(n, len(chunk))])
                    n -= len(chunk)
            except OSError:
                pass
            return
        self._answer(b"ok")

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        got = self.rfile.read(n)
        self._answer(f"got {len(got)}".encode())


def held(port):
    """Server-side ESTABLISHED sockets of `port` (the origin's)."""
    want = f"{port:04X}"
    n = 0
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            p = line.split()
            if len(p) > 3 and p[1].rsplit(":", 1)[1] == want and p[3] == "01":
                n += 1
    return n


UF_LIMITS = ""
UF_POOL = ""
NGX_EXTRA = ""


def start(kind, binary, tmp, port, origin):
    if kind == "ultrafast":
        cfg = os.path.join(tmp, "uf.toml")
        with open(cfg, "w") as f:
            f.write(f'[server]\nthreads = 1\npid_file = "{tmp}/uf.pid"\nupgrade_sock = "{tmp}/uf.sock"\n'
                    # nginx's `keepalive 32`: idle origin connections kept.
                    'upstream_keepalive_pool_size = 32\n'
                    f'[admin]\nlisten = ""\n[log]\naccess_log = "off"\n'
                    f'[limits]\nmax_connections = 0\nproxy_temp_path = "{tmp}"\n{UF_LIMITS}'
                    f'[[listeners]]\naddress = "127.0.0.1:{port}"\n'
                    f'[pools.o]\nmembers = [{{ addr = "127.0.0.1:{origin}" }}]\n{UF_POOL}'
                    '[[routes]]\npath = "/probe"\nmatch = "exact"\nreturn = { status = 200, body = "ok" }\n'
                    '[[routes]]\npath = "/"\npool = "o"\n')
        return spawn([binary, "serve", "-c", cfg], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     env={**os.environ, "RUST_LOG": "error"})
    # proxy_vs_nginx's launcher writes `user root`: a worker of the default
    # user cannot enter the run's directory (mkdtemp makes it 0700), so
    # every temporary file failed (`open() ... failed (13: Permission
    # denied) while reading upstream`) and nginx closed each slow reader
    # once its socket buffer was full.
    return nginx(tmp, "nginx", f"worker_processes 1; "
                 f"events {{ worker_connections 8192; }} http {{ access_log off; "
                 f"client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy; "
                 f"upstream o {{ server 127.0.0.1:{origin}; keepalive 32; }} "
                 f"server {{ listen 127.0.0.1:{port}; location = /probe {{ return 200 ok; }} "
                 f"location / {{ proxy_pass http://o; {NGX_EXTRA}"
                 f"proxy_http_version 1.1; proxy_set_header Connection \"\"; }} }} }}")


def warm(port):
    """A few whole requests through the proxied route and the fixed one
    before the idle RSS is taken, so that the attack is not charged with
    the first touch of the server's code and buffers (ultrafast's binary
    pages were 1.6 MB of a slow-read attack's 6.8)."""
    for path in ["/probe", "/", "/big"] * 3:
        with socket.create_connection(("127.0.0.1", port), 5) as s:
            s.settimeout(5)
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            while s.recv(1 << 16):
                pass


def probe(port, stop, lat, errors):
    while not stop.is_set():
        t = time.time()
        try:
            s = socket.create_connection(("127.0.0.1", port), 2)
            s.settimeout(2)
            s.sendall(b"GET /probe HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data = b""
            while True:
                b = s.recv(4096)
                if not b:
                    break
                data += b
            s.close()
            if data.startswith(b"HTTP/1.1 200"):
                lat.append(time.time() - t)
            else:
                errors.append(data[:40])
        except OSError as e:
            errors.append(str(e))
        time.sleep(max(0, 0.1 - (time.time() - t)))


ATTACKS = {
    "slowloris": ["-H", "-i", "10", "-x", "8"],
    "slow body": ["-B", "-i", "5", "-s", "65536", "-x", "8"],
    "slow read": ["-X", "-w", "1", "-y", "16", "-n", "2", "-z", "8"],
}


def attack(kind, name, port, origin, pids, conns, length, tmp):
    path = "/big" if name == "slow read" else "/"
    args = ["slowhttptest", *ATTACKS[name], "-c", str(conns), "-r", str(conns), "-l", str(length),
            "-p", "3", "-u", f"http://127.0.0.1:{port}{path}"]
    idle = exact_rss_kb(pids)
    stop, lat, errors = threading.Event(), [], []
    t = threading.Thread(target=probe, args=(port, stop, lat, errors))
    t.start()
    log = open(os.path.join(tmp, f"{name}.log"), "w")
    atk = spawn(args, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    up, peak, end = 0, 0, time.time() + length + 10
    # What the attack costs once the origin has sent everything: the last
    # samples before slowhttptest's own end (it stops at --length).
    late, late_up, late_rss = time.time() + length - 2, 0, 0
    try:
        while atk.poll() is None and time.time() < end:
            h, rss = held(origin), exact_rss_kb(pids)
            up, peak = max(up, h), max(peak, rss)
            if late <= time.time() < late + 1.5:
                late_up, late_rss = max(late_up, h), max(late_rss, rss)
            time.sleep(0.1)
    finally:
        stop_tree(atk)
        stop.set()
        t.join()
        log.close()
    return {"p99": pct_ms(lat, 0.99), "probes": len(lat), "errors": len(errors),
            "origin": up, "kib_per_conn": (peak - idle) / conns,
            "late_origin": late_up, "late_kib": (late_rss - idle) / conns}


def one(kind, binary, conns, length, origin):
    out = {}
    for name in ATTACKS:
        if name not in ONLY:
            continue
        tmp = tempfile.mkdtemp(prefix="uf-slow-")
        port = free_port()
        p = start(kind, binary, tmp, port, origin)
        try:
            wait_port(port)
            warm(port)
            time.sleep(1)
            pids = with_children(p.pid)
            out[name] = attack(kind, name, port, origin, pids, conns, length, tmp)
            r = out[name]
            print(f"{kind:9s} {name:9s} p99 {r['p99']:.1f} ms over {r['probes']} probes, "
                  f"{r['errors']} failed; origin held {r['origin']}; {r['kib_per_conn']:.1f} KiB/conn; "
                  f"last 2 s: origin held {r['late_origin']}, {r['late_kib']:.1f} KiB/conn",
                  flush=True)
        finally:
            stop_tree(p)
            shutil.rmtree(tmp, ignore_errors=True)
        time.sleep(2)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conns", type=int, default=500)
    ap.add_argument("--length", type=int, default=20)
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/release/ultrafast"))
    ap.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated subset")
    ap.add_argument("--servers", default="ultrafast,nginx")
    ap.add_argument("--no-request-buffering", action="store_true",
                    help="ultrafast with request_buffering = false (streams bodies, as before)")
    ap.add_argument("--no-response-buffering", action="store_true",
                    help="ultrafast with response_buffering = false, nginx with proxy_buffering off")
    ap.add_argument("--origin-concurrency", type=int, default=0,
                    help="ultrafast's max_concurrency on the origin's pool (0: none)")
    a = ap.parse_args()
    global UF_LIMITS, ONLY, NGX_EXTRA, UF_POOL
    if a.origin_concurrency:
        UF_POOL = f"max_concurrency = {a.origin_concurrency}\n"
    ONLY = a.attacks.split(",")
    if a.no_request_buffering:
        UF_LIMITS = "request_buffering = false\n"
    if a.no_response_buffering:
        UF_LIMITS += "response_buffering = false\n"
        NGX_EXTRA = "proxy_buffering off; "
    for need in ("nginx", "slowhttptest"):
        if not shutil.which(need):
            sys.exit(f"needs {need}")
    if not os.path.exists(a.bin):
        sys.exit("needs the ultrafast binary: cargo build --release -p ultrafast")
    http.server.ThreadingHTTPServer.daemon_threads = True
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Origin)
    # Clients the attack leaves behind reset their connections: not news.
    srv.handle_error = lambda *a: None
    origin = srv.server_address[1]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        res = {k: one(k, a.bin, a.conns, a.length, origin) for k in a.servers.split(",")}
    finally:
        srv.shutdown()
    kinds = list(res)
    print(f"\n| attack ({a.conns} connections, {a.length} s) | measure | " + " | ".join(kinds) + " |")
    print("|---|---|" + "---|" * len(kinds))
    rows = [("normal client p99 (ms)", "p99", "{:.1f}", None), ("normal client failures", "errors", "{}", None),
            ("RSS per connection (KiB)", "kib_per_conn", "{:.1f}", ("slowloris", "slow read")),
            ("origin connections held (max)", "origin", "{}", ("slow body", "slow read")),
            ("RSS per connection, last 2 s (KiB)", "late_kib", "{:.1f}", ("slow read",)),
            ("origin connections held, last 2 s", "late_origin", "{}", ("slow read",))]
    for name in ATTACKS:
        if name not in ONLY:
            continue
        for label, key, fmt, only in rows:
            if only is None or name in only:
                print(f"| {name} | {label} | " + " | ".join(fmt.format(res[k][name][key]) for k in kinds) + " |")


if __name__ == "__main__":
    main()
