#!/usr/bin/env python3
"""One server under each HTTP/2 and HTTP/3 attack for --seconds (30 by
default): its RSS (exact, smaps_rollup) sampled every 100 ms, and the
latency of a normal client beside the attack (an HTTP/1.1 GET on a fresh
connection every 20 ms), with its p99. The attacks are the test suite's
own clients (proxy/tests/py/h2_attack.py, h3_attack.py), repeated on new
connections until the time is up.

One ultrafast (1 worker, access log off) with a plain listener, an h2c
listener and a TLS listener with HTTP/3, in front of a small origin
(Python's http.server: /ok and /big/N). Loopback only; every process is
stopped at the end.

usage: benches/scripts/attack_memory.py [--seconds 30] [--only NAME,...]
       [--bin target/release/ultrafast]
Build first: cargo build --release -p ultrafast; needs .venv with aioquic.
"""
import argparse, http.server, json, os, shutil, socket, statistics, subprocess, sys, tempfile, threading, time
from benchlib import ROOT, exact_rss_kb, free_port, pct_ms, spawn, stop_tree, wait_port

PY = os.path.join(ROOT, ".venv", "bin", "python3")
H2 = os.path.join(ROOT, "proxy", "tests", "py", "h2_attack.py")
H3 = os.path.join(ROOT, "proxy", "tests", "py", "h3_attack.py")

# (name, command builder): each runs one attack for at most `s` seconds.
def attacks(h2c, tls, ca):
    h2 = lambda a, *x: (lambda s: [PY, H2, a, "--port", str(h2c), "--seconds", str(s), *x])
    h3 = lambda n, prefix, fill, *x: (lambda s: [PY, H3, "frames", "--port", str(tls), "--cafile", ca,
                                                 "--streams", str(n), "--prefix", prefix, "--fill", str(fill),
                                                 "--seconds", str(s), *x])
    return [
        ("none (the normal client alone)", lambda s: ["sleep", str(s)]),
        ("h2 rapid reset", h2("rapid-reset")),
        ("h2 CONTINUATION flood", h2("continuation")),
        ("h2 HPACK bomb", h2("hpack-bomb")),
        ("h2 SETTINGS flood", h2("settings-flood")),
        ("h2 PING flood", h2("ping-flood")),
        ("h2 zero window (100 x 1 MB)", h2("zero-window", "--count", "100", "--path", "/big/1000000")),
        ("h2 stream limit (1,000 open)", h2("streams", "--count", "1000")),
        ("h3 2^40-byte HEADERS x16", h3(16, "01c000010000000000", 4 << 20)),
        ("h3 unknown frames 2^40 x8", h3(8, "21c000010000000000", 8 << 20)),
        ("h3 trickled 1 MB heads x8", h3(8, "01800f4240", 900_000)),
        ("h3 control SETTINGS 1 MiB", h3(1, "0004c000000000100000", 64 << 10, "--uni")),
        ("h3 QPACK encoder flood", h3(2, "02", 4 << 20, "--uni")),
        ("h3 unknown uni streams x64", h3(64, "21", 64 << 10, "--uni")),
    ]


class Origin(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Head and body leave in separate writes: without this, Nagle and the
    # proxy's delayed ACK add 40 ms to every answer.
    disable_nagle_algorithm = True

    def do_GET(self):
        n = int(self.path.split("/")[2]) if self.path.startswith("/big/") else 2
        self.send_response(200)
        self.send_header("Content-Length", str(n))
        self.end_headers()
        left = n
        while left > 0:
            k = min(left, 65536)
            self.wfile.write(b"x" * k)
            left -= k

    def log_message(self, *a):
        pass


def normal_client(port, stop, lat, failures):
    while not stop.is_set():
        t = time.perf_counter()
        try:
            s = socket.create_connection(("127.0.0.1", port), 5)
            s.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data = b""
            while b"\r\n\r\n" not in data or not data.endswith(b"ok"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
            s.close()
            if data.startswith(b"HTTP/1.1 200"):
                lat.append(time.perf_counter() - t)
            else:
                failures.append(data[:40])
        except OSError as e:
            failures.append(str(e))
        time.sleep(0.02)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--only", default="")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "ultrafast"))
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="uf-attacks-")
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Origin)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    o = srv.server_address[1]
    subprocess.run([a.bin, "certs", "dev", "--out", f"{tmp}/certs"], check=True, stdout=subprocess.DEVNULL)
    port, h2c, tls, admin = free_port(), free_port(), free_port(), free_port()
    cfg = f"{tmp}/uf.toml"
    with open(cfg, "w") as f:
        f.write(f'[server]\nthreads = 1\npid_file = "{tmp}/uf.pid"\nupgrade_sock = "{tmp}/uf.sock"\n'
                f'[admin]\nlisten = "127.0.0.1:{admin}"\n[log]\naccess_log = "off"\n'
                f'[[listeners]]\nname = "http"\naddress = "127.0.0.1:{port}"\n'
                f'[[listeners]]\nname = "h2c"\naddress = "127.0.0.1:{h2c}"\nh2c = true\n'
                f'[[listeners]]\nname = "tls"\naddress = "127.0.0.1:{tls}"\nclient_header_timeout_ms = 5000\n'
                f'tls = {{ certs = [{{ cert = "{tmp}/certs/localhost.pem", key = "{tmp}/certs/localhost.key", '
                f'names = ["localhost"], default = true }}], http3 = true }}\n'
                f'[pools.o]\nmembers = [{{ addr = "127.0.0.1:{o}" }}]\n'
                f'[[routes]]\npath = "/"\npool = "o"\n')
    p = spawn([a.bin, "serve", "-c", cfg], stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/uf.log", "w"),
              env={**os.environ, "RUST_LOG": "warn"})
    rows = []
    try:
        for q in (port, h2c, tls):
            wait_port(q)
        time.sleep(1)
        only = [x.strip() for x in a.only.split(",") if x.strip()]
        for name, cmd in attacks(h2c, tls, f"{tmp}/certs/ca.pem"):
            if only and not any(x in name for x in only):
                continue
            time.sleep(2)
            idle = exact_rss_kb([p.pid])
            stop, lat, failures, peak = threading.Event(), [], [], [idle]
            client = threading.Thread(target=normal_client, args=(port, stop, lat, failures))
            client.start()

            def sample():
                while not stop.is_set():
                    peak.append(exact_rss_kb([p.pid]))
                    time.sleep(0.1)
            sampler = threading.Thread(target=sample)
            sampler.start()
            end = time.time() + a.seconds
            runs = 0
            while time.time() < end and runs < 1000:
                left = max(1.0, end - time.time())
                subprocess.run(["timeout", str(int(left) + 15), *cmd(min(left, 10.0))],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                runs += 1
            stop.set()
            client.join()
            sampler.join()
            alive = p.poll() is None
            row = {"attack": name, "idle_kib": idle, "peak_kib": max(peak), "over_idle_mib": round((max(peak) - idle) / 1024, 1),
                   "after_kib": exact_rss_kb([p.pid]), "attack_runs": runs, "normal_ok": len(lat),
                   "normal_failed": len(failures), "normal_p50_ms": round(pct_ms(lat, 0.5), 2),
                   "normal_p99_ms": round(pct_ms(lat, 0.99), 2), "server_alive": alive}
            print(json.dumps(row), flush=True)
            rows.append(row)
            if not alive:
                break
    finally:
        stop_tree(p)
        srv.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print("| attack | RSS peak over idle (MiB) | normal p50 / p99 (ms) | normal answered / failed |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['attack']} | {r['over_idle_mib']} | {r['normal_p50_ms']} / {r['normal_p99_ms']} | {r['normal_ok']} / {r['normal_failed']} |")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main()
