//! The connection guard of the traffic listeners: a whole-request-head
//! deadline (`client_header_timeout_ms`) however slowly the head trickles
//! in, that never cuts a slow response or a kept-alive connection waiting
//! between requests, and a cap on open connections (`max_connections`).

#![allow(clippy::unwrap_used)]
mod common;
use common::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

fn start(origin: &Origin, limits: &str) -> Ultrafast {
    Ultrafast::start(&format!(
        "[limits]\n{limits}\n{}[[routes]]\npath = \"/\"\npool = \"p\"\n",
        pool_toml("p", &[origin], "")
    ))
}

/// Seconds until the server closes `s`, reading and discarding (None if it
/// stays open past `limit`).
fn closed_after(s: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let t0 = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut buf = [0u8; 1024];
    while t0.elapsed() < limit {
        match s.read(&mut buf) {
            Ok(0) => return Some(t0.elapsed()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Some(t0.elapsed()),
            Err(_) => {}
        }
    }
    None
}

/// One header line every 200 ms on `s` (25 at most, until a write fails):
/// each read is quick, the whole head is not.
fn drip(s: &TcpStream) -> std::thread::JoinHandle<()> {
    let mut w = s.try_clone().unwrap();
    std::thread::spawn(move || {
        for i in 0..25 {
            std::thread::sleep(Duration::from_millis(200));
            if w.write_all(format!("X-Drip-{i}: 1\r\n").as_bytes())
                .is_err()
            {
                break;
            }
        }
    })
}

#[test]
fn a_dripping_head_is_closed_at_the_deadline() {
    let origin = Origin::start("o");
    let uf = start(&origin, "client_header_timeout_ms = 1000");
    let mut s = TcpStream::connect(uf.addr).unwrap();
    let t0 = Instant::now();
    s.write_all(b"GET / HTTP/1.1\r\nHost: a\r\n").unwrap();
    let writer = drip(&s);
    let closed = closed_after(&mut s, Duration::from_secs(6)).map(|_| t0.elapsed());
    writer.join().unwrap();
    let closed = closed.expect("still open after 6 s");
    assert!(closed >= Duration::from_millis(900), "{closed:?}");
    assert!(closed < Duration::from_millis(2500), "{closed:?}");
    assert_eq!(origin.requests(), 0, "nothing reached the origin");
    assert!(
        uf.metric(
            "ultrafast_downstream_connections_closed_total",
            &["header_timeout"]
        ) >= 1.0
    );
    // A connection that never sends a byte goes at the same deadline.
    let mut idle = TcpStream::connect(uf.addr).unwrap();
    let t = closed_after(&mut idle, Duration::from_secs(5)).expect("idle kept open");
    assert!(t < Duration::from_millis(2500), "{t:?}");
}

/// A later head on a kept-alive connection has the same deadline: timed
/// from when its reads first wait, so a head that drips is closed.
#[test]
fn a_later_head_that_drips_is_closed_at_the_deadline() {
    let origin = Origin::start("o");
    let uf = start(&origin, "client_header_timeout_ms = 1000");
    let mut s = TcpStream::connect(uf.addr).unwrap();
    s.write_all(b"GET /first HTTP/1.1\r\nHost: a\r\n\r\n")
        .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut head = [0u8; 12];
    s.read_exact(&mut head).unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    let t0 = Instant::now();
    s.write_all(b"GET /second HTTP/1.1\r\n").unwrap();
    let writer = drip(&s);
    // The rest of the first response, then the close.
    let closed = closed_after(&mut s, Duration::from_secs(6)).map(|_| t0.elapsed());
    writer.join().unwrap();
    let closed = closed.expect("still open after 6 s");
    assert!(closed >= Duration::from_millis(900), "{closed:?}");
    assert!(closed < Duration::from_millis(2500), "{closed:?}");
    assert_eq!(
        origin.requests(),
        1,
        "only the first request reached the origin"
    );
}

#[test]
fn the_deadline_never_cuts_a_slow_response_or_a_kept_alive_wait() {
    let origin = Origin::start("o");
    let uf = start(&origin, "client_header_timeout_ms = 800");
    origin.state.delay_ms.store(1500, Ordering::SeqCst);
    let mut c = Client::connect(uf.addr).unwrap();
    let r = c.request("GET", "/slow", &[], b"").unwrap();
    assert_eq!(r.status, 200, "a response slower than the head deadline");
    origin.state.delay_ms.store(0, Ordering::SeqCst);
    // Idle between requests for longer than the head deadline (the
    // keepalive timeout governs that wait), then a prompt request.
    std::thread::sleep(Duration::from_millis(1300));
    let r = c.request("GET", "/again", &[], b"").unwrap();
    assert_eq!(r.status, 200);
    // A body slower than the head deadline is the body timeout's business.
    let mut s = TcpStream::connect(uf.addr).unwrap();
    s.write_all(b"POST /b HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n\r\nab")
        .unwrap();
    std::thread::sleep(Duration::from_millis(1200));
    s.write_all(b"cd").unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut head = [0u8; 12];
    s.read_exact(&mut head).unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
}

#[test]
fn connections_past_the_cap_are_closed_at_once() {
    let origin = Origin::start("o");
    // The harness checks readiness with connections of its own: let them go.
    let uf = start(&origin, "max_connections = 3");
    assert!(eventually(Duration::from_secs(3), || {
        uf.metric("ultrafast_downstream_connections", &[]) == 0.0
    }));
    let held: Vec<TcpStream> = (0..3)
        .map(|_| TcpStream::connect(uf.addr).unwrap())
        .collect();
    assert!(eventually(Duration::from_secs(3), || {
        uf.metric("ultrafast_downstream_connections", &[]) == 3.0
    }));
    let mut extra = TcpStream::connect(uf.addr).unwrap();
    let t = closed_after(&mut extra, Duration::from_secs(3)).expect("the fourth stays open");
    assert!(t < Duration::from_millis(1000), "{t:?}");
    assert!(
        uf.metric(
            "ultrafast_downstream_connections_closed_total",
            &["max_connections"]
        ) >= 1.0
    );
    drop(held);
    assert!(eventually(Duration::from_secs(3), || {
        Client::connect(uf.addr)
            .and_then(|mut c| c.request("GET", "/", &[], b""))
            .is_ok_and(|r| r.status == 200)
    }));
}
