"""An HTTP/2 streaming client for h3_vs_h2.py, the counterpart of
`h3_client.py streams`: one TLS connection, `count` copies of one POST,
`inflight` at a time (the first ones `stagger_ms` apart), and for each
stream the arrival time of every SSE event, taken when its bytes are read
from the socket.

One reader task owns the socket and hands every frame to its stream as it
arrives, as aioquic's event loop does for HTTP/3. httpx's async HTTP/2
client was not used for this: a stream's events wait there until the task
holding the read lock gets one of its own (up to a token's interval at 4
in flight), which was the client's jitter, not the server's.

  h2_streams.py URL COUNT BODY INFLIGHT STAGGER_MS   (prints JSON)

Needs the `h2` package in the project's .venv (`.venv/bin/pip install h2`;
.ci/run does not install it, as no test uses it).
"""
import asyncio
import json
import ssl
import sys
import time
from urllib.parse import urlsplit

import h2.config
import h2.connection
import h2.events


class Client:
    def __init__(self, reader, writer, authority):
        self.reader, self.writer, self.authority = reader, writer, authority
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        # Room for every stream's body: flow control is not what is measured.
        self.conn.increment_flow_control_window(1 << 24)
        self.streams = {}
        self.flush()

    def flush(self):
        data = self.conn.data_to_send()
        if data:
            self.writer.write(data)

    async def read_loop(self):
        while True:
            data = await self.reader.read(65536)
            now = time.monotonic()
            if not data:
                for s in self.streams.values():
                    if not s["done"].done():
                        s["done"].set_exception(ConnectionError("connection closed"))
                return
            for ev in self.conn.receive_data(data):
                s = self.streams.get(getattr(ev, "stream_id", None))
                if isinstance(ev, h2.events.DataReceived):
                    self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    if s is not None and ev.data:
                        s["times"] += [round(now - s["t0"], 4)] * ev.data.count(b"data:")
                elif isinstance(ev, h2.events.ResponseReceived) and s is not None:
                    s["status"] = int(dict(ev.headers).get(b":status", b"0"))
                elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)) and s is not None:
                    if not s["done"].done():
                        s["done"].set_result(None)
            self.flush()

    async def request(self, method, path, body=b"", headers=()):
        sid = self.conn.get_next_available_stream_id()
        s = {"t0": time.monotonic(), "times": [], "status": None,
             "done": asyncio.get_running_loop().create_future()}
        self.streams[sid] = s
        hs = [(":method", method), (":scheme", "https"), (":authority", self.authority),
              (":path", path)] + list(headers)
        self.conn.send_headers(sid, hs, end_stream=not body)
        if body:
            self.conn.send_data(sid, body, end_stream=True)
        self.flush()
        await s["done"]
        del self.streams[sid]
        if s["status"] != 200:
            raise RuntimeError(f"status {s['status']} on {path}")
        return s["times"]


async def main():
    url, count, body, inflight, stagger = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode(), int(sys.argv[4]), float(sys.argv[5])
    u = urlsplit(url)
    ctx = ssl.create_default_context()
    # The dev certificate names localhost and the server is at an address
    # across the link: no verification, as h3_client.py gets it by name.
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    reader, writer = await asyncio.open_connection(u.hostname, u.port, ssl=ctx)
    c = Client(reader, writer, f"{u.hostname}:{u.port}")
    reading = asyncio.create_task(c.read_loop())
    # The connection is made (and its handshake done) before the timed
    # streams, as the HTTP/3 client's is; every stream then shares it.
    await c.request("GET", u.path.rsplit("/", 2)[0] + "/models")
    out, left = [], [count]

    async def worker(k):
        await asyncio.sleep(k * stagger / 1000)
        while left[0] > 0:
            left[0] -= 1
            out.append(await c.request("POST", u.path, body, [("content-type", "application/json")]))

    await asyncio.gather(*[worker(k) for k in range(inflight)])
    reading.cancel()
    writer.close()
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(asyncio.wait_for(main(), 590))
