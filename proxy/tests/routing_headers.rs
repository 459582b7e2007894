//! Routing precedence, header rules, forwarding headers, request ids and
//! downstream limits, against the real binary and a real origin.

#![allow(clippy::unwrap_used)]
mod common;
use common::*;
use std::time::Duration;

fn routes_config(a: &Origin, b: &Origin) -> String {
    format!(
        r#"{pa}{pb}
[[routes]]
name = "exact"
path = "/x"
match = "exact"
return = {{ status = 200, body = "exact" }}

[[routes]]
name = "root"
path = "/"
pool = "a"
headers.request.set = {{ "x-env" = "test" }}
headers.request.add = {{ "x-added" = "one" }}
headers.request.remove = ["x-secret"]
headers.response.set = {{ "x-served-by" = "ultrafast" }}
headers.response.remove = ["x-remove-me"]

[[routes]]
name = "images"
path = '\.(png|jpg)$'
match = "regex"
return = {{ status = 200, body = "regex" }}

[[routes]]
name = "static"
path = "/static/"
match = "priority_prefix"
return = {{ status = 200, body = "static" }}

[[routes]]
name = "api"
path = "/api/"
pool = "a"

[[routes]]
name = "wild"
hosts = ["*.example.com"]
path = "/"
return = {{ status = 200, body = "wild" }}

[[routes]]
name = "www"
hosts = ["www.example.com"]
path = "/"
pool = "b"
upstream_host = "backend.internal"

[[routes]]
name = "moved"
path = "/old/"
redirect = {{ status = 301, location = "https://new.example$request_uri" }}
"#,
        pa = pool_toml("a", &[a], ""),
        pb = pool_toml("b", &[b], ""),
    )
}

#[test]
fn nginx_precedence_end_to_end() {
    let (a, b) = (Origin::start("a"), Origin::start("b"));
    let uf = Ultrafast::start(&routes_config(&a, &b));
    let at = |host: &str, path: &str| get(uf.addr, path, &[("Host", host)]);
    assert_eq!(at("t", "/x").text(), "exact");
    assert_eq!(
        at("t", "/x/y").origin(),
        "a",
        "exact does not match longer paths"
    );
    assert_eq!(
        at("t", "/api/logo.png").text(),
        "regex",
        "regex beats plain prefix"
    );
    assert_eq!(
        at("t", "/static/logo.png").text(),
        "static",
        "^~ beats regex"
    );
    assert_eq!(at("t", "/api/v1").origin(), "a");
    assert_eq!(at("foo.example.com", "/any").text(), "wild");
    assert_eq!(
        at("www.example.com", "/any").origin(),
        "b",
        "exact host beats wildcard"
    );
    let r = at("t", "/old/page?q=1");
    assert_eq!(r.status, 301);
    assert_eq!(
        r.header("location"),
        Some("https://new.example/old/page?q=1")
    );
}

#[test]
fn header_rules_forwarding_and_host() {
    let (a, b) = (Origin::start("a"), Origin::start("b"));
    let uf = Ultrafast::start(&routes_config(&a, &b));
    let r = get(
        uf.addr,
        "/h",
        &[
            ("Host", "t.local"),
            ("X-Secret", "s"),
            ("X-Forwarded-For", "10.1.2.3"),
        ],
    );
    assert_eq!(r.status, 200);
    let seen = &r.json()["headers"];
    assert_eq!(seen["x-env"], "test");
    assert_eq!(seen["x-added"], "one");
    assert!(
        seen.get("x-secret").is_none(),
        "removed header reached origin"
    );
    assert_eq!(seen["x-forwarded-for"], "10.1.2.3, 127.0.0.1");
    assert_eq!(seen["x-forwarded-proto"], "http");
    assert_eq!(seen["host"], "t.local", "Host passes through by default");
    assert_eq!(r.header("x-served-by"), Some("ultrafast"));
    assert!(r.header("x-remove-me").is_none());
    let r = get(uf.addr, "/", &[("Host", "www.example.com")]);
    assert_eq!(
        r.json()["headers"]["host"],
        "backend.internal",
        "Host rewrite"
    );
}

#[test]
fn request_id_is_propagated_and_logged() {
    let (a, b) = (Origin::start("a"), Origin::start("b"));
    let uf = Ultrafast::start(&routes_config(&a, &b));
    // A client's UUID goes upstream as it is; any other id stays the
    // client's (response, log) and the origin gets a fresh UUID.
    let uuid = "123e4567-e89b-42d3-a456-426614174000";
    let r = get(uf.addr, "/rid", &[("X-Request-Id", uuid)]);
    assert_eq!(r.json()["headers"]["x-request-id"], uuid);
    assert_eq!(r.header("x-request-id"), Some(uuid));
    let r = get(uf.addr, "/rid", &[("X-Request-Id", "abc-123")]);
    assert_eq!(r.header("x-request-id"), Some("abc-123"));
    let sent = r.json()["headers"]["x-request-id"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(sent.len() == 36 && &sent[14..15] == "7", "{sent}");
    let r = uf.get("/rid2");
    let generated = r.header("x-request-id").unwrap().to_string();
    assert_eq!(generated.len(), 36, "a UUIDv7: {generated}");
    assert_eq!(r.json()["headers"]["x-request-id"], generated.as_str());
    assert!(eventually(Duration::from_secs(3), || uf
        .access_log()
        .contains(&generated)));
    let line = uf
        .access_log()
        .lines()
        .find(|l| l.contains(&generated))
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .unwrap();
    assert_eq!(line["route"], "root");
    assert_eq!(line["status"], 200);
    assert_eq!(line["upstream"], a.addr.to_string());
    assert!(line["upstream_ms"].as_f64().unwrap() >= 0.0);
    assert!(line["bytes"].as_u64().unwrap() > 0);
}

#[test]
fn oversize_bodies_get_413_and_never_reach_the_origin() {
    let a = Origin::start("a");
    let cfg = format!(
        "[limits]\nclient_max_body_bytes = 1000\n{}[[routes]]\npath = \"/\"\npool = \"a\"\n",
        pool_toml("a", &[&a], "")
    );
    let uf = Ultrafast::start(&cfg);
    let mut c = Client::connect(uf.addr).unwrap();
    let r = c.request("POST", "/up", &[], &[b'x'; 500]).unwrap();
    assert_eq!(r.status, 200);
    let r = Client::connect(uf.addr)
        .unwrap()
        .request("POST", "/up", &[], &[b'x'; 2000])
        .unwrap();
    assert_eq!(r.status, 413);
    assert_eq!(r.json()["error"]["code"], "body_too_large");
    // A chunked body has no declared length: counted as it streams.
    let mut c = Client::connect(uf.addr).unwrap();
    let chunk = "x".repeat(600);
    let raw = format!(
        "POST /up HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n258\r\n{chunk}\r\n258\r\n{chunk}\r\n0\r\n\r\n"
    );
    c.send_raw(raw.as_bytes()).unwrap();
    let r = c.read_response(false).unwrap();
    assert_eq!(r.status, 413);
    assert_eq!(a.requests(), 1, "only the small body reached the origin");
}

#[test]
fn oversize_headers_get_431() {
    let a = Origin::start("a");
    let cfg = format!("[limits]\nmax_header_bytes = 2048\nmax_headers = 20\n{}[[routes]]\npath = \"/\"\npool = \"a\"\n", pool_toml("a", &[&a], ""));
    let uf = Ultrafast::start(&cfg);
    let big = "v".repeat(4000);
    assert_eq!(get(uf.addr, "/", &[("X-Big", &big)]).status, 431);
    let many: Vec<(String, String)> = (0..30).map(|i| (format!("X-H{i}"), "1".into())).collect();
    let refs: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    assert_eq!(get(uf.addr, "/", &refs).status, 431);
    assert_eq!(get(uf.addr, "/", &[]).status, 200);
    assert_eq!(a.requests(), 1);
}

#[test]
fn malformed_http_gets_400_and_nothing_goes_upstream() {
    let a = Origin::start("a");
    let uf = Ultrafast::start(&format!(
        "{}[[routes]]\npath = \"/\"\npool = \"a\"\n",
        pool_toml("a", &[&a], "")
    ));
    for raw in [
        &b"GARBAGE\r\n\r\n"[..],
        b"GET / HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n",
    ] {
        let mut c = Client::connect(uf.addr).unwrap();
        c.send_raw(raw).unwrap();
        match c.read_response(false) {
            Ok(r) => assert_eq!(r.status, 400, "for {:?}", String::from_utf8_lossy(raw)),
            Err(e) => assert_eq!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof,
                "closed without reply is fine too"
            ),
        }
        assert!(
            c.closed_within(Duration::from_secs(3)),
            "connection left open"
        );
    }
    assert_eq!(a.requests(), 0);
    assert_eq!(uf.get("/").status, 200, "still serving");
}

#[test]
fn an_ambiguous_content_length_is_a_400_and_the_connection_closes() {
    let a = Origin::start("a");
    let uf = Ultrafast::start(&format!(
        "{}[[routes]]\npath = \"/\"\npool = \"a\"\n",
        pool_toml("a", &[&a], "")
    ));
    for cl in [
        "Content-Length: 5, 5\r\n",
        "Content-Length: 5\r\nContent-Length: 5\r\n",
        "Content-Length: 5\r\nContent-Length: 6\r\n",
        "Content-Length: +5\r\n",
    ] {
        let mut c = Client::connect(uf.addr).unwrap();
        let raw = format!(
            "POST / HTTP/1.1\r\nHost: x\r\n{cl}\r\nhelloGET /x HTTP/1.1\r\nHost: x\r\n\r\n"
        );
        c.send_raw(raw.as_bytes()).unwrap();
        match c.read_response(false) {
            Ok(r) => assert_eq!(r.status, 400, "for {cl:?}: {}", r.text()),
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{cl:?}"),
        }
        assert!(c.closed_within(Duration::from_secs(3)), "{cl:?}: left open");
    }
    assert_eq!(a.requests(), 0, "nothing reached the origin");
    assert_eq!(uf.get("/").status, 200, "still serving");
}

#[test]
fn an_http10_request_without_host_gets_one_upstream() {
    let a = Origin::start("a");
    let uf = Ultrafast::start(&format!(
        "{}[[routes]]\npath = \"/\"\npool = \"a\"\n",
        pool_toml("a", &[&a], "")
    ));
    let mut c = Client::connect(uf.addr).unwrap();
    c.send_raw(b"GET /old HTTP/1.0\r\n\r\n").unwrap();
    let r = c.read_response(false).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["headers"]["host"], a.addr.to_string());
}

#[test]
fn unknown_route_is_a_json_404() {
    let uf = Ultrafast::start(
        "[[routes]]\npath = \"/only\"\nmatch = \"exact\"\nreturn = { status = 204 }\n",
    );
    let r = uf.get("/nope");
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "no_route");
    assert_eq!(uf.get("/only").status, 204);
}
