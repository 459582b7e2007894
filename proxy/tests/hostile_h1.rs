//! HTTP/1.1 and the tunnels it opens, attacked the way their advisories
//! describe (the framing probes are `smuggling.rs`): chunk-extension and
//! chunk-size bombs, smuggling through a kept-alive connection to the
//! origin (judged by what the origin received), and a WebSocket frame that
//! announces more than any message should be. Each asserts that a normal
//! client keeps being served, the server's memory stays under the bound
//! the README's Security section states, and nothing panics.

#![allow(clippy::unwrap_used)]
mod common;
use common::*;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// The bound on what one attacking connection may add to the server.
const RSS_BOUND_KIB: u64 = 32 * 1024;

fn edge(origin: &Origin) -> Ultrafast {
    Ultrafast::start(&format!(
        "[limits]\nclient_max_body_bytes = 8388608\n\n[[routes]]\npath = \"/\"\npool = \"o\"\n\n{}",
        pool_toml("o", &[origin], "")
    ))
}

fn normal(uf: &Ultrafast) {
    let r = get(uf.addr, "/ok", &[]);
    assert_eq!(r.status, 200, "a normal client: {}", r.text());
}

/// Send `head` then `body` in 64 KiB writes for at most `limit`; what the
/// server answered (status, or 0 when it closed without one).
fn send(uf: &Ultrafast, head: &[u8], body: impl Iterator<Item = Vec<u8>>, limit: Duration) -> u16 {
    let mut s = TcpStream::connect(uf.addr).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let end = Instant::now() + limit;
    let _ = s.write_all(head);
    for piece in body {
        if Instant::now() > end || s.write_all(&piece).is_err() {
            break;
        }
    }
    let mut c = Client::from_stream(s);
    c.read_response(false).map(|r| r.status).unwrap_or(0)
}

#[test]
fn chunk_extension_and_chunk_size_bombs_are_bounded() {
    let origin = Origin::start("o");
    let uf = edge(&origin);
    normal(&uf);
    let idle = uf.rss_kib();
    let head = b"POST /up HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
    // One chunk whose extension never ends: 16 MiB of `;a=aaaa...`.
    let ext = std::iter::once(b"5;a=".to_vec()).chain((0..256).map(|_| vec![b'a'; 64 * 1024]));
    let (status, after_ext) = peak_rss(uf.child.id(), || {
        send(&uf, head, ext, Duration::from_secs(5))
    });
    assert!(
        status == 0 || status >= 400,
        "an endless chunk extension got {status}"
    );
    normal(&uf);
    // 500,000 one-byte chunks (2.5 MB of framing for 500 kB of body): served
    // or refused, within the body limit, at a bounded cost.
    let tiny = (0..500).map(|_| b"1\r\nx\r\n".repeat(1000));
    let (status, after) = peak_rss(uf.child.id(), || {
        send(
            &uf,
            head,
            tiny.chain(std::iter::once(b"0\r\n\r\n".to_vec())),
            Duration::from_secs(20),
        )
    });
    assert!(status == 200 || status >= 400, "{status}");
    normal(&uf);
    assert!(
        after_ext < idle + RSS_BOUND_KIB && after < idle + RSS_BOUND_KIB,
        "RSS {idle} KiB idle, {after_ext} at the extension bomb's peak, {after} at the chunks'"
    );
    assert!(!uf.stderr().contains("panicked"), "{}", uf.stderr());
}

#[test]
fn nothing_is_smuggled_through_a_kept_alive_connection_to_the_origin() {
    // The edge keeps its origin connections alive: a request whose body
    // holds a second request, in every framing the probes of smuggling.rs
    // use, must reach the origin as one request with its body, and the
    // next client's request on the same origin connection must be its own.
    let origin = Origin::start("o");
    let uf = edge(&origin);
    let inner = "GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n";
    let attacks = [
        format!(
            "POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{inner}",
            inner.len()
        ),
        format!(
            "POST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{inner}\r\n0\r\n\r\n",
            inner.len()
        ),
        format!(
            "POST /c HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n{inner}"
        ),
        format!("GET /d HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{inner}", inner.len()),
    ];
    for a in &attacks {
        let mut s = TcpStream::connect(uf.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(a.as_bytes()).unwrap();
        let mut buf = [0u8; 4096];
        let _ = s.read(&mut buf);
        // The next client, on the origin connection the edge kept.
        normal(&uf);
    }
    let seen = origin.order();
    assert!(
        !seen.iter().any(|p| p.contains("smuggled")),
        "the origin read a request from a body: {seen:?}"
    );
    assert!(
        origin.connections() <= 3,
        "{} origin connections",
        origin.connections()
    );
}

#[test]
fn a_websocket_frame_announcing_exabytes_streams_through_a_bounded_tunnel() {
    // The edge relays a tunnel's bytes as they come: a client frame that
    // announces 2^62 bytes (and then sends zeros) costs the edge what its
    // buffers hold, not what the frame announces; other clients are served.
    let origin = Origin::start("o");
    let ws = TcpListener::bind("127.0.0.1:0").unwrap();
    let ws_port = ws.local_addr().unwrap().port();
    // A WebSocket-speaking origin that accepts the upgrade and then reads
    // (and drops) whatever comes, as a server with no message limit would.
    std::thread::spawn(move || {
        if let Ok((mut c, _)) = ws.accept() {
            let mut buf = vec![0u8; 64 * 1024];
            let _ = c.read(&mut buf);
            let _ = c.write_all(
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
                  Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n",
            );
            while matches!(c.read(&mut buf), Ok(n) if n > 0) {}
        }
    });
    let uf = Ultrafast::start(&format!(
        "[pools.ws]\nmembers = [{{ addr = \"127.0.0.1:{ws_port}\" }}]\n\n\
         [[routes]]\npath = \"/ws\"\npool = \"ws\"\n\n[[routes]]\npath = \"/\"\npool = \"o\"\n\n{}",
        pool_toml("o", &[&origin], "")
    ));
    let idle = uf.rss_kib();
    let mut c = Client::connect(uf.addr).unwrap();
    c.send_raw(
        b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
          Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
    )
    .unwrap();
    let r = c.read_response(true).unwrap();
    assert_eq!(r.status, 101);
    // A masked binary frame with a 64-bit length of 2^62, unmasked bytes
    // after it (a client must mask: the origin's to refuse, the edge's to
    // relay without holding).
    let mut frame = vec![0x82, 0xff];
    frame.extend_from_slice(&(1u64 << 62).to_be_bytes());
    frame.extend_from_slice(&[1, 2, 3, 4]);
    c.send_raw(&frame).unwrap();
    let zeros = vec![0u8; 64 * 1024];
    let ((), peak) = peak_rss(uf.child.id(), || {
        for _ in 0..256 {
            if c.send_raw(&zeros).is_err() {
                break;
            }
        }
        normal(&uf);
    });
    assert!(
        peak < idle + RSS_BOUND_KIB,
        "RSS {idle} KiB idle, {peak} KiB with 16 MiB relayed"
    );
    assert!(!uf.stderr().contains("panicked"));
}
