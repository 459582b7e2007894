//! The HTTP cache of a proxy route against a real origin that counts what
//! reaches it (`/cache/...` in `common`, shaped by its query): freshness
//! from Cache-Control (max-age, s-maxage, no-store, private) and Expires,
//! the route's default TTL, Vary, revalidation with ETag and
//! Last-Modified, one origin fetch for concurrent misses,
//! stale-while-revalidate, stale-if-error, purge through the admin API,
//! the zone's memory bound, and RFC 9211 Cache-Status on each.

#![allow(clippy::unwrap_used)]
mod common;
use common::*;
use std::time::{Duration, Instant};

fn edge(cache: &str) -> (Origin, Ultrafast) {
    let a = Origin::start("a");
    let uf = Ultrafast::start(&format!(
        "{}[[routes]]\nname = \"site\"\npath = \"/\"\npool = \"a\"\ncache = {{ {cache} }}\n",
        pool_toml("a", &[&a], "")
    ));
    (a, uf)
}

/// Requests for `path` (any query) the origin received.
fn fetched(o: &Origin, path: &str) -> usize {
    o.order()
        .iter()
        .filter(|p| p.split('?').next() == Some(path))
        .count()
}

fn status(r: &Resp) -> &str {
    r.header("cache-status").unwrap_or("")
}

fn url(path: &str, q: &[(&str, &str)]) -> String {
    let q: Vec<String> = q
        .iter()
        .map(|(k, v)| format!("{k}={}", escape(v)))
        .collect();
    format!("{path}?{}", q.join("&"))
}

#[test]
fn max_age_is_served_from_the_cache_until_it_runs_out() {
    let (a, uf) = edge("");
    let u = url("/cache/fresh", &[("cc", "max-age=2")]);
    let first = get(uf.addr, &u, &[]);
    assert_eq!(first.status, 200);
    assert_eq!(
        status(&first),
        "ultrafast; fwd=miss; fwd-status=200; stored"
    );
    let hit = get(uf.addr, &u, &[]);
    assert_eq!(hit.body, first.body, "a hit is the stored body");
    assert!(status(&hit).starts_with("ultrafast; hit; ttl="), "{hit:?}");
    assert!(hit.header("age").is_some(), "a hit says its Age");
    // A hit passes the same response policy as anything proxied.
    assert!(hit.header("x-request-id").is_some());
    assert_eq!(fetched(&a, "/cache/fresh"), 1);
    std::thread::sleep(Duration::from_millis(2200));
    let after = get(uf.addr, &u, &[]);
    assert_ne!(after.body, first.body, "stale: fetched again");
    assert_eq!(
        status(&after),
        "ultrafast; fwd=stale; fwd-status=200; stored"
    );
    assert_eq!(fetched(&a, "/cache/fresh"), 2);
    // HEAD is answered from the stored GET.
    let head = Client::connect(uf.addr)
        .unwrap()
        .request("HEAD", &u, &[], b"")
        .unwrap();
    assert_eq!(head.status, 200);
    assert!(status(&head).contains("hit"), "{head:?}");
    assert_eq!(fetched(&a, "/cache/fresh"), 2);
    // The count is taken when the request's log is written, just after
    // its response: a scrape right behind the HEAD can precede it.
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    let mut m = uf.metric("ultrafast_cache_requests_total", &["site", "hit"]);
    while m < 2.0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        m = uf.metric("ultrafast_cache_requests_total", &["site", "hit"]);
    }
    assert!(m >= 2.0, "hits counted: {m}");
}

#[test]
fn what_the_origin_forbids_or_keeps_private_is_never_stored() {
    let (a, uf) = edge("default_ttl_s = 60");
    for (name, q) in [
        ("nostore", vec![("cc", "no-store, max-age=60")]),
        ("private", vec![("cc", "private, max-age=60")]),
        ("cookie", vec![("cc", "max-age=60"), ("cookie", "1")]),
        ("varystar", vec![("cc", "max-age=60"), ("vary", "*")]),
    ] {
        let path = format!("/cache/{name}");
        let u = url(&path, &q);
        for _ in 0..2 {
            let r = get(uf.addr, &u, &[]);
            assert_eq!(r.status, 200);
            let s = status(&r);
            assert!(
                s.starts_with("ultrafast; fwd=miss; fwd-status=200; detail="),
                "{name}: {s}"
            );
        }
        assert_eq!(fetched(&a, &path), 2, "{name} was stored");
    }
    // A request with Authorization is stored only when the response says
    // it may be shared (`public` or `s-maxage`).
    let u = url("/cache/auth", &[("cc", "max-age=60")]);
    let auth = [("authorization", "Bearer x")];
    get(uf.addr, &u, &auth);
    get(uf.addr, &u, &auth);
    assert_eq!(fetched(&a, "/cache/auth"), 2);
    let u = url("/cache/authpub", &[("cc", "public, max-age=60")]);
    get(uf.addr, &u, &auth);
    assert!(status(&get(uf.addr, &u, &auth)).contains("hit"));
    assert_eq!(fetched(&a, "/cache/authpub"), 1);
    // A method a cache cannot answer goes through, said so.
    let post = Client::connect(uf.addr)
        .unwrap()
        .request("POST", "/cache/post?cc=max-age%3D60", &[], b"x")
        .unwrap();
    assert_eq!(status(&post), "ultrafast; fwd=method");
}

#[test]
fn s_maxage_expires_and_the_default_ttl_give_freshness() {
    let (a, uf) = edge("default_ttl_s = 60");
    // s-maxage (for shared caches) wins over max-age.
    let u = url("/cache/smax", &[("cc", "max-age=0, s-maxage=60")]);
    get(uf.addr, &u, &[]);
    assert!(status(&get(uf.addr, &u, &[])).contains("hit"));
    assert_eq!(fetched(&a, "/cache/smax"), 1);
    // Expires in the future is fresh; in the past, stale at once.
    let u = url("/cache/expires", &[("expires", "60")]);
    get(uf.addr, &u, &[]);
    assert!(status(&get(uf.addr, &u, &[])).contains("hit"));
    assert_eq!(fetched(&a, "/cache/expires"), 1);
    let u = url("/cache/expired", &[("expires", "-60")]);
    get(uf.addr, &u, &[]);
    assert!(status(&get(uf.addr, &u, &[])).contains("fwd=stale"));
    assert_eq!(fetched(&a, "/cache/expired"), 2);
    // Silent responses live default_ttl_s.
    let r = get(uf.addr, "/cache/silent", &[]);
    assert!(status(&r).ends_with("stored"), "{r:?}");
    let r = get(uf.addr, "/cache/silent", &[]);
    let s = status(&r);
    let ttl: i64 = s.rsplit("ttl=").next().unwrap().parse().unwrap();
    assert!((55..=60).contains(&ttl), "{s}");
    assert_eq!(fetched(&a, "/cache/silent"), 1);
    // Without a default TTL a silent response is not stored.
    let (b, uf2) = edge("");
    get(uf2.addr, "/cache/silent", &[]);
    let r = get(uf2.addr, "/cache/silent", &[]);
    assert_eq!(
        status(&r),
        "ultrafast; fwd=miss; fwd-status=200; detail=OriginNotCache"
    );
    assert_eq!(fetched(&b, "/cache/silent"), 2);
}

#[test]
fn vary_keeps_one_variant_per_request_header_value() {
    let (a, uf) = edge("");
    let u = url(
        "/cache/vary",
        &[("cc", "max-age=60"), ("vary", "Accept-Language")],
    );
    let en = get(uf.addr, &u, &[("accept-language", "en")]);
    let fr = get(uf.addr, &u, &[("accept-language", "fr")]);
    assert!(en.text().contains("accept-language=en"));
    assert!(fr.text().contains("accept-language=fr"));
    let en2 = get(uf.addr, &u, &[("accept-language", "en")]);
    let fr2 = get(uf.addr, &u, &[("accept-language", "fr")]);
    assert_eq!(en2.body, en.body);
    assert_eq!(fr2.body, fr.body);
    assert!(status(&en2).contains("hit") && status(&fr2).contains("hit"));
    assert_eq!(fetched(&a, "/cache/vary"), 2);
    // No header is a variant of its own.
    let none = get(uf.addr, &u, &[]);
    assert!(status(&none).contains("fwd=miss"), "{none:?}");
    assert_eq!(fetched(&a, "/cache/vary"), 3);
}

#[test]
fn a_stale_copy_is_revalidated_with_its_etag_or_last_modified() {
    let (a, uf) = edge("");
    for (name, q, header) in [
        ("etag", ("etag", "v1"), "if-none-match"),
        ("lm", ("lm", "1"), "if-modified-since"),
    ] {
        let path = format!("/cache/reval-{name}");
        // no-cache: stored, but revalidated before every use.
        let u = url(&path, &[("cc", "no-cache"), q]);
        let first = get(uf.addr, &u, &[]);
        assert!(status(&first).ends_with("stored"), "{first:?}");
        let second = get(uf.addr, &u, &[]);
        assert_eq!(second.status, 200);
        assert_eq!(second.body, first.body, "the 304 kept the stored body");
        assert!(
            status(&second).starts_with("ultrafast; fwd=stale; fwd-status=304; ttl="),
            "{name}: {second:?}"
        );
        let sent = a.state.last_headers.lock().unwrap().clone();
        assert!(sent.contains_key(header), "{name}: {sent:?}");
        assert_eq!(fetched(&a, &path), 2);
    }
    // The client's own validators are answered from the cache: 304.
    let u = url(
        "/cache/client-etag",
        &[("cc", "max-age=60"), ("etag", "v7")],
    );
    get(uf.addr, &u, &[]);
    let r = get(uf.addr, &u, &[("if-none-match", "\"v7\"")]);
    assert_eq!(r.status, 304);
    assert_eq!(fetched(&a, "/cache/client-etag"), 1);
}

#[test]
fn concurrent_misses_of_one_key_make_one_origin_fetch() {
    let (a, uf) = edge("lock_timeout_ms = 5000");
    let u = url("/cache/slow", &[("cc", "max-age=60"), ("delay", "600")]);
    let addr = uf.addr;
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let u = u.clone();
            std::thread::spawn(move || get(addr, &u, &[]))
        })
        .collect();
    let got: Vec<Resp> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(got.iter().all(|r| r.status == 200 && r.body == got[0].body));
    assert_eq!(fetched(&a, "/cache/slow"), 1, "misses were not coalesced");
    let stored = got.iter().filter(|r| status(r).ends_with("stored")).count();
    assert_eq!(
        stored,
        1,
        "{:?}",
        got.iter().map(status).collect::<Vec<_>>()
    );
}

#[test]
fn stale_while_revalidate_answers_at_once_and_refreshes_behind() {
    let (a, uf) = edge("");
    let u = url(
        "/cache/swr",
        &[
            ("cc", "max-age=1, stale-while-revalidate=30"),
            ("delay", "300"),
        ],
    );
    let first = get(uf.addr, &u, &[]);
    std::thread::sleep(Duration::from_millis(1300));
    let t = Instant::now();
    let stale = get(uf.addr, &u, &[]);
    let took = t.elapsed();
    assert_eq!(stale.body, first.body);
    assert!(
        status(&stale).contains("hit; ttl=-") && status(&stale).contains("stale-while-revalidate"),
        "{stale:?}"
    );
    assert!(
        took < Duration::from_millis(250),
        "waited {took:?} for the origin"
    );
    assert!(
        eventually(Duration::from_secs(3), || fetched(&a, "/cache/swr") == 2),
        "no background refresh"
    );
    // The origin counts a request when it arrives, then takes its 300 ms.
    std::thread::sleep(Duration::from_millis(700));
    let fresh = get(uf.addr, &u, &[]);
    assert_ne!(fresh.body, first.body, "the refresh was stored");
    assert!(status(&fresh).starts_with("ultrafast; hit; ttl="));
}

#[test]
fn stale_if_error_serves_the_stored_copy_when_the_origin_fails() {
    let (mut a, uf) = edge("");
    let u = url("/cache/sie", &[("cc", "max-age=1, stale-if-error=60")]);
    let first = get(uf.addr, &u, &[]);
    std::thread::sleep(Duration::from_millis(1200));
    // A 5xx from the origin.
    a.state
        .status
        .store(503, std::sync::atomic::Ordering::SeqCst);
    let r = get(uf.addr, &u, &[]);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.body, first.body);
    assert!(status(&r).contains("detail=stale-if-error"), "{r:?}");
    // Without stale-if-error the 5xx goes through.
    let plain = url("/cache/nosie", &[("cc", "max-age=1")]);
    get(uf.addr, &plain, &[]);
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(get(uf.addr, &plain, &[]).status, 503);
    // An origin that is gone.
    a.stop();
    let r = get(uf.addr, &u, &[]);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.body, first.body);
}

#[test]
fn the_admin_api_purges_a_url_or_a_zone() {
    let (a, uf) = edge("");
    let u = url(
        "/cache/p",
        &[("cc", "max-age=60"), ("vary", "Accept-Language")],
    );
    get(uf.addr, &u, &[("accept-language", "en")]);
    get(uf.addr, &u, &[("accept-language", "fr")]);
    get(uf.addr, "/cache/q?cc=max-age%3D60", &[]);
    let list = admin_json(&uf, "GET", "/admin/cache", "");
    assert_eq!(list["zones"][0]["zone"], "site");
    assert_eq!(list["zones"][0]["objects"], 3);
    // Every variant of the URL, as the client wrote it.
    let full = format!("http://{}{u}", uf.addr);
    let body = serde_json::json!({ "url": full, "zone": "site" }).to_string();
    let r = admin_json(&uf, "POST", "/admin/cache/purge", &body);
    assert_eq!(r["purged"], 2, "{r}");
    let again = get(uf.addr, &u, &[("accept-language", "en")]);
    assert!(status(&again).contains("fwd=miss"));
    assert!(status(&get(uf.addr, "/cache/q?cc=max-age%3D60", &[])).contains("hit"));
    let r = admin_json(&uf, "POST", "/admin/cache/purge", r#"{"all": true}"#);
    assert_eq!(r["purged"], 2, "{r}");
    assert!(status(&get(uf.addr, "/cache/q?cc=max-age%3D60", &[])).contains("fwd=miss"));
    assert_eq!(fetched(&a, "/cache/q"), 2);
    // Bad requests say what is wrong.
    for (body, want) in [
        (r#"{"url": "/no/host"}"#, 400),
        (r#"{"url": "http://x/", "all": true}"#, 400),
        ("not json", 400),
        (r#"{"all": true, "zone": "nope"}"#, 404),
    ] {
        let r = Client::connect(uf.admin)
            .unwrap()
            .request("POST", "/admin/cache/purge", &[], body.as_bytes())
            .unwrap();
        assert_eq!(r.status, want, "{body}: {}", r.text());
        assert!(r.json()["error"].is_string());
    }
}

fn admin_json(uf: &Ultrafast, method: &str, path: &str, body: &str) -> serde_json::Value {
    let r = Client::connect(uf.admin)
        .unwrap()
        .request(method, path, &[], body.as_bytes())
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

#[test]
fn the_zone_stays_within_size_mb_and_skips_large_objects() {
    let (a, uf) = edge("size_mb = 1, max_object_kb = 64");
    // 60 objects of 32 KiB: 1.9 MiB offered to a 1 MiB zone.
    for i in 0..60 {
        let r = get(
            uf.addr,
            &format!("/cache/o{i}?cc=max-age%3D60&len=32768"),
            &[],
        );
        assert_eq!(r.body.len(), 32768);
    }
    // Eviction lands just after the fill that causes it.
    std::thread::sleep(Duration::from_millis(300));
    let zone = admin_json(&uf, "GET", "/admin/cache", "");
    let bytes = zone["zones"][0]["bytes"].as_f64().unwrap();
    assert!(bytes <= (1 << 20) as f64, "zone holds {bytes} bytes");
    assert!(bytes >= (512 << 10) as f64, "zone holds only {bytes} bytes");
    let objects = zone["zones"][0]["objects"].as_u64().unwrap();
    assert!((16..=32).contains(&objects), "{objects} objects of 32 KiB");
    assert!(uf.metric("ultrafast_cache_bytes", &["site"]) > 0.0);
    // Over max_object_kb: passed through whole, never stored.
    let big = "/cache/big?cc=max-age%3D60&len=100000";
    let r = get(uf.addr, big, &[]);
    assert_eq!(r.body.len(), 100000);
    let r = get(uf.addr, big, &[]);
    assert_eq!(r.body.len(), 100000);
    assert!(status(&r).contains("fwd=miss"), "{:?}", r.headers);
    assert_eq!(fetched(&a, "/cache/big"), 2);
}

#[test]
fn a_range_is_served_from_the_stored_body() {
    let (a, uf) = edge("");
    let u = "/cache/range?cc=max-age%3D60&len=1000";
    let whole = get(uf.addr, u, &[]);
    let part = get(uf.addr, u, &[("range", "bytes=10-19")]);
    assert_eq!(part.status, 206);
    assert_eq!(part.body, whole.body[10..20]);
    assert_eq!(part.header("content-range"), Some("bytes 10-19/1000"));
    assert_eq!(fetched(&a, "/cache/range"), 1);
}

#[test]
fn hits_are_compressed_per_request_and_a_reload_keeps_the_zone_warm() {
    use std::io::Read;
    let a = Origin::start("a");
    let body = |ttl: &str| {
        format!(
            "{}[[routes]]\nname = \"site\"\npath = \"/\"\npool = \"a\"\ncache = {{ size_mb = 2{ttl} }}\ncompress = {{ min_bytes = 10 }}\n",
            pool_toml("a", &[&a], "")
        )
    };
    let uf = Ultrafast::start(&body(""));
    let u = "/cache/z?cc=max-age%3D60&len=5000";
    let plain = get(uf.addr, u, &[]);
    assert_eq!(plain.body.len(), 5000);
    // The stored copy is the origin's; each client gets its own coding.
    let gz = get(uf.addr, u, &[("accept-encoding", "gzip")]);
    assert!(status(&gz).contains("hit"));
    assert_eq!(gz.header("content-encoding"), Some("gzip"));
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(&gz.body[..])
        .read_to_end(&mut out)
        .unwrap();
    assert_eq!(out, plain.body);
    // A reload that keeps the route keeps what it stored.
    uf.write_config(&body(", default_ttl_s = 5"));
    assert_eq!(uf.reload().status, 200);
    assert!(status(&get(uf.addr, u, &[])).contains("hit"));
    assert_eq!(fetched(&a, "/cache/z"), 1);
    // A reload that drops the route's cache empties its zone.
    uf.write_config(&format!(
        "{}[[routes]]\nname = \"other\"\npath = \"/\"\npool = \"a\"\n",
        pool_toml("a", &[&a], "")
    ));
    assert_eq!(uf.reload().status, 200);
    let zones = admin_json(&uf, "GET", "/admin/cache", "");
    assert_eq!(zones["zones"][0]["objects"], 0, "{zones}");
    assert!(get(uf.addr, u, &[]).header("cache-status").is_none());
}

#[test]
fn http2_clients_are_served_from_the_same_zone() {
    let a = Origin::start("a");
    let port = free_port();
    let uf = Ultrafast::start(&format!(
        "[[listeners]]\nname = \"h2c\"\naddress = \"127.0.0.1:{port}\"\nh2c = true\n\n{}[[routes]]\nname = \"site\"\npath = \"/\"\npool = \"a\"\ncache = {{ }}\n",
        pool_toml("a", &[&a], "")
    ));
    let u = "/cache/h2?cc=max-age%3D60&len=3000";
    // Stored by an HTTP/1.1 client (Host: test.local, as curl's below).
    let first = get(uf.addr, u, &[("Host", "test.local")]);
    let url = format!("http://127.0.0.1:{port}{u}");
    let out = std::process::Command::new("curl")
        .args([
            "-s",
            "-D",
            "-",
            "--max-time",
            "10",
            "--http2-prior-knowledge",
        ])
        .args(["-H", "host: test.local", &url])
        .output()
        .unwrap()
        .stdout;
    let split = out.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&out[..split]).to_ascii_lowercase();
    assert!(head.starts_with("http/2 200"), "{head}");
    assert!(
        head.contains("cache-status: ultrafast; hit; ttl="),
        "{head}"
    );
    assert_eq!(&out[split + 4..], &first.body[..]);
    assert_eq!(fetched(&a, "/cache/h2"), 1);
}

#[test]
fn no_host_can_bend_the_key_and_equivalent_paths_share_one_entry() {
    let (a, uf) = edge("");
    let u = url("/b/x", &[("cc", "max-age=60")]);
    // The audit's poisoning: a Host with a path in it is refused, not stored
    // where `/a/b` of the plain host would find it.
    let bent = get(uf.addr, &u, &[("Host", "example.com/a")]);
    assert_eq!(bent.status, 400, "{bent:?}");
    for bad in ["exa mple.com", "example.com:80:80", "[::1", "a..b"] {
        assert_eq!(get(uf.addr, "/", &[("Host", bad)]).status, 400, "{bad}");
    }
    let ab = url("/cache/b", &[("cc", "max-age=60")]);
    let first = get(uf.addr, &ab, &[("Host", "example.com")]);
    assert!(status(&first).contains("fwd=miss"), "{first:?}");
    // The normalized path is the key: these are one object to nginx and to
    // the origin.
    for same in ["//cache/b", "/cache/./b", "/x/../cache/b", "/%63ache/b"] {
        let u = url(same, &[("cc", "max-age=60")]);
        let r = get(uf.addr, &u, &[("Host", "example.com")]);
        assert!(status(&r).starts_with("ultrafast; hit"), "{same}: {r:?}");
        assert_eq!(r.body, first.body);
    }
    assert_eq!(fetched(&a, "/cache/b"), 1, "{:?}", a.order());
}

#[test]
fn a_repeated_vary_header_keys_on_every_line() {
    let (a, uf) = edge("");
    let u = url(
        "/cache/v",
        &[("cc", "max-age=60"), ("vary", "Accept-Language")],
    );
    // Stored for a client that sent the header twice: empty, then `fr`.
    let twice = get(
        uf.addr,
        &u,
        &[("Accept-Language", ""), ("Accept-Language", "fr")],
    );
    assert!(status(&twice).contains("stored"), "{twice:?}");
    // A client that sent only the empty line is another variant.
    let once = get(uf.addr, &u, &[("Accept-Language", "")]);
    assert!(status(&once).contains("fwd=miss"), "{once:?}");
    // And one without the header another again.
    let none = get(uf.addr, &u, &[]);
    assert!(status(&none).contains("fwd=miss"), "{none:?}");
    let again = get(
        uf.addr,
        &u,
        &[("Accept-Language", ""), ("Accept-Language", "fr")],
    );
    assert!(status(&again).starts_with("ultrafast; hit"), "{again:?}");
    assert_eq!(fetched(&a, "/cache/v"), 3);
}
