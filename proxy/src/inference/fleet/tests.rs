//! The fleet's decisions on hand-driven members (the simulator's tests,
//! `benches/tests/fleet.rs`, drive it with real step models).
#![allow(clippy::unwrap_used)]

use super::*;
use crate::admission::clock::ManualClock;

fn spec(k: usize) -> FleetSpec {
    FleetSpec {
        policy: Policy::PredictedLatency,
        k,
        block_tokens: 16,
        capacity_tokens: 16 * 1024,
        slots: 4,
        chunk: None,
        prefill_tps: 2_000.0,
        decode_tps: 50.0,
        window: Duration::from_secs(30),
    }
}

fn addrs(n: usize) -> Vec<SocketAddr> {
    (0..n)
        .map(|i| SocketAddr::from(([127, 0, 0, 1], 10_000 + i as u16)))
        .collect()
}

fn up(_: usize) -> Reported {
    Reported {
        up: true,
        ..Reported::default()
    }
}

fn ask<'a>(prompt: usize, ttft_ms: u64, tenant: &'a Tenant, blocks: &'a [u64]) -> Ask<'a> {
    Ask {
        rank: 1,
        prompt,
        max_out: 64,
        ttft: Some(Duration::from_millis(ttft_ms)),
        tpot: None,
        reserved: &[],
        tenant,
        blocks,
    }
}

/// Teach member `i` a step time: `n` inter-token gaps of `gap`.
fn teach(a: &Aligned, i: usize, gap: Duration, n: usize) {
    let r = &a.replicas[i].latency;
    let (_, t) = r.admit(None, 1, 10, 1000, None, &[], None, &Tenant::anonymous());
    let t = t.unwrap();
    t.dispatched();
    t.token(None, None);
    for _ in 0..n {
        t.token(Some(gap), None);
    }
}

#[test]
fn a_request_goes_where_the_prediction_is_lowest() {
    let f = Fleet::new(spec(8));
    let a = f.align(&addrs(3));
    teach(&a, 0, Duration::from_millis(20), 300);
    teach(&a, 1, Duration::from_millis(5), 300);
    teach(&a, 2, Duration::from_millis(60), 300);
    let anon = Tenant::anonymous();
    let p = f.place(&a, &up, &ask(200, 1_000, &anon, &[])).unwrap();
    assert_eq!(p.index, 1, "{p:?}");
}

#[test]
fn nothing_is_admitted_that_no_member_can_serve_in_time() {
    let f = Fleet::new(spec(8));
    let a = f.align(&addrs(2));
    teach(&a, 0, Duration::from_millis(200), 300);
    teach(&a, 1, Duration::from_millis(250), 300);
    let anon = Tenant::anonymous();
    let e = f.place(&a, &up, &ask(2_000, 100, &anon, &[])).unwrap_err();
    assert_eq!(e.scored, 2);
    assert!(e.predicted > Duration::from_millis(100), "{e:?}");
    assert!(!e.on_tpot);
    // A request with an inter-token target no member meets.
    let mut q = ask(10, 60_000, &anon, &[]);
    q.tpot = Some(Duration::from_millis(50));
    let e = f.place(&a, &up, &q).unwrap_err();
    assert!(e.on_tpot, "{e:?}");
    // A member down is never scored.
    let only0 = |i: usize| Reported {
        up: i == 0,
        ..up(i)
    };
    let p = f.place(&a, &only0, &ask(10, 60_000, &anon, &[])).unwrap();
    assert_eq!(p.index, 0);
}

#[test]
fn a_shared_prefix_returns_to_its_member_unless_it_lacks_headroom() {
    let f = Fleet::new(spec(1));
    let a = f.align(&addrs(6));
    let sys = "You answer questions about the attached manual. ".repeat(40);
    let p1 = prefix::blocks(format!("system\0{sys}\0user\0one\0").as_bytes(), 16);
    let anon = Tenant::anonymous();
    let first = f.place(&a, &up, &ask(600, 2_000, &anon, &p1)).unwrap();
    let home = first.index;
    drop(first);
    let p2 = prefix::blocks(format!("system\0{sys}\0user\0two\0").as_bytes(), 16);
    for _ in 0..20 {
        let p = f.place(&a, &up, &ask(600, 2_000, &anon, &p2)).unwrap();
        assert_eq!(p.index, home, "{p:?}");
        assert!(p.hit_tokens >= 480, "{p:?}");
    }
    // The home member slows tenfold: the prefix no longer pays for it.
    teach(&a, home, Duration::from_millis(400), 400);
    let p = f.place(&a, &up, &ask(600, 2_000, &anon, &p2)).unwrap();
    assert_ne!(p.index, home, "{p:?}");
}

#[test]
fn a_member_re_converges_after_a_slowdown() {
    let clock = Arc::new(ManualClock::new());
    let f = Fleet::with_clock(spec(8), clock.clone());
    let a = f.align(&addrs(1));
    teach(&a, 0, Duration::from_millis(10), 300);
    let before = a.replicas[0].latency.cost(None).step(1);
    assert!((before - 0.010).abs() < 0.003, "{before}");
    // Three times slower; a few seconds of streaming at 30 tokens/s.
    clock.advance(Duration::from_secs(1));
    teach(&a, 0, Duration::from_millis(30), 150);
    let after = a.replicas[0].latency.cost(None).step(1);
    assert!((after - 0.030).abs() < 0.006, "{after}");
}

#[test]
fn a_member_that_leaves_takes_its_prefixes_with_it() {
    let f = Fleet::new(spec(4));
    let two = addrs(2);
    let a = f.align(&two);
    let b = prefix::blocks(&[b'x'; 64 * 8], 16);
    let anon = Tenant::anonymous();
    let p = f.place(&a, &up, &ask(200, 10_000, &anon, &b)).unwrap();
    let gone = p.addr;
    drop(p);
    assert_eq!(f.held(gone), 8);
    let left: Vec<SocketAddr> = two.iter().copied().filter(|x| *x != gone).collect();
    let a2 = f.align(&left);
    assert_eq!(a2.replicas.len(), 1);
    assert_eq!(f.held(gone), 0);
    let p = f.place(&a2, &up, &ask(200, 10_000, &anon, &b)).unwrap();
    assert_eq!(p.addr, left[0]);
}

#[test]
fn a_decision_scores_a_bounded_number_of_members() {
    let f = Fleet::new(spec(4));
    let a = f.align(&addrs(1000));
    let anon = Tenant::anonymous();
    let b = prefix::blocks(&[b'y'; 64 * 4], 16);
    let mut tickets = Vec::new();
    for _ in 0..50 {
        tickets.push(f.place(&a, &up, &ask(64, 10_000, &anon, &b)).unwrap());
    }
    let e = f.place(&a, &up, &ask(100_000, 1, &anon, &b)).unwrap_err();
    assert!(e.scored <= 4 + HIT_CANDIDATES, "{e:?}");
}

#[test]
fn the_baseline_scorer_prefers_the_prefix_then_the_queue() {
    let f = Fleet::new(FleetSpec {
        policy: Policy::LoadPrefix,
        ..spec(4)
    });
    let a = f.align(&addrs(3));
    let b = prefix::blocks(&[b'p'; 64 * 8], 16);
    let first = f.pick_load_prefix(&a, &up, &b, &[]).unwrap();
    let again = f.pick_load_prefix(&a, &up, &b, &[]).unwrap();
    assert_eq!(first, again);
    // A long queue there outweighs the hit.
    let busy = |i: usize| Reported {
        up: true,
        outstanding: 0,
        scraped: Some((
            if i == first { 50 } else { 0 },
            if i == first { 0.9 } else { 0.1 },
        )),
    };
    assert_ne!(f.pick_load_prefix(&a, &busy, &b, &[]).unwrap(), first);
}
