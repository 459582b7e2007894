//! Admission end to end: bursts and Retry-After, lane priority under
//! saturation, max-wait refusals (at the door and after waiting), a client
//! that leaves while queued, and bad input that must not take a slot.

#![allow(clippy::unwrap_used)]
mod common;
use common::*;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

fn saturated_pool(o: &Origin, extra_lanes: &str, delay_ms: u64) -> String {
    o.state.delay_ms.store(delay_ms, Ordering::SeqCst);
    format!(
        "{extra_lanes}\n{}[[routes]]\npath = \"/\"\npool = \"p\"\n",
        pool_toml("p", &[o], "max_concurrency = 1\nretry = { attempts = 1 }")
    )
}

#[test]
fn burst_is_admitted_exactly_then_refused_with_a_usable_retry_after() {
    let uf = Ultrafast::start(
        "[rate_limits.per_ip]\nkey = \"client_ip\"\nrate_per_s = 2.0\nburst = 5\n\n\
         [[routes]]\npath = \"/\"\nrate_limits = [\"per_ip\"]\nreturn = { status = 200, body = \"ok\" }\n",
    );
    let mut c = Client::connect(uf.addr).unwrap();
    for i in 0..5 {
        assert_eq!(
            c.request("GET", "/", &[], b"").unwrap().status,
            200,
            "request {i} of the burst"
        );
    }
    let r = c.request("GET", "/", &[], b"").unwrap();
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-ultrafast-shed"), Some("rate_limit"));
    assert_eq!(r.header("retry-after"), Some("1"));
    let body = r.json();
    assert_eq!(body["error"]["code"], "rate_limit");
    assert_eq!(body["error"]["type"], "rate_limit_exceeded");
    let wait = body["retry_after_ms"].as_u64().unwrap();
    assert!((100..=500).contains(&wait), "retry_after_ms {wait} for 2/s");
    std::thread::sleep(Duration::from_millis(wait + 20));
    assert_eq!(
        c.request("GET", "/", &[], b"").unwrap().status,
        200,
        "allowed again after Retry-After"
    );
    assert_eq!(
        uf.metric("ultrafast_admission_shed_total", &["reason=\"rate_limit\""]),
        1.0
    );
}

#[test]
fn ultra_is_served_before_queued_standard_requests() {
    let o = Origin::start("o");
    let uf = Ultrafast::start(&saturated_pool(&o, "", 200));
    let addr = uf.addr;
    let send = |path: &'static str, lane: &'static str| {
        std::thread::spawn(move || get(addr, path, &[("X-Request-Priority", lane)]).status)
    };
    let mut hs = vec![send("/s0", "standard")];
    assert!(eventually(Duration::from_secs(2), || o.requests() == 1));
    for p in ["/s1", "/s2", "/s3"] {
        hs.push(send(p, "standard"));
        std::thread::sleep(Duration::from_millis(20));
    }
    hs.push(send("/u", "ultra"));
    for h in hs {
        assert_eq!(h.join().unwrap(), 200);
    }
    assert_eq!(o.order(), vec!["/s0", "/u", "/s1", "/s2", "/s3"]);
    assert_eq!(
        uf.metric("ultrafast_admission_admitted_total", &["lane=\"ultra\""]),
        1.0
    );
}

#[test]
fn a_request_that_cannot_be_served_in_time_is_refused_at_the_door() {
    let o = Origin::start("o");
    let lanes = "[lanes.standard]\nrank = 1\nmax_wait_ms = 1000\n[lanes.ultra]\nrank = 0\n";
    let uf = Ultrafast::start(&saturated_pool(&o, lanes, 250));
    let addr = uf.addr;
    // Phase 1: four requests at once teach the gate the drain rate (~4/s).
    let hs: Vec<_> = (0..4)
        .map(|i| {
            std::thread::sleep(Duration::from_millis(10));
            std::thread::spawn(move || get(addr, &format!("/warm{i}"), &[]).status)
        })
        .collect();
    for h in hs {
        assert_eq!(h.join().unwrap(), 200);
    }
    // Phase 2: one in flight, three queued (0.25 s, 0.5 s, 0.75 s expected)...
    let hs: Vec<_> = (0..4)
        .map(|i| {
            std::thread::sleep(Duration::from_millis(10));
            std::thread::spawn(move || get(addr, &format!("/q{i}"), &[]).status)
        })
        .collect();
    assert!(eventually(Duration::from_secs(2), || uf.metric(
        "ultrafast_admission_queue_depth",
        &["lane=\"standard\""]
    ) == 3.0));
    // ...so a fifth (1.0 s expected + its own service) cannot make 1 s: refused in milliseconds.
    let start = Instant::now();
    let r = get(addr, "/late", &[]);
    let took = start.elapsed();
    assert_eq!(r.status, 503);
    assert_eq!(r.header("x-ultrafast-shed"), Some("max_wait"));
    assert!(r.json()["retry_after_ms"].as_u64().unwrap() > 0);
    assert!(took < Duration::from_millis(100), "refusal took {took:?}");
    for h in hs {
        assert_eq!(h.join().unwrap(), 200);
    }
    assert!(!o.order().contains(&"/late".to_string()));
}

#[test]
fn a_request_that_waits_past_max_wait_is_removed_and_refused() {
    let o = Origin::start("o");
    let lanes = "[lanes.standard]\nrank = 1\nmax_wait_ms = 200\n";
    let uf = Ultrafast::start(&saturated_pool(&o, lanes, 1000));
    let addr = uf.addr;
    let first = std::thread::spawn(move || get(addr, "/first", &[]).status);
    assert!(eventually(Duration::from_secs(2), || o.requests() == 1));
    let start = Instant::now();
    let r = get(addr, "/second", &[]);
    assert_eq!(r.status, 503);
    assert_eq!(r.header("x-ultrafast-shed"), Some("max_wait"));
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(180) && took < Duration::from_millis(600),
        "{took:?}"
    );
    assert_eq!(first.join().unwrap(), 200);
    assert_eq!(o.order(), vec!["/first"]);
    assert_eq!(uf.metric("ultrafast_admission_queue_depth", &[]), 0.0);
}

#[test]
fn a_client_that_disconnects_while_queued_frees_its_place() {
    let o = Origin::start("o");
    let uf = Ultrafast::start(&saturated_pool(&o, "", 500));
    let addr = uf.addr;
    let first = std::thread::spawn(move || get(addr, "/first", &[]).status);
    assert!(eventually(Duration::from_secs(2), || o.requests() == 1));
    {
        let mut c = Client::connect(addr).unwrap();
        c.send_raw(b"GET /leaver HTTP/1.1\r\nHost: t\r\n\r\n")
            .unwrap();
        assert!(eventually(Duration::from_secs(2), || uf
            .metric("ultrafast_admission_queue_depth", &[])
            == 1.0));
    } // connection closed here
    assert!(
        eventually(Duration::from_millis(300), || uf
            .metric("ultrafast_admission_queue_depth", &[])
            == 0.0),
        "the queued request was not removed when its client left"
    );
    let third = get(addr, "/third", &[]);
    assert_eq!(third.status, 200);
    assert_eq!(first.join().unwrap(), 200);
    assert_eq!(
        o.order(),
        vec!["/first", "/third"],
        "the origin saw the request of a client that had left"
    );
    assert_eq!(
        uf.metric("ultrafast_downstream_rejected_total", &["client_gone"]),
        1.0
    );
}

#[test]
fn bad_lane_and_bad_authorization_are_400s_that_take_no_slot() {
    let o = Origin::start("o");
    let cfg = format!(
        "[rate_limits.keys]\nkey = \"api_key\"\nrate_per_s = 100.0\nburst = 100\n\n{}[[routes]]\npath = \"/\"\npool = \"p\"\nrate_limits = [\"keys\"]\n",
        pool_toml("p", &[&o], "max_concurrency = 1")
    );
    let uf = Ultrafast::start(&cfg);
    let r = get(uf.addr, "/", &[("X-Request-Priority", "urgent!!")]);
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["code"], "invalid_priority");
    let long = "x".repeat(5000);
    for auth in [
        "Basic dXNlcjpwYXNz",
        "Bearer",
        "Bearer a b c",
        long.as_str(),
    ] {
        let r = get(uf.addr, "/", &[("Authorization", auth)]);
        assert_eq!(r.status, 400, "{auth:.20}");
        assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    }
    assert_eq!(o.requests(), 0);
    assert_eq!(uf.metric("ultrafast_pool_concurrency_in_use", &[]), 0.0);
    let r = get(
        uf.addr,
        "/",
        &[
            ("Authorization", "Bearer sk-test-1"),
            ("X-Request-Priority", "ultra"),
        ],
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        uf.metric("ultrafast_downstream_rejected_total", &["invalid_priority"]),
        1.0
    );
    assert_eq!(
        uf.metric("ultrafast_downstream_rejected_total", &["invalid_api_key"]),
        4.0
    );
}
