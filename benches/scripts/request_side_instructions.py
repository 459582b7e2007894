#!/usr/bin/env python3
"""Instructions each proxy runs on the request side of a streamed
completion only: from the client's new connection to the request written
upstream. The upstream (`fake-openai --ttft-ms 1500`) holds its first token
for 1.5 s; callgrind's counters are zeroed before a request and dumped
0.8 s after it, when the proxy has forwarded the request and waits. The
same window without a request (the proxy's timers and background threads)
is measured before each request and subtracted; medians of N. After three
warm-up requests, so pooled upstream connections are reused as in steady
state.

Proxies: ultrafast (the pass-through route of inference_bench.py), nginx
(one process: `master_process off`), the bare Pingora proxy
(benches/src/bare_pingora.rs) and the Tokio floor (benches/src/tokio_floor.rs).

usage: benches/scripts/request_side_instructions.py [--n 6] [--only NAME,...]
Build first: cargo build --release -p ultrafast -p ultrafast-benches; needs
valgrind and nginx. Loopback only; every process is stopped by PID.
"""
import argparse, glob, os, shutil, signal, subprocess, sys, tempfile, time
import inference_bench as ib
from benchlib import free_port, read_stream, spawn, stop_tree, stream_chat, wait_port

REL = ib.REL


def command(which, tmp, fport):
    """The proxy's command and port."""
    if which == "ultrafast":
        conf, port = ib.ultrafast_conf(tmp, "uf", ib.pass_body(fport))
        return [os.path.join(REL, "ultrafast"), "serve", "-c", conf], port
    if which == "nginx":
        return ib.nginx_cmd(tmp, fport, single=True)
    port = free_port()
    return ib.reference_cmd(which, port, fport), port


def measure(which, n, fport):
    tmp = tempfile.mkdtemp(prefix="uf-req-side-")
    cmd, port = command(which, tmp, fport)
    p = spawn(["valgrind", "--tool=callgrind", "--dump-line=no", f"--callgrind-out-file={tmp}/cg.out", *cmd], stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/vg.log", "w"),
              cwd=tmp, env={**os.environ, "RUST_LOG": "warn"})

    def ctl(flag):
        subprocess.run(["callgrind_control", flag, str(p.pid)], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=True)

    def window(request):
        ctl("--zero")
        s = stream_chat(port, 2) if request else None
        time.sleep(0.8)
        ctl("--dump")
        time.sleep(0.3)
        newest = max(glob.glob(f"{tmp}/cg.out.*"), key=os.path.getmtime)
        with open(newest) as f:
            total = next(int(l.split()[1]) for l in f if l.startswith(("summary:", "totals:")))
        os.remove(newest)
        if s:
            read_stream(s)
        return total

    try:
        wait_port(port, limit=120)
        for _ in range(3):
            read_stream(stream_chat(port, 2))
        idle, busy = [], []
        for _ in range(n):
            idle.append(window(False))
            busy.append(window(True))
    finally:
        try:
            os.kill(p.pid, signal.SIGINT)
            p.wait(timeout=60)
        except Exception:
            pass
        stop_tree(p)
        shutil.rmtree(tmp, ignore_errors=True)
    idle.sort()
    busy.sort()
    return busy[n // 2] - idle[n // 2], busy[n // 2], idle[n // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--only", default="nginx,floor,bare,ultrafast")
    a = ap.parse_args()
    for need in ("valgrind", "callgrind_control", "nginx"):
        if not shutil.which(need):
            sys.exit(f"needs {need}")
    fp, fport = ib.fake(["--tokens", "2", "--itl-ms", "1", "--ttft-ms", "1500", "--capacity", "1000"])
    try:
        print("| proxy | request side, instructions | window with a request | without |")
        print("|---|---|---|---|")
        for which in a.only.split(","):
            d, b, i = measure(which, a.n, fport)
            print(f"| {which} | {d:,} | {b:,} | {i:,} |", flush=True)
    finally:
        stop_tree(fp)


if __name__ == "__main__":
    main()
