//! Response compression (`compress` on a route) against a real origin:
//! each coding alone and by q-value, `curl --compressed`, `Vary`, weak
//! `ETag`, HEAD, and what is left alone (small bodies, other types,
//! already-encoded bodies, ranges, event streams, routes without it).

#![allow(clippy::unwrap_used)]
mod common;
use common::*;
use std::io::Read;
use std::process::Command;

fn edge() -> (Origin, Ultrafast) {
    edge_with("")
}

fn edge_with(listeners: &str) -> (Origin, Ultrafast) {
    let a = Origin::start("a");
    let uf = Ultrafast::start(&format!(
        "{listeners}{}[[routes]]\npath = \"/plain\"\npool = \"a\"\n\n\
         [[routes]]\npath = \"/\"\npool = \"a\"\ncompress = {{ gzip = 6, br = 5, zstd = 3, min_bytes = 256 }}\n",
        pool_toml("a", &[&a], "")
    ));
    (a, uf)
}

fn get(uf: &Ultrafast, path: &str, ae: &str) -> Resp {
    let mut c = Client::connect(uf.addr).unwrap();
    let h: Vec<(&str, &str)> = if ae.is_empty() {
        vec![]
    } else {
        vec![("Accept-Encoding", ae)]
    };
    c.request("GET", path, &h, b"").unwrap()
}

fn decode(coding: &str, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    match coding {
        "gzip" => flate2::read::GzDecoder::new(body)
            .read_to_end(&mut out)
            .map(|_| ())
            .unwrap(),
        "br" => brotli::Decompressor::new(body, 4096)
            .read_to_end(&mut out)
            .map(|_| ())
            .unwrap_or_else(|e| panic!("br: {e} after {} bytes", out.len())),
        "zstd" => out = zstd::decode_all(body).unwrap(),
        other => panic!("coding {other}"),
    }
    out
}

#[test]
fn each_coding_alone_and_by_q_value_decodes_to_the_origins_bytes() {
    let (_a, uf) = edge();
    let want = text(200_000);
    for (ae, coding) in [
        ("gzip", "gzip"),
        ("br", "br"),
        ("zstd", "zstd"),
        ("gzip, deflate, br, zstd", "br"),
        ("br;q=0.2, zstd;q=0.9, gzip;q=0.5", "zstd"),
        ("*;q=0.1, gzip", "gzip"),
    ] {
        let r = get(&uf, "/text/200000", ae);
        assert_eq!(r.status, 200);
        assert_eq!(r.header("content-encoding"), Some(coding), "{ae}");
        assert_eq!(r.header("vary"), Some("Accept-Encoding"), "{ae}");
        assert_eq!(r.header("etag"), Some("W/\"v1\""), "{ae}");
        assert!(r.header("content-length").is_none(), "{ae}");
        assert!(r.header("accept-ranges").is_none(), "{ae}");
        assert!(
            r.body.len() < want.len() / 5,
            "{ae}: {} bytes",
            r.body.len()
        );
        let got = decode(coding, &r.body);
        assert!(
            got == want,
            "{ae}: {} bytes decoded, {} sent",
            got.len(),
            want.len()
        );
    }
    // No Accept-Encoding, identity, or every coding refused: as it is, with
    // Vary still set (a cache must not hand it to a gzip client as-is...
    // or the reverse).
    for ae in ["", "identity", "gzip;q=0, br;q=0, zstd;q=0"] {
        let r = get(&uf, "/text/5000", ae);
        assert!(r.header("content-encoding").is_none(), "{ae:?}");
        assert_eq!(r.header("vary"), Some("Accept-Encoding"), "{ae:?}");
        assert_eq!(r.header("etag"), Some("\"v1\""), "{ae:?}");
        assert!(r.body == text(5000), "{ae:?}: {} bytes", r.body.len());
    }
}

#[test]
fn curl_compressed_gets_the_same_bytes_and_head_gets_the_same_head() {
    let (_a, uf) = edge();
    let url = format!("http://{}/text/100000", uf.addr);
    let raw = curl(&["--compressed", &url]);
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    assert!(head.contains("content-encoding:"), "{head}");
    let body = &raw[split + 4..];
    assert!(
        body == &text(100_000)[..],
        "curl decoded {} bytes",
        body.len()
    );
    // HEAD: the head a GET gets, no body.
    let mut c = Client::connect(uf.addr).unwrap();
    c.send_raw(b"HEAD /text/100000 HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n")
        .unwrap();
    let r = c.read_response(true).unwrap();
    assert_eq!(r.header("content-encoding"), Some("gzip"));
    // And the connection is still good for a GET after it.
    let r = c
        .request("GET", "/text/3000", &[("Accept-Encoding", "gzip")], b"")
        .unwrap();
    assert_eq!(decode("gzip", &r.body), text(3000));
}

/// `curl -s -D - ARGS`: the head and the (decoded) body.
fn curl(args: &[&str]) -> Vec<u8> {
    Command::new("curl")
        .args(["-s", "-D", "-", "--max-time", "10"])
        .args(args)
        .output()
        .unwrap()
        .stdout
}

#[test]
fn over_http2_too() {
    let port = free_port();
    let (_a, _uf) = edge_with(&format!(
        "[[listeners]]\nname = \"h2c\"\naddress = \"127.0.0.1:{port}\"\nh2c = true\n\n"
    ));
    let url = format!("http://127.0.0.1:{port}/text/100000");
    let raw = curl(&["--http2-prior-knowledge", "--compressed", &url]);
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    assert!(head.starts_with("http/2 200"), "{head}");
    assert!(head.contains("content-encoding:"), "{head}");
    assert!(!head.contains("transfer-encoding"), "{head}");
    let body = &raw[split + 4..];
    assert!(
        body == &text(100_000)[..],
        "curl decoded {} bytes",
        body.len()
    );
}

#[test]
fn what_is_not_eligible_is_left_alone() {
    let (_a, uf) = edge();
    // Under min_bytes.
    let r = get(&uf, "/text/100", "gzip");
    assert!(r.header("content-encoding").is_none());
    assert!(r.header("vary").is_none());
    // A type not listed (the /big body has none).
    let r = get(&uf, "/big/100000", "gzip");
    assert!(r.header("content-encoding").is_none());
    assert_eq!(r.body.len(), 100_000);
    // An event stream passes as it comes.
    let r = get(&uf, "/stream", "gzip, br");
    assert!(r.header("content-encoding").is_none());
    assert!(r.text().contains("data: a-19"));
    // A route without `compress`.
    let r = get(&uf, "/plain/text/100000", "gzip");
    assert!(r.header("content-encoding").is_none());
    assert!(r.header("vary").is_none());
}
