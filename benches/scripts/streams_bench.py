#!/usr/bin/env python3
"""Plain proxied requests beside thousands of inference streams (#42 (d),
second half), in one run: ultrafast proxies `/plain/` to an nginx origin
(`return 200`) and serves model `m` from fake-openai (no slot limit, so
every stream is in the latency model's ledger). One client sends plain
GETs one after another on a keep-alive connection for --seconds and
takes each latency; first alone, then with N streams open (slo-flood: N
concurrent streamed chats in the batch lane, each producing a token every
--itl-ms (+-half of it, so that the streams do not tick in lockstep) for
longer than the run, so all N stay in flight while the plain requests
are timed). The model has no slot limit (`max_concurrency = 0`): every
stream is in the latency model's ledger. Prints the plain p50/p99 without and with the streams, their
ratio (target: p99 within 10%), the streams established, and the CPU
each process used meanwhile.

usage: benches/scripts/streams_bench.py [--streams 5000] [--seconds 20] [--itl-ms 5000]
       [--proxy ultrafast|nginx] [--isolate none|pin|nice]
(--proxy nginx runs the same load through nginx, the reference.)
Build first: cargo build --release -p ultrafast -p ultrafast-benches
Every process started is stopped by PID; every load is bounded in time.
"""
import argparse, http.client, json, os, resource, subprocess, tempfile, time, urllib.request
from benchlib import ROOT, free_port, spawn, stop_tree, uf_head, wait_port, pct_ms

BIN = os.path.join(ROOT, "target", "release")
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid):
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / TICK
    except OSError:
        return 0.0


def plain(port, seconds, limit=200_000):
    """Sequential GETs on one keep-alive connection: latencies in s."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    out, end = [], time.time() + seconds
    while time.time() < end and len(out) < limit:
        t0 = time.perf_counter()
        c.request("GET", "/plain/x")
        r = c.getresponse(); r.read()
        out.append(time.perf_counter() - t0)
        if r.status != 200:
            raise SystemExit(f"plain request got {r.status}")
    c.close()
    return out


def tree_cpu_s(pid):
    """CPU of `pid` and its children (nginx's master and workers)."""
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(d))
            except OSError:
                pass
    return cpu_s(pid) + sum(cpu_s(k) for k in kids)


def nginx_proxy(tmp, port, origin, fake, streams):
    """nginx as the proxy under test (the reference): `/plain/` to the
    origin, `/v1/` to fake-openai unbuffered, both pools kept alive."""
    conf = os.path.join(tmp, "proxy.conf")
    with open(conf, "w") as f:
        f.write(f"daemon off; worker_processes auto; worker_rlimit_nofile {streams * 4 + 1024}; "
                f"pid {tmp}/proxy.pid; error_log stderr;\n"
                f"events {{ worker_connections {streams * 3 + 1024}; }}\n"
                f"http {{ access_log off; client_body_temp_path {tmp}; proxy_temp_path {tmp}; "
                f"fastcgi_temp_path {tmp}; uwsgi_temp_path {tmp}; scgi_temp_path {tmp};\n"
                f"upstream origin {{ server 127.0.0.1:{origin}; keepalive 32; }}\n"
                f"upstream fake {{ server 127.0.0.1:{fake}; keepalive 1024; }}\n"
                f"server {{ listen 127.0.0.1:{port} backlog=8192;\n"
                f"location /plain/ {{ proxy_pass http://origin; proxy_http_version 1.1; proxy_set_header Connection \"\"; }}\n"
                f"location /v1/ {{ proxy_pass http://fake; proxy_http_version 1.1; proxy_set_header Connection \"\"; "
                f"proxy_buffering off; proxy_read_timeout 600s; }} }} }}\n")
    return conf


def streams_open(fake_port):
    """Streams the upstream holds open now (fake-openai's `active`)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{fake_port}/stats", timeout=5) as r:
        return int(json.loads(r.read())["active"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=5000)
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--itl-ms", type=int, default=5000)
    ap.add_argument("--heartbeat-ms", type=int, default=1000,
                    help="[inference] heartbeat_ms: an SSE comment on every stream idle this long")
    ap.add_argument("--keepalive-ms", type=int, default=15000,
                    help="[inference] keepalive_ms: an SSE comment on every stream idle this long between tokens")
    ap.add_argument("--proxy", choices=["ultrafast", "nginx"], default="ultrafast",
                    help="the proxy under test: ultrafast, or nginx as the reference")
    ap.add_argument("--work-stealing", choices=["true", "false"], default=None,
                    help="ultrafast's [server] work_stealing (its default when not given)")
    ap.add_argument("--isolate", choices=["none", "pin", "nice"], default="none",
                    help="keep the stand-ins for other machines (fake-openai, the stream client) off "
                         "the proxy's CPU: pin = they on CPU 1, ultrafast, nginx and the plain client "
                         "on CPU 0; nice = they at nice 19")
    a = ap.parse_args()
    near, far = [], []
    if a.isolate == "pin":
        near, far = ["taskset", "-c", "0"], ["taskset", "-c", "1"]
        os.sched_setaffinity(0, {0})
    elif a.isolate == "nice":
        far = ["nice", "-n", "19"]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    out = {"cpu": cpu, "cores": os.cpu_count(), "streams": a.streams, "itl_ms": a.itl_ms,
           "heartbeat_ms": a.heartbeat_ms, "keepalive_ms": a.keepalive_ms, "isolate": a.isolate, "proxy": a.proxy,
           "work_stealing": a.work_stealing}
    procs = []
    with tempfile.TemporaryDirectory(prefix="uf-streams-") as tmp:
        try:
            op = free_port()
            ngx = os.path.join(tmp, "nginx.conf")
            with open(ngx, "w") as f:
                f.write(f"daemon off; worker_processes 1; pid {tmp}/nginx.pid; error_log stderr;\n"
                        f"events {{ worker_connections 1024; }} http {{ access_log off; client_body_temp_path {tmp}; "
                        f"proxy_temp_path {tmp}; fastcgi_temp_path {tmp}; uwsgi_temp_path {tmp}; scgi_temp_path {tmp}; "
                        f"server {{ listen 127.0.0.1:{op}; location / {{ return 200 'hello world\\n'; }} }} }}\n")
            procs.append(spawn(near + ["nginx", "-c", ngx, "-p", tmp], stderr=subprocess.DEVNULL))
            wait_port(op)
            fake = spawn(far + [os.path.join(BIN, "fake-openai"), "--tokens", "100000", "--itl-ms", str(a.itl_ms),
                          "--ttft-ms", "20", "--jitter-ms", str(a.itl_ms // 2),
                          "--capacity", str(a.streams * 2)], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
            procs.append(fake)
            fport = int(fake.stdout.readline().strip().rsplit(":", 1)[1])
            port, admin = free_port(), free_port()
            conf = os.path.join(tmp, "uf.toml")
            with open(conf, "w") as f:
                head = uf_head(tmp, port, admin)
                if a.work_stealing is not None:
                    head = head.replace("[server]\n", f"[server]\nwork_stealing = {a.work_stealing}\n", 1)
                f.write(head +
                        f'[limits]\nmax_connections = {a.streams * 4}\n\n'
                        f'[inference]\nheartbeat_ms = {a.heartbeat_ms}\nkeepalive_ms = {a.keepalive_ms}\n\n'
                        f'[[routes]]\nname = "openai"\npath = "/v1/"\ninference = true\n\n'
                        f'[[routes]]\nname = "plain"\npath = "/plain/"\npool = "origin"\n\n'
                        f'[pools.origin]\nmembers = [{{ addr = "127.0.0.1:{op}" }}]\n\n'
                        f'[pools.fake]\nmembers = [{{ addr = "127.0.0.1:{fport}" }}]\nkeepalive_idle_s = 60\n\n'
                        f'[models.m]\nbackend = "upstream"\npool = "fake"\nmax_concurrency = 0\n')
            if a.proxy == "nginx":
                uf = spawn(near + ["nginx", "-c", nginx_proxy(tmp, port, op, fport, a.streams), "-p", tmp],
                           stderr=open(os.path.join(tmp, "uf.log"), "w"))
            else:
                uf = spawn(near + [os.path.join(BIN, "ultrafast"), "serve", "-c", conf], stdout=subprocess.DEVNULL,
                           stderr=open(os.path.join(tmp, "uf.log"), "w"), env={**os.environ, "RUST_LOG": "warn"})
                wait_port(admin)
            procs.append(uf)
            wait_port(port)
            plain(port, 3)  # warm-up
            c0 = {k: tree_cpu_s(p.pid) for k, p in (("proxy", uf), ("fake", fake))}
            alone = plain(port, a.seconds)
            c1 = {k: tree_cpu_s(p.pid) for k, p in (("proxy", uf), ("fake", fake))}
            spec = {"target": f"127.0.0.1:{port}", "model": "m", "run_cap_s": a.seconds + 120,
                    "groups": [{"name": "streams", "concurrency": a.streams, "count": a.streams, "lane": "batch",
                                "max_tokens": 100000, "prompt": "Tell me a long story.",
                                "timeout_ms": (a.seconds + 110) * 1000}]}
            sf = os.path.join(tmp, "spec.json")
            json.dump(spec, open(sf, "w"))
            flood = spawn(far + [os.path.join(BIN, "slo-flood"), "--spec", sf, "--out", os.path.join(tmp, "s.jsonl")],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(flood)
            # Until every stream is open (bounded), then let the ramp settle.
            end = time.time() + 90
            held = 0
            while time.time() < end:
                held = streams_open(fport)
                if held >= a.streams:
                    break
                time.sleep(1)
            time.sleep(3)
            c2 = {k: tree_cpu_s(p.pid) for k, p in (("proxy", uf), ("fake", fake), ("client", flood))}
            beside = plain(port, a.seconds)
            c3 = {k: tree_cpu_s(p.pid) for k, p in (("proxy", uf), ("fake", fake), ("client", flood))}
            held_after = streams_open(fport)
            stop_tree(flood)
            recs = [json.loads(l) for l in open(os.path.join(tmp, "s.jsonl"))] if os.path.exists(os.path.join(tmp, "s.jsonl")) else []
            from collections import Counter
            out["stream_records"] = dict(Counter(f'{r["status"]} {r["shed"] or r["error_code"] or r["error"] or ""}'[:80] for r in recs))
            out["uf_log"] = open(os.path.join(tmp, "uf.log")).read()[-1500:]
        finally:
            for p in reversed(procs):
                stop_tree(p)
    out["streams_held"] = [held, held_after]
    out["alone"] = {"n": len(alone), "p50_ms": round(pct_ms(alone, 0.5), 3), "p99_ms": round(pct_ms(alone, 0.99), 3),
                    "cpu_s": {k: round(c1[k] - c0[k], 2) for k in c1}}
    out["beside_streams"] = {"n": len(beside), "p50_ms": round(pct_ms(beside, 0.5), 3),
                             "p99_ms": round(pct_ms(beside, 0.99), 3),
                             "cpu_s": {k: round(c3[k] - c2[k], 2) for k in c3}}
    out["p99_ratio"] = round(pct_ms(beside, 0.99) / pct_ms(alone, 0.99), 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
