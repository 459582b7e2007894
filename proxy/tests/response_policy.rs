//! The one response policy, by kind of response: whoever produced it (the
//! origin, a fixed `return`, a redirect, the edge's own refusals and
//! errors, the inference front), a response carries the route's
//! `headers.response` rules, the request id, and HSTS when it went out on a
//! TLS listener (never on a plain one). The origin is told the listener's
//! real scheme in `X-Forwarded-Proto`.
//!
//! One server per test, each with a plain listener (the harness's), a TLS
//! listener with `hsts_max_age_s = 600` (dev certificates from
//! `ultrafast certs dev`, requests by `curl`), and an HTTPS-redirect
//! listener; every route has the same response rules.

#![allow(clippy::unwrap_used)]
mod common;
use common::infer::*;
use common::*;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::Duration;

const RULES: &str = r#"headers.response.set = { "x-policy" = "on" }
headers.response.add = { "x-policy-add" = "1" }
headers.response.remove = ["x-remove-me"]
"#;
const HSTS: &str = "max-age=600";

struct Edge {
    uf: Ultrafast,
    tls_port: u16,
    redirect: SocketAddr,
    origin: Origin,
    _fake: Fake,
    _certs: PathBuf,
}

/// The server: every kind of response is one request away.
fn start() -> Edge {
    let certs = scratch("policy-certs");
    let (cert, key) = dev_certs(&certs);
    let origin = Origin::start("o");
    let fake = Fake::start(&["--tokens", "6", "--itl-ms", "1", "--ttft-ms", "1"]);
    let (tls_port, redirect_port, dead) = (free_port(), free_port(), free_port());
    let body = format!(
        r#"[[listeners]]
name = "https"
address = "127.0.0.1:{tls_port}"
tls = {{ certs = [{{ cert = "{cert}", key = "{key}", names = ["localhost"], default = true }}], hsts_max_age_s = 600 }}

[[listeners]]
name = "to-https"
address = "127.0.0.1:{redirect_port}"
redirect_https_port = {tls_port}

[limits]
client_max_body_bytes = 1024
max_headers = 30

[rate_limits.once]
key = "header:x-tenant"
rate_per_s = 0.01
burst = 1

{origin_pool}
{slow_pool}
[pools.dead]
members = [{{ addr = "127.0.0.1:{dead}" }}]

{model}
[[routes]]
name = "proxied"
path = "/proxied"
pool = "origin"
{RULES}
[[routes]]
name = "fixed"
path = "/fixed"
return = {{ status = 200, body = "fixed" }}
{RULES}
[[routes]]
name = "moved"
path = "/moved"
redirect = {{ status = 302, location = "https://elsewhere.example$request_uri" }}
{RULES}
[[routes]]
name = "limited"
path = "/limited"
pool = "origin"
rate_limits = ["once"]
{RULES}
[[routes]]
name = "dead"
path = "/dead"
pool = "dead"
{RULES}
[[routes]]
name = "slow"
path = "/slow"
pool = "slow"
{RULES}
[[routes]]
name = "openai"
path = "/v1/"
inference = true
{RULES}"#,
        cert = cert.display(),
        key = key.display(),
        origin_pool = pool_toml("origin", &[&origin], ""),
        slow_pool = pool_toml("slow", &[&origin], "read_timeout_ms = 150"),
        model = upstream_model("m", &[&fake], ""),
    );
    let uf = Ultrafast::start(&body);
    assert!(eventually(Duration::from_secs(5), || {
        std::net::TcpStream::connect(("127.0.0.1", tls_port)).is_ok()
    }));
    Edge {
        uf,
        tls_port,
        redirect: format!("127.0.0.1:{redirect_port}").parse().unwrap(),
        origin,
        _fake: fake,
        _certs: certs,
    }
}

/// A request over TLS with `curl` (`http` picks `--http1.1` or
/// `--http2`), parsed like the harness's responses.
fn curl(port: u16, http: &str, path: &str, args: &[&str]) -> Resp {
    let out = Command::new("curl")
        .args(["-sk", "-i", "--max-time", "10", http])
        .args(args)
        .arg(format!("https://127.0.0.1:{port}{path}"))
        .output()
        .unwrap();
    parse_raw(&out.stdout)
}

/// A raw HTTP/1 response as a [`Resp`].
fn parse_raw(raw: &[u8]) -> Resp {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head: {}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line: {head}"));
    let mut headers = BTreeMap::new();
    for l in lines {
        if let Some((k, v)) = l.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    Resp {
        status,
        headers,
        body: raw[split + 4..].to_vec(),
    }
}

/// One request on the TLS listener over HTTP/1.1, with our request id.
fn tls(e: &Edge, method: &str, path: &str, rid: &str, extra: &[&str]) -> Resp {
    let id = format!("X-Request-Id: {rid}");
    let mut args = vec!["-X", method, "-H", &id];
    args.extend_from_slice(extra);
    curl(e.tls_port, "--http1.1", path, &args)
}

/// One request on the plain listener, with our request id.
fn plain(
    e: &Edge,
    method: &str,
    path: &str,
    rid: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Resp {
    let mut h = vec![("X-Request-Id", rid)];
    h.extend_from_slice(headers);
    Client::connect(e.uf.addr)
        .unwrap()
        .request(method, path, &h, body)
        .unwrap()
}

/// The policy's marks on a response: the request id sent, the route's
/// rules (when the request had a route), HSTS exactly when over TLS.
fn assert_policy(what: &str, r: &Resp, rid: &str, over_tls: bool, routed: bool) {
    // Status and head only: the bodies are not what is checked here.
    let seen = format!("{} {:?}", r.status, r.headers);
    let id = r.header("x-request-id");
    assert_eq!(id, Some(rid), "{what}: request id: {seen}");
    if routed {
        let (set, add) = (r.header("x-policy"), r.header("x-policy-add"));
        assert_eq!(set, Some("on"), "{what}: rule `set`: {seen}");
        assert_eq!(add, Some("1"), "{what}: rule `add`: {seen}");
    }
    let hsts = r.header("strict-transport-security");
    if over_tls {
        assert_eq!(hsts, Some(HSTS), "{what}: HSTS on TLS: {seen}");
    } else {
        assert_eq!(hsts, None, "{what}: no HSTS on plain HTTP: {seen}");
    }
}

fn forwarded_proto(e: &Edge) -> Option<String> {
    e.origin
        .state
        .last_headers
        .lock()
        .unwrap()
        .get("x-forwarded-proto")
        .cloned()
}

#[test]
fn proxied_responses_and_the_scheme_told_upstream() {
    let e = start();
    let r = tls(&e, "GET", "/proxied", "rid-proxied-tls", &[]);
    assert_eq!(r.status, 200, "{r:?}");
    assert_policy("proxied over TLS", &r, "rid-proxied-tls", true, true);
    assert_eq!(
        r.header("x-remove-me"),
        None,
        "rule `remove` on the origin's header"
    );
    assert_eq!(
        forwarded_proto(&e).as_deref(),
        Some("https"),
        "TLS listener"
    );
    let r = plain(&e, "GET", "/proxied", "rid-proxied", &[], b"");
    assert_policy("proxied", &r, "rid-proxied", false, true);
    assert_eq!(
        forwarded_proto(&e).as_deref(),
        Some("http"),
        "plain listener"
    );
    // HTTP/2 over TLS: the same digest tells the scheme.
    let r = curl(
        e.tls_port,
        "--http2",
        "/proxied",
        &["-H", "X-Request-Id: rid-h2"],
    );
    assert_eq!(r.status, 200, "{r:?}");
    assert_policy("proxied over h2", &r, "rid-h2", true, true);
    assert_eq!(
        forwarded_proto(&e).as_deref(),
        Some("https"),
        "TLS listener, h2"
    );
}

#[test]
fn fixed_returns() {
    let e = start();
    let r = tls(&e, "GET", "/fixed", "rid-fixed-tls", &[]);
    assert_eq!((r.status, r.text().as_str()), (200, "fixed"));
    assert_policy("fixed over TLS", &r, "rid-fixed-tls", true, true);
    let r = plain(&e, "GET", "/fixed", "rid-fixed", &[], b"");
    assert_eq!(r.status, 200);
    assert_policy("fixed", &r, "rid-fixed", false, true);
}

#[test]
fn redirects_of_a_route_and_of_the_https_listener() {
    let e = start();
    let r = tls(&e, "GET", "/moved/a?b=1", "rid-moved-tls", &[]);
    assert_eq!(r.status, 302);
    assert_eq!(
        r.header("location"),
        Some("https://elsewhere.example/moved/a?b=1")
    );
    assert_policy("redirect over TLS", &r, "rid-moved-tls", true, true);
    let r = plain(&e, "GET", "/moved", "rid-moved", &[], b"");
    assert_eq!(r.status, 302);
    assert_policy("redirect", &r, "rid-moved", false, true);
    // The redirecting listener routes nothing: no route rules, and no HSTS
    // on its plain HTTP.
    let r = Client::connect(e.redirect)
        .unwrap()
        .request("GET", "/fixed", &[("X-Request-Id", "rid-to-https")], b"")
        .unwrap();
    assert_eq!(r.status, 301);
    assert_policy("HTTPS redirect listener", &r, "rid-to-https", false, false);
    assert_eq!(r.header("x-policy"), None, "{r:?}");
}

/// Bytes sent as they are over TLS (`openssl s_client`), and what came
/// back until the server closed.
fn tls_raw(port: u16, raw: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut c = Command::new("openssl")
        .args(["s_client", "-quiet", "-ign_eof", "-servername", "localhost"])
        .arg("-connect")
        .arg(format!("127.0.0.1:{port}"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(raw).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while c.try_wait().unwrap().is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = c.kill();
    let out = c.wait_with_output().unwrap();
    out.stdout
}

#[test]
fn a_head_pingora_cannot_parse_and_connect_get_the_policy_too() {
    let e = start();
    // A header line without a colon: Pingora's parser refuses the head
    // before any of our phases runs.
    let bad = b"GET /fixed HTTP/1.1\r\nHost: localhost\r\nno colon here\r\n\r\n";
    let r = parse_raw(&tls_raw(e.tls_port, bad));
    assert_eq!(r.status, 400, "{r:?}");
    assert_eq!(r.json()["error"]["code"], "bad_request");
    assert_eq!(r.header("strict-transport-security"), Some(HSTS));
    assert!(r.header("x-request-id").is_some_and(|v| !v.is_empty()));
    assert_eq!(
        r.header("server"),
        None,
        "Pingora's bare 400 went out: {r:?}"
    );
    let mut c = Client::connect(e.uf.addr).unwrap();
    c.send_raw(bad).unwrap();
    let r = c.read_response(false).unwrap();
    assert_eq!(r.status, 400, "{r:?}");
    assert_eq!(r.json()["error"]["code"], "bad_request");
    assert_eq!(r.header("strict-transport-security"), None);
    assert!(r.header("x-request-id").is_some_and(|v| !v.is_empty()));
    assert!(c.closed_within(Duration::from_secs(2)));
    // A bad request line, sent after a good request on the same
    // connection: the second head is watched afresh.
    let mut c = Client::connect(e.uf.addr).unwrap();
    let ok = c
        .request("GET", "/fixed", &[("X-Request-Id", "rid-first")], b"")
        .unwrap();
    assert_eq!(ok.status, 200);
    c.send_raw(b"GET /fixed HTTP/1.1 extra\r\nHost: a\r\n\r\n")
        .unwrap();
    let r = c.read_response(false).unwrap();
    assert_eq!(r.status, 400, "{r:?}");
    assert_eq!(r.json()["error"]["code"], "bad_request");
    // More headers than Pingora's parser takes (256), or more than 1 MiB of
    // them: a 431 like every other oversized head, not a 400.
    for (what, head) in [
        (
            "300 headers",
            (0..300)
                .map(|i| format!("x-h{i}: 1\r\n"))
                .collect::<String>(),
        ),
        (
            "1.1 MiB of headers",
            format!("x-big: {}\r\n", "a".repeat(1_150_000)),
        ),
    ] {
        let mut c = Client::connect(e.uf.addr).unwrap();
        let raw = format!("GET /fixed HTTP/1.1\r\nHost: localhost\r\n{head}\r\n");
        let _ = c.send_raw(raw.as_bytes());
        let r = c.read_response(false).unwrap();
        assert_eq!(r.status, 431, "{what}: {r:?}");
        assert_eq!(r.json()["error"]["code"], "headers_too_large", "{what}");
        assert!(
            r.header("x-request-id").is_some_and(|v| !v.is_empty()),
            "{what}"
        );
    }
    // CONNECT: refused with 405 by our filter, with the route's rules.
    let raw = b"CONNECT localhost:443 HTTP/1.1\r\nHost: localhost:443\r\nX-Request-Id: rid-connect\r\n\r\n";
    let r = parse_raw(&tls_raw(e.tls_port, raw));
    assert_eq!(r.status, 405, "{r:?}");
    assert_eq!(r.json()["error"]["code"], "method_not_allowed");
    assert_policy("CONNECT over TLS", &r, "rid-connect", true, false);
    let mut c = Client::connect(e.uf.addr).unwrap();
    c.send_raw(raw).unwrap();
    let r = c.read_response(false).unwrap();
    assert_eq!(r.status, 405, "{r:?}");
    assert_policy("CONNECT", &r, "rid-connect", false, false);
    assert_eq!(e.origin.requests(), 0);
}

#[test]
fn unknown_route_is_a_404_with_the_policy() {
    let e = start();
    let r = tls(&e, "GET", "/nowhere", "rid-404-tls", &[]);
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "no_route");
    // No route, so no route rules; the rest of the policy still applies.
    assert_policy("404 over TLS", &r, "rid-404-tls", true, false);
    assert_eq!(r.header("x-policy"), None);
    let r = plain(&e, "GET", "/nowhere", "rid-404", &[], b"");
    assert_eq!(r.status, 404);
    assert_policy("404", &r, "rid-404", false, false);
}

#[test]
fn body_too_large_is_a_413_of_its_route() {
    let e = start();
    let big = "x".repeat(2048);
    let r = tls(
        &e,
        "POST",
        "/proxied",
        "rid-413-tls",
        &["--data-binary", &big],
    );
    assert_eq!(r.status, 413, "{r:?}");
    assert_policy("413 over TLS", &r, "rid-413-tls", true, true);
    let r = plain(&e, "POST", "/proxied", "rid-413", &[], big.as_bytes());
    assert_eq!(r.status, 413);
    assert_policy("413", &r, "rid-413", false, true);
    assert_eq!(e.origin.requests(), 0);
}

#[test]
fn too_many_headers_is_a_431_of_its_route() {
    let e = start();
    let many: Vec<String> = (0..40).map(|i| format!("x-h{i}: 1")).collect();
    let mut args = Vec::new();
    for h in &many {
        args.extend(["-H", h.as_str()]);
    }
    let r = tls(&e, "GET", "/fixed", "rid-431-tls", &args);
    assert_eq!(r.status, 431, "{r:?}");
    assert_policy("431 over TLS", &r, "rid-431-tls", true, true);
    let pairs: Vec<(String, &str)> = (0..40).map(|i| (format!("x-h{i}"), "1")).collect();
    let pairs: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    let r = plain(&e, "GET", "/fixed", "rid-431", &pairs, b"");
    assert_eq!(r.status, 431);
    assert_policy("431", &r, "rid-431", false, true);
}

/// A GET over h2c with `headers`: the status and the response headers.
fn h2_get(port: u16, headers: &[(&str, &str)]) -> (u16, BTreeMap<String, String>) {
    let mut req = http::Request::get(format!("http://127.0.0.1:{port}/"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let a = h2c(port, req.body(()).unwrap(), true);
    (a.status, a.headers)
}

#[test]
fn an_http2_header_list_past_the_limits_is_a_431_of_its_route() {
    let e = start();
    // 80 KB of one header: past Pingora's 64 KB HTTP/2 list (a refused
    // stream there) and our max_header_bytes. curl (nghttp2) will not send
    // a block past 64 KB, so an h2 client sends it, over h2c.
    let port = free_port();
    let uf = Ultrafast::start(&format!(
        "[[listeners]]\nname = \"h2c\"\naddress = \"127.0.0.1:{port}\"\nh2c = true\n\n\
         [[routes]]\npath = \"/\"\nreturn = {{ status = 200, body = \"ok\" }}\n"
    ));
    let (status, head) = h2_get(
        port,
        &[
            ("x-request-id", "rid-431-h2"),
            ("x-big", &"a".repeat(80_000)),
        ],
    );
    assert_eq!(status, 431, "{head:?}");
    assert_eq!(
        head.get("x-request-id").map(String::as_str),
        Some("rid-431-h2")
    );
    assert_eq!(
        head.get("content-type").map(String::as_str),
        Some("application/json")
    );
    drop(uf);
    // Too many headers over HTTP/2 (TLS, ALPN h2), as curl sends them.
    let many: Vec<String> = (0..40).map(|i| format!("x-h{i}: 1")).collect();
    let mut args = vec!["-H", "X-Request-Id: rid-431-h2n"];
    for h in &many {
        args.extend(["-H", h.as_str()]);
    }
    let r = curl(e.tls_port, "--http2", "/fixed", &args);
    assert_eq!(r.status, 431, "{r:?}");
    assert_policy("431 over HTTP/2", &r, "rid-431-h2n", true, true);
}

#[test]
fn a_rate_limit_shed_is_a_429_with_the_policy() {
    let e = start();
    let first = tls(&e, "GET", "/limited", "rid-ok", &["-H", "x-tenant: t"]);
    assert_eq!(first.status, 200);
    let r = tls(&e, "GET", "/limited", "rid-429-tls", &["-H", "x-tenant: t"]);
    assert_eq!(r.status, 429, "{r:?}");
    assert!(r.header("retry-after").is_some());
    assert_policy("429 over TLS", &r, "rid-429-tls", true, true);
    let tenant = [("x-tenant", "p")];
    assert_eq!(
        plain(&e, "GET", "/limited", "rid-ok", &tenant, b"").status,
        200
    );
    let r = plain(&e, "GET", "/limited", "rid-429", &tenant, b"");
    assert_eq!(r.status, 429);
    assert_policy("429", &r, "rid-429", false, true);
}

#[test]
fn upstream_failures_are_502_and_504_with_the_policy() {
    let e = start();
    let r = tls(&e, "GET", "/dead", "rid-502-tls", &[]);
    assert_eq!(r.status, 502, "{r:?}");
    assert_eq!(r.json()["error"]["code"], "bad_gateway");
    assert_policy("502 over TLS", &r, "rid-502-tls", true, true);
    let r = plain(&e, "GET", "/dead", "rid-502", &[], b"");
    assert_eq!(r.status, 502);
    assert_policy("502", &r, "rid-502", false, true);
    e.origin.state.delay_ms.store(600, Ordering::SeqCst);
    let r = tls(&e, "GET", "/slow", "rid-504-tls", &[]);
    assert_eq!(r.status, 504, "{r:?}");
    assert_eq!(r.json()["error"]["code"], "gateway_timeout");
    assert_policy("504 over TLS", &r, "rid-504-tls", true, true);
}

/// A chunked body that grows past the limit is refused while it streams
/// (Pingora's error path, `fail_to_proxy`), not from its head.
#[test]
fn a_streamed_body_too_large_is_a_413_of_its_route() {
    let e = start();
    let chunk = "x".repeat(2048);
    let raw = format!(
        "POST /proxied HTTP/1.1\r\nHost: test.local\r\nX-Request-Id: rid-413-chunked\r\n\
         Transfer-Encoding: chunked\r\n\r\n{:x}\r\n{chunk}\r\n0\r\n\r\n",
        chunk.len()
    );
    let mut c = Client::connect(e.uf.addr).unwrap();
    c.send_raw(raw.as_bytes()).unwrap();
    let r = c.read_response(false).unwrap();
    assert_eq!(r.status, 413, "{r:?}");
    assert_policy("streamed 413", &r, "rid-413-chunked", false, true);
}

fn chat(model: &str, stream: bool) -> String {
    format!(
        r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":4,"stream":{stream}}}"#
    )
}

const JSON: [&str; 2] = ["-H", "Content-Type: application/json"];

#[test]
fn inference_json_responses() {
    let e = start();
    let body = chat("m", false);
    let args = [JSON[0], JSON[1], "--data-binary", body.as_str()];
    let r = tls(&e, "POST", "/v1/chat/completions", "rid-json-tls", &args);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.json()["object"], "chat.completion");
    assert_policy("inference JSON over TLS", &r, "rid-json-tls", true, true);
    let r = plain(
        &e,
        "POST",
        "/v1/chat/completions",
        "rid-json",
        &[],
        body.as_bytes(),
    );
    assert_eq!(r.status, 200, "{r:?}");
    assert_policy("inference JSON", &r, "rid-json", false, true);
}

#[test]
fn inference_stream_heads() {
    let e = start();
    let body = chat("m", true);
    let args = [JSON[0], JSON[1], "-N", "--data-binary", body.as_str()];
    let r = tls(&e, "POST", "/v1/chat/completions", "rid-sse-tls", &args);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    assert!(r.text().contains("data: [DONE]"), "{}", r.text());
    assert_policy("SSE head over TLS", &r, "rid-sse-tls", true, true);
    let r = plain(
        &e,
        "POST",
        "/v1/chat/completions",
        "rid-sse",
        &[],
        body.as_bytes(),
    );
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    assert_policy("SSE head", &r, "rid-sse", false, true);
}

#[test]
fn async_202_and_the_job_endpoints() {
    let e = start();
    let body = chat("m", false);
    let args = [
        JSON[0],
        JSON[1],
        "-H",
        "Prefer: respond-async",
        "--data-binary",
        body.as_str(),
    ];
    let r = tls(&e, "POST", "/v1/chat/completions", "rid-202-tls", &args);
    assert_eq!(r.status, 202, "{r:?}");
    assert_policy("202 over TLS", &r, "rid-202-tls", true, true);
    let id = r.json()["id"].as_str().unwrap().to_string();
    let r = tls(&e, "GET", &format!("/v1/requests/{id}"), "rid-job-tls", &[]);
    assert_eq!(r.status, 200, "{r:?}");
    assert_policy("job status over TLS", &r, "rid-job-tls", true, true);
    let events = format!("/v1/requests/{id}/events");
    let r = tls(&e, "GET", &events, "rid-events-tls", &["-N"]);
    assert_eq!(r.header("content-type"), Some("text/event-stream"), "{r:?}");
    assert_policy("job events over TLS", &r, "rid-events-tls", true, true);
    let async_ = [("Prefer", "respond-async")];
    let r = plain(
        &e,
        "POST",
        "/v1/chat/completions",
        "rid-202",
        &async_,
        body.as_bytes(),
    );
    assert_eq!(r.status, 202);
    assert_policy("202", &r, "rid-202", false, true);
}

#[test]
fn the_model_list() {
    let e = start();
    let r = tls(&e, "GET", "/v1/models", "rid-models-tls", &[]);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.json()["data"][0]["id"], "m");
    assert_policy("/v1/models over TLS", &r, "rid-models-tls", true, true);
    let r = plain(&e, "GET", "/v1/models", "rid-models", &[], b"");
    assert_eq!(r.status, 200);
    assert_policy("/v1/models", &r, "rid-models", false, true);
}

#[test]
fn inference_client_errors() {
    let e = start();
    let body = chat("no-such-model", false);
    let args = [JSON[0], JSON[1], "--data-binary", body.as_str()];
    let r = tls(&e, "POST", "/v1/chat/completions", "rid-4xx-tls", &args);
    assert_eq!(r.status, 404, "{r:?}");
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    assert_policy("inference 404 over TLS", &r, "rid-4xx-tls", true, true);
    let r = plain(
        &e,
        "POST",
        "/v1/chat/completions",
        "rid-4xx",
        &[],
        b"{not json",
    );
    assert_eq!(r.status, 400, "{r:?}");
    assert_policy("inference 400", &r, "rid-4xx", false, true);
    let r = tls(&e, "GET", "/v1/nothing", "rid-url-tls", &[]);
    assert_eq!(r.status, 404, "{r:?}");
    assert_policy(
        "unknown inference URL over TLS",
        &r,
        "rid-url-tls",
        true,
        true,
    );
}
