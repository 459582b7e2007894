#!/usr/bin/env python3
"""The fleet benchmark, live: ultrafast in front of the fleet simulator's
replicas (`fleet-sim serve`, a port each, real SSE, vLLM's metric names),
one policy at a time on the same trace (`fleet-sim load`: a multi-tenant
chat trace with shared system prompts, Poisson arrivals with bursts, at a
share of the fleet's capacity). A fresh simulator for every policy, so no
policy inherits another's caches.

usage: fleet_bench.py [--speeds 1,1,0.5,2] [--load 0.8] [--seconds 60]
    [--ttft-ms 1000] [--policies least_outstanding,prefix_affinity,...]
    [--slow I@T:SPEED]
Baselines run as ultrafast ran them before per-member prediction (the
standard lane's 10 s target, so they refuse nearly nothing, as nginx or
llm-d would not); `predicted_latency` gets the target as the request's own
`x-slo-ttft-ms`, and refuses what no member can serve in time. Round robin
is in the discrete-event run only (an inference pool balances by requests
in flight unless it names another policy). Prints a Markdown table.
"""
import argparse, json, os, subprocess, sys, tempfile, threading, time
sys.path.insert(0, os.path.dirname(__file__))
from benchlib import ROOT, free_port, spawn, stop_tree, uf_head, wait_ready

POLICIES = ["least_outstanding", "prefix_affinity", "queue_aware", "load_prefix", "predicted_latency"]


def pool_toml(policy, members):
    lb = {"least_outstanding": "least_outstanding", "prefix_affinity": "least_outstanding",
          "queue_aware": "queue_aware", "load_prefix": "load_prefix",
          "predicted_latency": "predicted_latency"}[policy]
    m = ", ".join(f'{{ addr = "{a}" }}' for a in members)
    model_lb = "prefix_affinity" if policy == "prefix_affinity" else "least_outstanding"
    return (f'[[routes]]\nname = "openai"\npath = "/v1/"\ninference = true\n\n'
            f'[pools.fleet]\nmembers = [{m}]\nlb = "{lb}"\nmember_slots = 16\nmember_chunk_tokens = 512\n'
            f'scrape_interval_ms = 200\nread_timeout_ms = 120000\n\n'
            f'[models.m]\nbackend = "upstream"\npool = "fleet"\nupstream_model = "sim"\nlb = "{model_lb}"\n'
            f'prefill_tokens_per_s = 10000\ndecode_tokens_per_s = 95\nstall_timeout_ms = 120000\n')


def one(policy, a, sim_bin, uf_bin):
    sim = spawn([sim_bin, "serve", "--speeds", a.speeds], stdout=subprocess.PIPE, text=True)
    try:
        line = sim.stdout.readline().strip()
        members = line.removeprefix("listening on ").split(",")
        tmp = tempfile.mkdtemp(prefix="fleet-bench-")
        port, admin = free_port(), free_port()
        cfg = os.path.join(tmp, "uf.toml")
        with open(cfg, "w") as f:
            f.write(uf_head(tmp, port, admin) + pool_toml(policy, members))
        log = os.path.join(tmp, "uf.log")
        uf = spawn([uf_bin, "serve", "-c", cfg], stdout=open(log, "w"), stderr=subprocess.STDOUT)
        try:
            wait_ready(uf, admin, 30, log)
            cmd = [sim_bin, "load", "--edge", f"127.0.0.1:{port}", "--speeds", a.speeds,
                   "--load", str(a.load), "--seconds", str(a.seconds), "--ttft-ms", str(a.ttft_ms),
                   "--model", "m", "--label", policy]
            if policy == "predicted_latency":
                cmd += ["--header", f"x-slo-ttft-ms:{a.ttft_ms}"]
            slow = None
            if a.slow:
                i, rest = a.slow.split("@")
                t, speed = rest.split(":")
                def later():
                    time.sleep(float(t))
                    subprocess.run(["curl", "-s", "-X", "POST", "-d", json.dumps({"speed": float(speed)}),
                                    f"http://{members[int(i)]}/control"], capture_output=True)
                slow = threading.Thread(target=later, daemon=True)
                slow.start()
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.seconds + 300)
            if out.returncode != 0:
                raise SystemExit(f"load failed: {out.stderr}")
            return json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            stop_tree(uf)
    finally:
        stop_tree(sim)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--speeds", default="1,1,0.5,2")
    p.add_argument("--load", type=float, default=0.8)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--ttft-ms", type=int, default=1000)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--slow", default="")
    a = p.parse_args()
    rel = os.path.join(ROOT, "target", "release")
    sim_bin, uf_bin = os.path.join(rel, "fleet-sim"), os.path.join(rel, "ultrafast")
    print(f"speeds {a.speeds}, load {a.load}, {a.seconds} s, TTFT target {a.ttft_ms} ms")
    print("| policy | admitted | TTFT p50 / p99 ms | e2e p50 ms | within target | goodput tok/s | refusal p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for pol in a.policies.split(","):
        r = one(pol, a, sim_bin, uf_bin)
        print(r["row"], flush=True)


if __name__ == "__main__":
    main()
