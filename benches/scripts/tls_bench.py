#!/usr/bin/env python3
"""TLS handshakes: full vs resumed, ultrafast vs nginx, in one run.

Both servers use the same ECDSA P-256 certificate (from `ultrafast certs
dev`), TLS 1.3, session tickets and a session cache (nginx:
`ssl_session_tickets on; ssl_session_cache shared:SSL:10m;`), 1 worker each.
The client is Python's `ssl` (OpenSSL): a full handshake opens a new
connection with no session; a resumed one offers the session from the
previous connection (read after a request, so the TLS 1.3 ticket has
arrived). Each run is bounded by time and count; runs alternate; medians of
the rounds. Reported: handshakes/s, p50/p99 handshake time, server CPU per
handshake.

usage: benches/scripts/tls_bench.py [--rounds 3] [--seconds 4]
Build first: cargo build --release -p ultrafast
"""
import argparse, os, shutil, socket, ssl, statistics, subprocess, sys, tempfile, time
from benchlib import ROOT, free_port, pct_ms, spawn, stop_tree, wait_port

CLK = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid):
    total = 0
    for p in [pid] + [int(c) for t in os.listdir(f"/proc/{pid}/task") for c in open(f"/proc/{pid}/task/{t}/children").read().split()]:
        try:
            f = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            total += int(f[11]) + int(f[12])
        except OSError:
            pass
    return total


def handshake(port, ctx, session):
    t0 = time.perf_counter()
    raw = socket.create_connection(("127.0.0.1", port))
    s = ctx.wrap_socket(raw, server_hostname="localhost", session=session)
    dt = time.perf_counter() - t0
    s.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    while s.recv(4096):
        pass
    sess, reused = s.session, s.session_reused
    s.close()
    return dt, sess, reused


def run(port, pid, resumed, seconds, cap=20000):
    ctx = ssl.create_default_context(cafile=CA)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    times, reused_n, session = [], 0, None
    if resumed:
        _, session, _ = handshake(port, ctx, None)
    c0, start = cpu_ticks(pid), time.perf_counter()
    while time.perf_counter() - start < seconds and len(times) < cap:
        dt, sess, reused = handshake(port, ctx, session if resumed else None)
        times.append(dt)
        reused_n += reused
        if resumed:
            session = sess
    elapsed = time.perf_counter() - start
    cpu_us = (cpu_ticks(pid) - c0) / CLK * 1e6 / max(1, len(times))
    return len(times) / elapsed, pct_ms(times, 0.5), pct_ms(times, 0.99), cpu_us, reused_n / max(1, len(times))


def main():
    global CA
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4)
    ap.add_argument("--rsa", action="store_true", help="RSA-2048 certificate instead of ECDSA P-256")
    a = ap.parse_args()
    uf = os.path.join(ROOT, "target/release/ultrafast")
    if not os.path.exists(uf) or not shutil.which("nginx"):
        sys.exit("needs target/release/ultrafast and nginx")
    tmp = tempfile.mkdtemp(prefix="uf-tls-")
    procs = []
    try:
        if a.rsa:
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{tmp}/localhost.key",
                            "-out", f"{tmp}/localhost.pem", "-days", "2", "-subj", "/CN=localhost",
                            "-addext", "subjectAltName=DNS:localhost"], check=True, capture_output=True)
            shutil.copy(f"{tmp}/localhost.pem", f"{tmp}/ca.pem")
        else:
            subprocess.run([uf, "certs", "dev", "--out", tmp], check=True, capture_output=True)
        CA = f"{tmp}/ca.pem"
        np_, up = free_port(), free_port()
        with open(f"{tmp}/nginx.conf", "w") as f:
            f.write(f"daemon off; pid {tmp}/nginx.pid; error_log {tmp}/e.log warn; user root; worker_processes 1;\n"
                    f"events {{}} http {{ access_log off; server {{ listen 127.0.0.1:{np_} ssl; ssl_certificate {tmp}/localhost.pem; "
                    f"ssl_certificate_key {tmp}/localhost.key; ssl_protocols TLSv1.2 TLSv1.3; ssl_session_tickets on; "
                    f"ssl_session_cache shared:SSL:10m; location / {{ return 200 'ok'; }} }} }}\n")
        with open(f"{tmp}/uf.toml", "w") as f:
            f.write(f"[server]\nthreads = 1\npid_file = \"{tmp}/uf.pid\"\nupgrade_sock = \"{tmp}/uf.sock\"\nshutdown_grace_period_s = 0\n"
                    f"[admin]\nlisten = \"\"\n[log]\naccess_log = \"off\"\n"
                    f"[[listeners]]\naddress = \"127.0.0.1:{up}\"\ntls = {{ certs = [{{ cert = \"{tmp}/localhost.pem\", key = \"{tmp}/localhost.key\", names = [\"localhost\"], default = true }}] }}\n"
                    f"[[routes]]\npath = \"/\"\nreturn = {{ status = 200, body = \"ok\" }}\n")
        servers = {
            "nginx": (spawn(["nginx", "-p", tmp, "-c", f"{tmp}/nginx.conf"]), np_),
            "ultrafast": (spawn([uf, "serve", "-c", f"{tmp}/uf.toml"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"}), up),
        }
        procs = [p for p, _ in servers.values()]
        for _, port in servers.values():
            wait_port(port)
        print(f"# certificate: {'RSA-2048' if a.rsa else 'ECDSA P-256'}; load average before: {os.getloadavg()}")
        res = {}
        names = list(servers)
        for r in range(a.rounds):
            for k in (names if r % 2 == 0 else names[::-1]):
                p, port = servers[k]
                for mode in ("full", "resumed"):
                    out = run(port, p.pid, mode == "resumed", a.seconds)
                    res.setdefault((k, mode), []).append(out)
                    print(f"round {r} {k:9s} {mode:8s} {out[0]:7.0f}/s p50 {out[1]:.3f} ms p99 {out[2]:.3f} ms cpu {out[3]:.0f} us reused {out[4]:.2f}", flush=True)
        print("\n| server | handshake | per second (median, min-max) | p50 ms | p99 ms | server CPU us each | resumed share |")
        print("|---|---|---|---|---|---|---|")
        med = {}
        for (k, mode), v in sorted(res.items()):
            m = [statistics.median(x[i] for x in v) for i in range(5)]
            med[(k, mode)] = m
            rates = [x[0] for x in v]
            print(f"| {k} | {mode} | {m[0]:.0f} ({min(rates):.0f}-{max(rates):.0f}) | {m[1]:.3f} | {m[2]:.3f} | {m[3]:.0f} | {m[4]:.2f} |")
        u, n = med[("ultrafast", "resumed")], med[("nginx", "resumed")]
        uf_full = med[('ultrafast', 'full')]
        print(f"\nultrafast resumed/full: {u[0] / uf_full[0]:.2f}x by client-observed rate, {uf_full[3] / u[3]:.2f}x by server CPU per handshake; "
              f"resumed vs nginx resumed: {u[0] / n[0]:.2f}x; "
              f"p99 full vs nginx: {med[('ultrafast', 'full')][2] / med[('nginx', 'full')][2]:.2f}x, resumed: {u[2] / n[2]:.2f}x")
        print(f"# load average after: {os.getloadavg()}")
    finally:
        for p in procs:
            stop_tree(p)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
