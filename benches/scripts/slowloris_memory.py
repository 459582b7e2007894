#!/usr/bin/env python3
"""RSS per slowloris connection: ultrafast beside nginx, in one run.

Each server gets --conns connections that have sent a partial request head
(a request line and one header line, never the empty line) and then hold;
RSS (exact, from /proc/PID/smaps_rollup, summed over the process and its
children) is read before and 2 s after they are open. Both servers answer
a fixed 200 and log nothing; 1 worker each. Loopback only; every
connection is closed and every server stopped at the end.

usage: benches/scripts/slowloris_memory.py [--conns 1000] [--rounds 3]
       [--bin target/release/ultrafast]
Build first: cargo build --release -p ultrafast; needs nginx.
"""
import argparse, os, shutil, socket, statistics, subprocess, sys, tempfile, time
from benchlib import ROOT, exact_rss_kb, free_port, spawn, stop_tree, wait_port, with_children


def start(kind, binary, tmp, port):
    if kind == "ultrafast":
        cfg = os.path.join(tmp, "uf.toml")
        with open(cfg, "w") as f:
            f.write(f'[server]\nthreads = 1\npid_file = "{tmp}/uf.pid"\nupgrade_sock = "{tmp}/uf.sock"\n'
                    f'[admin]\nlisten = ""\n[log]\naccess_log = "off"\n[[listeners]]\naddress = "127.0.0.1:{port}"\n'
                    '[[routes]]\npath = "/"\nreturn = { status = 200, body = "ok" }\n')
        return spawn([binary, "serve", "-c", cfg], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     env={**os.environ, "RUST_LOG": "warn"})
    conf = os.path.join(tmp, "nginx.conf")
    with open(conf, "w") as f:
        f.write(f"daemon off; pid {tmp}/ngx.pid; error_log {tmp}/ngx.err; worker_processes 1; "
                f"events {{ worker_connections 8192; }} http {{ access_log off; "
                f"server {{ listen 127.0.0.1:{port}; location / {{ return 200 ok; }} }} }}")
    return spawn(["nginx", "-p", tmp, "-c", conf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def one(kind, binary, conns):
    tmp = tempfile.mkdtemp(prefix="uf-slowloris-")
    port = free_port()
    p = start(kind, binary, tmp, port)
    socks = []
    try:
        wait_port(port)
        time.sleep(1)
        pids = with_children(p.pid)
        idle = exact_rss_kb(pids)
        for _ in range(conns):
            s = socket.create_connection(("127.0.0.1", port), 5)
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-a: 1\r\n")
            socks.append(s)
        time.sleep(2)
        held = exact_rss_kb(pids)
        return idle, held, (held - idle) / conns
    finally:
        for s in socks:
            s.close()
        stop_tree(p)
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conns", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/release/ultrafast"))
    a = ap.parse_args()
    if not os.path.exists(a.bin) or not shutil.which("nginx"):
        sys.exit("needs the ultrafast binary (cargo build --release -p ultrafast) and nginx")
    res = {"ultrafast": [], "nginx": []}
    for r in range(a.rounds):
        for kind in (("ultrafast", "nginx") if r % 2 == 0 else ("nginx", "ultrafast")):
            idle, held, per = one(kind, a.bin, a.conns)
            res[kind].append(per)
            print(f"round {r} {kind:9s} idle {idle} KiB, with {a.conns} held {held} KiB: {per:.1f} KiB/conn", flush=True)
    uf, ng = statistics.median(res["ultrafast"]), statistics.median(res["nginx"])
    print(f"\n| server | KiB per slowloris connection (median of {a.rounds}) | vs nginx |\n|---|---|---|")
    print(f"| nginx | {ng:.1f} | 1.00x |\n| ultrafast | {uf:.1f} | {uf / ng:.2f}x |")


if __name__ == "__main__":
    main()
