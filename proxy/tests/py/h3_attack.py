"""Hostile HTTP/3 clients for the tests (aioquic at the QUIC layer, so
that the frames are the bytes we choose, not what an HTTP/3 client would
send). Prints one JSON document on stdout.

  h3_attack.py frames --port P --cafile CA --streams N --prefix HEX
      [--fill BYTES] [--seconds S] [--uni]
      Open N streams (bidirectional, or unidirectional with --uni) and
      send on each the bytes of HEX, then zeros up to BYTES, in 16 KiB
      pieces spread over at most S seconds. Counts what the server did:
      streams it reset or stopped (with their codes), and whether it
      closed the connection.
  h3_attack.py datagrams --port P --cafile CA
      Whether the server offers QUIC datagrams (a client could fill the
      buffer of those nothing reads), and what sending some does.
  h3_attack.py churn --port P --cafile CA --count N
      N connections one after another, each migrating to a fresh
      connection id (and a new local port) before it closes.

Every loop is bounded in count and time.
"""

import argparse
import asyncio
import json
import ssl
import time

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import (
    ConnectionTerminated,
    QuicEvent,
    StopSendingReceived,
    StreamReset,
)

PIECE = 16 * 1024


class Raw(QuicConnectionProtocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reset = {}
        self.stopped = {}
        self.terminated = None

    def quic_event_received(self, event: QuicEvent):
        if isinstance(event, ConnectionTerminated):
            self.terminated = {"error_code": event.error_code, "reason": event.reason_phrase}
        elif isinstance(event, StreamReset):
            self.reset[event.stream_id] = event.error_code
        elif isinstance(event, StopSendingReceived):
            self.stopped[event.stream_id] = event.error_code


def config(a):
    c = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name="localhost")
    c.load_verify_locations(a.cafile)
    c.verify_mode = ssl.CERT_REQUIRED
    c.idle_timeout = 30.0
    return c


async def frames(a):
    prefix = bytes.fromhex(a.prefix)
    async with connect("127.0.0.1", a.port, configuration=config(a), create_protocol=Raw) as c:
        ids = []
        for _ in range(a.streams):
            sid = c._quic.get_next_available_stream_id(is_unidirectional=a.uni)
            c._quic.send_stream_data(sid, prefix)
            ids.append(sid)
        c.transmit()
        sent = len(prefix) * len(ids)
        left = {sid: max(0, a.fill - len(prefix)) for sid in ids}
        t0 = time.monotonic()
        pieces = sum((v + PIECE - 1) // PIECE for v in left.values())
        pause = a.seconds / max(1, pieces / max(1, len(ids)))
        while time.monotonic() - t0 < a.seconds and c.terminated is None:
            live = [s for s in ids if left[s] > 0 and s not in c.stopped and s not in c.reset]
            if not live:
                break
            for sid in live:
                n = min(PIECE, left[sid])
                try:
                    c._quic.send_stream_data(sid, bytes(n))
                except Exception:  # the stream was reset under us
                    left[sid] = 0
                    continue
                left[sid] -= n
                sent += n
            c.transmit()
            await asyncio.sleep(pause)
        # What the server does in the next moment counts too.
        await asyncio.sleep(0.5)
        return {
            "sent": sent,
            "seconds": round(time.monotonic() - t0, 3),
            "reset": {str(k): v for k, v in c.reset.items()},
            "stopped": {str(k): v for k, v in c.stopped.items()},
            "terminated": c.terminated,
        }


async def churn(a):
    done = 0
    migrated = 0
    for _ in range(a.count):
        async with connect("127.0.0.1", a.port, configuration=config(a), create_protocol=Raw) as c:
            # A new connection id and a new path, as a migrating client.
            try:
                c.change_connection_id()
                migrated += 1
            except Exception:
                pass
            c.transmit()
            await asyncio.sleep(0.02)
            done += 1
    return {"connections": done, "migrated": migrated}


async def datagrams(a):
    cfg = config(a)
    cfg.max_datagram_frame_size = 65536
    async with connect("127.0.0.1", a.port, configuration=cfg, create_protocol=Raw) as c:
        await asyncio.sleep(0.2)
        offered = c._quic._remote_max_datagram_frame_size
        sent = 0
        if offered:
            for _ in range(a.count):
                c._quic.send_datagram_frame(bytes(1000))
                sent += 1
            c.transmit()
            await asyncio.sleep(0.5)
        return {"offered": offered, "sent": sent, "terminated": c.terminated}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["frames", "churn", "datagrams"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--cafile", required=True)
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--prefix", default="")
    p.add_argument("--fill", type=int, default=0)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--uni", action="store_true")
    p.add_argument("--count", type=int, default=10)
    a = p.parse_args()
    run = {"frames": frames, "churn": churn, "datagrams": datagrams}[a.mode]
    print(json.dumps(asyncio.run(asyncio.wait_for(run(a), 120))))


if __name__ == "__main__":
    main()
