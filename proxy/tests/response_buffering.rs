//! Response buffering (`response_buffering`, nginx's `proxy_buffering on`):
//! a client that reads slowly gets every byte from the edge's buffer while
//! the origin's connection is back in the pool within a second of the
//! origin finishing; temporary files are unlinked and gone with their
//! response; a bound streams the rest unbuffered and is counted; a route,
//! an origin's `X-Accel-Buffering: no` and event streams are not buffered.

#![allow(clippy::unwrap_used)]
mod common;
use common::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// Larger than what the kernel's socket buffers on both sides can hold
/// (loopback autotuning stops near 10 MB), so most of it waits in the
/// edge's buffer while the client does not read.
const BIG: usize = 48 << 20;

const ROUTES: &str =
    "[[routes]]\nhosts = [\"nobuf\"]\npath = \"/\"\npool = \"a\"\nresponse_buffering = false\n\n\
                      [[routes]]\npath = \"/\"\npool = \"a\"\n";

fn edge(limits: &str) -> (Origin, Ultrafast, std::path::PathBuf) {
    edge_with(limits, "")
}

/// [`edge`] with more settings of the origin's pool.
fn edge_with(limits: &str, pool: &str) -> (Origin, Ultrafast, std::path::PathBuf) {
    let a = Origin::start("a");
    let temp = scratch("spool");
    std::fs::create_dir_all(&temp).unwrap();
    let uf = Ultrafast::start(&format!(
        "[limits]\nproxy_temp_path = \"{}\"\n{limits}\n{}{ROUTES}",
        temp.display(),
        pool_toml("a", &[&a], pool)
    ));
    (a, uf, temp)
}

/// A client that sent its request and reads only what it is asked to.
struct Slow {
    conn: TcpStream,
    got: usize,
    bad: usize,
}

impl Slow {
    fn open(uf: &Ultrafast, host: &str, path: &str) -> Slow {
        let mut conn = TcpStream::connect(uf.addr).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        write!(conn, "GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n").unwrap();
        Slow {
            conn,
            got: 0,
            bad: 0,
        }
    }

    /// The head, and the first `n` body bytes after it (one read).
    fn head(&mut self) -> String {
        let mut buf = vec![0; 4096];
        let n = self.conn.read(&mut buf).unwrap();
        let text = String::from_utf8_lossy(&buf[..n]).to_string();
        let end = text
            .find("\r\n\r\n")
            .expect("a whole head in the first read")
            + 4;
        self.count(&buf[end..n]);
        text[..end].to_string()
    }

    fn count(&mut self, bytes: &[u8]) {
        self.got += bytes.len();
        self.bad += bytes.iter().filter(|&&b| b != b'x').count();
    }

    /// Read until `total` body bytes have come (or the connection ends).
    fn read_to(&mut self, total: usize) {
        let mut buf = vec![0; 256 * 1024];
        while self.got < total {
            let n = self.conn.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            self.count(&buf[..n]);
        }
    }

    /// Whether the edge closes the connection after the response.
    fn closed_after(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.conn.read(&mut b), Ok(0))
    }
}

/// Whether the origin wrote a `/big/` response whole within 10 s.
fn origin_finished(a: &Origin) -> bool {
    eventually(Duration::from_secs(10), || {
        !a.state.big_done.lock().unwrap().is_empty()
    })
}

/// Open descriptors of the edge pointing into `dir`.
fn files_in(uf: &Ultrafast, dir: &Path) -> usize {
    let fds = format!("/proc/{}/fd", uf.child.id());
    let dir = dir.to_string_lossy().to_string();
    std::fs::read_dir(fds)
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|t| t.to_string_lossy().starts_with(&dir))
        .count()
}

#[test]
fn a_slow_reader_gets_everything_from_the_buffer_while_the_origin_is_free() {
    let (a, uf, temp) = edge("response_buffer_kb = 16");
    let origin = a.addr.port();
    let mut slow = Slow::open(&uf, "x", &format!("/big/{BIG}"));
    assert!(slow.head().starts_with("HTTP/1.1 200"));
    // The origin sends everything although the client reads nothing.
    assert!(
        origin_finished(&a),
        "the origin could not finish: its connection is held by the slow reader"
    );
    let done = a.state.big_done.lock().unwrap()[0];
    // Its connection is back in the pool: the request ended, and the rest
    // is sent from the buffer by a task of its own.
    assert!(
        eventually(Duration::from_secs(2), || uf
            .metric("ultrafast_response_buffer_draining", &[])
            == 1.0),
        "the buffered response did not leave its request"
    );
    let freed = done.elapsed();
    assert!(
        freed < Duration::from_secs(1),
        "origin freed after {freed:?}"
    );
    // The next request takes the same origin connection.
    assert_eq!(uf.get("/again").status, 200);
    assert_eq!(
        a.state
            .connections
            .load(std::sync::atomic::Ordering::SeqCst),
        1
    );
    assert_eq!(held(origin), 1);
    // The spilled bytes are in an unlinked file of proxy_temp_path.
    assert!(uf.metric("ultrafast_response_buffer_bytes", &["disk"]) > 1e6);
    assert_eq!(files_in(&uf, &temp), 1, "one temporary file, open");
    assert_eq!(std::fs::read_dir(&temp).unwrap().count(), 0, "and unlinked");
    // Both responses were buffered (the second sent at once).
    assert_eq!(uf.metric("ultrafast_responses_buffered_total", &[]), 2.0);
    // Now the client reads, slowly at first.
    for _ in 0..5 {
        let mut b = [0u8; 1024];
        let n = slow.conn.read(&mut b).unwrap();
        slow.count(&b[..n]);
        std::thread::sleep(Duration::from_millis(50));
    }
    slow.read_to(BIG);
    assert_eq!((slow.got, slow.bad), (BIG, 0), "every byte, intact");
    assert!(
        slow.closed_after(),
        "the connection closes after a drained response"
    );
    assert!(eventually(Duration::from_secs(5), || uf
        .metric("ultrafast_response_buffer_draining", &[])
        == 0.0));
    assert_eq!(uf.metric("ultrafast_response_buffer_bytes", &[]), 0.0);
    assert_eq!(files_in(&uf, &temp), 0, "the temporary file is gone");
    assert_eq!(
        uf.metric("ultrafast_response_buffer_overflows_total", &[]),
        0.0
    );
}

#[test]
fn over_tls_the_rest_is_sent_and_flushed_after_the_request() {
    let dir = scratch("spool-tls");
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = dev_certs(&dir);
    let a = Origin::start("a");
    let port = free_port();
    let uf = Ultrafast::start(&format!(
        "[[listeners]]\naddress = \"127.0.0.1:{port}\"\n\
         tls = {{ certs = [{{ cert = \"{}\", key = \"{}\", default = true }}] }}\n\n{}{ROUTES}",
        cert.display(),
        key.display(),
        pool_toml("a", &[&a], "")
    ));
    // `openssl s_client` over HTTP/1.1 (no ALPN), its output read only
    // once the origin has finished: a slow reader.
    let mut child = std::process::Command::new("openssl")
        .args(["s_client", "-quiet", "-ign_eof", "-servername", "localhost"])
        .arg("-CAfile")
        .arg(dir.join("ca.pem"))
        .arg("-connect")
        .arg(format!("127.0.0.1:{port}"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    write!(stdin, "GET /big/{BIG} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    assert!(origin_finished(&a), "the origin finished");
    assert!(eventually(Duration::from_secs(2), || uf
        .metric("ultrafast_response_buffer_draining", &[])
        == 1.0));
    let mut out = Vec::new();
    child.stdout.take().unwrap().read_to_end(&mut out).unwrap();
    drop(stdin);
    let _ = child.kill();
    let _ = child.wait();
    let end = out.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    let body = &out[end..];
    assert_eq!(body.len(), BIG, "every byte, the last TLS record flushed");
    assert!(body.iter().all(|&b| b == b'x'));
    assert!(eventually(Duration::from_secs(5), || uf
        .metric("ultrafast_response_buffer_draining", &[])
        == 0.0));
}

#[test]
fn requests_pipelined_behind_a_buffered_response_are_answered_in_order() {
    let (a, uf, _temp) = edge("");
    let mut conn = TcpStream::connect(uf.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    write!(
        conn,
        "GET /big/{BIG} HTTP/1.1\r\nHost: x\r\n\r\nGET /after HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    .unwrap();
    assert!(origin_finished(&a));
    // Read both: the big body whole, then the second response after it.
    let mut c = Client::from_stream(conn);
    let first = c.read_response(false).unwrap();
    assert_eq!(first.status, 200);
    assert_eq!(first.body.len(), BIG);
    let second = c.read_response(false).unwrap();
    assert_eq!(second.status, 200);
    assert_eq!(second.json()["path"], "/after");
}

#[test]
fn a_fast_reader_keeps_its_connection_and_small_responses_stay_in_memory() {
    let (a, uf, temp) = edge("");
    let mut c = Client::connect(uf.addr).unwrap();
    for i in 0..5 {
        let r = c.request("GET", &format!("/small/{i}"), &[], b"").unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.json()["path"], format!("/small/{i}"));
        let r = c.request("GET", "/big/300000", &[], b"").unwrap();
        assert_eq!(r.body.len(), 300_000);
    }
    assert_eq!(
        a.state
            .connections
            .load(std::sync::atomic::Ordering::SeqCst),
        1
    );
    assert_eq!(uf.metric("ultrafast_responses_buffered_total", &[]), 10.0);
    assert_eq!(std::fs::read_dir(&temp).unwrap().count(), 0);
    assert_eq!(uf.metric("ultrafast_response_buffer_bytes", &[]), 0.0);
}

#[test]
fn what_must_stream_is_not_buffered() {
    let (a, uf, _temp) = edge("");
    // The route says no, and the origin says `X-Accel-Buffering: no`.
    for (host, path) in [
        ("nobuf", format!("/big/{BIG}")),
        ("x", format!("/big/{BIG}?accel=no")),
    ] {
        a.state.big_done.lock().unwrap().clear();
        let mut slow = Slow::open(&uf, host, &path);
        let head = slow.head();
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(
            !head.to_ascii_lowercase().contains("x-accel-buffering"),
            "the origin's instruction is not passed on: {head}"
        );
        std::thread::sleep(Duration::from_millis(1500));
        assert!(
            a.state.big_done.lock().unwrap().is_empty(),
            "{host} {path}: unbuffered, the origin waits for the client"
        );
        slow.read_to(BIG);
        assert_eq!((slow.got, slow.bad), (BIG, 0));
    }
    // An event stream reaches the client event by event.
    let mut c = Client::connect(uf.addr).unwrap();
    let r = c.request("GET", "/stream", &[], b"").unwrap();
    assert_eq!(r.status, 200);
    assert!(r.text().contains("data: a-19"));
    assert_eq!(uf.metric("ultrafast_responses_buffered_total", &[]), 0.0);
}

#[test]
fn past_the_temporary_file_bound_the_rest_streams_and_nothing_is_lost() {
    let (a, uf, temp) = edge("response_buffer_kb = 8\nmax_temp_file_bytes = 2000000");
    let mut slow = Slow::open(&uf, "x", &format!("/big/{BIG}"));
    assert!(slow.head().starts_with("HTTP/1.1 200"));
    assert!(
        eventually(Duration::from_secs(5), || uf.metric(
            "ultrafast_response_buffer_overflows_total",
            &["temp_file"]
        ) == 1.0),
        "the bound is counted"
    );
    // Past the bound the origin waits for the client again.
    std::thread::sleep(Duration::from_millis(500));
    assert!(a.state.big_done.lock().unwrap().is_empty());
    let t = Instant::now();
    slow.read_to(BIG);
    assert_eq!((slow.got, slow.bad), (BIG, 0), "every byte, in order");
    assert!(t.elapsed() < Duration::from_secs(30));
    assert!(eventually(Duration::from_secs(5), || files_in(&uf, &temp) == 0));
    assert_eq!(uf.metric("ultrafast_response_buffer_bytes", &[]), 0.0);
}

#[test]
fn a_burst_of_slow_readers_holds_no_more_origin_connections_than_the_pool_allows() {
    // nginx holds few origin connections under a slow-read burst only
    // because it accepts slowly; here the pool's `max_concurrency` queues
    // the rest at the edge, and buffering frees each slot as soon as its
    // origin has sent everything.
    const N: usize = 10;
    const SIZE: usize = 8 << 20;
    let (a, uf, temp) = edge_with("", "max_concurrency = 2");
    let origin = a.addr.port();
    let mut readers: Vec<Slow> = (0..N)
        .map(|i| Slow::open(&uf, "x", &format!("/big/{SIZE}?n={i}")))
        .collect();
    // Nobody reads, yet every response is fetched, two at a time.
    let mut most = 0;
    let all = eventually(Duration::from_secs(30), || {
        most = most.max(held(origin));
        a.state.big_done.lock().unwrap().len() == N
    });
    assert!(
        all,
        "the origin sent every response to readers that read nothing"
    );
    assert!(most <= 2, "{most} origin connections held at once");
    assert!(
        a.state
            .connections
            .load(std::sync::atomic::Ordering::SeqCst)
            <= 2,
        "the two connections were reused"
    );
    for r in &mut readers {
        assert!(r.head().starts_with("HTTP/1.1 200"));
        r.read_to(SIZE);
        assert_eq!((r.got, r.bad), (SIZE, 0), "every byte, intact");
    }
    assert!(eventually(Duration::from_secs(5), || files_in(&uf, &temp) == 0));
    assert_eq!(
        uf.metric("ultrafast_responses_buffered_total", &[]),
        N as f64
    );
}
