#!/usr/bin/env python3
"""HTTP/3 against HTTP/2 to ultrafast, one run, both protocols alternating.

1. Clean link (loopback): server CPU per request. One TLS listener with
   `http3 = true` answers a fixed route. HTTP/2 load is h2load, HTTP/3 load
   is `h3-load` (benches/src/h3_load.rs: quinn + h3, one thread, a new
   request as each ends, as h2load -m does); both one connection, 16
   streams. A client as fast as h2load matters: a slow one (aioquic in
   Python) makes the server wake once per request and triples its cost.
   Measured: ultrafast's CPU ticks (/proc) over the requests it served.
   Target: HTTP/3 within 1.5x.
2. Bad links: streamed completions (fake-openai, `--tokens` 20 ms apart)
   through a pair of network namespaces this script makes, joined by a
   veth pair with `tc netem` (25 ms each way: 50 ms RTT; 0, 1 and 3 %
   loss). Each protocol streams `--streams` completions over one
   connection, `--inflight` of them at a time (1: one after the other; 4:
   four at once, started `--stagger-ms` apart so their tokens travel in
   different packets, as independent requests' do). Clients: aioquic
   (h3_client.py streams) and the h2 package (h2_streams.py), both one
   asyncio reader per connection that timestamps each event as its bytes
   arrive. Measured per protocol: TTFT p50/p99 and the standard deviation
   (and p99) of the gaps between tokens, pooled over `--link-rounds`
   rounds with the protocols' order alternating. Target: HTTP/3 at most
   HTTP/2's at every loss rate. Needs root; where the kernel has no `sch_netem`, the same
   delay and loss are made in user space over TUN devices (`tunlink.py`),
   and the output says which link was used.

"""
import argparse, json, os, shutil, statistics, subprocess, sys, tempfile, time
from benchlib import ROOT, free_port, pct_ms, spawn, stop_tree, tail, wait_port

REL = os.path.join(ROOT, "target", "release")
PY = os.path.join(ROOT, ".venv", "bin", "python3")
H3 = os.path.join(ROOT, "proxy", "tests", "py", "h3_client.py")
H2 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "h2_streams.py")
CLK = os.sysconf("SC_CLK_TCK")
# The bad-link server's ports, inside its own namespace.
LINK_TLS, LINK_HTTP, LINK_ADMIN = 8443, 8080, 9901


def cpu_model():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def cpu_ticks(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])


def config(tmp, port, admin, tls_port, extra="", bind="127.0.0.1"):
    return (f'[server]\nthreads = 1\npid_file = "{tmp}/uf.pid"\nupgrade_sock = "{tmp}/uf.sock"\n\n'
            f'[admin]\nlisten = "127.0.0.1:{admin}"\n\n[log]\naccess_log = "off"\n\n'
            f'[[listeners]]\nname = "http"\naddress = "127.0.0.1:{port}"\n\n'
            f'[[listeners]]\nname = "https"\naddress = "{bind}:{tls_port}"\n'
            f'tls = {{ certs = [{{ cert = "{tmp}/localhost.pem", key = "{tmp}/localhost.key", default = true }}], http3 = true }}\n\n'
            f'[[routes]]\nname = "fixed"\npath = "/fixed"\nreturn = {{ status = 200, body = "ok\\n" }}\n\n{extra}')


def clean_link(args, tmp):
    port, admin, tls = free_port(), free_port(), free_port()
    cfg = os.path.join(tmp, "clean.toml")
    open(cfg, "w").write(config(tmp, port, admin, tls))
    log = open(os.path.join(tmp, "clean.log"), "w")
    p = spawn([os.path.join(REL, "ultrafast"), "serve", "-c", cfg], stdout=log, stderr=log)
    try:
        wait_port(tls)
        time.sleep(0.5)
        per = {"h2": [], "h3": []}
        for r in range(args.rounds):
            for proto in (["h2", "h3"] if r % 2 == 0 else ["h3", "h2"]):
                t0 = cpu_ticks(p.pid)
                if proto == "h2":
                    out = subprocess.run(["h2load", "-n", str(args.requests), "-c", "1", "-m", "16",
                                          f"https://localhost:{tls}/fixed"],
                                         capture_output=True, text=True, timeout=120).stdout
                    done = int(out.split("requests:")[1].split("succeeded,")[0].split()[-1]) if "succeeded" in out else 0
                else:
                    out = subprocess.run([os.path.join(REL, "h3-load"), "--addr", f"127.0.0.1:{tls}",
                                          "--ca", os.path.join(tmp, "ca.pem"), "--path", "/fixed",
                                          "-n", str(args.requests), "-m", "16"],
                                         capture_output=True, text=True, timeout=120).stdout
                    done = json.loads(out).get("ok", 0)
                ticks = cpu_ticks(p.pid) - t0
                us = ticks / CLK / max(done, 1) * 1e6
                per[proto].append(us)
                print(f"  round {r + 1} {proto}: {done} requests, server CPU {us:.1f} us/request", flush=True)
        h2, h3 = statistics.median(per["h2"]), statistics.median(per["h3"])
        return h2, h3
    finally:
        stop_tree(p)


def sh(cmd):
    return subprocess.run(cmd, shell=True, capture_output=True, text=True)


def netns_setup(loss):
    """The impaired link: tc netem on a veth pair, or, where the kernel has
    no netem, the same delay and loss in user space over TUN devices
    (`tunlink.py`). Returns (what was made, None) or (None, why not)."""
    sh("ip netns del ufb-srv; ip netns del ufb-cli")
    for s in ["ip netns add ufb-srv", "ip netns add ufb-cli",
              "ip -n ufb-srv link set lo up", "ip -n ufb-cli link set lo up"]:
        r = sh(s)
        if r.returncode != 0:
            return None, f"`{s}`: {r.stderr.strip()}"
    steps = [
        "ip link add ufb-a type veth peer name ufb-b",
        "ip link set ufb-a netns ufb-srv", "ip link set ufb-b netns ufb-cli",
        "ip -n ufb-srv addr add 10.213.0.1/24 dev ufb-a", "ip -n ufb-cli addr add 10.213.0.2/24 dev ufb-b",
        "ip -n ufb-srv link set ufb-a up", "ip -n ufb-cli link set ufb-b up",
        f"ip netns exec ufb-srv tc qdisc add dev ufb-a root netem delay 25ms loss {loss}%",
        f"ip netns exec ufb-cli tc qdisc add dev ufb-b root netem delay 25ms loss {loss}%",
    ]
    for s in steps:
        r = sh(s)
        if r.returncode != 0:
            if "netem" in s:
                # No sch_netem: the same link in user space.
                sh("ip -n ufb-srv link del ufb-a")
                try:
                    from tunlink import TunLink
                    return ("tun", TunLink("ufb-srv", "10.213.0.1", "ufb-cli", "10.213.0.2", 0.025, loss / 100)), None
                except Exception as e:
                    return None, f"no netem ({r.stderr.strip()}) and no TUN link ({e})"
            return None, f"`{s}`: {r.stderr.strip()}"
    return ("netem", None), None


def netns_teardown(made=None):
    if made and made[1] is not None:
        made[1].stop()
    sh("ip netns del ufb-srv; ip netns del ufb-cli")


def start_link(args, tmp, loss):
    """The impaired link with fake-openai and ultrafast in the server's
    namespace. Returns (made, [processes]) or (None, why)."""
    made, why = netns_setup(loss)
    if why:
        netns_teardown()
        return None, why
    fake = spawn(["ip", "netns", "exec", "ufb-srv", os.path.join(REL, "fake-openai"), "--tokens", str(args.tokens),
                  "--itl-ms", "20", "--ttft-ms", "20"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    addr = fake.stdout.readline().strip().removeprefix("listening on ")
    tls, port, admin = LINK_TLS, LINK_HTTP, LINK_ADMIN
    cfg = os.path.join(tmp, f"loss{loss}.toml")
    extra = (f'[[routes]]\nname = "openai"\npath = "/v1/"\ninference = true\n\n'
             f'[pools.fm-pool]\nmembers = [{{ addr = "{addr}" }}]\n\n[models.fm]\nbackend = "upstream"\npool = "fm-pool"\n')
    open(cfg, "w").write(config(tmp, port, admin, tls, extra, bind="10.213.0.1"))
    log = open(os.path.join(tmp, f"loss{loss}.log"), "w")
    uf = spawn(["ip", "netns", "exec", "ufb-srv", os.path.join(REL, "ultrafast"), "serve", "-c", cfg], stdout=log, stderr=log)
    time.sleep(1.5)
    return made, [uf, fake]


def one_protocol(args, tmp, proto, inflight):
    """`args.streams` streamed chats over one connection, `inflight` at a
    time (the first ones `args.stagger_ms` apart). Returns each stream's
    event arrival times (seconds after its request)."""
    tls = LINK_TLS
    body = json.dumps({"model": "fm", "stream": True, "max_tokens": args.tokens,
                       "messages": [{"role": "user", "content": "hi"}]})
    ca = os.path.join(tmp, "ca.pem")
    if proto == "h2":
        r = subprocess.run(["ip", "netns", "exec", "ufb-cli", PY, H2,
                            f"https://10.213.0.1:{tls}/v1/chat/completions", str(args.streams), body,
                            str(inflight), str(args.stagger_ms)],
                           capture_output=True, text=True, timeout=600, env={**os.environ, "no_proxy": "*"})
        return json.loads(r.stdout)
    req = {"method": "POST", "path": "/v1/chat/completions",
           "headers": {"content-type": "application/json"}, "body": body}
    r = subprocess.run(["ip", "netns", "exec", "ufb-cli", PY, H3, "streams", "--host", "10.213.0.1",
                        "--port", str(tls), "--cafile", ca, "--timeout", "590", "--count", str(args.streams),
                        "--inflight", str(inflight), "--stagger-ms", str(args.stagger_ms),
                        "--requests", json.dumps([req])],
                       capture_output=True, text=True, timeout=600)
    return [[t for t, n in zip(one["chunk_times"], one["chunk_events"]) for _ in range(n)]
            for one in json.loads(r.stdout)]


def summarize(runs):
    # TTFT: the first content event (the first is the role's); gaps
    # between the events after it (the last is [DONE]).
    ttft = [t[1] for t in runs if len(t) > 1]
    gaps = [(b - a) * 1000 for t in runs for a, b in zip(t[1:], t[2:-1])]
    return (pct_ms(ttft, 0.5), pct_ms(ttft, 0.99), statistics.pstdev(gaps) if gaps else float("nan"),
            pct_ms([g / 1000 for g in gaps], 0.99) if gaps else float("nan"), len(runs))


def streams(args, tmp, loss):
    """Every in-flight count for both protocols on one link, `args.link_rounds`
    times with the protocols' order alternating; samples pooled per cell."""
    made, procs = start_link(args, tmp, loss)
    if made is None:
        return procs
    try:
        res = {}
        for rnd in range(args.link_rounds):
            for inflight in args.inflight:
                for proto in (["h2", "h3"] if rnd % 2 == 0 else ["h3", "h2"]):
                    res.setdefault((inflight, proto), []).extend(one_protocol(args, tmp, proto, inflight))
        return {k: summarize(v) for k, v in res.items()}
    finally:
        for p in procs:
            stop_tree(p)
        netns_teardown(made)
        print(f"  (link: {'tc netem' if made[0] == 'netem' else 'user-space TUN link, tunlink.py'})", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--inflight", default="1,4",
                    help="streams in flight per connection, comma-separated: each is measured")
    ap.add_argument("--stagger-ms", type=float, default=5.0,
                    help="start offset between the first in-flight streams (so their tokens are not sent together)")
    ap.add_argument("--link-rounds", type=int, default=1,
                    help="repeats per loss rate, protocols alternating first; samples pooled")
    ap.add_argument("--losses", default="0,1,3", help="loss rates in percent, comma-separated")
    ap.add_argument("--skip-clean", action="store_true", help="only the bad-link part")
    args = ap.parse_args()
    args.inflight = [int(x) for x in args.inflight.split(",")]
    tmp = tempfile.mkdtemp(prefix="h3bench-")
    subprocess.run([os.path.join(REL, "ultrafast"), "certs", "dev", "--out", tmp], check=True, capture_output=True)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores")
    if not args.skip_clean:
        print("1. clean link, server CPU per request (1 connection, 16 streams):")
        h2, h3 = clean_link(args, tmp)
        print(f"| protocol | server CPU per request (us, median of {args.rounds}) |\n|---|---|")
        print(f"| HTTP/2 | {h2:.1f} |\n| HTTP/3 | {h3:.1f} |")
        print(f"HTTP/3 / HTTP/2: {h3 / h2:.2f}x (target at most 1.5x)")
    print("2. streamed completions through netns + netem, 50 ms RTT:")
    rows = []
    for loss in [float(x) if "." in x else int(x) for x in args.losses.split(",")]:
        r = streams(args, tmp, loss)
        if isinstance(r, str):
            print(f"  not run: cannot make the impaired link ({r})")
            break
        for (inflight, proto), v in sorted(r.items()):
            rows.append((inflight, loss, proto, v))
            print(f"  loss {loss}%, {inflight} in flight, {proto}: {v[4]} streams, TTFT p50 {v[0]:.1f} p99 {v[1]:.1f} ms, "
                  f"gap stddev {v[2]:.2f} ms, gap p99 {v[3]:.1f} ms", flush=True)
    print("| in flight | loss | protocol | streams | TTFT p50 (ms) | TTFT p99 (ms) | gap stddev (ms) | gap p99 (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for inflight, loss, proto, v in sorted(rows):
        print(f"| {inflight} | {loss} % | {'HTTP/2' if proto == 'h2' else 'HTTP/3'} | {v[4]} | {v[0]:.1f} | {v[1]:.1f} | {v[2]:.2f} | {v[3]:.1f} |")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
