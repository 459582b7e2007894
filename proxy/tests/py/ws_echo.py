"""A WebSocket echo server and client (the `websockets` package), for
proxy/tests/websocket.rs.

  ws_echo.py server        print the port, then echo every message until killed
  ws_echo.py client URL N  send N text and N binary messages of varied sizes,
                           check each echo, close with 1000; print "ok N 1000"
"""
import asyncio
import sys

import websockets


async def serve():
    async def echo(ws):
        try:
            async for message in ws:
                await ws.send(message)
        except websockets.ConnectionClosed:
            pass  # a client that leaves without a close frame (the raw tests)

    async with websockets.serve(echo, "127.0.0.1", 0, max_size=None) as server:
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.Future()


async def client(url, n):
    async with websockets.connect(url, max_size=None) as ws:
        for i in range(n):
            text = f"text {i} " * (i % 50 + 1)
            await ws.send(text)
            got = await ws.recv()
            assert got == text, f"text {i}: {got[:40]!r}"
            blob = bytes((i + j) % 256 for j in range(i * 977 % 70000))
            await ws.send(blob)
            got = await ws.recv()
            assert got == blob, f"binary {i}: {len(got)} bytes of {len(blob)}"
        await ws.close(code=1000)
        print(f"ok {n} {ws.close_code}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        asyncio.run(serve())
    else:
        asyncio.run(client(sys.argv[2], int(sys.argv[3])))
