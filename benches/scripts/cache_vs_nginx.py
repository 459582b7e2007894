#!/usr/bin/env python3
"""Cache hit throughput: ultrafast's route cache vs nginx's `proxy_cache`,
side by side in one run.

One origin (nginx, `Cache-Control: max-age=3600`, bodies of each size), one
proxy worker each, access logs off, the cache warmed by one request, then
wrk on the one cached URL; runs alternated and medians over the rounds. CPU
per request is the proxy tree's utime+stime. After the runs the origin's
own access log must show one fetch per proxy and size (every measured
request was a hit). Every process is started here and stopped by PID; each
run is bounded by wrk's duration. Loopback only.

usage: benches/scripts/cache_vs_nginx.py [--rounds 3] [--duration 5] [--sizes 1024,65536]
Build first: cargo build --release -p ultrafast
"""
import argparse, os, shutil, statistics, subprocess, sys, tempfile, time, urllib.request
from benchlib import ROOT, free_port, spawn, stop_tree, wait_port
from proxy_vs_nginx import CLK, busy_fraction, cpu_ticks, nginx, wrk


def head(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        r.read()
        return r.headers.get("Cache-Status") or r.headers.get("X-Cache-Status") or ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--sizes", default="1024,65536")
    a = ap.parse_args()
    uf = os.path.join(ROOT, "target/release/ultrafast")
    if not os.path.exists(uf):
        sys.exit(f"missing {uf}: cargo build --release -p ultrafast")
    for t in ("nginx", "wrk"):
        if not shutil.which(t):
            sys.exit(f"missing {t}: apt-get install -y nginx wrk")
    sizes = [int(s) for s in a.sizes.split(",")]
    tmp = tempfile.mkdtemp(prefix="uf-cache-bench-")
    procs = []
    try:
        for s in sizes:
            with open(os.path.join(tmp, f"b{s}"), "wb") as f:
                f.write(b"x" * s)
        op = free_port()
        origin_log = os.path.join(tmp, "origin.log")
        procs.append(nginx(tmp, "origin", f"worker_processes 1; events {{}} http {{ access_log {origin_log}; server {{ listen 127.0.0.1:{op}; root {tmp}; location / {{ add_header Cache-Control \"max-age=3600\"; }} }} }}\n"))
        wait_port(op)
        ports = {"nginx": free_port(), "ultrafast": free_port()}
        servers = {}
        cache_dir = os.path.join(tmp, "nginx-cache")
        servers["nginx"] = nginx(tmp, "proxy", f"worker_processes 1; events {{ worker_connections 4096; }} http {{ access_log off; proxy_cache_path {cache_dir} keys_zone=z:16m max_size=256m; upstream up {{ server 127.0.0.1:{op}; keepalive 64; }} server {{ listen 127.0.0.1:{ports['nginx']}; location / {{ proxy_cache z; proxy_cache_lock on; add_header X-Cache-Status $upstream_cache_status; proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection \"\"; }} }} }}\n")
        cfg = os.path.join(tmp, "uf.toml")
        with open(cfg, "w") as f:
            f.write(f"""[server]\nthreads = 1\npid_file = "{tmp}/uf.pid"\nupgrade_sock = "{tmp}/uf.sock"\nshutdown_grace_period_s = 0\n
[admin]\nlisten = ""\n[log]\naccess_log = "off"\n[[listeners]]\naddress = "127.0.0.1:{ports['ultrafast']}"\n
[pools.o]\nmembers = [{{ addr = "127.0.0.1:{op}" }}]\n[[routes]]\npath = "/"\npool = "o"\ncache = {{ size_mb = 256, max_object_kb = 1024 }}\n""")
        servers["ultrafast"] = spawn([uf, "serve", "-c", cfg], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
        procs += servers.values()
        for k in servers:
            wait_port(ports[k])
        print(f"# load before start: {os.getloadavg()}  busy: {busy_fraction():.2f}")
        results = {}
        for s in sizes:
            path = f"/b{s}"
            for k in servers:
                head(ports[k], path)
                print(f"# {k} {path}: {head(ports[k], path)}")
                wrk(ports[k], 1, a.conns, path)  # warm-up
            for r in range(a.rounds):
                order = list(servers)[r % 2:] + list(servers)[:r % 2]
                for k in order:
                    while busy_fraction(0.3) > 0.25:
                        time.sleep(0.5)
                    c0 = cpu_ticks(servers[k].pid)
                    rps, p50, p99, total, errs = wrk(ports[k], a.duration, a.conns, path)
                    cpu_us = (cpu_ticks(servers[k].pid) - c0) / CLK * 1e6 / max(1, total)
                    results.setdefault((s, k), []).append((rps, p50, p99, cpu_us, errs))
                    print(f"size={s} round={r} {k:9s} {rps:9.0f} req/s p50 {p50:.3f} ms p99 {p99:.3f} ms cpu {cpu_us:.1f} us/req errors {errs}", flush=True)
        with open(origin_log) as f:
            fetches = {}
            for line in f:
                p = line.split('"')[1].split()[1] if '"' in line else ""
                fetches[p] = fetches.get(p, 0) + 1
        print(f"\n# origin fetches per path (2 proxies: 2 each means every measured request was a hit): {fetches}")
        print("\n| body | proxy | hits/s (median, min-max) | p50 ms | p99 ms | CPU us/req | hits/s vs nginx |")
        print("|---|---|---|---|---|---|---|")
        for s in sizes:
            med = {k: [statistics.median(x[i] for x in results[(s, k)]) for i in range(4)] for k in servers}
            for k in ("nginx", "ultrafast"):
                rps = [x[0] for x in results[(s, k)]]
                m = med[k]
                print(f"| {s} B | {k} | {m[0]:.0f} ({min(rps):.0f}-{max(rps):.0f}) | {m[1]:.3f} | {m[2]:.3f} | {m[3]:.1f} | {m[0] / med['nginx'][0]:.2f}x |")
        print(f"\n# load after: {os.getloadavg()}")
    finally:
        for p in procs:
            try:
                stop_tree(p)
            except Exception:
                pass
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
