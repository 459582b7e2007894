//! One name for one resource: what the origin is asked for, the cache key
//! and the access log agree. A differential test against real nginx with
//! `proxy_cache` on both, in front of the same origin: the same raw
//! targets (dot segments, runs of slashes, encodings, queries), each sent
//! twice in one order to both, so that every cache fills. For every target
//! ultrafast either refuses it (400) or serves what nginx serves: the
//! answer the origin gave for the same resource (the path it was asked,
//! compared decoded). Two modes, each against the nginx form it mirrors:
//! - `upstream_path = "normalized"` (the default) against `proxy_pass`
//!   with a URI (nginx sends the normalized path);
//! - `upstream_path = "original"` against `proxy_pass` without one (nginx
//!   sends the client's target and keys on `$request_uri`).
//!
//! Before the change, the cache keyed on the normalized path while the
//! origin was sent the raw target: `GET //x/../index.html` stored the
//! origin's answer to `//x/../index.html` under `/index.html`.

#![allow(clippy::unwrap_used)]
mod common;
use common::*;
use std::net::SocketAddr;

/// Segments joined into targets: names, dot segments plain and encoded,
/// empty segments, encoded letters and a query.
const SEGMENTS: [&str; 12] = [
    "",
    ".",
    "..",
    "%2e",
    "x",
    "index.html",
    "%69ndex.html",
    "a",
    "%61",
    "caf%C3%A9",
    "b;c",
    "~u",
];

/// Targets the test sends, in order: the poisoning pairs first, then the
/// generated ones.
fn targets() -> Vec<String> {
    let mut t: Vec<String> = [
        "//x/../index.html",
        "/index.html",
        "/a/./b",
        "/a/b",
        "/%69ndex.html",
        "/a//b?q=1",
        "/a/b?q=1",
        "/x/%2e%2e/a/b",
        "/caf%C3%A9/x",
        "/caf%c3%a9/x",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..120 {
        let mut p = String::new();
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let n = 1 + (seed % 4) as usize;
        for k in 0..n {
            p.push('/');
            p.push_str(SEGMENTS[((seed >> (8 * k + 4)) % SEGMENTS.len() as u64) as usize]);
        }
        t.push(p);
    }
    t
}

/// Percent-decoded, for comparing what two proxies asked the origin.
fn decoded(p: &str) -> Vec<u8> {
    let b = p.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&p[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    out
}

/// (status, the path the origin was asked for in the answer served).
fn ask(addr: SocketAddr, host: &str, target: &str) -> (u16, Option<String>) {
    let r = get(addr, target, &[("Host", host)]);
    let asked = serde_json::from_slice::<serde_json::Value>(&r.body)
        .ok()
        .and_then(|v| v["path"].as_str().map(String::from));
    (r.status, asked)
}

#[test]
fn the_cache_serves_what_nginx_serves_for_every_target_in_both_modes() {
    let origin = Origin::start("o");
    let o = origin.addr.port();
    let nginx = common::nginx::start(
        "nginx-one-name",
        &format!(
            "proxy_cache_path {{dir}}/cache keys_zone=z:1m;\n\
             server {{ listen 127.0.0.1:{{port}} default_server; server_name normalized;\n\
               location / {{ proxy_pass http://127.0.0.1:{o}/; proxy_cache z; proxy_cache_valid 200 1m; }} }}\n\
             server {{ listen 127.0.0.1:{{port}}; server_name original;\n\
               location / {{ proxy_pass http://127.0.0.1:{o}; proxy_cache z; proxy_cache_valid 200 1m; }} }}"
        ),
    );
    let uf = Ultrafast::start(&format!(
        "{}[[routes]]\nhosts = [\"original\"]\npath = \"/\"\npool = \"o\"\nupstream_path = \"original\"\n\
         cache = {{ default_ttl_s = 60 }}\n\n\
         [[routes]]\npath = \"/\"\npool = \"o\"\ncache = {{ default_ttl_s = 60 }}\n",
        pool_toml("o", &[&origin], "")
    ));
    let mut compared = 0;
    let mut hits = 0;
    for host in ["normalized", "original"] {
        for round in 0..2 {
            for t in targets() {
                let (us, ours) = ask(uf.addr, host, &t);
                let (ns, theirs) = ask(nginx.addr, host, &t);
                if us == 400 {
                    continue; // refused: nothing served, nothing stored
                }
                assert_eq!(us, ns, "{host} {t}: status {us} here, {ns} from nginx");
                if us != 200 {
                    continue;
                }
                let (ours, theirs) = (ours.unwrap(), theirs.unwrap());
                assert_eq!(
                    decoded(&ours),
                    decoded(&theirs),
                    "{host} round {round} {t}: served the origin's answer to `{ours}`, nginx its answer to `{theirs}`"
                );
                compared += 1;
                hits += usize::from(round == 1);
            }
        }
    }
    assert!(compared > 200, "{compared} answers compared");
    assert!(hits > 100, "{hits}");
    // The cache was used (a second round from the cache, not the origin).
    let stored = uf.metric("ultrafast_cache_requests_total", &["outcome=\"hit\""]);
    assert!(stored > 100.0, "{stored} hits");
    // The access log names the target the origin was asked for.
    // On the normalized route (`route1`) `//x/../index.html` is logged as
    // `/index.html`; on the original one (`route0`) as it came.
    let log = uf.access_log();
    let lines = |route: &str, uri: &str| {
        log.lines()
            .filter(|l| l.contains(&format!("\"route\":\"{route}\"")))
            .filter(|l| l.contains(&format!("\"uri\":\"{uri}\"")))
            .count()
    };
    assert!(lines("route1", "/index.html") >= 2, "{log}");
    assert_eq!(lines("route1", "//x/../index.html"), 0, "{log}");
    assert!(lines("route0", "//x/../index.html") >= 1, "{log}");
}

#[test]
fn dot_parameters_and_raw_bytes_that_are_not_utf8_are_refused() {
    let origin = Origin::start("o");
    let uf = Ultrafast::start(&format!(
        "{}[[routes]]\npath = \"/lenient/\"\npool = \"o\"\nallow_dot_parameters = true\n\n\
         [[routes]]\npath = \"/\"\npool = \"o\"\n",
        pool_toml("o", &[&origin], "")
    ));
    for bad in ["/public/..;/admin", "/a/.;x/b", "/%2e%2e;/x"] {
        let r = get(uf.addr, bad, &[]);
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
    }
    // A route may let them through.
    let r = get(uf.addr, "/lenient/..;/x", &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    // Raw bytes that are not UTF-8 are refused as `%FF` is.
    let mut c = Client::connect(uf.addr).unwrap();
    c.send_raw(b"GET /a\xff\xfe HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let r = c.read_response(false).unwrap();
    assert_eq!(r.status, 400, "{}", r.text());
    let r = get(uf.addr, "/a%ff%fe", &[]);
    assert_eq!(r.status, 400);
    assert_eq!(
        origin.requests(),
        1,
        "only the lenient route reached the origin"
    );
}

#[test]
fn a_trailing_dot_in_host_names_the_same_virtual_host_and_cache_entry() {
    let a = Origin::start("a");
    let b = Origin::start("b");
    let uf = Ultrafast::start(&format!(
        "{}{}[[routes]]\nhosts = [\"api.example.com\"]\npath = \"/\"\npool = \"a\"\ncache = {{ default_ttl_s = 60 }}\n\n\
         [[routes]]\npath = \"/\"\npool = \"b\"\n",
        pool_toml("a", &[&a], ""),
        pool_toml("b", &[&b], "")
    ));
    let r = get(uf.addr, "/x", &[("Host", "api.example.com")]);
    assert_eq!(r.header("x-origin"), Some("a"));
    for host in ["api.example.com.", "API.example.com.:8080"] {
        let r = get(uf.addr, "/x", &[("Host", host)]);
        assert_eq!(r.header("x-origin"), Some("a"), "{host}");
    }
    assert_eq!(
        a.requests(),
        2,
        "`api.example.com.` is served from the same entry"
    );
    // And the origin is asked for the name without the dot (an origin
    // that keeps it could answer for another site under this key).
    let r = get(uf.addr, "/y", &[("Host", "api.example.com.")]);
    assert_eq!(
        r.json()["headers"]["host"],
        "api.example.com",
        "{}",
        r.text()
    );
}
