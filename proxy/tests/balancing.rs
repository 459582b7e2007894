//! Each load-balancing policy's distribution, consistent-hash stability, and
//! upstream keepalive reuse, measured at real origins.

#![allow(clippy::unwrap_used)]
mod common;
use common::*;
use std::collections::HashMap;
use std::sync::atomic::Ordering;

fn route(pool: &str) -> String {
    format!("[[routes]]\npath = \"/\"\npool = \"{pool}\"\n")
}

fn members(origins: &[(&Origin, u32)]) -> String {
    let m: Vec<String> = origins
        .iter()
        .map(|(o, w)| format!("{{ addr = \"{}\", weight = {w} }}", o.addr))
        .collect();
    format!("members = [{}]\n", m.join(", "))
}

fn tally(uf: &Ultrafast, n: usize, headers: &[(&str, &str)]) -> HashMap<String, usize> {
    let mut c = Client::connect(uf.addr).unwrap();
    let mut counts = HashMap::new();
    for _ in 0..n {
        let r = c.request("GET", "/", headers, b"").unwrap();
        *counts.entry(r.origin()).or_insert(0) += 1;
    }
    counts
}

#[test]
fn weighted_round_robin_follows_weights() {
    let (a, b, c) = (Origin::start("a"), Origin::start("b"), Origin::start("c"));
    let cfg = format!(
        "[pools.p]\nlb = \"round_robin\"\n{}{}",
        members(&[(&a, 3), (&b, 1), (&c, 1)]),
        route("p")
    );
    let uf = Ultrafast::start(&cfg);
    let t = tally(&uf, 100, &[]);
    assert_eq!((t["a"], t["b"], t["c"]), (60, 20, 20), "{t:?}");
}

#[test]
fn least_outstanding_avoids_the_busy_member() {
    let (slow, fast) = (Origin::start("slow"), Origin::start("fast"));
    slow.state.delay_ms.store(300, Ordering::SeqCst);
    let cfg = format!(
        "[pools.p]\nlb = \"least_outstanding\"\n{}{}",
        members(&[(&slow, 1), (&fast, 1)]),
        route("p")
    );
    let uf = Ultrafast::start(&cfg);
    // Four concurrent clients for a bounded number of requests each: the
    // slow member holds its requests longer, so it gets fewer of them.
    let addr = uf.addr;
    let handles: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(move || {
                let mut c = Client::connect(addr).unwrap();
                (0..10)
                    .map(|_| c.request("GET", "/", &[], b"").unwrap().origin())
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let all: Vec<String> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    let slow_n = all.iter().filter(|o| *o == "slow").count();
    assert_eq!(all.len(), 40);
    assert!(slow_n <= 8, "slow member got {slow_n} of 40");
}

#[test]
fn peak_ewma_prefers_the_fast_member() {
    let (slow, fast) = (Origin::start("slow"), Origin::start("fast"));
    slow.state.delay_ms.store(50, Ordering::SeqCst);
    let cfg = format!(
        "[pools.p]\nlb = \"peak_ewma\"\n{}{}",
        members(&[(&slow, 1), (&fast, 1)]),
        route("p")
    );
    let uf = Ultrafast::start(&cfg);
    let t = tally(&uf, 60, &[]);
    let slow_n = t.get("slow").copied().unwrap_or(0);
    assert!(slow_n <= 10, "slow member got {slow_n} of 60: {t:?}");
}

#[test]
fn consistent_hash_is_sticky_and_moves_about_one_nth_when_a_member_joins() {
    let origins: Vec<Origin> = (0..5).map(|i| Origin::start(&format!("m{i}"))).collect();
    let four: Vec<(&Origin, u32)> = origins[..4].iter().map(|o| (o, 1)).collect();
    let five: Vec<(&Origin, u32)> = origins.iter().map(|o| (o, 1)).collect();
    let conf = |m: &[(&Origin, u32)]| {
        format!(
            "[pools.p]\nlb = \"consistent_hash\"\nhash_key = \"header:x-user\"\nhash_load_factor = 100.0\n{}{}",
            members(m),
            route("p")
        )
    };
    let before = Ultrafast::start(&conf(&four));
    let after = Ultrafast::start(&conf(&five));
    let keys: Vec<String> = (0..300).map(|i| format!("user-{i}")).collect();
    let owner = |uf: &Ultrafast, k: &str| get(uf.addr, "/", &[("x-user", k)]).origin();
    let mut moved = 0;
    for k in &keys {
        let o1 = owner(&before, k);
        assert_eq!(o1, owner(&before, k), "same key, same member");
        let o2 = owner(&after, k);
        if o1 != o2 {
            assert_eq!(o2, "m4", "a key only ever moves to the new member");
            moved += 1;
        }
    }
    let frac = moved as f64 / keys.len() as f64;
    assert!(
        (0.1..0.32).contains(&frac),
        "moved {frac} of keys, expected ~1/5"
    );
}

#[test]
fn consistent_hash_bounded_load_spills_a_hot_key() {
    let (a, b) = (Origin::start("a"), Origin::start("b"));
    a.state.delay_ms.store(200, Ordering::SeqCst);
    b.state.delay_ms.store(200, Ordering::SeqCst);
    let cfg = format!(
        "[pools.p]\nlb = \"consistent_hash\"\nhash_key = \"cookie:sid\"\nhash_load_factor = 1.25\n{}{}",
        members(&[(&a, 1), (&b, 1)]),
        route("p")
    );
    let uf = Ultrafast::start(&cfg);
    let addr = uf.addr;
    // Eight concurrent requests for one hot key: with a 1.25 bound no member
    // may hold more than ceil(1.25 * n / 2) of them, so some spill over.
    let hs: Vec<_> = (0..8)
        .map(|i| {
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(i * 10));
                get(addr, "/", &[("Cookie", "theme=dark; sid=hot")]).origin()
            })
        })
        .collect();
    let got: Vec<String> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    let a_n = got.iter().filter(|o| *o == "a").count();
    assert!((1..8).contains(&a_n), "hot key was not spread: {got:?}");
}

#[test]
fn upstream_keepalive_reuses_connections() {
    let a = Origin::start("a");
    let uf = Ultrafast::start(&format!("{}{}", pool_toml("p", &[&a], ""), route("p")));
    let mut c = Client::connect(uf.addr).unwrap();
    for _ in 0..200 {
        assert_eq!(c.request("GET", "/", &[], b"").unwrap().status, 200);
    }
    assert_eq!(a.requests(), 200);
    assert!(
        a.connections() <= 3,
        "origin saw {} connections for 200 requests",
        a.connections()
    );
    let reused = uf.metric("ultrafast_upstream_connections_total", &["reused=\"true\""]);
    let fresh = uf.metric(
        "ultrafast_upstream_connections_total",
        &["reused=\"false\""],
    );
    assert!(
        reused >= 190.0 && fresh <= 3.0,
        "reused {reused} new {fresh}"
    );
}

#[test]
fn keepalive_off_opens_a_connection_per_request() {
    let a = Origin::start("a");
    let uf = Ultrafast::start(&format!(
        "{}{}",
        pool_toml("p", &[&a], "keepalive_idle_s = 0"),
        route("p")
    ));
    for _ in 0..20 {
        assert_eq!(uf.get("/").status, 200);
    }
    assert!(
        a.connections() >= 20,
        "origin saw {} connections",
        a.connections()
    );
}
