#!/usr/bin/env python3
"""gRPC test origin without protoc-generated code.

Service `test.Echo` (raw bytes in, raw bytes out):
  Unary        echo the request; b"fail" -> INVALID_ARGUMENT "unary asked to fail"
  ServerStream request is N as decimal text; replies N messages b"0".."N-1"
  Bidi         echo each message as it arrives
  Slow         request is seconds as decimal text (float ok); sleeps, replies b"slept"
  Meta         replies with the request's metadata as "k=v\n" lines (debugging)
Service `test.Control`:
  SetHealth    request b"SERVING" | b"NOT_SERVING" [+ b" service-name"]; sets health
Standard `grpc.health.v1.Health` (Check/Watch), overall service "" and "test.Echo".
Health can also be flipped by a file: --health-file PATH; if the file exists its
first word (SERVING / NOT_SERVING) is applied (polled every 0.2 s).

Usage:
  grpc_origin.py [--port 0] [--host 127.0.0.1] [--tls-cert C --tls-key K]
Prints "PORT <n>" on stdout (flushed) once listening.
"""
import argparse
import os
import sys
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

ident = lambda b: b  # bytes passthrough (de)serializer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def unary(req, ctx):
    if req == b"fail":
        ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "unary asked to fail")
    return req


def server_stream(req, ctx):
    try:
        n = int(req.decode() or "0")
    except ValueError:
        ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "request must be a decimal count")
    for i in range(n):
        yield str(i).encode()


def bidi(req_iter, ctx):
    for m in req_iter:
        yield m


def slow(req, ctx):
    secs = float(req.decode() or "0")
    end = time.monotonic() + secs
    while time.monotonic() < end:
        if not ctx.is_active():  # deadline passed / client cancelled
            return b""
        time.sleep(0.01)
    return b"slept"


def meta(req, ctx):
    return "".join(f"{k}={v}\n" for k, v in ctx.invocation_metadata()).encode()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--tls-cert")
    ap.add_argument("--tls-key")
    ap.add_argument("--health-file")
    a = ap.parse_args()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    server.add_generic_rpc_handlers((
        grpc.method_handlers_generic_handler("test.Echo", {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, ident, ident),
            "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream, ident, ident),
            "Bidi": grpc.stream_stream_rpc_method_handler(bidi, ident, ident),
            "Slow": grpc.unary_unary_rpc_method_handler(slow, ident, ident),
            "Meta": grpc.unary_unary_rpc_method_handler(meta, ident, ident),
        }),
    ))

    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)

    def set_health(status, service=None):
        for svc in ([service] if service is not None else ["", "test.Echo"]):
            hs.set(svc, status)

    set_health(SERVING)

    def control_set_health(req, ctx):
        parts = req.decode().split()
        if not parts or parts[0] not in ("SERVING", "NOT_SERVING"):
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "want SERVING|NOT_SERVING [service]")
        set_health(SERVING if parts[0] == "SERVING" else NOT_SERVING,
                   parts[1] if len(parts) > 1 else None)
        return b"ok"

    server.add_generic_rpc_handlers((
        grpc.method_handlers_generic_handler("test.Control", {
            "SetHealth": grpc.unary_unary_rpc_method_handler(control_set_health, ident, ident),
        }),
    ))

    addr = f"{a.host}:{a.port}"
    if a.tls_cert:
        with open(a.tls_cert, "rb") as f:
            cert = f.read()
        with open(a.tls_key, "rb") as f:
            key = f.read()
        port = server.add_secure_port(addr, grpc.ssl_server_credentials([(key, cert)]))
    else:
        port = server.add_insecure_port(addr)
    if port == 0:
        sys.exit(f"cannot bind {addr}")
    server.start()

    if a.health_file:
        def watch():
            last = None
            while True:
                try:
                    with open(a.health_file) as f:
                        word = (f.read().split() or ["SERVING"])[0]
                except FileNotFoundError:
                    word = None
                if word != last and word in ("SERVING", "NOT_SERVING"):
                    set_health(SERVING if word == "SERVING" else NOT_SERVING)
                last = word
                time.sleep(0.2)
        threading.Thread(target=watch, daemon=True).start()

    print(f"PORT {port}", flush=True)
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        server.stop(0)


if __name__ == "__main__":
    main()
