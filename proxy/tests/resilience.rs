//! Health checks, passive ejection, retries and the retry budget, and
//! upstream faults, with real origins that fail on command.

#![allow(clippy::unwrap_used)]
mod common;
use common::*;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

fn route(pool: &str) -> String {
    format!("[[routes]]\npath = \"/\"\npool = \"{pool}\"\n")
}

#[test]
fn active_health_check_ejects_and_recovers() {
    let (a, b) = (Origin::start("a"), Origin::start("b"));
    let hc = "health_check = { path = \"/health\", interval_ms = 50, timeout_ms = 200, rise = 2, fall = 2 }\npassive = { max_fails = 0 }";
    let uf = Ultrafast::start(&format!("{}{}", pool_toml("p", &[&a, &b], hc), route("p")));
    let label = format!("member=\"{}\"", a.addr);
    a.state.health_status.store(503, Ordering::SeqCst);
    assert!(eventually(Duration::from_secs(5), || uf
        .metric("ultrafast_upstream_member_healthy", &[&label])
        == 0.0));
    let before = a.requests();
    for _ in 0..20 {
        assert_eq!(uf.get("/").origin(), "b");
    }
    assert_eq!(a.requests(), before, "a down member got traffic");
    a.state.health_status.store(200, Ordering::SeqCst);
    assert!(eventually(Duration::from_secs(5), || uf
        .metric("ultrafast_upstream_member_healthy", &[&label])
        == 1.0));
    let served: Vec<String> = (0..10).map(|_| uf.get("/").origin()).collect();
    assert!(
        served.iter().any(|o| o == "a"),
        "recovered member gets traffic again"
    );
}

#[test]
fn passive_ejection_after_consecutive_failures() {
    let (mut a, b) = (Origin::start("a"), Origin::start("b"));
    let extra = "passive = { max_fails = 2, cooldown_ms = 60000 }\nretry = { attempts = 2, budget_ratio = 1.0 }";
    let uf = Ultrafast::start(&format!(
        "{}{}",
        pool_toml("p", &[&a, &b], extra),
        route("p")
    ));
    a.stop();
    // Every request still succeeds (connect failures are retried on b)...
    for _ in 0..20 {
        assert_eq!(uf.get("/").origin(), "b");
    }
    // ...and after two failures a is skipped for the cooldown.
    let label = format!("member=\"{}\"", a.addr);
    assert_eq!(
        uf.metric("ultrafast_upstream_ejections_total", &[&label]),
        1.0
    );
    assert_eq!(
        uf.metric(
            "ultrafast_upstream_retries_total",
            &["outcome=\"attempted\""]
        ),
        2.0
    );
}

#[test]
fn concurrent_failures_eject_a_member_once() {
    let (mut a, b) = (Origin::start("a"), Origin::start("b"));
    let extra = "lb = \"round_robin\"\npassive = { max_fails = 2, cooldown_ms = 60000 }\nretry = { attempts = 2, budget_ratio = 1.0 }";
    let uf = Ultrafast::start(&format!(
        "{}{}",
        pool_toml("p", &[&a, &b], extra),
        route("p")
    ));
    a.stop();
    // Sixteen requests at once: many fail on a together.
    let addr = uf.addr;
    let threads: Vec<_> = (0..16)
        .map(|_| std::thread::spawn(move || get(addr, "/", &[]).origin()))
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), "b");
    }
    let label = format!("member=\"{}\"", a.addr);
    assert_eq!(
        uf.metric("ultrafast_upstream_ejections_total", &[&label]),
        1.0
    );
    assert!(eventually(Duration::from_secs(3), || uf
        .stderr()
        .contains("ejected")));
    assert_eq!(
        uf.stderr().matches("ejected for").count(),
        1,
        "{}",
        uf.stderr()
    );
}

#[test]
fn refused_connection_is_retried_on_another_member() {
    let (mut a, b) = (Origin::start("a"), Origin::start("b"));
    let extra = "lb = \"round_robin\"\npassive = { max_fails = 0 }\nretry = { attempts = 2, budget_ratio = 1.0 }";
    let uf = Ultrafast::start(&format!(
        "{}{}",
        pool_toml("p", &[&a, &b], extra),
        route("p")
    ));
    a.stop();
    let mut c = Client::connect(uf.addr).unwrap();
    for _ in 0..10 {
        // POST too: the refused upstream never saw it, so a retry is safe.
        let r = c.request("POST", "/", &[], b"payload").unwrap();
        assert_eq!((r.status, r.origin()), (200, "b".to_string()));
    }
    assert!(
        uf.metric(
            "ultrafast_upstream_retries_total",
            &["outcome=\"attempted\""]
        ) >= 5.0
    );
}

#[test]
fn post_is_never_retried_after_the_upstream_got_it() {
    let (a, b) = (Origin::start("a"), Origin::start("b"));
    a.set_fault(Fault::ResetAfterRequest);
    b.set_fault(Fault::ResetAfterRequest);
    let extra = "lb = \"round_robin\"\npassive = { max_fails = 0 }\nretry = { attempts = 2, budget_ratio = 1.0 }";
    let uf = Ultrafast::start(&format!(
        "{}{}",
        pool_toml("p", &[&a, &b], extra),
        route("p")
    ));
    let r = Client::connect(uf.addr)
        .unwrap()
        .request("POST", "/", &[], b"charge-card")
        .unwrap();
    assert_eq!(r.status, 502);
    assert_eq!(
        a.requests() + b.requests(),
        1,
        "the POST was delivered twice"
    );
    // The same failure on a GET is retried on the other member.
    a.set_fault(Fault::None);
    b.set_fault(Fault::None);
    a.set_fault(Fault::ResetAfterRequest);
    let before = (a.requests(), b.requests());
    let mut got_b = false;
    for _ in 0..4 {
        let r = uf.get("/");
        assert_eq!(r.status, 200);
        got_b |= r.origin() == "b";
    }
    assert!(got_b);
    assert!(a.requests() > before.0, "a was tried first at least once");
}

#[test]
fn retry_budget_caps_retries() {
    let (mut a, b) = (Origin::start("a"), Origin::start("b"));
    let extra = "lb = \"round_robin\"\npassive = { max_fails = 0 }\nretry = { attempts = 2, budget_ratio = 0.1, budget_min_per_s = 0 }";
    let uf = Ultrafast::start(&format!(
        "{}{}",
        pool_toml("p", &[&a, &b], extra),
        route("p")
    ));
    a.stop();
    let mut c = Client::connect(uf.addr).unwrap();
    let mut failed = 0;
    for _ in 0..100 {
        let r = c.request("GET", "/", &[], b"").unwrap();
        if r.status != 200 {
            assert_eq!(r.status, 502);
            assert_eq!(r.json()["error"]["code"], "bad_gateway");
            failed += 1;
            c = Client::connect(uf.addr).unwrap();
        }
    }
    let retried = uf.metric(
        "ultrafast_upstream_retries_total",
        &["outcome=\"attempted\""],
    );
    let denied = uf.metric(
        "ultrafast_upstream_retries_total",
        &["outcome=\"denied_by_budget\""],
    );
    // Half the requests hit the dead member; only 10% of traffic may retry.
    assert!(retried <= 10.0, "retried {retried}");
    assert!(denied >= 35.0, "denied {denied}");
    assert_eq!(failed as f64, denied);
}

#[test]
fn upstream_reset_mid_response_never_hangs() {
    let a = Origin::start("a");
    a.set_fault(Fault::TruncateBody);
    let uf = Ultrafast::start(&format!(
        "{}{}",
        pool_toml("p", &[&a], "read_timeout_ms = 2000"),
        route("p")
    ));
    let start = Instant::now();
    let mut c = Client::connect(uf.addr).unwrap();
    let r = c.request("GET", "/", &[], b"");
    // Headers were already sent: the client sees a short body and a closed
    // connection (a clean error), never a hang or a retry.
    match r {
        Ok(resp) => assert_eq!(resp.status, 200),
        Err(e) => assert!(
            matches!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
            ),
            "{e}"
        ),
    }
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "took {:?}",
        start.elapsed()
    );
    assert_eq!(
        a.requests(),
        1,
        "a response in progress must not be retried"
    );
    a.set_fault(Fault::None);
    assert_eq!(uf.get("/").status, 200, "still serving");
}

#[test]
fn upstream_timeout_is_a_504() {
    let a = Origin::start("a");
    a.state.delay_ms.store(1500, Ordering::SeqCst);
    let uf = Ultrafast::start(&format!(
        "{}{}",
        pool_toml(
            "p",
            &[&a],
            "read_timeout_ms = 300\nretry = { attempts = 1 }"
        ),
        route("p")
    ));
    let start = Instant::now();
    let r = uf.get("/");
    assert_eq!(r.status, 504);
    assert!(start.elapsed() < Duration::from_millis(1400));
}

/// A response cut after its head: the client sees the head and then a
/// closed connection (the body it was promised never comes), within the
/// bound, and the request is not sent again (a byte already went out).
fn cut_response(uf: &Ultrafast, method: &str, limit: Duration) {
    let start = Instant::now();
    let mut c = Client::connect(uf.addr).unwrap();
    let body: &[u8] = if method == "POST" { b"order" } else { b"" };
    let r = c.request(method, "/", &[], body);
    match r {
        Ok(resp) => assert!(
            matches!(resp.status, 502 | 504),
            "{method}: a whole {} response from a cut one",
            resp.status
        ),
        Err(e) => assert!(
            matches!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
            ),
            "{method}: {e}"
        ),
    }
    assert!(
        start.elapsed() < limit,
        "{method}: took {:?}",
        start.elapsed()
    );
}

#[test]
fn upstream_stalling_after_the_head_is_cut_at_the_read_timeout() {
    let a = Origin::start("a");
    a.set_fault(Fault::StallAfterHead);
    let uf = Ultrafast::start(&format!(
        "{}{}",
        pool_toml("p", &[&a], "read_timeout_ms = 500"),
        route("p")
    ));
    cut_response(&uf, "GET", Duration::from_secs(3));
    assert_eq!(a.requests(), 1, "a started response must not be retried");
    a.set_fault(Fault::None);
    assert_eq!(uf.get("/").status, 200, "still serving");
}

#[test]
fn upstream_closing_after_the_head_is_a_clean_error() {
    let (a, b) = (Origin::start("a"), Origin::start("b"));
    a.set_fault(Fault::CloseAfterHead);
    b.set_fault(Fault::CloseAfterHead);
    let extra = "passive = { max_fails = 0 }\nretry = { attempts = 2, budget_ratio = 1.0 }";
    let uf = Ultrafast::start(&format!(
        "{}{}",
        pool_toml("p", &[&a, &b], extra),
        route("p")
    ));
    for method in ["GET", "POST"] {
        let before = a.requests() + b.requests();
        cut_response(&uf, method, Duration::from_secs(3));
        assert_eq!(
            a.requests() + b.requests(),
            before + 1,
            "{method}: sent again after its head went out"
        );
    }
}

#[test]
fn upstream_reset_before_any_byte_retries_a_get_but_never_a_post() {
    let (a, b) = (Origin::start("a"), Origin::start("b"));
    a.set_fault(Fault::RstAfterRequest);
    b.set_fault(Fault::RstAfterRequest);
    let extra = "lb = \"round_robin\"\npassive = { max_fails = 0 }\nretry = { attempts = 2, budget_ratio = 1.0 }";
    let uf = Ultrafast::start(&format!(
        "{}{}",
        pool_toml("p", &[&a, &b], extra),
        route("p")
    ));
    let start = Instant::now();
    let r = Client::connect(uf.addr)
        .unwrap()
        .request("POST", "/", &[], b"charge-card")
        .unwrap();
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(
        a.requests() + b.requests(),
        1,
        "the POST was delivered twice"
    );
    // Both members reset: a GET is tried on each, then fails cleanly.
    let r = uf.get("/");
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(a.requests() + b.requests(), 3, "the GET was tried on both");
    // Only a resets: every GET is answered, by b when a was picked first.
    b.set_fault(Fault::None);
    for _ in 0..4 {
        let r = uf.get("/");
        assert_eq!((r.status, r.origin()), (200, "b".to_string()));
    }
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn upstream_reset_mid_response_is_never_retried_get_or_post() {
    let (a, b) = (Origin::start("a"), Origin::start("b"));
    a.set_fault(Fault::RstMidBody);
    b.set_fault(Fault::RstMidBody);
    let extra = "passive = { max_fails = 0 }\nretry = { attempts = 2, budget_ratio = 1.0 }";
    let uf = Ultrafast::start(&format!(
        "{}{}",
        pool_toml("p", &[&a, &b], extra),
        route("p")
    ));
    for method in ["GET", "POST"] {
        let before = a.requests() + b.requests();
        cut_response(&uf, method, Duration::from_secs(3));
        assert_eq!(
            a.requests() + b.requests(),
            before + 1,
            "{method}: sent again after its head went out"
        );
    }
    a.set_fault(Fault::None);
    b.set_fault(Fault::None);
    assert_eq!(uf.get("/").status, 200, "still serving");
}

#[test]
fn a_client_that_hangs_up_is_neither_retried_nor_held_against_the_member() {
    let (a, b) = (Origin::start("a"), Origin::start("b"));
    a.state.delay_ms.store(800, Ordering::SeqCst);
    b.state.delay_ms.store(800, Ordering::SeqCst);
    let uf = Ultrafast::start(&format!(
        "{}{}",
        pool_toml(
            "p",
            &[&a, &b],
            "passive = { max_fails = 1 }\nretry = { attempts = 2 }"
        ),
        route("p")
    ));
    for _ in 0..3 {
        let mut c = Client::connect(uf.addr).unwrap();
        c.send_raw(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
            .unwrap();
        std::thread::sleep(Duration::from_millis(200));
        drop(c);
    }
    // Each aborted GET reached one member, once.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        a.requests() + b.requests(),
        3,
        "an aborted request was retried"
    );
    let retries = uf.metric("ultrafast_upstream_retries_total", &["attempted"]);
    assert_eq!(retries, 0.0);
    assert_eq!(uf.metric("ultrafast_upstream_ejections_total", &[]), 0.0);
    // And both members still serve.
    let served: Vec<String> = (0..4).map(|_| uf.get("/").origin()).collect();
    assert!(
        served.iter().any(|o| o == "a") && served.iter().any(|o| o == "b"),
        "{served:?}"
    );
}
