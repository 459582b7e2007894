//! Request-smuggling probes over raw sockets: each probe is a request whose
//! body, read one way, holds a second request (`/smuggled-N`). Whatever the
//! edge makes of it, the answer is a refusal or one well-defined response,
//! the connection closes, and the inner request never reaches the origin
//! (which records every request it parses, as a lax backend would).

#![allow(clippy::unwrap_used)]
mod common;
use common::*;
use std::time::{Duration, Instant};

/// What a probe may get back.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Want {
    /// A 4xx/5xx from the edge, or a close without a reply.
    Refused,
    /// Either a refusal or one response (the framing has a single
    /// RFC 9112 reading, e.g. chunked wins over Content-Length).
    OneResponse,
}

fn inner(n: usize) -> String {
    format!("GET /smuggled-{n} HTTP/1.1\r\nHost: x\r\n\r\n")
}

/// A request with `headers` whose body is `body`; `{CL}` in the headers is
/// replaced by the body's length (so Content-Length covers the inner request
/// while another reading of the framing ends the body before it).
fn probe(headers: &str, body: &str) -> String {
    let headers = headers.replace("{CL}", &body.len().to_string());
    format!("POST /outer HTTP/1.1\r\nHost: x\r\n{headers}\r\n{body}")
}

fn probes() -> Vec<(String, String, Want)> {
    let mut out = Vec::new();
    let mut add = |name: &str, raw: String, want| out.push((name.to_string(), raw, want));
    let n = std::cell::Cell::new(0);
    let next = || {
        n.set(n.get() + 1);
        inner(n.get())
    };
    // Content-Length and Transfer-Encoding together (CL.TE and TE.CL).
    add(
        "CL.TE",
        probe(
            "Content-Length: {CL}\r\nTransfer-Encoding: chunked\r\n",
            &format!("0\r\n\r\n{}", next()),
        ),
        Want::OneResponse,
    );
    let i = next();
    add(
        "TE.CL",
        probe(
            "Content-Length: 4\r\nTransfer-Encoding: chunked\r\n",
            &format!("{:x}\r\n{i}\r\n0\r\n\r\n", i.len()),
        ),
        Want::OneResponse,
    );
    // Duplicate Content-Length.
    add(
        "CL 0 then CL n",
        probe("Content-Length: 0\r\nContent-Length: {CL}\r\n", &next()),
        Want::Refused,
    );
    add(
        "CL n then CL 0",
        probe("Content-Length: {CL}\r\nContent-Length: 0\r\n", &next()),
        Want::Refused,
    );
    // Obfuscated Transfer-Encoding, alone (the body would be empty if the
    // coding is ignored, making the inner request the next one) and with a
    // Content-Length that covers the inner request.
    for te in [
        "Transfer-Encoding: xchunked\r\n",
        "Transfer-Encoding: chunked, identity\r\n",
        "Transfer-Encoding: identity\r\n",
        "Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n",
        "Transfer-Encoding: identity\r\nTransfer-Encoding: chunked\r\n",
        "Transfer-Encoding: xchunked\r\nTransfer-Encoding: chunked\r\n",
        "Transfer-Encoding: gzip, chunked\r\n",
        "Transfer-Encoding: \"chunked\"\r\n",
        "Transfer-Encoding: chunked;q=1\r\n",
        "Transfer-Encoding : chunked\r\n",
        "Transfer-Encoding: \x0bchunked\r\n",
        " Transfer-Encoding: chunked\r\n",
        "Transfer-Encoding\r\n : chunked\r\n",
    ] {
        let body = format!("0\r\n\r\n{}", next());
        add(&format!("TE {te:?}"), probe(te, &body), Want::Refused);
        let body = format!("0\r\n\r\n{}", next());
        add(
            &format!("TE {te:?} + CL"),
            probe(&format!("Content-Length: {{CL}}\r\n{te}"), &body),
            Want::Refused,
        );
    }
    // Whitespace the grammar allows around a plain `chunked`: one reading
    // only, but with a Content-Length as well the connection must close.
    for te in [
        "Transfer-Encoding:  chunked\r\n",
        "Transfer-Encoding:\tchunked\r\n",
        "Transfer-Encoding: chunked \r\n",
        "Transfer-Encoding: CHUNKED\r\n",
    ] {
        let body = format!("0\r\n\r\n{}", next());
        add(
            &format!("TE {te:?} + CL"),
            probe(&format!("Content-Length: {{CL}}\r\n{te}"), &body),
            Want::OneResponse,
        );
    }
    // Obsolete line folding hides or continues a framing header.
    add(
        "obs-fold continues Content-Length",
        probe("X-A: 1\r\n Content-Length: {CL}\r\n", &next()),
        Want::Refused,
    );
    add(
        "obs-fold continues Transfer-Encoding",
        probe(
            "Transfer-Encoding: identity\r\n chunked\r\n",
            &format!("0\r\n\r\n{}", next()),
        ),
        Want::Refused,
    );
    add(
        "obs-fold with tab",
        probe(
            "Content-Length: {CL}\r\n\tTransfer-Encoding: chunked\r\n",
            &format!("0\r\n\r\n{}", next()),
        ),
        Want::Refused,
    );
    // Bad chunk sizes, each followed by a request a lax parser would see.
    for (name, chunks) in [
        ("negative", "-1\r\nx\r\n0\r\n\r\n"),
        ("hex overflow", "10000000000000005\r\nhello\r\n0\r\n\r\n"),
        ("0x prefix", "0x5\r\nhello\r\n0\r\n\r\n"),
        ("trailing junk", "5 junk\r\nhello\r\n0\r\n\r\n"),
        ("junk after size", "5x\r\nhello\r\n0\r\n\r\n"),
        ("missing CRLF after data", "5\r\nhelloXX0\r\n\r\n"),
        ("short data", "5\r\nhel\r\n0\r\n\r\n"),
        ("bare LF", "5\nhello\n0\n\n"),
        ("size with plus", "+5\r\nhello\r\n0\r\n\r\n"),
    ] {
        add(
            &format!("chunk size {name}"),
            probe(
                "Transfer-Encoding: chunked\r\n",
                &format!("{chunks}{}", next()),
            ),
            Want::Refused,
        );
    }
    // An empty chunk size: Pingora 0.9 (httparse) reads it as the last
    // chunk and what follows as trailers, so the body is empty; one
    // response, then the rest is dropped with the connection.
    add(
        "chunk size empty",
        probe(
            "Transfer-Encoding: chunked\r\n",
            &format!("\r\nhello\r\n0\r\n\r\n{}", next()),
        ),
        Want::OneResponse,
    );
    out
}

/// One response at most, then the connection closes: returns the status
/// (0 when closed without a reply).
fn send_probe(uf: &Ultrafast, name: &str, raw: &str) -> u16 {
    let mut c = Client::connect(uf.addr).unwrap();
    c.send_raw(raw.as_bytes()).unwrap();
    let status = match c.read_response(false) {
        Ok(r) => r.status,
        Err(_) => 0,
    };
    let (rest, closed) = c.read_rest(Duration::from_secs(3));
    assert!(
        rest.is_empty(),
        "{name}: a second response: {:?}",
        String::from_utf8_lossy(&rest)
    );
    assert!(closed, "{name}: connection left open after status {status}");
    status
}

#[test]
fn smuggled_requests_never_reach_the_origin() {
    let start = Instant::now();
    let a = Origin::start("a");
    let uf = Ultrafast::start(&format!(
        "{}[[routes]]\npath = \"/\"\npool = \"a\"\n",
        pool_toml("a", &[&a], "retry = { attempts = 1 }")
    ));
    let mut failures = Vec::new();
    for (name, raw, want) in probes() {
        let status = send_probe(&uf, &name, &raw);
        let ok = match want {
            Want::Refused => status == 0 || (400..=501).contains(&status),
            Want::OneResponse => status == 0 || status == 200 || (400..=501).contains(&status),
        };
        if !ok {
            failures.push(format!("{name}: status {status}"));
        }
    }
    let order = a.order();
    let smuggled: Vec<_> = order.iter().filter(|p| p.contains("smuggled")).collect();
    assert!(smuggled.is_empty(), "reached the origin: {smuggled:?}");
    assert!(failures.is_empty(), "{failures:#?}");
    // Still serving, on a fresh connection.
    assert_eq!(uf.get("/").status, 200);
    assert!(start.elapsed() < Duration::from_secs(60));
}

/// A refused framing never reaches the origin at all, even as the outer
/// request: the edge answers before choosing a member.
#[test]
fn an_unsupported_transfer_coding_is_refused_before_the_origin() {
    let a = Origin::start("a");
    let uf = Ultrafast::start(&format!(
        "{}[[routes]]\npath = \"/\"\npool = \"a\"\n",
        pool_toml("a", &[&a], "")
    ));
    for te in [
        "Transfer-Encoding: identity\r\nTransfer-Encoding: chunked\r\n",
        "Transfer-Encoding: xchunked\r\nTransfer-Encoding: chunked\r\n",
        "Transfer-Encoding: gzip, chunked\r\n",
    ] {
        let raw = probe(te, "5\r\nhello\r\n0\r\n\r\n");
        let status = send_probe(&uf, te, &raw);
        assert!(matches!(status, 400 | 501), "{te:?}: {status}");
    }
    assert_eq!(a.requests(), 0, "forwarded: {:?}", a.order());
    // A plain chunked body still goes through.
    let mut c = Client::connect(uf.addr).unwrap();
    c.send_raw(probe("Transfer-Encoding: chunked\r\n", "5\r\nhello\r\n0\r\n\r\n").as_bytes())
        .unwrap();
    let r = c.read_response(false).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["body_len"], 5);
}

#[test]
fn pipelined_requests_are_answered_in_order() {
    let origin = Origin::start("o");
    let uf = Ultrafast::start(&format!(
        "{}[[routes]]\npath = \"/\"\npool = \"p\"\n",
        pool_toml("p", &[&origin], "")
    ));
    let mut c = Client::connect(uf.addr).unwrap();
    // Three GETs, then a POST with its body and a GET, in one write each.
    let mut raw = String::new();
    for i in 1..=3 {
        raw.push_str(&format!(
            "GET /p{i} HTTP/1.1\r\nHost: x\r\nX-Request-Id: rid-{i}\r\n\r\n"
        ));
    }
    raw.push_str(
        "POST /p4 HTTP/1.1\r\nHost: x\r\nX-Request-Id: rid-4\r\nContent-Length: 5\r\n\r\nhello",
    );
    raw.push_str("GET /p5 HTTP/1.1\r\nHost: x\r\nX-Request-Id: rid-5\r\n\r\n");
    c.send_raw(raw.as_bytes()).unwrap();
    for i in 1..=5 {
        let r = c.read_response(false).unwrap();
        assert_eq!(r.status, 200, "response {i}: {r:?}");
        assert_eq!(
            r.header("x-request-id"),
            Some(format!("rid-{i}").as_str()),
            "out of order"
        );
    }
    assert_eq!(origin.requests(), 5);
    let paths = origin.order();
    assert_eq!(paths.len(), 5, "{paths:?}");
}
