//! Request buffering (`request_buffering`, nginx's `proxy_request_buffering
//! on`) and per-listener deadlines: a body still arriving holds no upstream
//! connection, a body past `client_body_buffer_kb` spills to a file and
//! arrives intact, a route can stream instead, and each deadline answers
//! and counts its expiry.

#![allow(clippy::unwrap_used)]
mod common;
use common::*;
use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

fn edge(limits: &str, routes: &str) -> (Origin, Ultrafast) {
    let a = Origin::start("a");
    let uf = Ultrafast::start(&format!(
        "[limits]\n{limits}\n{}{routes}",
        pool_toml("a", &[&a], "")
    ));
    (a, uf)
}

const ROUTES: &str =
    "[[routes]]\npath = \"/unbuffered\"\npool = \"a\"\nrequest_buffering = false\n\n\
                      [[routes]]\npath = \"/\"\npool = \"a\"\n";

fn body(n: usize, seed: u32) -> Vec<u8> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(31).wrapping_add(seed) % 251) as u8)
        .collect()
}

/// A connection that has sent a head and part of its body.
struct Partial {
    conn: TcpStream,
    rest: Vec<u8>,
}

impl Partial {
    fn open(uf: &Ultrafast, head: &str, wire: &[u8], sent: usize) -> Partial {
        let mut conn = TcpStream::connect(uf.addr).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        conn.write_all(head.as_bytes()).unwrap();
        conn.write_all(&wire[..sent]).unwrap();
        Partial {
            conn,
            rest: wire[sent..].to_vec(),
        }
    }

    /// Send the rest of the body and read the JSON the origin answered.
    fn finish(mut self) -> serde_json::Value {
        for part in self.rest.chunks(7000) {
            self.conn.write_all(part).unwrap();
        }
        let mut c = Client::from_stream(self.conn);
        let r = c.read_response(false).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    }
}

fn post_head(path: &str, len: usize) -> String {
    format!("POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len}\r\n\r\n")
}

fn chunked(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for c in b.chunks(3000) {
        out.extend_from_slice(format!("{:x};e=1\r\n", c.len()).as_bytes());
        out.extend_from_slice(c);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\nX-Trailer: 1\r\n\r\n");
    out
}

/// A POST over h2c that sends its head and then nothing: the status of
/// the answer and how long it took.
fn h2_post_stalled(port: u16) -> (u16, Duration) {
    let req = http::Request::post(format!("http://127.0.0.1:{port}/up"))
        .body(())
        .unwrap();
    // The stream stays open: no DATA, no end of stream.
    let a = h2c(port, req, false);
    (a.status, a.took)
}

#[test]
fn bodies_still_arriving_hold_no_upstream_connection_and_arrive_whole() {
    // 4 KiB in memory: the 100 kB bodies spill to the temporary file.
    let (a, uf) = edge(
        "client_body_buffer_kb = 4\nclient_body_timeout_ms = 20000",
        ROUTES,
    );
    let origin = a.addr.port();
    let len = 100_000;
    let mut open = Vec::new();
    for i in 0..20u32 {
        let b = body(len, i);
        open.push((
            Partial::open(&uf, &post_head("/up", len), &b, 30_000 + i as usize),
            b,
        ));
    }
    let mut chunky = Vec::new();
    for i in 0..5u32 {
        let b = body(50_000, 100 + i);
        let wire = chunked(&b);
        let head = "POST /up HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
        chunky.push((Partial::open(&uf, head, &wire, 20_000), b));
    }
    // Every head has arrived, no body is whole: the origin sees nothing.
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(held(origin), 0, "origin connections while bodies arrive");
    assert_eq!(a.requests(), 0);
    for (p, b) in open.into_iter().chain(chunky) {
        let j = p.finish();
        assert_eq!(j["body_len"], b.len());
        assert_eq!(j["body_fnv"], fnv(&b), "the body arrived changed");
    }
    assert_eq!(a.requests(), 25);

    // A small body read whole in memory, with the head in one write.
    let b = body(3000, 7);
    let mut c = Client::connect(uf.addr).unwrap();
    let r = c.request("POST", "/small", &[], &b).unwrap();
    assert_eq!(r.json()["body_fnv"], fnv(&b));

    // A request pipelined behind a held body is answered after it.
    let b = body(30_000, 11);
    let mut wire = post_head("/one", b.len()).into_bytes();
    wire.extend_from_slice(&b[..1000]);
    let mut conn = TcpStream::connect(uf.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    conn.write_all(&wire).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let mut rest = b[1000..].to_vec();
    rest.extend_from_slice(b"GET /two HTTP/1.1\r\nHost: x\r\n\r\n");
    conn.write_all(&rest).unwrap();
    let mut c = Client::from_stream(conn);
    let one = c.read_response(false).unwrap().json();
    assert_eq!(
        (one["path"].as_str(), one["body_fnv"].as_u64()),
        (Some("/one"), Some(fnv(&b)))
    );
    let two = c.read_response(false).unwrap().json();
    assert_eq!(two["path"], "/two");

    // `Expect: 100-continue` is the edge's to answer; the origin gets the
    // body without being asked.
    let b = body(20_000, 9);
    let mut conn = TcpStream::connect(uf.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let head =
        "POST /up HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 20000\r\n\r\n";
    conn.write_all(head.as_bytes()).unwrap();
    let mut interim = [0u8; 25];
    std::io::Read::read_exact(&mut conn, &mut interim).unwrap();
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    conn.write_all(&b).unwrap();
    let mut c = Client::from_stream(conn);
    let j = c.read_response(false).unwrap().json();
    assert_eq!(j["body_fnv"], fnv(&b));
    assert!(j["headers"].get("expect").is_none(), "{j}");
    // Our 100 Continue did not cost the connection its keepalive.
    assert_eq!(c.request("GET", "/after", &[], b"").unwrap().status, 200);

    // A POST pipelined behind a GET, its head's end in a later write: it
    // is not held on what the GET's read carried past its head.
    let mut conn = TcpStream::connect(uf.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let first =
        "GET /a HTTP/1.1\r\nHost: x\r\n\r\nPOST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n";
    conn.write_all(first.as_bytes()).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    conn.write_all(b"\r\nhello").unwrap();
    let mut c = Client::from_stream(conn);
    assert_eq!(c.read_response(false).unwrap().json()["path"], "/a");
    let b = c.read_response(false).unwrap().json();
    assert_eq!(
        (b["path"].as_str(), b["body_len"].as_u64()),
        (Some("/b"), Some(5))
    );

    // A route with request_buffering = false streams: the origin holds a
    // connection for each body still arriving.
    let mut streamed = Vec::new();
    for i in 0..10u32 {
        let b = body(len, 200 + i);
        streamed.push((
            Partial::open(&uf, &post_head("/unbuffered", len), &b, 10_000),
            b,
        ));
    }
    assert!(
        eventually(Duration::from_secs(5), || held(origin) >= 10),
        "streamed bodies hold {} origin connections",
        held(origin)
    );
    for (p, b) in streamed {
        assert_eq!(p.finish()["body_fnv"], fnv(&b));
    }
}

#[test]
fn a_body_that_stops_arriving_gets_a_408_and_one_past_the_limit_a_413() {
    let h2c = free_port();
    let (a, uf) = edge(
        "client_body_timeout_ms = 600\nclient_max_body_bytes = 20000",
        &format!(
            "[[listeners]]\nname = \"h2c\"\naddress = \"127.0.0.1:{h2c}\"\nh2c = true\n\n{ROUTES}"
        ),
    );
    let b = body(10_000, 1);
    let mut p = Partial::open(&uf, &post_head("/up", 10_000), &b, 4000);
    let t = std::time::Instant::now();
    let mut c = Client::from_stream(p.conn.try_clone().unwrap());
    let r = c.read_response(false).unwrap();
    assert_eq!(r.status, 408, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "request_timeout");
    assert!(r.header("x-request-id").is_some());
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert!(c.closed_within(Duration::from_secs(2)));
    p.rest.clear();
    // A chunked body has no length to refuse at the head: the hold counts.
    let big = chunked(&body(30_000, 2));
    let head = "POST /up HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
    let mut conn = TcpStream::connect(uf.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    conn.write_all(head.as_bytes()).unwrap();
    let _ = conn.write_all(&big);
    let r = Client::from_stream(conn).read_response(false).unwrap();
    assert_eq!(r.status, 413, "{}", r.text());
    assert_eq!(a.requests(), 0, "neither reached the origin");
    // The limit is on the data: 15 kB in one-byte chunks (90 kB on the
    // wire) is under it.
    let small = body(15_000, 3);
    let mut wire = Vec::new();
    for b in &small {
        wire.extend_from_slice(b"1\r\n");
        wire.push(*b);
        wire.extend_from_slice(b"\r\n");
    }
    wire.extend_from_slice(b"0\r\n\r\n");
    let mut conn = TcpStream::connect(uf.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    conn.write_all(head.as_bytes()).unwrap();
    conn.write_all(&wire).unwrap();
    let r = Client::from_stream(conn).read_response(false).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["body_fnv"], fnv(&small));
    // HTTP/2: a stream that sends its head and no body is timed too.
    let (status, took) = h2_post_stalled(h2c);
    assert_eq!(status, 408);
    assert!(took < Duration::from_secs(3), "{took:?}");
    assert!(
        uf.metric(
            "ultrafast_downstream_connections_closed_total",
            &["body_timeout"]
        ) >= 1.0
    );
}

#[test]
fn each_listener_keeps_its_own_deadlines() {
    let (port, slow_port) = (free_port(), free_port());
    let (_a, uf) = edge(
        "client_header_timeout_ms = 30000",
        &format!(
            "[[listeners]]\nname = \"quick\"\naddress = \"127.0.0.1:{port}\"\n\
             client_header_timeout_ms = 500\nkeepalive_timeout_s = 1\n\n\
             [[listeners]]\nname = \"h2c\"\naddress = \"127.0.0.1:{slow_port}\"\n\
             h2c = true\nh2c_preface_timeout_ms = 500\n\n{ROUTES}"
        ),
    );
    let at = |p: u16| -> std::net::SocketAddr { format!("127.0.0.1:{p}").parse().unwrap() };
    // Half a head on each listener.
    let mut quick = Client::connect(at(port)).unwrap();
    quick.send_raw(b"GET / HTTP/1.1\r\nHost: x\r\n").unwrap();
    let mut default = Client::connect(uf.addr).unwrap();
    default.send_raw(b"GET / HTTP/1.1\r\nHost: x\r\n").unwrap();
    let t = std::time::Instant::now();
    let r = quick.read_response(false).unwrap();
    assert_eq!(r.status, 408, "{}", r.text());
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert!(r.header("x-request-id").is_some());
    // The default listener's 30 s deadline still waits.
    assert!(!default.closed_within(Duration::from_millis(800)));
    default.send_raw(b"\r\n").unwrap();
    assert_eq!(default.read_response(false).unwrap().status, 200);

    // A later head on a kept-alive connection is timed too.
    let mut again = Client::connect(at(port)).unwrap();
    assert_eq!(again.request("GET", "/", &[], b"").unwrap().status, 200);
    again.send_raw(b"GET / HTTP/1.1\r\n").unwrap();
    assert_eq!(again.read_response(false).unwrap().status, 408);

    // The quick listener's 1 s keepalive closes an idle connection.
    let mut idle = Client::connect(at(port)).unwrap();
    assert_eq!(idle.request("GET", "/", &[], b"").unwrap().status, 200);
    let t = std::time::Instant::now();
    assert!(idle.closed_within(Duration::from_secs(5)));
    assert!(
        t.elapsed() >= Duration::from_millis(800),
        "{:?}",
        t.elapsed()
    );

    // The h2c listener closes a connection that has not shown its protocol.
    let mut silent = Client::connect(at(slow_port)).unwrap();
    silent.send_raw(b"PRI * HT").unwrap();
    let t = std::time::Instant::now();
    assert!(silent.closed_within(Duration::from_secs(5)));
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert!(
        uf.metric(
            "ultrafast_downstream_connections_closed_total",
            &["preface_timeout"]
        ) >= 1.0
    );
    // An HTTP/1 request there is answered as usual.
    let mut plain = Client::connect(at(slow_port)).unwrap();
    assert_eq!(plain.request("GET", "/", &[], b"").unwrap().status, 200);
}

#[test]
fn a_grpc_content_type_does_not_switch_buffering_off_on_a_plain_pool() {
    // gRPC is what the route serves: over HTTP/1.1, to an HTTP/1.1 pool,
    // `application/grpc` is an ordinary content type. Before, the edge
    // took the client's word, streamed the body to the origin as it came
    // (the origin answered after 10 of 100,000 bytes) and answered its own
    // refusals as gRPC trailers-only responses.
    let (a, uf) = edge("client_body_timeout_ms = 20000", ROUTES);
    let len = 100_000;
    let b = body(len, 3);
    let head = format!(
        "POST /up HTTP/1.1\r\nHost: x\r\nContent-Type: application/grpc\r\nTE: trailers\r\nContent-Length: {len}\r\n\r\n"
    );
    let p = Partial::open(&uf, &head, &b, 10);
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(held(a.addr.port()), 0, "the body is not whole yet");
    assert_eq!(a.requests(), 0);
    let j = p.finish();
    assert_eq!(j["body_fnv"], fnv(&b));
    // The edge's own answers stay HTTP: a body past the limit is a 413.
    let (_a, small) = edge("client_max_body_bytes = 1000", ROUTES);
    let mut c = Client::connect(small.addr).unwrap();
    let r = c
        .request(
            "POST",
            "/up",
            &[("Content-Type", "application/grpc")],
            &[0; 2000],
        )
        .unwrap();
    assert_eq!(r.status, 413, "{:?}", r.headers);
    assert!(r.header("grpc-status").is_none(), "{:?}", r.headers);
}
