//! The PROXY protocol on listeners (issue #47 part 3), against the real
//! binary: v1 and v2 headers carry the client address into
//! `X-Forwarded-For`, the access log and per-client rate limits; `curl
//! --haproxy-protocol` over plain HTTP and over TLS; sources outside
//! `proxy_protocol_from`, malformed, missing and late headers are closed
//! and counted.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::Duration;

/// A v2 PROXY header for TCP over IPv4 or IPv6, with `tlvs` after the
/// addresses.
fn v2(src: SocketAddr, dst: SocketAddr, tlvs: &[u8]) -> Vec<u8> {
    let mut addrs = Vec::new();
    let fam = match (src, dst) {
        (SocketAddr::V4(s), SocketAddr::V4(d)) => {
            addrs.extend_from_slice(&s.ip().octets());
            addrs.extend_from_slice(&d.ip().octets());
            0x11
        }
        (SocketAddr::V6(s), SocketAddr::V6(d)) => {
            addrs.extend_from_slice(&s.ip().octets());
            addrs.extend_from_slice(&d.ip().octets());
            0x21
        }
        _ => panic!("one family"),
    };
    addrs.extend_from_slice(&src.port().to_be_bytes());
    addrs.extend_from_slice(&dst.port().to_be_bytes());
    let mut h = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
    h.extend_from_slice(&[0x21, fam]);
    h.extend_from_slice(&((addrs.len() + tlvs.len()) as u16).to_be_bytes());
    h.extend_from_slice(&addrs);
    h.extend_from_slice(tlvs);
    h
}

/// The v2 header of a balancer's own connection.
fn v2_local() -> Vec<u8> {
    let mut h = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
    h.extend_from_slice(&[0x20, 0x00, 0x00, 0x00]);
    h
}

/// A server whose first listener expects the header from `from`.
fn start(origin: &Origin, from: &str, extra_listener: &str) -> Ultrafast {
    let dir = scratch("pp");
    let (port, admin_port) = (free_port(), free_port());
    let cfg = format!(
        "[server]\nthreads = 1\npid_file = \"{d}/uf.pid\"\nupgrade_sock = \"{d}/uf.sock\"\n\n\
         [admin]\nlisten = \"127.0.0.1:{admin_port}\"\n\n[log]\naccess_log = \"{d}/access.log\"\n\n\
         [[listeners]]\nname = \"lb\"\naddress = \"127.0.0.1:{port}\"\nproxy_protocol = true\n\
         proxy_protocol_from = [{from}]\nproxy_protocol_timeout_ms = 400\n{extra_listener}\n\
         [rate_limits.per_client]\nkey = \"client_ip\"\nrate_per_s = 0.01\nburst = 1\n\n\
         [[routes]]\npath = \"/limited\"\npool = \"o\"\nrate_limits = [\"per_client\"]\n\n\
         [[routes]]\npath = \"/\"\npool = \"o\"\n\n{}",
        pool_toml("o", &[origin], ""),
        d = dir.display()
    );
    let config = dir.join("ultrafast.toml");
    std::fs::write(&config, cfg).unwrap();
    Ultrafast::spawn(dir, config, port, admin_port, false)
}

/// Send `header` then a GET on a fresh connection; the response, or None
/// when the server closed the connection without one.
fn get_behind(uf: &Ultrafast, header: &[u8], path: &str) -> Option<Resp> {
    let mut c = Client::connect(uf.addr).unwrap();
    c.send_raw(header).unwrap();
    c.request("GET", path, &[("host", "example.test")], b"")
        .ok()
}

fn forwarded_for(origin: &Origin) -> String {
    origin
        .state
        .last_headers
        .lock()
        .unwrap()
        .get("x-forwarded-for")
        .cloned()
        .unwrap_or_default()
}

#[test]
fn v1_and_v2_headers_carry_the_client_address_everywhere() {
    let origin = Origin::start("o");
    let uf = start(&origin, "\"127.0.0.0/8\"", "");
    let dst: SocketAddr = "10.0.0.1:443".parse().unwrap();

    // v1, the request in the same write as the header.
    let r = get_behind(&uf, b"PROXY TCP4 192.0.2.7 10.0.0.1 56324 443\r\n", "/a").unwrap();
    assert_eq!(r.status, 200, "{}", uf.stderr());
    assert_eq!(forwarded_for(&origin), "192.0.2.7");

    // v2 over IPv4 with TLVs (ALPN, authority), skipped.
    let tlvs = [
        &[0x01, 0x00, 0x02][..],
        b"h2",
        &[0x02, 0x00, 0x0c],
        b"example.test",
    ]
    .concat();
    let r = get_behind(
        &uf,
        &v2("198.51.100.9:4000".parse().unwrap(), dst, &tlvs),
        "/b",
    )
    .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(forwarded_for(&origin), "198.51.100.9");

    // v2 over IPv6.
    let r = get_behind(
        &uf,
        &v2(
            "[2001:db8::42]:5000".parse().unwrap(),
            "[2001:db8::1]:443".parse().unwrap(),
            &[],
        ),
        "/c",
    )
    .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(forwarded_for(&origin), "2001:db8::42");

    // The balancer's own health check (LOCAL) keeps the balancer's address.
    let r = get_behind(&uf, &v2_local(), "/d").unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(forwarded_for(&origin), "127.0.0.1");

    // Keepalive: the second request of a connection keeps the address.
    let mut c = Client::connect(uf.addr).unwrap();
    c.send_raw(b"PROXY TCP4 203.0.113.5 10.0.0.1 1000 443\r\n")
        .unwrap();
    for path in ["/e1", "/e2"] {
        let r = c
            .request("GET", path, &[("host", "example.test")], b"")
            .unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(forwarded_for(&origin), "203.0.113.5");
    }

    // Rate limits key on the carried address: one client is limited, the
    // next is not.
    let hdr = |ip: &str| format!("PROXY TCP4 {ip} 10.0.0.1 1000 443\r\n").into_bytes();
    assert_eq!(
        get_behind(&uf, &hdr("192.0.2.50"), "/limited")
            .unwrap()
            .status,
        200
    );
    assert_eq!(
        get_behind(&uf, &hdr("192.0.2.50"), "/limited")
            .unwrap()
            .status,
        429
    );
    assert_eq!(
        get_behind(&uf, &hdr("192.0.2.51"), "/limited")
            .unwrap()
            .status,
        200
    );

    // And the access log shows the client, not the balancer.
    assert!(
        eventually(Duration::from_secs(5), || uf
            .access_log()
            .contains("198.51.100.9")),
        "{}",
        uf.access_log()
    );
    assert!(uf.metric("ultrafast_proxy_protocol_total", &["result=\"proxied\""]) >= 7.0);
    assert!(uf.metric("ultrafast_proxy_protocol_total", &["result=\"local\""]) >= 1.0);
}

#[test]
fn curl_haproxy_protocol_over_http_and_tls() {
    let origin = Origin::start("o");
    let dir = scratch("pp-certs");
    let (cert, key) = dev_certs(&dir);
    let tls_port = free_port();
    let tls = format!(
        "\n[[listeners]]\nname = \"lb-tls\"\naddress = \"127.0.0.1:{tls_port}\"\nproxy_protocol = true\n\
         proxy_protocol_from = [\"127.0.0.1\"]\ntls = {{ certs = [{{ cert = \"{}\", key = \"{}\", default = true }}] }}\n",
        cert.display(),
        key.display()
    );
    let uf = start(&origin, "\"127.0.0.1/32\"", &tls);
    let curl = |args: &[&str]| {
        let out = Command::new("timeout")
            .arg("20")
            .arg("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}"])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let plain = format!("http://127.0.0.1:{}/plain", uf.addr.port());
    assert_eq!(curl(&["--haproxy-protocol", &plain]), "200");
    let secure = format!("https://127.0.0.1:{tls_port}/tls");
    // The header is read before the TLS handshake.
    assert_eq!(
        curl(&["-k", "--haproxy-protocol", &secure]),
        "200",
        "{}",
        uf.stderr()
    );
    assert_eq!(forwarded_for(&origin), "127.0.0.1");
    // Without the header neither listener serves.
    assert_eq!(curl(&[&plain]), "000");
    assert_eq!(curl(&["-k", &secure]), "000");
    assert_eq!(origin.requests(), 2);
}

#[test]
fn refused_sources_and_bad_headers_are_closed_and_counted() {
    let origin = Origin::start("o");
    // Only a block the test's loopback address is not in may send headers.
    let uf = start(&origin, "\"10.9.0.0/16\", \"2001:db8::/32\"", "");
    assert!(get_behind(&uf, b"PROXY TCP4 192.0.2.7 10.0.0.1 1 2\r\n", "/").is_none());
    assert!(
        uf.metric(
            "ultrafast_proxy_protocol_total",
            &["result=\"refused_source\""]
        ) >= 1.0
    );
    drop(uf);

    let uf = start(&origin, "\"127.0.0.1\"", "");
    let refused = [
        // No header: a plain request.
        &b""[..],
        // Malformed v1 lines.
        b"PROXY TCP4 192.0.2.7 10.0.0.1 56324\r\n",
        b"PROXY TCP9 192.0.2.7 10.0.0.1 1 2\r\n",
        b"PROXY TCP4 999.0.2.7 10.0.0.1 1 2\r\n",
        // A v1 line longer than the spec allows.
        &[b"PROXY TCP4 ".as_slice(), &[b'9'; 200], b"\r\n"].concat(),
    ];
    for h in refused {
        assert!(
            get_behind(&uf, h, "/").is_none(),
            "{}",
            String::from_utf8_lossy(h)
        );
    }
    // A v2 header of an unknown version, and one claiming more than the
    // accepted length.
    let mut bad = v2(
        "192.0.2.7:1".parse().unwrap(),
        "10.0.0.1:2".parse().unwrap(),
        &[],
    );
    bad[12] = 0x31;
    assert!(get_behind(&uf, &bad, "/").is_none());
    let mut long = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
    long.extend_from_slice(&[0x21, 0x11, 0xff, 0xff]);
    assert!(get_behind(&uf, &long, "/").is_none());
    // A header that never comes: closed at proxy_protocol_timeout_ms.
    let mut silent = TcpStream::connect(uf.addr).unwrap();
    silent.write_all(b"PROXY TCP4 192.0.2.7").unwrap();
    let mut c = Client::from_stream(silent);
    assert!(c.closed_within(Duration::from_secs(3)));
    assert_eq!(origin.requests(), 0);
    assert!(uf.metric("ultrafast_proxy_protocol_total", &["result=\"malformed\""]) >= 6.0);
    assert!(uf.metric("ultrafast_proxy_protocol_total", &["result=\"timeout\""]) >= 1.0);
    // Still serving good ones.
    let ok = get_behind(&uf, b"PROXY TCP4 192.0.2.8 10.0.0.1 1 2\r\n", "/ok").unwrap();
    assert_eq!(ok.status, 200);
    assert!(eventually(Duration::from_secs(3), || uf
        .stderr()
        .contains("PROXY protocol: closed")));
}

#[test]
fn the_settings_are_checked_with_their_location() {
    let dir = scratch("pp-check");
    let cases = [
        ("proxy_protocol = true\n", "listeners[0].proxy_protocol_from"),
        (
            "proxy_protocol = true\nproxy_protocol_from = [\"10.0.0.1/8\"]\n",
            "listeners[0].proxy_protocol_from[0]",
        ),
        (
            "proxy_protocol = true\nproxy_protocol_from = [\"10.0.0.0/33\"]\n",
            "listeners[0].proxy_protocol_from[0]",
        ),
        ("proxy_protocol_from = [\"10.0.0.0/8\"]\n", "listeners[0].proxy_protocol_from"),
        (
            "proxy_protocol = true\nproxy_protocol_from = [\"10.0.0.0/8\"]\nproxy_protocol_timeout_ms = 0\n",
            "listeners[0].proxy_protocol_timeout_ms",
        ),
    ];
    for (listener, field) in cases {
        let path = dir.join("c.toml");
        std::fs::write(
            &path,
            format!(
                "[[listeners]]\naddress = \"127.0.0.1:{}\"\n{listener}\n[[routes]]\npath = \"/\"\nreturn = {{ status = 200 }}\n",
                free_port()
            ),
        )
        .unwrap();
        let out = Command::new(bin())
            .arg("check")
            .arg("-c")
            .arg(&path)
            .output()
            .unwrap();
        let err = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!out.status.success(), "{listener}");
        assert!(
            err.contains("c.toml:") && err.contains(field),
            "{listener}: {err}"
        );
    }
}

#[test]
fn a_header_split_across_reads_is_read_whole() {
    // A load balancer's header may arrive in pieces (a v2 header's 16-byte
    // preamble, its addresses, then the request): each split is waited for
    // within proxy_protocol_timeout_ms, never read as a request.
    let origin = Origin::start("o");
    let uf = start(&origin, "\"127.0.0.1\"", "");
    let header = v2(
        "192.0.2.41:5000".parse().unwrap(),
        "10.0.0.1:80".parse().unwrap(),
        &[],
    );
    for cuts in [vec![1usize, 12], vec![13, 16, 20], vec![5]] {
        let mut c = Client::connect(uf.addr).unwrap();
        let mut at = 0;
        for cut in cuts.iter().copied().chain(std::iter::once(header.len())) {
            c.send_raw(&header[at..cut]).unwrap();
            at = cut;
            std::thread::sleep(Duration::from_millis(60));
        }
        let r = c
            .request("GET", "/split", &[("host", "example.test")], b"")
            .unwrap();
        assert_eq!(r.status, 200, "{cuts:?}");
        assert_eq!(forwarded_for(&origin), "192.0.2.41", "{cuts:?}");
    }
    // v1, one byte at a time.
    let line = b"PROXY TCP4 192.0.2.42 10.0.0.1 1 2\r\n";
    let mut c = Client::connect(uf.addr).unwrap();
    for b in line {
        c.send_raw(&[*b]).unwrap();
        std::thread::sleep(Duration::from_millis(5));
    }
    let r = c
        .request("GET", "/split", &[("host", "example.test")], b"")
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(forwarded_for(&origin), "192.0.2.42");
}
