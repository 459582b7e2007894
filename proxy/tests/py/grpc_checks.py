#!/usr/bin/env python3
"""The official grpcio client against grpc_origin.py, directly or through
the edge (proxy/tests/grpc.rs).

Usage:
  grpc_checks.py HOST:PORT [--tls --ca ROOT.pem [--server-name NAME]]
                 [--only unary,unary_fail,...] [--skip-control] [--edge]
--edge adds the edge's own answers: a route to a pool with no live member
(`/test.Down/`) answers UNAVAILABLE, a rate-limited route
(`/test.Limited/`, one call a minute) RESOURCE_EXHAUSTED, a message past
the edge's body limit (4 MiB) RESOURCE_EXHAUSTED at once, each as a gRPC
status in a trailers-only response with the edge's message.
Prints one line per check: "PASS name" / "FAIL name: why"; exit 1 if any failed.
"""
import argparse
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ident = lambda b: b


def make_channel(a):
    opts = []
    if a.tls:
        with open(a.ca, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        if a.server_name:
            opts.append(("grpc.ssl_target_name_override", a.server_name))
            opts.append(("grpc.default_authority", a.server_name))
        return grpc.secure_channel(a.target, creds, options=opts)
    return grpc.insecure_channel(a.target, options=opts)


def checks(ch, a):
    unary = ch.unary_unary("/test.Echo/Unary", ident, ident)
    sstream = ch.unary_stream("/test.Echo/ServerStream", ident, ident)
    bidi = ch.stream_stream("/test.Echo/Bidi", ident, ident)
    slow = ch.unary_unary("/test.Echo/Slow", ident, ident)
    control = ch.unary_unary("/test.Control/SetHealth", ident, ident)
    hstub = health_pb2_grpc.HealthStub(ch)
    T = a.timeout

    def c_unary():
        r = unary(b"hello", timeout=T)
        assert r == b"hello", r
        big = bytes(range(256)) * 4096  # 1 MiB
        r = unary(big, timeout=T)
        assert r == big, len(r)

    def c_unary_fail():
        try:
            unary(b"fail", timeout=T)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.code()
            assert e.details() == "unary asked to fail", e.details()
            return
        raise AssertionError("no error")

    def c_unimplemented():
        m = ch.unary_unary("/test.Echo/Nope", ident, ident)
        try:
            m(b"x", timeout=T)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNIMPLEMENTED, e.code()
            return
        raise AssertionError("no error")

    def c_server_stream():
        got = list(sstream(b"50", timeout=T))
        assert got == [str(i).encode() for i in range(50)], got[:5]

    def c_bidi():
        msgs = [f"m{i}".encode() for i in range(20)]
        got = list(bidi(iter(msgs), timeout=T))
        assert got == msgs, got[:5]

    def c_bidi_pingpong():
        # interleaved: each reply must arrive before the next request is sent
        import queue
        q = queue.Queue()

        def gen():
            for i in range(5):
                yield f"p{i}".encode()
                q.get(timeout=T)  # wait for the echo
        it = bidi(gen(), timeout=T)
        for i in range(5):
            r = next(it)
            assert r == f"p{i}".encode(), r
            q.put(None)
        assert list(it) == []

    def c_deadline():
        t0 = time.monotonic()
        try:
            slow(b"3", timeout=0.5)
        except grpc.RpcError as e:
            dt = time.monotonic() - t0
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.code()
            assert dt < 2.0, dt
            return
        raise AssertionError("no deadline error")

    def c_slow_ok():
        assert slow(b"0.2", timeout=T) == b"slept"

    def c_metadata_trailers():
        r, call = unary.with_call(b"x", timeout=T, metadata=(("x-test", "1"),))
        assert r == b"x"
        assert call.code() == grpc.StatusCode.OK

    def c_health():
        r = hstub.Check(health_pb2.HealthCheckRequest(service=""), timeout=T)
        assert r.status == health_pb2.HealthCheckResponse.SERVING, r.status
        r = hstub.Check(health_pb2.HealthCheckRequest(service="test.Echo"), timeout=T)
        assert r.status == health_pb2.HealthCheckResponse.SERVING, r.status
        try:
            hstub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=T)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.NOT_FOUND, e.code()
        else:
            raise AssertionError("unknown service answered")

    def c_health_flip():
        assert control(b"NOT_SERVING", timeout=T) == b"ok"
        try:
            r = hstub.Check(health_pb2.HealthCheckRequest(service=""), timeout=T)
            assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING, r.status
        finally:
            control(b"SERVING", timeout=T)
        r = hstub.Check(health_pb2.HealthCheckRequest(service=""), timeout=T)
        assert r.status == health_pb2.HealthCheckResponse.SERVING, r.status

    def c_edge_unavailable():
        down = ch.unary_unary("/test.Down/Unary", ident, ident)
        try:
            down(b"x", timeout=T)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e.code()
            assert "upstream" in e.details(), e.details()
            return
        raise AssertionError("no error")

    def c_edge_limited():
        lim = ch.unary_unary("/test.Limited/Unary", ident, ident)
        codes = []
        for _ in range(3):
            try:
                lim(b"x", timeout=T)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    assert "rate" in e.details().lower(), e.details()
        # The first reaches the origin (which has no such service).
        assert codes[0] == grpc.StatusCode.UNIMPLEMENTED, codes
        assert codes[1:] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2, codes

    def c_edge_too_large():
        # Past the edge's client_max_body_bytes (4 MiB in the test).
        t0 = time.monotonic()
        try:
            unary(b"z" * (5 << 20), timeout=T)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (e.code(), e.details())
            assert "too large" in e.details(), e.details()
            assert time.monotonic() - t0 < 3, time.monotonic() - t0
            return
        raise AssertionError("no error")

    edge = [("edge_unavailable", c_edge_unavailable), ("edge_limited", c_edge_limited),
            ("edge_too_large", c_edge_too_large)]
    return ([] if not a.edge else edge) + [
        ("unary", c_unary), ("unary_fail", c_unary_fail),
        ("unimplemented", c_unimplemented), ("server_stream", c_server_stream),
        ("bidi", c_bidi), ("bidi_pingpong", c_bidi_pingpong),
        ("deadline", c_deadline), ("slow_ok", c_slow_ok),
        ("metadata_trailers", c_metadata_trailers), ("health", c_health),
        ("health_flip", c_health_flip),
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("--tls", action="store_true")
    ap.add_argument("--ca")
    ap.add_argument("--server-name")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--only")
    ap.add_argument("--edge", action="store_true", help="also the edge's own answers")
    ap.add_argument("--skip-control", action="store_true",
                    help="skip health_flip (needs test.Control reachable)")
    a = ap.parse_args()
    only = set(a.only.split(",")) if a.only else None
    ch = make_channel(a)
    failed = 0
    for name, fn in checks(ch, a):
        if only and name not in only:
            continue
        if a.skip_control and name == "health_flip":
            continue
        try:
            fn()
            print(f"PASS {name}", flush=True)
        except Exception as e:  # noqa: BLE001
            failed += 1
            code = e.code() if isinstance(e, grpc.RpcError) else ""
            print(f"FAIL {name}: {type(e).__name__} {code} {e}".replace("\n", " "), flush=True)
    ch.close()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
