#!/usr/bin/env python3
"""The shared store's cost: admission decision latency and one instance's
requests/s, in memory vs through Redis (`[cluster]`), in one run.

1. Decision latency: `cluster-decide` times the same request-rate decision
   (`admission::shared::check_rates`, one limiter keyed by client IP, never
   refusing) one at a time, first in memory, then through a redis-server
   on loopback; p50/p99 in microseconds.
2. Requests/s: one ultrafast worker proxying GETs to an nginx `return 200`
   origin on a route with that rate limit, wrk -t1 -c32, in memory and
   with `[cluster]`, alternated over the rounds; medians.

Every process is started here and stopped by PID; loopback only; every run
is bounded by wrk's duration.

usage: benches/scripts/cluster_bench.py [--rounds 3] [--duration 5] [--n 20000]
Build first: cargo build --release -p ultrafast -p ultrafast-benches
"""
import argparse, json, os, statistics, subprocess, sys, tempfile, time
from benchlib import ROOT, free_port, spawn, stop_tree, wait_port
from proxy_vs_nginx import nginx, wrk

REL = os.path.join(ROOT, "target", "release")


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def redis(tmp):
    port = free_port()
    p = spawn(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
               "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return p, port


def ultrafast(tmp, name, origin, redis_port):
    d = os.path.join(tmp, name); os.makedirs(d, exist_ok=True)
    port, admin = free_port(), free_port()
    cluster = (f'[cluster]\nredis = "redis://127.0.0.1:{redis_port}/0"\nprefix = "{name}:"\n\n'
               if redis_port else "")
    conf = os.path.join(d, "uf.toml")
    with open(conf, "w") as f:
        f.write(f'[server]\nthreads = 1\npid_file = "{d}/uf.pid"\nupgrade_sock = "{d}/uf.sock"\n\n'
                f'[admin]\nlisten = "127.0.0.1:{admin}"\n\n[log]\naccess_log = "off"\n\n'
                f'[[listeners]]\nname = "http"\naddress = "127.0.0.1:{port}"\n\n{cluster}'
                f'[rate_limits.ip]\nkey = "client_ip"\nrate_per_s = 1000000000.0\nburst = 1000000\n\n'
                f'[pools.p]\nmembers = [{{ addr = "127.0.0.1:{origin}" }}]\n\n'
                f'[[routes]]\npath = "/"\npool = "p"\nrate_limits = ["ip"]\n')
    p = spawn([os.path.join(REL, "ultrafast"), "serve", "-c", conf],
              stdout=subprocess.DEVNULL, stderr=open(os.path.join(d, "stderr.log"), "w"))
    wait_port(port); wait_port(admin)
    return p, port, admin


def metric(admin, name):
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=5).read().decode()
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
               if l.startswith(name) and not l.startswith("#"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--n", type=int, default=20000)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="uf-cluster-bench-")
    procs = []
    try:
        rp, rport = redis(tmp); procs.append(rp)
        dec = []
        for _ in range(a.rounds):
            out = subprocess.run([os.path.join(REL, "cluster-decide"), "--redis",
                                  f"redis://127.0.0.1:{rport}/0", "--n", str(a.n)],
                                 capture_output=True, text=True, timeout=300)
            if out.returncode != 0:
                sys.exit(f"cluster-decide failed: {out.stderr}")
            r = json.loads(out.stdout)
            if r["fallbacks"] or r["store_decisions"] < a.n:
                sys.exit(f"the store did not take every decision: {r}")
            dec.append(r)
        oport = free_port()
        procs.append(nginx(tmp, "origin", "worker_processes 1; events {} http { access_log off; "
                           f"server {{ listen 127.0.0.1:{oport}; location / {{ return 200 'ok'; }} }} }}"))
        wait_port(oport)
        mem = ultrafast(tmp, "memory", oport, None); procs.append(mem[0])
        shr = ultrafast(tmp, "shared", oport, rport); procs.append(shr[0])
        rps = {"memory": [], "shared": []}
        p99 = {"memory": [], "shared": []}
        for i in range(a.rounds):
            order = [("memory", mem), ("shared", shr)] if i % 2 == 0 else [("shared", shr), ("memory", mem)]
            for name, (_, port, _) in order:
                r, _, q99, _, errors = wrk(port, a.duration, 32)
                if errors:
                    sys.exit(f"{name}: {errors} non-2xx responses (the limit must never refuse)")
                rps[name].append(r); p99[name].append(q99)
        fell_back = metric(shr[2], "ultrafast_cluster_fallback_decisions_total")
        med = statistics.median
        print(f"CPU: {cpu_model()}, {os.cpu_count()} vCPUs; rounds {a.rounds}; n {a.n}; duration {a.duration}s")
        print("\n| decision | p50 us (median of rounds) | p99 us | mean us |\n|---|---|---|---|")
        for m in ["memory", "shared"]:
            print(f"| {m} | {med(d[m]['p50_us'] for d in dec):.2f} | {med(d[m]['p99_us'] for d in dec):.2f} "
                  f"| {med(d[m]['mean_us'] for d in dec):.2f} |")
        print("\n| mode | requests/s (median, min-max) | p99 ms | vs memory |\n|---|---|---|---|")
        for m in ["memory", "shared"]:
            print(f"| {m} | {med(rps[m]):.0f} ({min(rps[m]):.0f}-{max(rps[m]):.0f}) | {med(p99[m]):.3f} "
                  f"| {med(rps[m]) / med(rps['memory']):.2f}x |")
        print(f"\nshared instance: decisions that fell back to memory: {fell_back:.0f}")
    finally:
        for p in procs:
            stop_tree(p)


if __name__ == "__main__":
    main()
