#!/usr/bin/env python3
"""Wake-ups and CPU time per streamed completion, per proxy and per thread:
voluntary context switches (each one a sleep and a wake) and time on CPU
from /proc (`schedstat`), over N streamed completions (16 tokens from
`fake-openai --ttft-ms 5 --itl-ms 1`), one every 50 ms on a new connection,
as in inference_bench.py's pass-through. Background threads that wake on
their own (timers, periodic loops) show here per request, where they cost
the request sharing their CPU.

usage: benches/scripts/wakeups.py [--n 200] [--only ultrafast,nginx,bare,floor] [--bin-dir DIR]
Build first: cargo build --release -p ultrafast -p ultrafast-benches; needs
nginx and Linux /proc. Loopback only; every process is stopped by PID.
"""
import argparse, glob, subprocess, tempfile, time
import inference_bench as ib
from benchlib import read_stream, stop_tree, stream_chat


def threads(pid):
    """{thread name and id: (voluntary switches, ns on CPU)}."""
    out = {}
    for t in glob.glob(f"/proc/{pid}/task/*"):
        try:
            name = open(f"{t}/comm").read().strip()
            vol = next(int(l.split()[1]) for l in open(f"{t}/status") if l.startswith("voluntary_ctxt_switches"))
            ns = int(open(f"{t}/schedstat").read().split()[0])
        except (OSError, StopIteration):
            continue
        out[f"{name} ({t.rsplit('/', 1)[1]})"] = (vol, ns)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--only", default="ultrafast,nginx,bare,floor")
    ap.add_argument("--bin-dir", help="where ultrafast, fake-openai, bare-pingora and tokio-floor are "
                    "(default: target/release)")
    a = ap.parse_args()
    if a.bin_dir:
        ib.REL = a.bin_dir
    tmp = tempfile.mkdtemp(prefix="uf-wakeups-")
    fp, fport = ib.fake(["--tokens", "16", "--itl-ms", "1", "--ttft-ms", "5", "--capacity", "1000"])
    procs = [fp]
    try:
        for which in a.only.split(","):
            if which == "ultrafast":
                p, port = ib.ultrafast(tmp, "uf", ib.pass_body(fport))
                pid = p.pid
            elif which == "nginx":
                p, port = ib.nginx(tmp, fport)
                kids = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
                pid = int(kids[0])  # the one worker
            else:
                p, port = ib.reference(which, fport)
                pid = p.pid
            procs.append(p)
            for _ in range(20):
                read_stream(stream_chat(port, 16))
            before = threads(pid)
            for _ in range(a.n):
                read_stream(stream_chat(port, 16))
                time.sleep(0.05)
            after = threads(pid)
            rows = []
            for k, (vol, ns) in after.items():
                v0, n0 = before.get(k, (0, 0))
                rows.append(((vol - v0) / a.n, (ns - n0) / a.n / 1000, k))
            sw = sum(r[0] for r in rows)
            cpu = sum(r[1] for r in rows)
            busy = ", ".join(f"{k} {s:.1f} / {c:.0f}" for s, c, k in sorted(rows, key=lambda r: -r[1]) if c >= 5)
            print(f"| {which} | {sw:.1f} | {cpu:.0f} | {busy} |", flush=True)
            stop_tree(p)
            procs.remove(p)
    finally:
        for p in procs:
            stop_tree(p)


if __name__ == "__main__":
    print("| proxy | voluntary switches per request | CPU us per request | threads (switches / CPU us) |")
    print("|---|---|---|---|")
    main()
