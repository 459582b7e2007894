"""An HTTP/3 client for the tests (aioquic): requests over one QUIC
connection, the connection's limits as the server advertises them, and
several connections at once. Prints one JSON document on stdout.

  h3_client.py requests --port P --cafile CA --requests '[{"method": "GET", "path": "/"}]'
  h3_client.py limits   --port P --cafile CA [--idle 2.0]
  h3_client.py conns    --port P --cafile CA --count 3 --hold 1.0
  h3_client.py early    --port P --cafile CA --requests '[...]'
  h3_client.py streams  --port P --cafile CA --count N --inflight M --stagger-ms S --requests '[{...}]'
      (N copies of the one request, M in flight on one connection, the
      first M started S ms apart so that their bodies' chunks are not sent
      together; each ended one is followed at once by the next)
  h3_client.py load     --port P --cafile CA --count N --inflight M --path /p
      (N GETs, M in flight on one connection, as h2load -m M does: a new
      request is queued as a response ends, and the connection sends once
      per batch of received packets)
      (a first connection for a session ticket, then the requests at once
      on a resumed connection, in 0-RTT where the ticket allows it)
"""

import argparse
import asyncio
import json
import ssl
import sys
import time

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamReset


def pairs(headers):
    """A request's headers: a JSON object, or a list of [name, value]
    pairs (a name may repeat)."""
    if isinstance(headers, list):
        return [(k, v) for k, v in headers]
    return list((headers or {}).items())


class Client(QuicConnectionProtocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.streams = {}
        self.terminated = None

    def quic_event_received(self, event: QuicEvent):
        if isinstance(event, ConnectionTerminated):
            self.terminated = {
                "error_code": event.error_code,
                "reason": event.reason_phrase,
                "at": time.monotonic(),
            }
            for s in self.streams.values():
                if not s["done"].done():
                    s["done"].set_result(None)
        if isinstance(event, StreamReset) and event.stream_id in self.streams:
            # The server refused the stream (a malformed request, say).
            s = self.streams[event.stream_id]
            s["reset"] = event.error_code
            if not s["done"].done():
                s["done"].set_result(None)
        for ev in self.h3.handle_event(event):
            s = self.streams.get(getattr(ev, "stream_id", None))
            if s is None:
                continue
            if isinstance(ev, HeadersReceived):
                if s["status"] is None:
                    s["headers"] = [(k.decode(), v.decode()) for k, v in ev.headers]
                    s["status"] = int(dict(s["headers"]).get(":status", "0"))
                else:
                    s["trailers"] = [(k.decode(), v.decode()) for k, v in ev.headers]
            elif isinstance(ev, DataReceived):
                if ev.data:
                    s["chunks"].append((time.monotonic() - s["t0"], ev.data))
            if getattr(ev, "stream_ended", False) and not s["done"].done():
                s["done"].set_result(None)

    async def request(self, method, path, headers=None, body=b"", authority="localhost"):
        sid = self._quic.get_next_available_stream_id()
        loop = asyncio.get_running_loop()
        s = {
            "status": None,
            "headers": [],
            "trailers": [],
            "chunks": [],
            "t0": time.monotonic(),
            "done": loop.create_future(),
        }
        self.streams[sid] = s
        hs = [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", authority.encode()),
            (b":path", path.encode()),
        ] + [(k.lower().encode(), v.encode()) for k, v in pairs(headers)]
        self.h3.send_headers(sid, hs, end_stream=not body)
        if body:
            self.h3.send_data(sid, body, end_stream=True)
        self.transmit()
        await s["done"]
        text = b"".join(c for _, c in s["chunks"])
        return {
            "status": s["status"],
            "headers": s["headers"],
            "trailers": s["trailers"],
            "body": text.decode("utf-8", "replace"),
            "chunk_times": [round(t, 4) for t, _ in s["chunks"]],
            "chunk_events": [c.count(b"data:") for _, c in s["chunks"]],
            "ended": s["done"].done() and self.terminated is None,
            "reset": s.get("reset"),
        }


class Load(Client):
    """Keeps `inflight` GETs of `path` going until `count` are answered."""

    def start_load(self, path, authority, count, inflight):
        self.path, self.authority, self.left, self.ok = path, authority, count, 0
        self.finished = asyncio.get_running_loop().create_future()
        for _ in range(min(inflight, count)):
            self.send_next()
        self.transmit()

    def send_next(self):
        if self.left == 0:
            return
        self.left -= 1
        sid = self._quic.get_next_available_stream_id()
        self.h3.send_headers(sid, [
            (b":method", b"GET"), (b":scheme", b"https"),
            (b":authority", self.authority.encode()), (b":path", self.path.encode()),
        ], end_stream=True)
        self.load_streams.add(sid)

    def quic_event_received(self, event):
        if isinstance(event, ConnectionTerminated) and not self.finished.done():
            self.finished.set_result(None)
        for ev in self.h3.handle_event(event):
            sid = getattr(ev, "stream_id", None)
            if sid in self.load_streams and getattr(ev, "stream_ended", False):
                self.load_streams.discard(sid)
                if isinstance(ev, (HeadersReceived, DataReceived)):
                    self.ok += 1
                self.send_next()
                if not self.load_streams and self.left == 0 and not self.finished.done():
                    self.finished.set_result(None)
        # The protocol sends what was queued here once this batch is done.


async def load(args):
    c = config(args)
    async with connect(args.host, args.port, configuration=c, create_protocol=Load) as client:
        client.load_streams = set()
        t0 = time.monotonic()
        client.start_load(args.path, args.servername, args.count, args.inflight)
        await asyncio.wait_for(client.finished, 120)
        return {"ok": client.ok, "seconds": round(time.monotonic() - t0, 3)}


async def streams(args):
    """`count` copies of one request, `inflight` at a time on one
    connection, the first ones staggered: what a client with several
    completions in flight sends (bench h3_vs_h2.py, concurrent mode)."""
    r = json.loads(args.requests)[0]
    out = []
    left = [args.count]
    async with connect(
        args.host, args.port, configuration=config(args), create_protocol=Client
    ) as client:
        await client.request("GET", "/v1/models", None, b"", args.servername)

        async def worker(k):
            await asyncio.sleep(k * args.stagger_ms / 1000)
            while left[0] > 0:
                left[0] -= 1
                out.append(await client.request(
                    r.get("method", "GET"), r["path"], r.get("headers"),
                    r.get("body", "").encode(), r.get("authority", args.servername),
                ))

        await asyncio.gather(*[worker(k) for k in range(args.inflight)])
    return out


def config(args):
    c = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)
    c.load_verify_locations(args.cafile)
    c.server_name = args.servername
    c.idle_timeout = 30.0
    return c


async def requests(args):
    out = []
    async with connect(
        args.host, args.port, configuration=config(args), create_protocol=Client
    ) as client:
        todo = json.loads(args.requests)
        if args.parallel:
            results = await asyncio.gather(
                *[
                    client.request(
                        r.get("method", "GET"),
                        r["path"],
                        r.get("headers"),
                        r.get("body", "").encode(),
                        args.servername,
                    )
                    for r in todo
                ]
            )
            out.extend(results)
        else:
            for r in todo:
                out.append(
                    await client.request(
                        r.get("method", "GET"),
                        r["path"],
                        r.get("headers"),
                        r.get("body", "").encode(),
                        args.servername,
                    )
                )
    return out


async def limits(args):
    async with connect(
        args.host, args.port, configuration=config(args), create_protocol=Client
    ) as client:
        await client.ping()
        q = client._quic
        report = {
            "max_streams_bidi": q._remote_max_streams_bidi,
            "idle_timeout_ms": (
                round(q._remote_max_idle_timeout * 1000) if q._remote_max_idle_timeout else None
            ),
        }
        if args.idle:
            t0 = time.monotonic()
            await asyncio.sleep(args.idle)
            report["terminated_after_s"] = (
                round(client.terminated["at"] - t0, 3) if client.terminated else None
            )
        return report


async def one_conn(args, hold):
    try:
        async with connect(
            args.host, args.port, configuration=config(args), create_protocol=Client,
        ) as client:
            r = await asyncio.wait_for(client.request("GET", args.path, None, b"", args.servername), 10)
            await asyncio.sleep(hold)
            return {"ok": True, "status": r["status"]}
    except Exception as e:  # refused, timed out
        return {"ok": False, "error": type(e).__name__ + ": " + str(e)}


async def conns(args):
    held = []
    # Open them one after the other, each kept open while the next opens.
    tasks = []
    for i in range(args.count):
        tasks.append(asyncio.create_task(one_conn(args, args.hold * (args.count - i))))
        await asyncio.sleep(0.3)
    held = await asyncio.gather(*tasks)
    return held


async def resumed_config(args):
    """A first connection for a session ticket, and the configuration of
    a second that resumes with it (None without a ticket)."""
    tickets = []
    c = config(args)
    async with connect(
        args.host, args.port, configuration=c, create_protocol=Client,
        session_ticket_handler=tickets.append,
    ) as client:
        await client.request("GET", args.path, None, b"", args.servername)
        await asyncio.sleep(0.2)
    if not tickets:
        return None
    c = config(args)
    c.session_ticket = tickets[-1]
    return c


async def early(args):
    c = await resumed_config(args)
    if c is None:
        return {"error": "no session ticket"}
    tickets = [c.session_ticket]
    todo = json.loads(args.requests)
    async with connect(
        args.host, args.port, configuration=c, create_protocol=Client,
        wait_connected=False,
    ) as client:
        results = await asyncio.gather(
            *[
                client.request(
                    r.get("method", "GET"), r["path"], r.get("headers"),
                    r.get("body", "").encode(), r.get("authority", args.servername),
                )
                for r in todo
            ]
        )
        return {
            "ticket_allows_early_data": tickets[-1].max_early_data_size is not None,
            "early_data_accepted": bool(client._quic.tls.early_data_accepted),
            "results": results,
        }


async def early_stall(args):
    """A resumed connection that sends a GET in 0-RTT and then never
    finishes its handshake (nothing more leaves the client): how long the
    server keeps it."""
    c = await resumed_config(args)
    if c is None:
        return {"error": "no session ticket"}
    c.idle_timeout = 60.0
    async with connect(
        args.host, args.port, configuration=c, create_protocol=Client,
        wait_connected=False,
    ) as client:
        t0 = time.monotonic()
        answer = asyncio.ensure_future(client.request("GET", args.path, None, b"", args.servername))
        await asyncio.sleep(0)
        # The first flight (ClientHello and the 0-RTT request) is out:
        # from here the client sends nothing, its Finished included.
        client._transport.sendto = lambda *a, **k: None
        try:
            r = await asyncio.wait_for(answer, 5)
        except asyncio.TimeoutError:
            r = None
        while client.terminated is None and time.monotonic() - t0 < args.hold:
            await asyncio.sleep(0.05)
        return {
            "early_data_accepted": bool(client._quic.tls.early_data_accepted),
            "answer": r and r["status"],
            "closed_after_s": client.terminated and round(client.terminated["at"] - t0, 3),
        }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["requests", "limits", "conns", "early", "early-stall", "load", "streams"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--cafile", required=True)
    p.add_argument("--servername", default="localhost")
    p.add_argument("--requests", default="[]")
    p.add_argument("--parallel", action="store_true")
    p.add_argument("--idle", type=float, default=0.0)
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--hold", type=float, default=1.0)
    p.add_argument("--path", default="/")
    p.add_argument("--inflight", type=int, default=16)
    p.add_argument("--stagger-ms", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for the whole run")
    args = p.parse_args()
    run = {"requests": requests, "limits": limits, "conns": conns, "early": early,
           "early-stall": early_stall, "load": load,
           "streams": streams}[args.mode]
    try:
        result = asyncio.run(asyncio.wait_for(run(args), args.timeout))
    except Exception as e:
        print(json.dumps({"error": type(e).__name__ + ": " + str(e)}))
        sys.exit(2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
