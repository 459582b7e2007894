#!/usr/bin/env python3
"""Where each proxy's added time to first token goes in the SSE
pass-through, from the kernel's packet times on loopback (tcpdump), so
nothing in the proxies is instrumented and nothing is slowed:

 request side: the client's request packet -> the proxy's request to the
               upstream (accept, read, parse, admission, the upstream
               connection, the write);
 token side:   the upstream's first content packet -> the proxy's first
               content packet to the client.

Same load as inference_bench.py's pass-through (direct, ultrafast and nginx
interleaved request by request, 60 requests/s, 16 tokens from
`fake-openai --ttft-ms 5 --itl-ms 1`); each request's prompt carries a
marker so its packets can be told apart on the shared upstream connections.

usage: benches/scripts/sse_ttft_split.py [--rounds 2] [--duration 5] [--rate 60] [--bin-dir DIR]
Build first: cargo build --release -p ultrafast -p ultrafast-benches; needs
tcpdump and the right to capture on `lo` (root). Loopback only; every
process started is stopped by PID.
"""
import argparse, asyncio, os, re, statistics, struct, subprocess, sys, tempfile, time
import inference_bench as ib
from benchlib import stop_tree


def packets(path):
    """(time, source port, destination port, payload) of each TCP packet
    with a payload in a pcap file of IPv4 on `lo`."""
    with open(path, "rb") as f:
        data = f.read()
    nano = struct.unpack("<I", data[:4])[0] == 0xA1B23C4D
    link = struct.unpack("<I", data[20:24])[0]
    off, out = 24, []
    while off + 16 <= len(data):
        sec, frac, incl, _ = struct.unpack("<IIII", data[off:off + 16])
        pkt = data[off + 16:off + 16 + incl]
        off += 16 + incl
        pkt = pkt[14:] if link == 1 else pkt[16:] if link == 113 else pkt
        if len(pkt) < 20 or pkt[0] >> 4 != 4 or pkt[9] != 6:
            continue
        tcp = pkt[(pkt[0] & 15) * 4:]
        sport, dport = struct.unpack(">HH", tcp[:4])
        payload = tcp[(tcp[12] >> 4) * 4:]
        if payload:
            out.append((sec + frac / (1e9 if nano else 1e6), sport, dport, payload))
    return out


CONTENT = re.compile(rb'"content":"[^"]')
MARK = re.compile(rb'"m(\d{7})"')


def first_content(pk, after, sport, dport):
    return next((t for t, s, d, p in pk if t > after and s == sport and d == dport
                 and CONTENT.search(p) and b'"role"' not in p), None)


def q(v, p):
    return v[min(len(v) - 1, int(p * len(v)))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=5)
    ap.add_argument("--rate", type=float, default=60)
    ap.add_argument("--bin-dir", help="where ultrafast and fake-openai are (default: target/release)")
    ap.add_argument("--bare", action="store_true",
                    help="a bare Pingora proxy (benches/src/bare_pingora.rs) as another path")
    ap.add_argument("--floor", action="store_true",
                    help="the least a Tokio program does to pass a stream through (benches/src/tokio_floor.rs) "
                    "as another path")
    a = ap.parse_args()
    if a.bin_dir:
        ib.REL = a.bin_dir
    tmp = tempfile.mkdtemp()
    fp, fport = ib.fake(["--tokens", "16", "--itl-ms", "1", "--ttft-ms", "5", "--capacity", "1000"])
    up = np_ = td = bp = tf = None
    try:
        up, uport = ib.ultrafast(tmp, "pass", ib.pass_body(fport))
        np_, nport = ib.nginx(tmp, fport)
        proxies = {"ultrafast": uport, "nginx": nport}
        if a.bare:
            bp, proxies["bare"] = ib.reference("bare", fport)
        if a.floor:
            tf, proxies["tokio floor"] = ib.reference("floor", fport)
        pcap = os.path.join(tmp, "lo.pcap")
        td = subprocess.Popen(["tcpdump", "-i", "lo", "-s", "400", "-w", pcap, "-U", "--time-stamp-precision=nano",
                               f"tcp port {fport} or " + " or ".join(f"tcp port {v}" for v in proxies.values())],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        paths = {"direct": fport, **proxies}
        names = list(paths)
        ttft = {k: [] for k in names}
        for r in range(a.rounds):
            res = asyncio.run(ib.load(paths, a.rate, a.duration,
                                      lambda i: (ib.chat(16, f"m{r:02d}{i:05d}"), {}, names[i % len(names)])))
            for k in names:
                ttft[k].extend(x["ttft"] for x in res[k] if x["ttft"] is not None)
        time.sleep(0.5)
    finally:
        if td:
            td.terminate()
            td.wait()
        for p in (fp, up, np_, bp, tf):
            if p:
                stop_tree(p)
    pk = packets(pcap)
    asked, sent = {}, {}
    by_port = {v: k for k, v in proxies.items()}
    for t, sp, dp, pl in pk:
        m = MARK.search(pl)
        if not m:
            continue
        key = m.group(1)
        if dp in by_port and key not in asked:
            asked[key] = (by_port[dp], t, sp)
        elif dp == fport and sp not in by_port and key not in sent:
            sent[key] = (t, sp)
    rows = {k: [] for k in proxies}
    for key, (proxy, t0, client) in asked.items():
        if key not in sent:
            continue
        t1, conn = sent[key]
        t2 = first_content(pk, t1, fport, conn)
        t3 = first_content(pk, t1, proxies[proxy], client)
        if t2 is not None and t3 is not None:
            rows[proxy].append(((t1 - t0) * 1e6, (t3 - t2) * 1e6))
    d50 = statistics.median(ttft["direct"])
    print(f"SSE pass-through, {a.rate:g} requests/s over {len(paths)} paths, {a.rounds} x {a.duration:g} s")
    print("| proxy | requests | request side us p50 / p90 / p99 | token side us p50 / p90 / p99 | TTFT added p50 ms |")
    print("|---|---|---|---|---|")
    for k in proxies:
        r = sorted(x[0] for x in rows[k])
        t = sorted(x[1] for x in rows[k])
        if not r:
            sys.exit(f"no {k} request matched in the capture")
        print(f"| {k} | {len(r)} | {q(r, .5):.0f} / {q(r, .9):.0f} / {q(r, .99):.0f} | "
              f"{q(t, .5):.0f} / {q(t, .9):.0f} / {q(t, .99):.0f} | {(statistics.median(ttft[k]) - d50) * 1e3:+.3f} |")


if __name__ == "__main__":
    main()
