//! Hot reload: zero failed requests over 100 reloads under load, an SSE
//! stream that outlives reloads, refused bad configs, state that survives an
//! unrelated change, and every trigger (admin API, SIGHUP, CLI, watcher).

#![allow(clippy::unwrap_used)]
mod common;
use common::*;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn body(pools: &str, tag: &str) -> String {
    format!(
        "{pools}[[routes]]\nname = \"main\"\npath = \"/\"\npool = \"p\"\nheaders.response.set = {{ \"x-config\" = \"{tag}\" }}\n"
    )
}

#[test]
fn hundred_reloads_under_load_fail_no_request() {
    let (a, b) = (Origin::start("a"), Origin::start("b"));
    let pools = pool_toml("p", &[&a, &b], "");
    let uf = Ultrafast::start(&body(&pools, "a"));
    let (stop, ok, failed) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let seen = Arc::new(Mutex::new(std::collections::BTreeSet::new()));
    let addr = uf.addr;
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let (stop, ok, failed, seen) = (stop.clone(), ok.clone(), failed.clone(), seen.clone());
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(60);
                let mut c = Client::connect(addr).unwrap();
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) && Instant::now() < deadline && n < 50_000 {
                    n += 1;
                    match c.request("GET", "/", &[], b"") {
                        Ok(r) if r.status == 200 => {
                            ok.fetch_add(1, Ordering::SeqCst);
                            seen.lock()
                                .unwrap()
                                .insert(r.header("x-config").unwrap_or("").to_string());
                        }
                        _ => {
                            failed.fetch_add(1, Ordering::SeqCst);
                            c = Client::connect(addr).unwrap();
                        }
                    }
                }
            })
        })
        .collect();
    for i in 0..100 {
        let tag = if i % 2 == 0 { "b" } else { "a" };
        uf.write_config(&body(&pools, tag));
        let r = uf.reload();
        assert_eq!(r.status, 200, "reload {i}: {}", r.text());
        std::thread::sleep(Duration::from_millis(10));
    }
    stop.store(true, Ordering::SeqCst);
    for w in workers {
        w.join().unwrap();
    }
    assert_eq!(
        failed.load(Ordering::SeqCst),
        0,
        "{} ok",
        ok.load(Ordering::SeqCst)
    );
    assert!(ok.load(Ordering::SeqCst) > 500);
    assert_eq!(
        *seen.lock().unwrap(),
        ["a", "b"].iter().map(|s| s.to_string()).collect()
    );
    assert_eq!(
        uf.metric("ultrafast_config_reloads_total", &["result=\"ok\""]),
        100.0
    );
    assert_eq!(
        uf.get("/").header("x-config"),
        Some("a"),
        "the last config serves"
    );
}

#[test]
fn a_stream_in_flight_survives_reloads() {
    let a = Origin::start("a");
    let pools = pool_toml("p", &[&a], "");
    let uf = Ultrafast::start(&body(&pools, "a"));
    let addr = uf.addr;
    let stream = std::thread::spawn(move || get(addr, "/stream", &[]));
    std::thread::sleep(Duration::from_millis(150));
    for i in 0..5 {
        uf.write_config(&body(&pools, if i % 2 == 0 { "b" } else { "a" }));
        assert_eq!(uf.reload().status, 200);
        std::thread::sleep(Duration::from_millis(50));
    }
    let r = stream.join().unwrap();
    assert_eq!(r.status, 200);
    let text = r.text();
    for i in 0..20 {
        assert!(
            text.contains(&format!("data: a-{i}\n\n")),
            "event {i} missing: {text}"
        );
    }
}

#[test]
fn an_invalid_config_changes_nothing_and_says_where() {
    let a = Origin::start("a");
    let uf = Ultrafast::start(&body(&pool_toml("p", &[&a], ""), "a"));
    uf.write_config("[[routes]]\npath = \"/\"\npool = \"missing\"\n");
    let r = uf.reload();
    assert_eq!(r.status, 400);
    let v = r.json();
    assert_eq!(v["status"], "error");
    let e = &v["errors"][0];
    assert_eq!(e["field"], "routes[0].pool");
    assert!(e["line"].as_u64().unwrap() > 1);
    assert!(e["text"]
        .as_str()
        .unwrap()
        .contains(&format!("{}:", uf.config.display())));
    let served = uf.get("/");
    assert_eq!((served.status, served.header("x-config")), (200, Some("a")));
    assert_eq!(
        uf.metric("ultrafast_config_reloads_total", &["result=\"error\""]),
        1.0
    );
    // Each kind of mistake from the issue: refused with its location.
    let cases = [
        (
            "[[listeners]]\naddress = \"127.0.0.1:1\"\n[[listeners]]\naddress = \"127.0.0.1:1\"\n",
            "listeners[2].address",
        ),
        (
            "[[routes]]\npath = \"(\"\nmatch = \"regex\"\nreturn = { status = 200 }\n",
            "routes[0].path",
        ),
        (
            "[pools.q]\nmembers = [{ addr = \"no-such-host.invalid:80\" }]\n",
            "pools.q.members[0].addr",
        ),
    ];
    for (text, field) in cases {
        uf.write_config(text);
        let r = uf.reload();
        assert_eq!(r.status, 400, "{field}");
        assert_eq!(r.json()["errors"][0]["field"], field);
    }
    assert_eq!(uf.get("/").header("x-config"), Some("a"));
}

#[test]
fn pool_state_survives_an_unrelated_change() {
    let (mut a, b) = (Origin::start("a"), Origin::start("b"));
    let extra = "passive = { max_fails = 1, cooldown_ms = 60000 }\nretry = { attempts = 2, budget_ratio = 1.0 }";
    let pools = pool_toml("p", &[&a, &b], extra);
    let uf = Ultrafast::start(&body(&pools, "a"));
    a.stop();
    for _ in 0..4 {
        assert_eq!(uf.get("/").status, 200);
    }
    let retries = uf.metric(
        "ultrafast_upstream_retries_total",
        &["outcome=\"attempted\""],
    );
    assert_eq!(retries, 1.0, "a was ejected after one failure");
    let conns = b.connections();
    uf.write_config(&body(&pools, "b"));
    let r = uf.reload();
    assert_eq!(r.status, 200);
    assert!(r.json()["diff"]["pools_changed"]
        .as_array()
        .unwrap()
        .is_empty());
    let mut c = Client::connect(uf.addr).unwrap();
    for _ in 0..10 {
        let r = c.request("GET", "/", &[], b"").unwrap();
        assert_eq!((r.status, r.header("x-config")), (200, Some("b")));
    }
    assert_eq!(
        uf.metric(
            "ultrafast_upstream_retries_total",
            &["outcome=\"attempted\""]
        ),
        retries,
        "the ejection was forgotten"
    );
    assert_eq!(b.connections(), conns, "keepalive connections were dropped");
}

#[test]
fn sighup_cli_and_watcher_all_reload() {
    let a = Origin::start("a");
    let pools = pool_toml("p", &[&a], "");
    let uf = Ultrafast::start(&body(&pools, "a"));
    uf.write_config(&body(&pools, "hup"));
    uf.signal(1);
    assert!(eventually(Duration::from_secs(5), || uf
        .get("/")
        .header("x-config")
        == Some("hup")));
    uf.write_config(&body(&pools, "cli"));
    let out = std::process::Command::new(bin())
        .args(["reload", "-c"])
        .arg(&uf.config)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"status\":\"ok\""));
    assert_eq!(uf.get("/").header("x-config"), Some("cli"));
    // The watcher is itself enabled by a reload.
    uf.write_config(&format!(
        "[reload]\nwatch = true\nwatch_interval_ms = 100\n{}",
        body(&pools, "w1")
    ));
    assert_eq!(uf.reload().status, 200);
    std::thread::sleep(Duration::from_millis(50));
    uf.write_config(&format!(
        "[reload]\nwatch = true\nwatch_interval_ms = 100\n{}",
        body(&pools, "watched")
    ));
    assert!(eventually(Duration::from_secs(5), || uf
        .get("/")
        .header("x-config")
        == Some("watched")));
    // /admin/config shows the active config, with its hash.
    let view = get(uf.admin, "/admin/config", &[]).json();
    let hash = view["hash"].as_str().unwrap().to_string();
    assert_eq!(
        uf.metric("ultrafast_config_info", &[&format!("hash=\"{hash}\"")]),
        1.0
    );
    // A header rule's value is redacted (it may be a credential); its
    // name is shown.
    assert_eq!(
        view["config"]["routes"][0]["headers"]["response"]["set"]["x-config"],
        "<redacted>"
    );
}

#[test]
fn listener_changes_are_reported_as_pending_not_ignored() {
    let a = Origin::start("a");
    let pools = pool_toml("p", &[&a], "");
    let uf = Ultrafast::start(&body(&pools, "a"));
    let moved = uf.head.replace(
        &format!("127.0.0.1:{}\"", uf.addr.port()),
        &format!("127.0.0.1:{}\"", free_port()),
    );
    std::fs::write(&uf.config, format!("{moved}{}", body(&pools, "b"))).unwrap();
    let r = uf.reload();
    assert_eq!(r.status, 200);
    let pending = r.json()["diff"]["pending_upgrade"].to_string();
    assert!(pending.contains("listeners changed"), "{pending}");
    assert_eq!(
        uf.get("/").header("x-config"),
        Some("b"),
        "the rest applied, on the old address"
    );
}

#[test]
fn redaction_hides_secret_looking_values() {
    let mut v = serde_json::json!({"tls": {"key_file": "/k.pem", "ticket_key_file": "/t"}, "pools": {"p": {"hash_key": "client_ip"}}, "api_token": "x"});
    ultrafast::admin::redact(&mut v);
    assert_eq!(v["tls"]["key_file"], "<redacted>");
    assert_eq!(v["api_token"], "<redacted>");
    assert_eq!(v["pools"]["p"]["hash_key"], "client_ip");
    // A URL's credentials, whatever the field is called.
    let mut v = serde_json::json!({"cluster": {"redis": "redis://user:hunter2@10.0.0.1:6379/0"},
        "pools": {"p": {"members": [{"addr": "https://a:b@h/x@y"}]}}, "plain": "http://h/p@q"});
    ultrafast::admin::redact(&mut v);
    assert_eq!(v["cluster"]["redis"], "redis://<redacted>@10.0.0.1:6379/0");
    assert_eq!(
        v["pools"]["p"]["members"][0]["addr"],
        "https://<redacted>@h/x@y"
    );
    assert_eq!(
        v["plain"], "http://h/p@q",
        "an @ in the path is no userinfo"
    );
    // Redacted by what a value is: header rules' values (names shown), a
    // URL's query, whatever the field is called.
    let mut v = serde_json::json!({"routes": [{"headers": {"request": {"set": {"cookie": "sid=1", "x-auth": "s3cr3t"},
        "remove": ["x-drop"]}, "response": {"add": {"x-served-by": "edge"}}}}],
        "tracing": {"otlp_endpoint": "https://collector:4318/v1/traces?api_key=abc"}, "max_keys": 5});
    ultrafast::admin::redact(&mut v);
    let h = &v["routes"][0]["headers"];
    assert_eq!(h["request"]["set"]["cookie"], "<redacted>");
    assert_eq!(h["request"]["set"]["x-auth"], "<redacted>");
    assert_eq!(h["response"]["add"]["x-served-by"], "<redacted>");
    assert_eq!(h["request"]["remove"][0], "x-drop", "names are shown");
    assert_eq!(
        v["tracing"]["otlp_endpoint"],
        "https://collector:4318/v1/traces?<redacted>"
    );
    assert_eq!(v["max_keys"], 5);
}

#[test]
fn the_admin_config_hides_the_redis_password_and_a_tokenless_admin_refuses_pages() {
    let uf = Ultrafast::start(
        "[cluster]\nredis = \"redis://user:hunter2@127.0.0.1:1/0\"\n\n[[routes]]\npath = \"/\"\nreturn = { status = 200, body = \"x\" }\n",
    );
    let cfg = get(uf.admin, "/admin/config", &[]);
    assert_eq!(cfg.status, 200);
    assert!(!cfg.text().contains("hunter2"), "{}", cfg.text());
    // A page elsewhere: DNS rebinding (its own name as Host), a cross-site
    // form, a cross-origin fetch.
    let rebound = get(uf.admin, "/admin/config", &[("Host", "evil.example:9090")]);
    assert_eq!(rebound.status, 403);
    let pages: [(&str, (&str, &str), &[u8]); 2] = [
        ("/admin/reload", ("Sec-Fetch-Site", "cross-site"), b""),
        (
            "/admin/cache/purge",
            ("Origin", "https://evil.example"),
            b"{\"all\":true}",
        ),
    ];
    for (path, header, body) in pages {
        let r = Client::connect(uf.admin)
            .unwrap()
            .request("POST", path, &[header], body)
            .unwrap();
        assert_eq!(r.status, 403, "{path} {header:?}");
    }
    // The machine's own tools and its probes still get through.
    let own = get(
        uf.admin,
        "/admin/config",
        &[("Host", "localhost:1"), ("Origin", "http://127.0.0.1:1")],
    );
    assert_eq!(own.status, 200);
    assert_eq!(
        get(uf.admin, "/healthz", &[("Host", "10.1.2.3:9090")]).status,
        200
    );
    assert_eq!(
        get(uf.admin, "/metrics", &[("Sec-Fetch-Site", "same-origin")]).status,
        200
    );
}
