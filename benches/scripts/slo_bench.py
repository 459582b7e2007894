#!/usr/bin/env python3
"""SLA-aware admission benchmark on the in-process engine, in one run:
the default lanes (TTFT targets on) beside today's behaviour (the same lanes
with every `ttft_slo_ms = 0`: queue with max_wait only), alternating the
order each round, a fresh server per scenario so each flood starts cold
right after /readyz.

 (a) cold flood: N concurrent standard chat requests (max_tokens 128) sent
     at once right after ready: time-to-refusal p50/p99 (refused = any
     4xx/5xx), admitted count, admitted TTFT p50/p99 against the standard
     target, completion tokens/s served (total completion tokens / (last
     completion - first request)), refusal reasons.
 (b) ultra during a standard flood: 20 sequential ultra requests alone
     (short prompt, max_tokens 16) -> unloaded TTFT; then a closed-loop
     standard flood (concurrency 64, max_tokens 128, ~40 s; refused
     clients wait out Retry-After, at most 2 s) with ultra requests open
     loop at 1/s -> ultra TTFT p50/p99, ratio to the unloaded p50, against
     the ultra target.
 (attack) the 1 MiB `ultra` attack (#42): two connections looping
     `X-Request-Priority: ultra` chats with a 1 MiB user message and
     max_tokens 1 for --attack-s seconds, beside one closed-loop client of
     ordinary standard chats (short prompt, max_tokens 16): share of the
     ordinary requests served and their TTFT p50/p99 against the standard
     target, the attackers' answers by status and code.
 --hog: a second process (a busy loop at normal priority) takes one core
     from before the server starts until the scenario ends: the cold flood
     on a deliberately slowed engine (its warm-up fit sees the slower
     machine; the correction factor starts at its conservative prior).
     --hog-at ready starts it right after /readyz instead, so the fit
     believes the machine is twice as fast as it is.
 (c) predictor error over the admitted requests of (a) and (b):
     |predicted_ttft_ms - ttft_ms| from each stream's `ultrafast_timing`.

The load client is `slo-flood` (benches/src/slo_flood.rs): raw HTTP/1.1 on
loopback, one JSON line per request, kept with `--save DIR`. Latency is
measured at the client from each request's start (planned start for the
open-loop ultra requests). The server's and the client's CPU time and the
machine's other busy time are reported per scenario. Every wait is bounded
and every process started is stopped by PID.

usage: benches/scripts/slo_bench.py [--rounds 1] [--only cold,ultra] [--save DIR]
(one round is 4 servers: about 10 minutes on 2 cores, most of it the
legacy cold flood draining 200 x 128 tokens)
Build first: cargo build --release -p ultrafast -p ultrafast-benches
Smoke test of the harness without the engine: --fake (the model is served
by fake-openai behind the same proxy; numbers mean nothing).
"""
import argparse, json, os, re, resource, shlex, shutil, statistics, subprocess, sys, tempfile, time, tomllib
import urllib.request
from collections import Counter
from benchlib import ROOT, free_port, spawn, stop_tree, wait_ready

CONF = os.path.join(ROOT, "conf", "ultrafast.toml")
LANES_SRC = os.path.join(ROOT, "proxy", "src", "admission", "mod.rs")
TICK = os.sysconf("SC_CLK_TCK")

LONG_PROMPT = ("You are a careful technical writer. Write a detailed, well organised essay on how lighthouses "
               "were built and kept running in the nineteenth century: the choice of site, the foundations on "
               "rock and sand, the lenses and lamps, the fuel, the daily work of the keepers, the dangers they "
               "faced in storms, and how the coming of electricity changed the job. Use several paragraphs.")
SHORT_PROMPT = "What is the capital of France?"

# Mirror of proxy/src/admission/mod.rs default_lanes(), used only when that
# file cannot be read: (rank, queue_len, max_wait_ms, reserved_share, preempt),
# and DEFAULT_SLO_MS: (ttft_slo_ms, high_watermark) by rank.
FALLBACK_LANES = {"ultra": (0, 256, 2000, 0.2, True), "standard": (1, 1024, 15000, 0.0, False),
                  "batch": (2, 4096, 60000, 0.0, False)}
FALLBACK_SLO = [(1500, 1.0), (10000, 0.9), (0, 0.9)]


def default_lanes():
    """The default lanes and their TTFT targets, read from the proxy source
    so the legacy config stays the defaults with only the targets off."""
    try:
        src = open(LANES_SRC).read()
        body = src[src.index("pub fn default_lanes"):]
        lanes = {m[0]: (int(m[1]), int(m[2].replace("_", "")), int(m[3].replace("_", "")), float(m[4]), m[5] == "true")
                 for m in re.findall(r'lane\(\s*"(\w+)",\s*(\d+),\s*([\d_]+),\s*([\d_]+),\s*([\d.]+),\s*(true|false)\s*[,)]', body)}
        slo = [(int(a.replace("_", "")), float(b)) for a, b in
               re.findall(r"\(([\d_]+),\s*([\d.]+)\)", re.search(r"DEFAULT_SLO_MS[^=]*=\s*\[(.*?)\];", src, re.S)[1])]
        if set(lanes) == set(FALLBACK_LANES) and len(slo) == 3:
            return lanes, slo, "proxy/src/admission/mod.rs"
    except (OSError, ValueError, TypeError, IndexError):
        pass
    return FALLBACK_LANES, FALLBACK_SLO, "built-in fallback (could not read proxy/src/admission/mod.rs)"


def legacy_lanes_toml(lanes, slo, with_slo_key=True):
    out = []
    for name, (rank, qlen, wait, share, preempt) in sorted(lanes.items(), key=lambda kv: kv[1][0]):
        hw = slo[rank][1] if rank < len(slo) else 1.0
        out.append(f"[lanes.{name}]\nrank = {rank}\nqueue_len = {qlen}\nmax_wait_ms = {wait}\n"
                   f"reserved_share = {share}\npreempt = {'true' if preempt else 'false'}\nhigh_watermark = {hw}\n"
                   + ("ttft_slo_ms = 0\n" if with_slo_key else ""))
    return "\n".join(out)


def sub1(pattern, repl, text):
    new, n = re.subn(pattern, repl, text, flags=re.M)
    if n != 1:
        raise SystemExit(f"conf/ultrafast.toml: expected one line matching {pattern!r}, found {n}")
    return new


def make_conf(tmp, name, legacy, lanes, slo, fake_port=None, with_slo_key=True, extra_toml=""):
    """conf/ultrafast.toml with ephemeral ports and private paths; legacy:
    the default lanes written out with every ttft_slo_ms = 0."""
    text = open(CONF).read()
    parsed = tomllib.loads(text)
    model = next(iter(parsed.get("models", {})), None)
    if model is None:
        raise SystemExit("conf/ultrafast.toml has no [models.*]")
    port, admin = free_port(), free_port()
    text = sub1(r"^pid_file\s*=.*$", f'pid_file = "{tmp}/{name}.pid"', text)
    text = sub1(r"^upgrade_sock\s*=.*$", f'upgrade_sock = "{tmp}/{name}.sock"', text)
    text = sub1(r"^listen\s*=.*$", f'listen = "127.0.0.1:{admin}"', text)
    text = sub1(r"^address\s*=.*$", f'address = "127.0.0.1:{port}"', text)
    if fake_port:
        # Smoke mode: the same model name served by fake-openai upstream.
        text = re.sub(r"^\[models\.[^\]]+\]\n(?:(?!\[).*\n?)*", "", text, flags=re.M)
        text += (f'\n[pools.fake]\nmembers = [{{ addr = "127.0.0.1:{fake_port}" }}]\nkeepalive_idle_s = 60\n'
                 f'[models.{model}]\nbackend = "upstream"\npool = "fake"\nmax_concurrency = 16\n')
    if legacy:
        if "lanes" in parsed:
            # The shipped config names its lanes: turn each one's target off.
            text = re.sub(r"^ttft_slo_ms\s*=.*\n?", "", text, flags=re.M)
            text = re.sub(r"^(\[lanes\.[^\]]+\]\n)", r"\1ttft_slo_ms = 0\n" if with_slo_key else r"\1", text, flags=re.M)
        else:
            text += "\n# legacy: the default lanes, every TTFT target off\n" + legacy_lanes_toml(lanes, slo, with_slo_key)
    text += extra_toml
    path = os.path.join(tmp, f"{name}.toml")
    with open(path, "w") as f:
        f.write(text)
    return path, port, admin, model


def check_conf(exe, path):
    r = subprocess.run([exe, "check", "-c", path], capture_output=True, text=True, timeout=60)
    return r.returncode == 0, r.stdout + r.stderr


def proc_cpu_s(pid):
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / TICK  # utime, stime (all threads)
    except (OSError, IndexError, ValueError):
        return 0.0


def machine_busy_s():
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(f) - f[3] - f[4]) / TICK  # all but idle and iowait


def children_cpu_s():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_quiet(limit_s, threshold=0.25):
    """Wait (bounded) until the machine's busy share over a second is low."""
    n = os.cpu_count() or 1
    busy = 1.0
    end = time.time() + limit_s
    while time.time() < end:
        b0 = machine_busy_s(); time.sleep(1.0); busy = (machine_busy_s() - b0) / n
        if busy < threshold:
            break
    return busy


class Server:
    """One ultrafast on a generated config, stopped by PID on exit."""

    def __init__(self, a, tmp, name, legacy, env, extra_toml=""):
        self.a, self.tmp, self.name = a, tmp, name
        self.conf, self.port, self.admin, self.model = make_conf(tmp, name, legacy, a.lanes, a.slo, a.fake_port,
                                                                 not a.no_slo_key, extra_toml)
        self.log = os.path.join(tmp, f"{name}.log")
        self.env = env

    def __enter__(self):
        with open(self.log, "w") as log:
            self.p = spawn([self.a.exe, "serve", "-c", self.conf], stdout=log, stderr=subprocess.STDOUT, env=self.env)
        try:
            wait_ready(self.p, self.admin, self.a.ready_timeout, self.log)
        except BaseException:
            stop_tree(self.p); raise
        return self

    def __exit__(self, *exc):
        stop_tree(self.p)


def flood(a, srv, tmp, tag, groups, cap_s):
    """Run slo-flood once; its records, and the CPU spent meanwhile."""
    spec = {"target": f"127.0.0.1:{srv.port}", "model": srv.model, "run_cap_s": cap_s, "groups": groups}
    sf, out = os.path.join(tmp, f"{tag}.spec.json"), os.path.join(tmp, f"{tag}.jsonl")
    with open(sf, "w") as f:
        json.dump(spec, f)
    s0, c0, m0 = proc_cpu_s(srv.p.pid), children_cpu_s(), machine_busy_s()
    p = spawn([a.flood_exe, "--spec", sf, "--out", out], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = p.communicate(timeout=cap_s + 30)
    except subprocess.TimeoutExpired:
        stop_tree(p); raise SystemExit(f"slo-flood ran past its cap ({tag})")
    s1, c1, m1 = proc_cpu_s(srv.p.pid), children_cpu_s(), machine_busy_s()
    if p.returncode != 0:
        raise SystemExit(f"slo-flood failed ({p.returncode}): {err}")
    if a.verbose:
        sys.stderr.write(err)
    recs = [json.loads(line) for line in open(out)]
    if a.save:
        shutil.copy(out, os.path.join(a.save, os.path.basename(out)))
    cpu = {"server": s1 - s0, "client": c1 - c0, "other": max(0.0, (m1 - m0) - (s1 - s0) - (c1 - c0))}
    return recs, cpu


def pct(v, q):
    if not v:
        return float("nan")
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))]


def reason(r):
    if r["status"] == 0:
        return "client: " + (r["error"] or "?").split(":")[0]
    return f'{r["status"]} {r["shed"] or r["error_code"] or ""}'.strip()


def tokens_per_s(recs):
    ok = [r for r in recs if r["status"] == 200]
    if not ok:
        return float("nan")
    first = min(r["t_origin_ms"] for r in recs)
    last = max(r["t_origin_ms"] + r["e2e_ms"] for r in ok)
    return sum(r["completion_tokens"] for r in ok) / max(1e-9, (last - first) / 1000)


def pred_pairs(recs):
    """(predicted, actual) TTFT of admitted streams, both from ultrafast_timing."""
    return [(r["predicted_ttft_ms"], r["server_ttft_ms"]) for r in recs
            if r["status"] == 200 and r["predicted_ttft_ms"] is not None and r["server_ttft_ms"] is not None]


def cpu_rows(cpu, tokens):
    return {"server CPU s": cpu["server"], "server CPU ms / completion token": 1000 * cpu["server"] / tokens if tokens else float("nan"),
            "client CPU s": cpu["client"], "other CPU s on the machine": cpu["other"]}


class Hog:
    """A busy loop at normal priority taking one core (bounded: it exits by
    itself after an hour), stopped by PID."""

    def __init__(self, on):
        self.on = on

    def __enter__(self):
        if self.on:
            self.p = spawn([sys.executable, "-c", "import time\nend = time.time() + 3600\nwhile time.time() < end: pass"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc):
        if self.on:
            stop_tree(self.p)


def cold(a, tmp, name, legacy, env, rnd):
    early, late = a.hog and a.hog_at == "start", a.hog and a.hog_at == "ready"
    with Hog(early), Server(a, tmp, f"cold-{name}-{rnd}", legacy, env) as srv, Hog(late):
        g = {"name": "flood", "concurrency": a.flood_n, "count": a.flood_n, "lane": "standard", "prompt": a.prompt,
             "max_tokens": a.flood_tokens, "timeout_ms": a.request_timeout * 1000, "extra": a.extra}
        recs, cpu = flood(a, srv, tmp, f"cold-{name}-{rnd}", [g], a.request_timeout + 10)
    ok = [r for r in recs if r["status"] == 200]
    refused = [r for r in recs if r["status"] >= 400]
    ttft = [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]
    target = a.targets.get("standard", 0)
    row = {"requests": len(recs), "admitted (200)": len(ok), "refused (4xx/5xx)": len(refused),
           "client errors / timeouts": sum(1 for r in recs if r["status"] == 0),
           "admitted but cut short": sum(1 for r in ok if not r["complete"]),
           "time-to-refusal p50 ms": pct([r["e2e_ms"] for r in refused], 0.5),
           "time-to-refusal p99 ms": pct([r["e2e_ms"] for r in refused], 0.99),
           "admitted TTFT p50 ms": pct(ttft, 0.5), "admitted TTFT p99 ms": pct(ttft, 0.99),
           f"admitted over the standard target ({target} ms)": sum(1 for t in ttft if target and t > target),
           "server ttft_ms p99": pct([r["server_ttft_ms"] for r in ok if r["server_ttft_ms"] is not None], 0.99),
           "completion tokens": sum(r["completion_tokens"] for r in ok),
           "completion tokens/s served": tokens_per_s(recs)}
    row.update(cpu_rows(cpu, row["completion tokens"]))
    return row, Counter(reason(r) for r in refused + [r for r in recs if r["status"] == 0]), {"(a) cold flood, standard": pred_pairs(recs)}


def ultra(a, tmp, name, legacy, env, rnd):
    with Server(a, tmp, f"ultra-{name}-{rnd}", legacy, env) as srv:
        u = {"name": "ultra", "lane": "ultra", "prompt": a.ultra_prompt, "max_tokens": a.ultra_tokens,
             "timeout_ms": 60000, "extra": a.extra}
        # Markers 100.. alone and 200.. under the flood: the same number of
        # digits, and no ultra prompt under the flood is in the prefix cache
        # from the unloaded run (that made the loaded ones look faster).
        base, _ = flood(a, srv, tmp, f"ultra-unloaded-{name}-{rnd}", [{**u, "concurrency": 1, "count": a.ultra_n, "marker_base": 100}], 120)
        fl = {"name": "standard", "concurrency": a.flood_c, "count": 1_000_000, "duration_s": a.flood_s, "lane": "standard",
              "prompt": a.prompt, "max_tokens": a.flood_tokens, "timeout_ms": min(a.request_timeout, a.flood_s + 60) * 1000,
              "honor_retry_after": True, "max_backoff_ms": 2000, "extra": a.extra}
        n_ultra = max(1, int((a.flood_s - a.ultra_delay) * a.ultra_rate))
        ug = {**u, "rate": a.ultra_rate, "count": n_ultra, "start_delay_ms": a.ultra_delay * 1000, "marker_base": 200}
        recs, cpu = flood(a, srv, tmp, f"ultra-loaded-{name}-{rnd}", [fl, ug], a.flood_s + min(a.request_timeout, a.flood_s + 60) + 10)
    unl = [r["ttft_ms"] for r in base if r["status"] == 200 and r["ttft_ms"] is not None]
    ur = [r for r in recs if r["group"] == "ultra"]
    sr = [r for r in recs if r["group"] == "standard"]
    ut = [r["ttft_ms"] for r in ur if r["status"] == 200 and r["ttft_ms"] is not None]
    st = [r["ttft_ms"] for r in sr if r["status"] == 200 and r["ttft_ms"] is not None]
    p50u = pct(unl, 0.5)
    row = {"ultra unloaded TTFT p50 ms": p50u, "ultra unloaded TTFT p99 ms": pct(unl, 0.99),
           "ultra under flood: sent": len(ur), "ultra admitted": sum(1 for r in ur if r["status"] == 200),
           "ultra refused": sum(1 for r in ur if r["status"] >= 400),
           "ultra TTFT p50 ms": pct(ut, 0.5), "ultra TTFT p99 ms": pct(ut, 0.99),
           "ultra p99 / unloaded p50": pct(ut, 0.99) / p50u if p50u == p50u and p50u else float("nan"),
           f"ultra over the ultra target ({a.targets.get('ultra', 0)} ms)": sum(1 for t in ut if a.targets.get("ultra") and t > a.targets["ultra"]),
           "standard sent": len(sr), "standard admitted": sum(1 for r in sr if r["status"] == 200),
           "standard refused": sum(1 for r in sr if r["status"] >= 400),
           "standard TTFT p99 ms": pct(st, 0.99),
           "completion tokens/s served": tokens_per_s(recs)}
    row.update(cpu_rows(cpu, sum(r["completion_tokens"] for r in recs if r["status"] == 200)))
    return row, Counter(f'{r["group"]}: {reason(r)}' for r in recs if r["status"] != 200), {
        "(b) ultra alone": pred_pairs(base), "(b) ultra during the flood": pred_pairs(ur), "(b) standard flood": pred_pairs(sr)}


def attack(a, tmp, name, legacy, env, rnd):
    big = "[limits]\nclient_max_body_bytes = 4194304\n"
    with Server(a, tmp, f"attack-{name}-{rnd}", legacy, env, big) as srv:
        atk = {"name": "attack", "concurrency": 2, "count": 1_000_000, "duration_s": a.attack_s, "lane": "ultra",
               "prompt": "a " * (512 * 1024), "max_tokens": 1, "timeout_ms": 60000, "extra": a.extra}
        ordinary = {"name": "ordinary", "concurrency": 1, "count": 1_000_000, "duration_s": a.attack_s, "lane": "standard",
                    "prompt": a.ultra_prompt, "max_tokens": 16, "timeout_ms": 60000, "start_delay_ms": 500, "extra": a.extra}
        recs, cpu = flood(a, srv, tmp, f"attack-{name}-{rnd}", [atk, ordinary], a.attack_s + 70)
    orr = [r for r in recs if r["group"] == "ordinary"]
    ar = [r for r in recs if r["group"] == "attack"]
    ot = [r["ttft_ms"] for r in orr if r["status"] == 200 and r["ttft_ms"] is not None]
    served = sum(1 for r in orr if r["status"] == 200)
    row = {"ordinary sent": len(orr), "ordinary served (200)": served,
           "ordinary served %": 100 * served / len(orr) if orr else float("nan"),
           "ordinary TTFT p50 ms": pct(ot, 0.5), "ordinary TTFT p99 ms": pct(ot, 0.99),
           f"ordinary over the standard target ({a.targets.get('standard', 0)} ms)":
               sum(1 for t in ot if a.targets.get("standard") and t > a.targets["standard"]),
           "attack requests": len(ar), "attack answered 400": sum(1 for r in ar if r["status"] == 400),
           "attack time-to-answer p99 ms": pct([r["e2e_ms"] for r in ar if r["status"] >= 400], 0.99)}
    row.update(cpu_rows(cpu, sum(r["completion_tokens"] for r in recs if r["status"] == 200)))
    return row, Counter(f'{r["group"]}: {reason(r)}' for r in recs if r["status"] != 200), {
        "(attack) ordinary standard": pred_pairs(orr)}


def fmt(vals):
    vals = [v for v in vals if v == v]  # drop nan
    if not vals:
        return "-"
    f = (lambda v: f"{v:.0f}") if all(float(v).is_integer() for v in vals) else (lambda v: f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}")
    med = statistics.median(vals)
    return f(med) if len(vals) == 1 else f"{f(med)} ({f(min(vals))}-{f(max(vals))})"


def table(title, rows, reasons):
    print(f"\n{title}\n")
    print("| metric | SLA lanes (defaults) | legacy (every ttft_slo_ms = 0) |")
    print("|---|---|---|")
    keys = list(rows["sla"][0]) if rows["sla"] else list(rows["legacy"][0])
    for k in keys:
        print(f"| {k} | {fmt([r.get(k, float('nan')) for r in rows['sla']])} | {fmt([r.get(k, float('nan')) for r in rows['legacy']])} |")
    for mode in ("sla", "legacy"):
        tot = sum(reasons[mode], Counter())
        print(f"\nnon-200 by reason, {mode}, all rounds: " + (", ".join(f"{k} x{v}" for k, v in tot.most_common()) or "none"))


def predictor_table(preds):
    print("\n(c) predictor error over admitted streams, all rounds pooled: |predicted_ttft_ms - ttft_ms|, both from"
          " each stream's ultrafast_timing; bias = median of (predicted - actual), negative = predicted too low\n")
    print("| requests | SLA n | SLA abs error p50 / p99 ms | SLA bias ms | legacy n | legacy abs error p50 / p99 ms | legacy bias ms |")
    print("|---|---|---|---|---|---|---|")
    for k in sorted(set(preds["sla"]) | set(preds["legacy"])):
        cells = []
        for mode in ("sla", "legacy"):
            pairs = preds[mode].get(k, [])
            err = [abs(p - t) for p, t in pairs]
            bias = statistics.median([p - t for p, t in pairs]) if pairs else float("nan")
            cells += [str(len(pairs)), f"{pct(err, 0.5):.1f} / {pct(err, 0.99):.1f}", f"{bias:+.1f}"]
        print(f"| {k} | " + " | ".join(cells) + " |")


def verdicts(a, res):
    med = lambda mode, scen, k: statistics.median([r[k] for r in res[scen][mode]] or [float("nan")])
    print("\nIssue targets (medians over rounds, SLA config):")
    if res["cold"]["sla"]:
        ttr = med("sla", "cold", "time-to-refusal p99 ms")
        ttft = med("sla", "cold", "admitted TTFT p99 ms")
        tps, fifo = med("sla", "cold", "completion tokens/s served"), med("legacy", "cold", "completion tokens/s served")
        print(f"- (a) time-to-refusal p99 {ttr:.1f} ms (target < 50): met" if ttr < 50 else
              f"- (a) time-to-refusal p99 {ttr:.1f} ms (target < 50): MISSED" if ttr == ttr else "- (a) time-to-refusal: no refusals")
        t = a.targets.get("standard", 0)
        print(f"- (a) admitted TTFT p99 {ttft:.0f} ms vs standard target {t} ms: {'met' if t and ttft <= t else 'MISSED'}")
        print(f"- (a) tokens/s {tps:.1f} vs legacy {fifo:.1f} ({tps / fifo if fifo else float('nan'):.2f}x): {'met' if tps >= fifo else 'MISSED'}")
    if res["attack"]["sla"]:
        share, p99 = med("sla", "attack", "ordinary served %"), med("sla", "attack", "ordinary TTFT p99 ms")
        t = a.targets.get("standard", 0)
        print(f"- (attack) ordinary served {share:.1f}% (target >= 99): {'met' if share >= 99 else 'MISSED'}; "
              f"TTFT p99 {p99:.0f} ms vs standard target {t} ms: {'met' if t and p99 <= t else 'MISSED'}")
    if res["ultra"]["sla"]:
        p99, ratio, t = med("sla", "ultra", "ultra TTFT p99 ms"), med("sla", "ultra", "ultra p99 / unloaded p50"), a.targets.get("ultra", 0)
        print(f"- (b) ultra TTFT p99 {p99:.0f} ms vs ultra target {t} ms: {'met' if t and p99 <= t else 'MISSED'}; "
              f"{ratio:.2f}x unloaded p50 (target <= 2x): {'met' if ratio <= 2 else 'MISSED'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--only", default="cold,ultra")
    ap.add_argument("--modes", default="sla,legacy", help="which configs to run (a quick look: --modes sla)")
    ap.add_argument("--flood-n", type=int, default=200, help="(a) concurrent requests")
    ap.add_argument("--flood-tokens", type=int, default=128)
    ap.add_argument("--flood-c", type=int, default=64, help="(b) standard flood concurrency")
    ap.add_argument("--flood-s", type=float, default=40)
    ap.add_argument("--ultra-n", type=int, default=20, help="(b) unloaded ultra requests")
    ap.add_argument("--ultra-tokens", type=int, default=16)
    ap.add_argument("--ultra-rate", type=float, default=1.0)
    ap.add_argument("--ultra-delay", type=float, default=5, help="(b) seconds into the flood before the first ultra")
    ap.add_argument("--request-timeout", type=float, default=300, help="seconds, per request")
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--targets", dest="targets_arg", default="", help="lane=ms,... (default: DEFAULT_SLO_MS in proxy/src/admission/mod.rs)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sent in every request (negative: not sent)")
    ap.add_argument("--quiet-wait", type=float, default=30, help="seconds to wait at most for a quiet machine")
    ap.add_argument("--bin-dir", default=os.path.join(ROOT, "target", "release"))
    ap.add_argument("--fake", action="store_true", help="smoke-test the harness: model served by fake-openai")
    ap.add_argument("--hog", action="store_true", help="(a) a busy loop takes one core from before the server starts")
    ap.add_argument("--hog-at", choices=("start", "ready"), default="start",
                    help="when the busy loop starts: before the server (its warm-up sees the slower machine) or right after /readyz (the fit does not)")
    ap.add_argument("--attack-s", type=float, default=15, help="(attack) seconds of the attack")
    ap.add_argument("--no-slo-key", action="store_true", help="legacy config without ttft_slo_ms (servers that predate it)")
    ap.add_argument("--save", help="directory to keep every request's JSON line in")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    a.prompt, a.ultra_prompt = LONG_PROMPT, SHORT_PROMPT
    a.extra = {"temperature": a.temperature} if a.temperature >= 0 else {}
    a.exe, a.flood_exe = os.path.join(a.bin_dir, "ultrafast"), os.path.join(a.bin_dir, "slo-flood")
    for b in (a.exe, a.flood_exe) + ((os.path.join(a.bin_dir, "fake-openai"),) if a.fake else ()):
        if not os.path.exists(b):
            sys.exit(f"missing {b}: cargo build --release -p ultrafast -p ultrafast-benches")
    a.lanes, a.slo, lanes_from = default_lanes()
    a.targets = {n: a.slo[r[0]][0] for n, r in a.lanes.items() if r[0] < len(a.slo)}
    for kv in filter(None, a.targets_arg.split(",")):
        k, v = kv.split("=", 1)
        a.targets[k.strip()] = int(v)
    if a.save:
        os.makedirs(a.save, exist_ok=True)
    env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
    rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    flags = next((l.split(":", 1)[1].split() for l in open("/proc/cpuinfo") if l.startswith("flags")), [])
    print(f"# SLA-aware admission benchmark, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"command: `python3 {shlex.join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])}`")
    print(f"commit {rev}{' (uncommitted changes)' if dirty else ''}; CPU {cpu}, {os.cpu_count()} CPUs, "
          f"{' '.join(f for f in ('avx512f', 'avx2', 'fma') if f in flags)}; load average before {os.getloadavg()}")
    print(f"lane targets (ms): {a.targets}; legacy lanes from {lanes_from}: {a.lanes}")
    if a.fake:
        print("SMOKE TEST: the model is served by fake-openai, not the engine; these numbers mean nothing")
    with tempfile.TemporaryDirectory(prefix="uf-slo-") as tmp:
        fake = None
        if a.fake:
            fake = spawn([os.path.join(a.bin_dir, "fake-openai"), "--tokens", "400", "--itl-ms", "5", "--ttft-ms", "30",
                          "--capacity", "16"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            a.fake_port = int(fake.stdout.readline().strip().rsplit(":", 1)[1])
        else:
            a.fake_port = None
        try:
            # An older server does not know ttft_slo_ms: say so instead of failing later.
            conf, *_ = make_conf(tmp, "check", True, a.lanes, a.slo, a.fake_port, not a.no_slo_key)
            ok, out = check_conf(a.exe, conf)
            if not ok:
                sys.exit(f"`ultrafast check` refuses the legacy config ({'try --no-slo-key' if 'ttft_slo_ms' in out else ''}):\n{out}")
            res = {s: {"sla": [], "legacy": []} for s in ("cold", "ultra", "attack")}
            reasons = {s: {"sla": [], "legacy": []} for s in ("cold", "ultra", "attack")}
            preds = {"sla": {}, "legacy": {}}
            for rnd in range(a.rounds):
                order = ("sla", "legacy") if rnd % 2 == 0 else ("legacy", "sla")
                order = [m for m in order if m in a.modes.split(",")]
                for scen in a.only.split(","):
                    for mode in order:
                        busy = wait_quiet(a.quiet_wait)
                        print(f"round {rnd + 1}: {scen} / {mode} (machine busy before: {busy:.0%} of {os.cpu_count()} CPUs)", file=sys.stderr)
                        fn = {"cold": cold, "ultra": ultra, "attack": attack}[scen]
                        row, why, pairs = fn(a, tmp, mode, mode == "legacy", env, rnd)
                        for k, v in pairs.items():
                            preds[mode].setdefault(k, []).extend(v)
                        row["machine busy before, % of all CPUs"] = 100 * busy
                        res[scen][mode].append(row); reasons[scen][mode].append(why)
        finally:
            if fake:
                stop_tree(fake)
    if res["cold"]["sla"] or res["cold"]["legacy"]:
        table(f"(a) cold flood: {a.flood_n} concurrent standard chat requests, max_tokens {a.flood_tokens}, sent at once right after /readyz"
              f" ({a.rounds} round(s); median (min-max))", res["cold"], reasons["cold"])
    if res["ultra"]["sla"] or res["ultra"]["legacy"]:
        table(f"(b) ultra during a standard flood: {a.ultra_n} sequential ultra alone, then standard concurrency {a.flood_c}"
              f" x {a.flood_s:.0f} s (max_tokens {a.flood_tokens}) with ultra at {a.ultra_rate}/s (max_tokens {a.ultra_tokens})",
              res["ultra"], reasons["ultra"])
    if res["attack"]["sla"] or res["attack"]["legacy"]:
        table(f"(attack) two connections looping 1 MiB ultra prompts (max_tokens 1) for {a.attack_s:.0f} s beside one"
              " client of ordinary standard chats", res["attack"], reasons["attack"])
    predictor_table(preds)
    verdicts(a, res)
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
