#!/usr/bin/env python3
"""Reload under load: ultrafast (SIGHUP) vs nginx (`nginx -s reload`, also a
SIGHUP), in one run.

Each proxy fronts the same nginx `return 200` origin with keepalive, under a
closed-loop load of C keepalive connections (bounded by duration). Every
second a reload switches between two configs that differ only in a response
header (X-Config: a|b). Reported: failed requests, p99 latency of requests
sent within 500 ms after a trigger vs all others, and the time from trigger
to the first response carrying the new header. Loopback only; every process
started here is stopped by PID.

usage: benches/scripts/reload_bench.py [--reloads 10] [--conns 8]
Build first: cargo build --release -p ultrafast
"""
import argparse, asyncio, os, shutil, signal, statistics, subprocess, sys, tempfile, time
from benchlib import ROOT, free_port, pct_ms, spawn, stop_tree, wait_port











async def client(port, stop, log):
    r = w = None
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            if w is None:
                r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET / HTTP/1.1\r\nHost: b\r\n\r\n")
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
            lines = head.decode().split("\r\n")
            status = int(lines[0].split()[1])
            hdrs = {l.split(":", 1)[0].lower(): l.split(":", 1)[1].strip() for l in lines[1:] if ":" in l}
            await r.readexactly(int(hdrs.get("content-length", "0")))
            log.append((t0, time.monotonic() - t0, status, hdrs.get("x-config", "")))
            if hdrs.get("connection", "").lower() == "close":
                w.close(); w = None
        except Exception:
            log.append((t0, time.monotonic() - t0, 0, ""))
            if w is not None:
                w.close()
            w = None


def nginx_conf(d, port, origin, tag):
    return (f"daemon off; pid {d}/nginx.pid; error_log {d}/error.log warn; user root; worker_processes 1;\n"
            f"events {{ worker_connections 4096; }} http {{ access_log off; upstream up {{ server 127.0.0.1:{origin}; keepalive 64; }}\n"
            f"server {{ listen 127.0.0.1:{port}; location / {{ proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection \"\"; add_header X-Config {tag}; }} }} }}\n")


def uf_conf(d, port, origin, tag):
    return (f"[server]\nthreads = 1\npid_file = \"{d}/uf.pid\"\nupgrade_sock = \"{d}/uf.sock\"\nshutdown_grace_period_s = 0\n"
            f"[admin]\nlisten = \"\"\n[log]\naccess_log = \"off\"\n[[listeners]]\naddress = \"127.0.0.1:{port}\"\n"
            f"[pools.o]\nmembers = [{{ addr = \"127.0.0.1:{origin}\" }}]\n"
            f"[[routes]]\npath = \"/\"\npool = \"o\"\nheaders.response.set = {{ \"x-config\" = \"{tag}\" }}\n")


async def run(name, start_cmd, conf_path, make_conf, reload_fn, port, args):
    with open(conf_path, "w") as f:
        f.write(make_conf("a"))
    p = spawn(start_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
    try:
        wait_port(port)
        stop, log = asyncio.Event(), []
        tasks = [asyncio.create_task(client(port, stop, log)) for _ in range(args.conns)]
        await asyncio.sleep(1.0)
        triggers = []
        for i in range(args.reloads):
            tag = "b" if i % 2 == 0 else "a"
            with open(conf_path, "w") as f:
                f.write(make_conf(tag))
            triggers.append((time.monotonic(), tag))
            reload_fn(p)
            await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*tasks)
    finally:
        stop_tree(p)
    failed = sum(1 for x in log if x[2] != 200)
    in_win, out_win = [], []
    for t0, lat, status, _ in log:
        if status != 200:
            continue
        (in_win if any(0 <= t0 - t < 0.5 for t, _ in triggers) else out_win).append(lat)
    def p99(v):
        return pct_ms(v, 0.99)
    delays = []
    for t, tag in triggers:
        first = next((t0 + lat for t0, lat, s, x in log if t0 >= t and x == tag), None)
        if first is not None:
            delays.append((first - t) * 1000)
    return dict(name=name, requests=len(log), failed=failed, p99_reload=p99(in_win), p99_steady=p99(out_win),
                switch_ms=statistics.median(delays) if delays else float("nan"), switch_max=max(delays) if delays else float("nan"))


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reloads", type=int, default=10)
    ap.add_argument("--conns", type=int, default=8)
    args = ap.parse_args()
    uf = os.path.join(ROOT, "target/release/ultrafast")
    if not os.path.exists(uf) or not shutil.which("nginx"):
        sys.exit("needs target/release/ultrafast and nginx")
    tmp = tempfile.mkdtemp(prefix="uf-reload-")
    op = free_port()
    od = os.path.join(tmp, "origin"); os.makedirs(od)
    with open(f"{od}/nginx.conf", "w") as f:
        f.write(f"daemon off; pid {od}/nginx.pid; error_log {od}/e.log warn; user root; worker_processes 1; events {{}} http {{ access_log off; server {{ listen 127.0.0.1:{op}; location / {{ return 200 'hello'; }} }} }}\n")
    origin = spawn(["nginx", "-p", od, "-c", f"{od}/nginx.conf"])
    try:
        wait_port(op)
        print(f"# load average before: {os.getloadavg()}")
        results = []
        nd = os.path.join(tmp, "nginx"); os.makedirs(nd)
        np_ = free_port()
        results.append(await run("nginx", ["nginx", "-p", nd, "-c", f"{nd}/nginx.conf"], f"{nd}/nginx.conf",
                                 lambda tag: nginx_conf(nd, np_, op, tag),
                                 lambda p: subprocess.run(["nginx", "-p", nd, "-c", f"{nd}/nginx.conf", "-s", "reload"], check=False, capture_output=True),
                                 np_, args))
        ud = os.path.join(tmp, "uf"); os.makedirs(ud)
        up = free_port()
        results.append(await run("ultrafast", [uf, "serve", "-c", f"{ud}/uf.toml"], f"{ud}/uf.toml",
                                 lambda tag: uf_conf(ud, up, op, tag), lambda p: p.send_signal(signal.SIGHUP), up, args))
        print("| proxy | requests | failed | p99 ms within 500 ms of a reload | p99 ms otherwise | ratio | trigger -> new config served, median (max) ms |")
        print("|---|---|---|---|---|---|---|")
        for r in results:
            print(f"| {r['name']} | {r['requests']} | {r['failed']} | {r['p99_reload']:.2f} | {r['p99_steady']:.2f} | {r['p99_reload'] / r['p99_steady']:.2f}x | {r['switch_ms']:.1f} ({r['switch_max']:.1f}) |")
        print(f"# load average after: {os.getloadavg()}")
    finally:
        stop_tree(origin)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
