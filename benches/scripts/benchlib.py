"""Shared helpers of the benchmark scripts: ports, child processes that are
always stopped with their whole tree, readiness waits, percentiles."""
import os, signal, socket, subprocess, sys, time, urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def wait_port(port, limit=10.0):
    end = time.time() + limit
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close(); return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} never opened")


def tail(path, n=30):
    """The last `n` lines of a log file ("" if unreadable)."""
    try:
        return "".join(open(path, errors="replace").readlines()[-n:])
    except OSError:
        return ""


def wait_ready(p, admin, limit, log):
    """Until ultrafast's admin `/readyz` answers 200; exits with the log's
    tail if the process dies or `limit` seconds pass first."""
    end = time.time() + limit
    while time.time() < end:
        if p.poll() is not None:
            raise SystemExit(f"ultrafast exited ({p.returncode}) before ready; log:\n{tail(log)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin}/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"not ready after {limit} s; log:\n{tail(log)}")


def uf_head(tmp, port, admin):
    """The head of a generated ultrafast config: pid and upgrade paths in
    `tmp`, the admin listener on `admin`, access log off, one plain
    listener on `port`."""
    return (f'[server]\npid_file = "{tmp}/uf.pid"\nupgrade_sock = "{tmp}/uf.sock"\n\n'
            f'[admin]\nlisten = "127.0.0.1:{admin}"\n\n[log]\naccess_log = "off"\n\n'
            f'[[listeners]]\nname = "http"\naddress = "127.0.0.1:{port}"\n\n')


def spawn(cmd, **kw):
    """Start a child in its own process group, so stopping it stops its
    whole tree (nginx's workers included)."""
    return subprocess.Popen(cmd, start_new_session=True, **kw)


def stop_tree(p):
    """Stop a child started by `spawn` and everything it forked."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(timeout=5)
    except Exception:
        pass


def exact_rss_kb(pids):
    """RSS of `pids` summed, in KiB, from smaps_rollup: exact (since Linux
    6.2 the RSS in /proc/PID/status is an approximate per-CPU sum)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(l.split()[1]) for l in f if l.startswith("Rss:"))
        except (OSError, StopIteration):
            pass
    return total


def with_children(pid):
    """`pid` and its direct children (nginx's workers)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [pid] + [int(x) for x in out.split()]


def pct_ms(values, q):
    """The q-quantile of durations in seconds, in ms (nan if empty)."""
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] * 1000


def callgrind(cmd, out, log):
    """Start `cmd` under callgrind, writing its counts to `out` at exit
    (per-line counts off: per-function counts are what the scripts read)."""
    return spawn(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-line=no", *cmd],
                 stdout=subprocess.DEVNULL, stderr=open(log, "w"), env={**os.environ, "RUST_LOG": "warn"})


def callgrind_stop(p, out):
    """SIGINT (Pingora's fast shutdown; callgrind writes its file at exit),
    then the run's total instructions."""
    try:
        os.kill(p.pid, signal.SIGINT)
        p.wait(timeout=120)
    finally:
        stop_tree(p)
    with open(out) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    sys.exit(f"no totals in {out}")


def callgrind_costs(out, inclusive=False):
    """Instructions per function of a callgrind file, from
    callgrind_annotate: exclusive (a function's own count; with LTO it
    includes what was inlined into it), or inclusive (with its callees)."""
    import re
    txt = subprocess.run(["callgrind_annotate", f"--inclusive={'yes' if inclusive else 'no'}",
                          "--threshold=100", out], capture_output=True, text=True).stdout
    res = {}
    for line in txt.splitlines():
        m = re.match(r"\s*([\d,]+)\s+\([\s\d.]+%\)\s+(\S.*)", line)
        # "=>" and "<" lines are call-tree lines (inclusive costs of calls).
        if not m or m.group(2).startswith(("PROGRAM TOTALS", "events annotated", "=>", "<")):
            continue
        name = m.group(2)
        if name.startswith(("???:", "/")) and ":" in name:
            name = name.split(":", 1)[1]
        name = re.sub(r"\s+\[.*\]$", "", name)
        name = re.sub(r"\s+\([\d,]+x\)$", "", name).strip()[:110]
        n = int(m.group(1).replace(",", ""))
        # Inlined pieces of one function are listed apart: their own
        # counts add up; inclusive counts of the same function do not.
        res[name] = max(res.get(name, 0), n) if inclusive else res.get(name, 0) + n
    return res


def stream_chat(port, max_tokens):
    """Send one streamed chat completion for model `m` on a new connection
    (`Connection: close`); returns the socket, to be read by
    `read_stream`."""
    import json
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": max_tokens, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port), 30)
    s.settimeout(30)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    return s


def read_stream(s):
    """Read a stream sent by `stream_chat` to its `[DONE]`, then close."""
    buf = b""
    while b"[DONE]" not in buf:
        c = s.recv(65536)
        if not c:
            sys.exit("the stream ended before [DONE]")
        buf += c
    s.close()
