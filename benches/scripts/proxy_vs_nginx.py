#!/usr/bin/env python3
"""Side-by-side proxy benchmark: ultrafast vs nginx vs a bare Pingora proxy.

Same origin (nginx `return 200`, small body), keepalive to the origin on all
three, equal worker counts, access logs off on all three, the same wrk
settings, runs alternated A,B,C / B,C,A / ... and medians over the rounds.
CPU per request is utime+stime of the proxy's whole process tree, read from
/proc before and after each run. Every process is started here and killed by
PID; every run is bounded by wrk's duration. Loopback only.

usage: benches/scripts/proxy_vs_nginx.py [--rounds 3] [--duration 5] [--workers 1,2]
Build first: cargo build --release -p ultrafast -p ultrafast-benches
"""
import argparse, os, re, shutil, statistics, subprocess, sys, tempfile, time
from benchlib import ROOT, free_port, spawn, stop_tree, wait_port





CLK = os.sysconf("SC_CLK_TCK")






def tree(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop(); out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def cpu_ticks(pid):
    total = 0
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:
            pass
    return total


def busy_fraction(sec=0.5):
    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]
    t0, i0 = snap(); time.sleep(sec); t1, i1 = snap()
    return 1 - (i1 - i0) / max(1, t1 - t0)


def nginx(tmp, name, body):
    d = os.path.join(tmp, name); os.makedirs(d, exist_ok=True)
    conf = os.path.join(d, "nginx.conf")
    with open(conf, "w") as f:
        f.write(f"daemon off; pid {d}/nginx.pid; error_log {d}/error.log warn; user root;\n{body}")
    p = spawn(["nginx", "-p", d, "-c", conf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return p


def wrk(port, duration, conns, path="/"):
    out = subprocess.run(["wrk", "-t1", f"-c{conns}", f"-d{duration}s", "--latency", f"http://127.0.0.1:{port}{path}"],
                         capture_output=True, text=True, timeout=duration + 30).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    total = int(re.search(r"(\d+) requests in", out).group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    def lat(q):
        m = re.search(rf"\s{q}%\s+([\d.]+)(us|ms|s)", out)
        v, u = float(m.group(1)), m.group(2)
        return v / 1000 if u == "us" else v * 1000 if u == "s" else v
    return rps, lat(50), lat(99), total, int(errors.group(1)) if errors else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--alt", default="", help="a second ultrafast binary (another build "
                    "of it, e.g. --features mimalloc) run in the same rounds as `ultrafast-alt`")
    a = ap.parse_args()
    uf = os.path.join(ROOT, "target/release/ultrafast")
    bare = os.path.join(ROOT, "target/release/bare-pingora")
    for b in (uf, bare):
        if not os.path.exists(b):
            sys.exit(f"missing {b}: cargo build --release -p ultrafast -p ultrafast-benches")
    for t in ("nginx", "wrk"):
        if not shutil.which(t):
            sys.exit(f"missing {t}: apt-get install -y nginx wrk")
    tmp = tempfile.mkdtemp(prefix="uf-bench-")
    procs = []
    try:
        op = free_port()
        procs.append(nginx(tmp, "origin", f"worker_processes 1; events {{}} http {{ access_log off; server {{ listen 127.0.0.1:{op}; location / {{ return 200 'hello world\\n'; }} }} }}\n"))
        wait_port(op)
        print(f"# load before start: {os.getloadavg()}  busy: {busy_fraction():.2f}")
        results = {}
        for w in [int(x) for x in a.workers.split(",")]:
            kinds = ("nginx", "ultrafast", "bare") + (("ultrafast-alt",) if a.alt else ())
            ports = {k: free_port() for k in kinds}
            servers = {}
            servers["nginx"] = nginx(tmp, f"proxy{w}", f"worker_processes {w}; events {{ worker_connections 4096; }} http {{ access_log off; upstream up {{ server 127.0.0.1:{op}; keepalive 64; }} server {{ listen 127.0.0.1:{ports['nginx']}; location / {{ proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection \"\"; }} }} }}\n")
            cfg = os.path.join(tmp, f"uf{w}.toml")
            with open(cfg, "w") as f:
                f.write(f"""[server]\nthreads = {w}\npid_file = "{tmp}/uf{w}.pid"\nupgrade_sock = "{tmp}/uf{w}.sock"\nshutdown_grace_period_s = 0\n
[admin]\nlisten = ""\n[log]\naccess_log = "off"\n[[listeners]]\naddress = "127.0.0.1:{ports['ultrafast']}"\n
[pools.o]\nmembers = [{{ addr = "127.0.0.1:{op}" }}]\n[[routes]]\npath = "/"\npool = "o"\n""")
            servers["ultrafast"] = spawn([uf, "serve", "-c", cfg], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
            if a.alt:
                cfg_alt = cfg.replace(".toml", "-alt.toml")
                with open(cfg) as f, open(cfg_alt, "w") as g:
                    g.write(f.read().replace(f"127.0.0.1:{ports['ultrafast']}", f"127.0.0.1:{ports['ultrafast-alt']}")
                            .replace(f"uf{w}.pid", f"uf{w}-alt.pid").replace(f"uf{w}.sock", f"uf{w}-alt.sock"))
                servers["ultrafast-alt"] = spawn([a.alt, "serve", "-c", cfg_alt], stdout=subprocess.DEVNULL,
                                                 stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
            servers["bare"] = spawn([bare, f"127.0.0.1:{ports['bare']}", f"127.0.0.1:{op}", str(w)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
            procs += servers.values()
            for k in servers:
                wait_port(ports[k])
                wrk(ports[k], 1, a.conns)  # warm-up
            names = list(servers)
            for r in range(a.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for k in order:
                    while busy_fraction(0.3) > 0.25:
                        time.sleep(0.5)
                    c0 = cpu_ticks(servers[k].pid)
                    rps, p50, p99, total, errs = wrk(ports[k], a.duration, a.conns)
                    cpu_us = (cpu_ticks(servers[k].pid) - c0) / CLK * 1e6 / max(1, total)
                    results.setdefault((w, k), []).append((rps, p50, p99, cpu_us, errs))
                    print(f"w={w} round={r} {k:9s} {rps:9.0f} req/s p50 {p50:.3f} ms p99 {p99:.3f} ms cpu {cpu_us:.1f} us/req errors {errs}", flush=True)
            for p in servers.values():
                stop_tree(p)
        print("\n| workers | proxy | req/s (median, min-max) | p50 ms | p99 ms | CPU us/req | req/s vs nginx | CPU vs bare Pingora |")
        print("|---|---|---|---|---|---|---|---|")
        for w in sorted({w for w, _ in results}):
            med = {k: [statistics.median(x[i] for x in results[(w, k)]) for i in range(4)] for (ww, k) in results if ww == w}
            for k in ("nginx", "bare", "ultrafast") + (("ultrafast-alt",) if a.alt else ()):
                rps = [x[0] for x in results[(w, k)]]
                m = med[k]
                print(f"| {w} | {k} | {m[0]:.0f} ({min(rps):.0f}-{max(rps):.0f}) | {m[1]:.3f} | {m[2]:.3f} | {m[3]:.1f} | {m[0] / med['nginx'][0]:.2f}x | {m[3] / med['bare'][3]:.2f}x |")
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
