#!/usr/bin/env python3
"""Fair shares between tenants inside a lane (#42 part 4), in one run,
through ultrafast to fake-openai (the real protocol) behind a model gate
of 64 slots: 20 tokens per request, 200 ms to the first, 10 ms apart
(each +-5 ms), so a request
holds a slot about 0.42 s and the backend serves about 150 requests (3,000
tokens) a second. Tenants are API keys (`weight` in the key
file); the load client is `slo-flood` (streamed chats, one connection per
request).

 capacity: one request at a time (20 sequential) -> the time a request
     holds a slot; capacity = slots x tokens / that time.
 lone: one tenant alone, 640 closed loops (10x the slots) for 30 s ->
     its tokens/s (past the first 2 s) against the capacity and against
     the two tenants' total of `equal` (work-conserving: >= 95%).
 Heavy's requests ask 8 to 32 tokens (20 on average), light's 20: slots
 free at scattered times, as with real outputs of different lengths.
 equal: heavy 640 and light 64 closed loops (offered 10:1 in requests
     outstanding; each above its share of 32 slots, so both stay
     backlogged; together 11x the slots) for 60 s, weights 1 and 1 ->
     tokens received light:heavy (target 1:1 +-10%), Jain's index of
     weight-normalised tokens per 10 s window (>= 0.95).
 weighted: the same with light's key at weight 3 (light 96 closed loops,
     heavy 960: each above its share, 48 and 16 slots) -> 3:1 +-10%.
 light TTFT: light alone open loop at 4 requests/s for 30 s (solo), then
     the same beside heavy's 640 closed loops, light starting 5 s after
     heavy (into a lane already backlogged) -> light's TTFT p99 against
     its solo p99 (target <= 1.2x). Light waits for the next slot to free:
     with 64 slots held 0.42 s, one frees every 6.5 ms on average.
 decide (--decide): the gate's scheduling decision (`fair-decide`: a
     release and the next grant with its charges, 1000 tenants backlogged)
     under callgrind at two decision counts -> instructions per decision
     (target < 5 us; at 3 instructions per ns that is 15,000), and its
     wall-clock p50/p99 in the release build.

usage: benches/scripts/fair_bench.py [--seconds 60] [--decide] [--save DIR]
Build first: cargo build --release -p ultrafast -p ultrafast-benches
Every process started is stopped by PID; every load is bounded in time.
"""
import argparse, json, os, resource, shutil, subprocess, sys, tempfile, time, urllib.request
from benchlib import ROOT, free_port, spawn, stop_tree, uf_head, wait_ready

BIN = os.path.join(ROOT, "target", "release")
SLOTS, TOKENS, TTFT_MS, ITL_MS, JITTER_MS = 64, 20, 200, 10, 5


def cpu_model():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


class Server:
    """ultrafast with the keys `heavy` and `light` (light's weight given)."""

    def __init__(self, tmp, fake_port, light_weight):
        self.tmp = tmp
        self.port, self.admin = free_port(), free_port()
        keys = os.path.join(tmp, "keys.toml")
        with open(keys, "w") as f:
            f.write(f'[[keys]]\nname = "heavy"\nkey = "sk-heavy"\n\n'
                    f'[[keys]]\nname = "light"\nkey = "sk-light"\nweight = {light_weight}\n')
        self.conf = os.path.join(tmp, "ultrafast.toml")
        with open(self.conf, "w") as f:
            f.write(uf_head(tmp, self.port, self.admin) +
                    f'[api_keys]\nfile = "{keys}"\n\n'
                    f'[[routes]]\nname = "openai"\npath = "/v1/"\ninference = true\n\n'
                    f'[pools.fake]\nmembers = [{{ addr = "127.0.0.1:{fake_port}" }}]\nkeepalive_idle_s = 60\n\n'
                    f'[models.m]\nbackend = "upstream"\npool = "fake"\nmax_concurrency = {SLOTS}\n')

    def __enter__(self):
        self.log = os.path.join(self.tmp, "uf.log")
        with open(self.log, "w") as log:
            self.p = spawn([os.path.join(BIN, "ultrafast"), "serve", "-c", self.conf], stdout=log,
                           stderr=subprocess.STDOUT, env={**os.environ, "RUST_LOG": "warn"})
        try:
            wait_ready(self.p, self.admin, 30, self.log)
        except BaseException:
            stop_tree(self.p); raise
        return self

    def __exit__(self, *exc):
        stop_tree(self.p)


def flood(a, srv, tag, groups, cap_s):
    """One slo-flood run: its records."""
    spec = {"target": f"127.0.0.1:{srv.port}", "model": "m", "run_cap_s": cap_s, "groups": groups}
    sf, out = os.path.join(srv.tmp, f"{tag}.spec.json"), os.path.join(srv.tmp, f"{tag}.jsonl")
    with open(sf, "w") as f:
        json.dump(spec, f)
    p = spawn([os.path.join(BIN, "slo-flood"), "--spec", sf, "--out", out], stdout=subprocess.DEVNULL,
              stderr=subprocess.PIPE, text=True)
    try:
        _, err = p.communicate(timeout=cap_s + 60)
    except subprocess.TimeoutExpired:
        stop_tree(p); raise SystemExit(f"slo-flood ran past its cap ({tag})")
    if p.returncode != 0:
        raise SystemExit(f"slo-flood failed: {err}")
    if a.save:
        shutil.copy(out, os.path.join(a.save, f"{tag}.jsonl"))
    return [json.loads(l) for l in open(out)]


def group(name, key, secs, concurrency=None, rate=None, max_tokens=TOKENS, delay_s=0):
    g = {"name": name, "count": 100_000, "duration_s": secs, "start_delay_ms": delay_s * 1000, "max_tokens": max_tokens, "lane": "standard",
         "prompt": "Say something.", "timeout_ms": 60_000, "honor_retry_after": True, "max_backoff_ms": 1000,
         "headers": {"Authorization": f"Bearer {key}"}}
    if concurrency:
        g["concurrency"] = concurrency
    else:
        g["rate"] = rate
    return g


def heavy(secs, concurrency):
    """The heavy tenant's closed loops, as five groups asking 8 to 32
    tokens (20 on average): completions spread out as real outputs' do,
    instead of freeing slots in lockstep."""
    return [group(f"heavy{i}", "sk-heavy", secs, concurrency=concurrency // 5, max_tokens=8 + 6 * i)
            for i in range(5)]


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def ok(recs, name):
    return [r for r in recs if r["group"].startswith(name) and r["status"] == 200 and r["complete"]]


def tokens_in(recs, name, t0, t1):
    """Tokens of `name` received between t0 and t1 s (by completion time)."""
    return sum(r["completion_tokens"] for r in ok(recs, name) if t0 <= (r["t_origin_ms"] + r["e2e_ms"]) / 1000 < t1)


def jain(xs):
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else float("nan")


def shares(recs, secs, w_light):
    """Light:heavy over the run, and Jain's index per 10 s window of tokens
    divided by weight (the first window's ramp-up included)."""
    windows = []
    for t0 in range(0, secs, 10):
        h, l = tokens_in(recs, "heavy", t0, t0 + 10), tokens_in(recs, "light", t0, t0 + 10)
        windows.append({"from_s": t0, "heavy": h, "light": l, "jain": round(jain([h, l / w_light]), 4)})
    h, l = tokens_in(recs, "heavy", 0, secs), tokens_in(recs, "light", 0, secs)
    refused = sum(1 for r in recs if r["status"] != 200)
    return {"heavy_tokens": h, "light_tokens": l, "light_over_heavy": round(l / max(1, h), 3),
            "target": w_light, "min_jain": min(w["jain"] for w in windows), "windows": windows,
            "refused": refused, "tokens_per_s": round((h + l) / secs, 1)}


def decide(a):
    exe = os.path.join(BIN, "fair-decide")
    wall = json.loads(subprocess.run([exe, "--tenants", "1000", "--decisions", "200000"], capture_output=True,
                                     text=True, check=True).stdout.strip())
    # Instructions inside the decision alone (the output charge and the
    # release with its grant), not the re-queueing around it.
    with tempfile.TemporaryDirectory() as t:
        n = 10000
        out = os.path.join(t, "cg")
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                        "--toggle-collect=*LaneQueue*release_for*", "--toggle-collect=*LaneQueue*produced*",
                        exe, "--tenants", "1000", "--decisions", str(n)], capture_output=True, check=True)
        summary = next(l for l in open(out) if l.startswith(("summary:", "totals:")))
        per = int(summary.split()[1]) / n
    return {"instructions_per_decision": round(per), "wall": wall, "tenants": 1000, "waiters_per_tenant": 4}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--short-seconds", type=int, default=30)
    ap.add_argument("--decide", action="store_true")
    ap.add_argument("--save")
    a = ap.parse_args()
    # A thousand client connections and as many to the upstream.
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    out = {"cpu": cpu_model(), "cores": os.cpu_count(), "slots": SLOTS, "tokens": TOKENS, "ttft_ms": TTFT_MS,
           "itl_ms": ITL_MS, "jitter_ms": JITTER_MS}
    if a.decide:
        out["decide"] = decide(a)
    secs, short = a.seconds, a.short_seconds
    with tempfile.TemporaryDirectory(prefix="uf-fair-") as tmp:
        fake = spawn([os.path.join(BIN, "fake-openai"), "--tokens", "100", "--itl-ms", str(ITL_MS),
                      "--ttft-ms", str(TTFT_MS), "--jitter-ms", str(JITTER_MS), "--capacity", "4000"], stdout=subprocess.PIPE,
                     stderr=subprocess.DEVNULL, text=True)
        try:
            fake_port = int(fake.stdout.readline().strip().rsplit(":", 1)[1])
            with Server(tmp, fake_port, 1) as srv:
                recs = flood(a, srv, "capacity", [group("light", "sk-light", 30, concurrency=1) | {"count": 20}], 60)
                hold = pct([r["e2e_ms"] for r in ok(recs, "light")], 0.5) / 1000
                capacity = SLOTS * TOKENS / hold
                out["capacity"] = {"hold_s": round(hold, 3), "tokens_per_s": round(capacity, 1)}
                recs = flood(a, srv, "lone", heavy(short, 10 * SLOTS), short + 30)
                # Past the first requests' ramp (the first slot frees after a hold).
                lone = tokens_in(recs, "heavy", 2, short) / (short - 2)
                out["lone"] = {"tokens_per_s": round(lone, 1), "of_capacity": round(lone / capacity, 3)}
                recs = flood(a, srv, "solo", [group("light", "sk-light", short, rate=4)], short + 30)
                solo = [r["ttft_ms"] for r in ok(recs, "light")]
                recs = flood(a, srv, "beside", heavy(short + 5, 10 * SLOTS) +
                             [group("light", "sk-light", short, rate=4, delay_s=5)], short + 40)
                beside = [r["ttft_ms"] for r in ok(recs, "light")]
                out["light_ttft"] = {"solo_p50_ms": pct(solo, 0.5), "solo_p99_ms": pct(solo, 0.99), "n_solo": len(solo),
                                     "beside_p50_ms": pct(beside, 0.5), "beside_p99_ms": pct(beside, 0.99),
                                     "n_beside": len(beside),
                                     "p99_ratio": round(pct(beside, 0.99) / pct(solo, 0.99), 3)}
                recs = flood(a, srv, "equal", heavy(secs, 10 * SLOTS) + [group("light", "sk-light", secs, concurrency=SLOTS)],
                             secs + 30)
                out["equal"] = shares(recs, secs, 1)
                shared = (tokens_in(recs, "heavy", 2, secs) + tokens_in(recs, "light", 2, secs)) / (secs - 2)
                out["lone"]["of_two_tenants_total"] = round(lone / shared, 3)
            with Server(tmp, fake_port, 3) as srv:
                recs = flood(a, srv, "weighted",
                             heavy(secs, 15 * SLOTS) + [group("light", "sk-light", secs, concurrency=3 * SLOTS // 2)],
                             secs + 30)
                out["weighted"] = shares(recs, secs, 3)
        finally:
            stop_tree(fake)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
