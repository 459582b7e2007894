#!/usr/bin/env python3
"""First-token hedging and the SLA watchdog's fallback, in one run, against
two fake OpenAI upstream members (benches/src/fake_openai.rs) behind
ultrafast on loopback.

 (a) hedging: members A and B both answer with a time to first token of
     --ttft-ms (jitter +-10%), and A answers --slow-fraction of its requests
     (10%) with 10x that. N streaming chat requests, --concurrency at once,
     through one model over the two members, in three modes on fresh
     processes each round (order rotated per round):
       off      no hedge
       fixed    hedge = { after_ms = 1.5 x ttft, max_ratio = 0.1 }
       p90      hedge = { after = "p90", max_ratio = 0.1 }
     Reported: client TTFT p50/p90/p99 (first content chunk, measured at the
     client from the request's start), the p99 ratio off/mode, and the extra
     upstream requests ((A + B requests - N) / N).
 (b) fallback: model m over member A with a watchdog (1 s windows, 2 bad
     windows to enter, 2 good to leave, TTFT target 300 ms) and
     fallback = "spare" (member S). Eight clients in a closed loop; A turns
     slow (1000 ms to the first token) through its /control endpoint:
     time until the first response served by the fallback; then A is fast
     again: time until the first response served by m again.

Medians over --rounds. Every process started is stopped by PID; every loop
is bounded in count and time.

usage: benches/scripts/hedge_bench.py [--rounds 3] [--requests 600]
Build first: cargo build --release -p ultrafast -p ultrafast-benches
"""
import argparse, http.client, json, os, platform, statistics, subprocess, sys, tempfile, threading, time
from benchlib import ROOT, free_port, spawn, stop_tree, wait_port, pct_ms

REL = os.path.join(ROOT, "target", "release")


def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class Fake:
    def __init__(self, *args):
        self.p = spawn([os.path.join(REL, "fake-openai"), *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.p.stdout.readline().strip()
        if not line.startswith("listening on "):
            stop_tree(self.p)
            raise RuntimeError(f"fake-openai did not start: {line!r}")
        self.addr = line.removeprefix("listening on ")
        self.port = int(self.addr.rsplit(":", 1)[1])

    def call(self, method, path, body=None):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        c.request(method, path, body=json.dumps(body) if body is not None else None)
        r = c.getresponse()
        out = json.loads(r.read() or b"null")
        c.close()
        return out

    def stats(self):
        return self.call("GET", "/stats")

    def control(self, **kw):
        return self.call("POST", "/control", kw)

    def stop(self):
        stop_tree(self.p)


class Server:
    def __init__(self, tmp, body):
        self.port, self.admin = free_port(), free_port()
        self.dir = tempfile.mkdtemp(dir=tmp)
        conf = os.path.join(self.dir, "ultrafast.toml")
        with open(conf, "w") as f:
            f.write(f"[server]\nthreads = 2\npid_file = \"{self.dir}/uf.pid\"\nupgrade_sock = \"{self.dir}/uf.sock\"\n\n"
                    f"[admin]\nlisten = \"127.0.0.1:{self.admin}\"\n\n[log]\naccess_log = \"off\"\n\n"
                    f"[[listeners]]\nname = \"http\"\naddress = \"127.0.0.1:{self.port}\"\n\n"
                    f"[[routes]]\nname = \"openai\"\npath = \"/v1/\"\ninference = true\n\n{body}")
        self.log = open(os.path.join(self.dir, "stderr.log"), "w")
        self.p = spawn([os.path.join(REL, "ultrafast"), "serve", "-c", conf], stdout=subprocess.DEVNULL, stderr=self.log)
        wait_port(self.port)
        wait_port(self.admin)

    def stop(self):
        stop_tree(self.p)
        self.log.close()


def pool(name, fakes, extra=""):
    members = ", ".join(f'{{ addr = "{f.addr}" }}' for f in fakes)
    return f"[pools.{name}]\nmembers = [{members}]\n{extra}\n"


def model(name, pool_name, extra=""):
    return f"[models.{name}]\nbackend = \"upstream\"\npool = \"{pool_name}\"\nmax_concurrency = 0\n{extra}\n"


BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True})


def stream_ttft(port, body=BODY, headers=None):
    """(ttft seconds or None, status, response headers) of one streaming request."""
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json", **(headers or {})})
        r = c.getresponse()
        ttft = None
        while True:
            line = r.readline()
            if not line:
                break
            if ttft is None and line.startswith(b"data: {") and b'"content"' in line:
                ttft = time.perf_counter() - t0
            if line.strip() == b"data: [DONE]":
                break
        return ttft, r.status, dict(r.getheaders())
    finally:
        c.close()


def hedge_mode(tmp, args, mode):
    slow_ms = args.ttft_ms * 10
    jitter = max(1, args.ttft_ms // 10)
    a = Fake("--ttft-ms", str(args.ttft_ms), "--jitter-ms", str(jitter), "--itl-ms", "2", "--tokens", "4",
             "--slow-fraction", str(args.slow_fraction), "--slow-ttft-ms", str(slow_ms), "--capacity", "1024")
    b = Fake("--ttft-ms", str(args.ttft_ms), "--jitter-ms", str(jitter), "--itl-ms", "2", "--tokens", "4", "--capacity", "1024")
    hedge = {"off": "", "fixed": f"hedge = {{ after_ms = {int(args.ttft_ms * 1.5)}, max_ratio = 0.1 }}",
             "p90": "hedge = { after = \"p90\", max_ratio = 0.1 }"}[mode]
    srv = Server(tmp, pool("p", [a, b]) + model("m", "p", hedge))
    try:
        # Warm-up: connections and (for p90) the TTFT history; not counted.
        for _ in range(40):
            stream_ttft(srv.port)
        base = a.stats()["requests"] + b.stats()["requests"]
        ttfts, errors, lock = [], 0, threading.Lock()
        todo = iter(range(args.requests))
        deadline = time.time() + 300

        def worker():
            nonlocal errors
            for _ in todo:
                if time.time() > deadline:
                    return
                t, status, _ = stream_ttft(srv.port)
                with lock:
                    if status == 200 and t is not None:
                        ttfts.append(t)
                    else:
                        errors += 1

        threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        upstream = a.stats()["requests"] + b.stats()["requests"] - base
        slow = a.stats()["slow"]
        n = len(ttfts) + errors
        return {"mode": mode, "n": n, "errors": errors, "p50_ms": pct_ms(ttfts, 0.5), "p90_ms": pct_ms(ttfts, 0.9),
                "p99_ms": pct_ms(ttfts, 0.99), "extra": (upstream - n) / max(n, 1), "slow_answers": slow}
    finally:
        srv.stop(); a.stop(); b.stop()


def fallback_round(tmp):
    a = Fake("--ttft-ms", "50", "--itl-ms", "2", "--tokens", "4", "--capacity", "1024")
    s = Fake("--ttft-ms", "50", "--itl-ms", "2", "--tokens", "4", "--capacity", "1024")
    wd = ('watchdog = { window_ms = 1000, enter_after = 2, leave_after = 2, min_samples = 5, '
          'probe_interval_ms = 200, ttft_ms = 300 }\nfallback = "spare"')
    srv = Server(tmp, pool("pa", [a]) + pool("ps", [s]) + model("m", "pa", wd) + model("spare", "ps"))
    log, lock, stop = [], threading.Lock(), threading.Event()

    def client():
        end = time.time() + 120
        while not stop.is_set() and time.time() < end:
            _, status, h = stream_ttft(srv.port)
            with lock:
                log.append((time.time(), status, h.get("x-ultrafast-fallback")))

    threads = [threading.Thread(target=client) for _ in range(8)]
    try:
        [t.start() for t in threads]
        time.sleep(3)
        def first_after(since, served_by):
            """Seconds from `since` to the first response served by
            `served_by` (None: the primary), at most 30 s."""
            end = time.time() + 30
            while time.time() < end:
                time.sleep(0.02)
                with lock:
                    hit = [t for t, _, f in log if t > since and f == served_by]
                if hit:
                    return min(hit) - since
            return None

        t_slow = time.time()
        a.control(ttft_ms=1000)
        to_fallback = first_after(t_slow, "spare")
        time.sleep(2)
        t_fast = time.time()
        a.control(ttft_ms=50)
        back = first_after(t_fast, None)
        stop.set()
        [t.join() for t in threads]
        with lock:
            errors = sum(1 for _, st, _ in log if st != 200)
        return {"to_fallback_s": to_fallback, "back_s": back, "requests": len(log), "errors": errors}
    finally:
        stop.set()
        srv.stop(); a.stop(); s.stop()


def med(rows, key):
    vals = [r[key] for r in rows if r[key] is not None]
    return statistics.median(vals) if vals else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--ttft-ms", type=int, default=100)
    ap.add_argument("--slow-fraction", type=float, default=0.1)
    ap.add_argument("--only", default="hedge,fallback")
    args = ap.parse_args()
    for b in ("ultrafast", "fake-openai"):
        if not os.path.exists(os.path.join(REL, b)):
            sys.exit(f"build first: cargo build --release -p ultrafast -p ultrafast-benches ({b} missing)")
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; rounds {args.rounds}")
    only = set(args.only.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        if "hedge" in only:
            modes = ["off", "fixed", "p90"]
            rows = {m: [] for m in modes}
            for r in range(args.rounds):
                order = modes[r % 3:] + modes[:r % 3]
                for m in order:
                    row = hedge_mode(tmp, args, m)
                    rows[m].append(row)
                    print(f"  round {r + 1} {m:5}: p50 {row['p50_ms']:.1f} p90 {row['p90_ms']:.1f} p99 {row['p99_ms']:.1f} ms, "
                          f"extra upstream {100 * row['extra']:.1f}%, errors {row['errors']}, slow answers {row['slow_answers']}", flush=True)
            print(f"\n(a) hedging: {args.requests} requests x {args.concurrency} concurrent, TTFT {args.ttft_ms} ms, "
                  f"member A {100 * args.slow_fraction:.0f}% at 10x; medians of {args.rounds} rounds")
            print("| mode | TTFT p50 ms | p90 ms | p99 ms | p99 off / mode | extra upstream requests |")
            print("|---|---|---|---|---|---|")
            off99 = med(rows["off"], "p99_ms")
            for m in modes:
                p99 = med(rows[m], "p99_ms")
                print(f"| {m} | {med(rows[m], 'p50_ms'):.1f} | {med(rows[m], 'p90_ms'):.1f} | {p99:.1f} | "
                      f"{off99 / p99:.2f}x | {100 * med(rows[m], 'extra'):.1f}% |")
        if "fallback" in only:
            rows = []
            for r in range(args.rounds):
                row = fallback_round(tmp)
                rows.append(row)
                print(f"  round {r + 1}: slow -> fallback serving {row['to_fallback_s']}, fast -> back {row['back_s']} s, "
                      f"{row['requests']} requests, {row['errors']} errors", flush=True)
            print(f"\n(b) fallback (1 s windows, enter after 2, leave after 2): medians of {args.rounds} rounds")
            print(f"| slow -> fallback serving | fast -> primary serving | errors |")
            print("|---|---|---|")
            print(f"| {med(rows, 'to_fallback_s'):.2f} s | {med(rows, 'back_s'):.2f} s | {sum(r['errors'] for r in rows)} |")


if __name__ == "__main__":
    main()
