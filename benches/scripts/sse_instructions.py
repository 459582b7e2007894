#!/usr/bin/env python3
"""Instructions per streamed completion through ultrafast's upstream path,
under callgrind: ultrafast in front of `fake-openai --tokens 16 --itl-ms 1
--ttft-ms 5` (the pass-through case of inference_bench.py, lane `standard`
with pacing off), serving N1 and then N2 streamed chat completions one
after another, each on its own connection; per request = (I(N2) - I(N1)) /
(N2 - N1), which cancels start-up and shutdown. With --top, the functions
with the largest inclusive cost per request are listed.

usage: benches/scripts/sse_instructions.py [--n1 50] [--n2 250] [--top 0] [--keep DIR]
       [--proxy ultrafast|bare|floor] [--bin PATH]
(--proxy bare: the bare Pingora proxy, benches/src/bare_pingora.rs; floor:
the least a Tokio program does to pass the stream, benches/src/tokio_floor.rs)
Build first: cargo build --release -p ultrafast -p ultrafast-benches; needs
valgrind. Loopback only; every process is stopped by PID.
"""
import argparse, os, sys, tempfile, shutil
import inference_bench as ib
from benchlib import (callgrind, callgrind_costs, callgrind_stop, free_port, read_stream, stop_tree,
                      stream_chat, wait_port)

REL = ib.REL


def run(n, tmp, fport, proxy="ultrafast", binary=None):
    if proxy == "ultrafast":
        conf, port = ib.ultrafast_conf(tmp, f"uf-{n}", ib.pass_body(fport))
        cmd = [binary or os.path.join(REL, "ultrafast"), "serve", "-c", conf]
    else:
        port = free_port()
        cmd = ib.reference_cmd(proxy, port, fport)
    out = os.path.join(tmp, f"cg-{n}.out")
    p = callgrind(cmd, out, os.path.join(tmp, f"vg-{n}.log"))
    try:
        wait_port(port, limit=120)
        for _ in range(n):
            read_stream(stream_chat(port, 16))
    finally:
        total = callgrind_stop(p, out)
    return total, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n1", type=int, default=50)
    ap.add_argument("--n2", type=int, default=250)
    ap.add_argument("--top", type=int, default=0)
    ap.add_argument("--keep", help="copy the two callgrind files into this folder")
    ap.add_argument("--bin", help="the ultrafast binary to measure (default target/release/ultrafast; "
                    "an older build's copy compares two commits in one run)")
    ap.add_argument("--proxy", choices=("ultrafast", "bare", "floor"), default="ultrafast",
                    help="bare: the bare Pingora proxy; floor: the least a Tokio program does (tokio-floor)")
    a = ap.parse_args()
    for need in ("valgrind", "callgrind_annotate"):
        if not shutil.which(need):
            sys.exit(f"needs {need}")
    tmp = tempfile.mkdtemp(prefix="uf-sse-cg-")
    fake, fport = ib.fake(["--tokens", "16", "--itl-ms", "1", "--ttft-ms", "5", "--capacity", "1000"])
    try:
        i1, f1 = run(a.n1, tmp, fport, a.proxy, a.bin)
        i2, f2 = run(a.n2, tmp, fport, a.proxy, a.bin)
        dn = a.n2 - a.n1
        print(f"I({a.n1}) = {i1:,}  I({a.n2}) = {i2:,}  -> {(i2 - i1) / dn:,.0f} instructions per streamed request")
        if a.top:
            x, y = callgrind_costs(f1, True), callgrind_costs(f2, True)
            rows = sorted(((y.get(k, 0) - x.get(k, 0)) / dn, k) for k in y)
            for d, k in reversed(rows[-a.top:]):
                print(f"{d:10,.0f}  {k}")
        if a.keep:
            os.makedirs(a.keep, exist_ok=True)
            for f in (f1, f2):
                shutil.copy(f, a.keep)
    finally:
        stop_tree(fake)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
