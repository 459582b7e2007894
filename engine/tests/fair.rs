//! Fair shares between tenants on the engine thread, on the real model:
//! a tenant that queues ten times the work of another does not get ten
//! times the service while both are backlogged; weights 3:1 give 3:1; one
//! tenant alone is served in the queue's own order; the counters are
//! published with tokens served.
#![allow(clippy::unwrap_used)]

use std::time::Instant;
use ultrafast_engine::api::Event;
use ultrafast_engine::fair::Tenant;
use ultrafast_engine::sampling::SamplingParams;
use ultrafast_engine::scheduler::GenerateRequest;
use ultrafast_engine::scheduler::{Engine, EngineConfig};

mod common;
use common::{loaded, prompt};

/// Same prompt, same length: every request costs the same, so service is
/// counted in requests (greedy, the answer is longer than `n` tokens).
fn req(tenant: &Tenant, n: usize) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt("Count from one to twenty."),
        max_tokens: n,
        sampling: SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        stop: vec![],
        lane_rank: 1,
        tenant: Some(tenant.clone()),
        guide: None,
    }
}

/// One sequence at a time, so the order of starts is the order of
/// service. Submits `heavy` requests of tenant `a`, then `light` of `b`,
/// all before the engine thread can run any (the first is held by a long
/// request of a third tenant), and returns the tenants in the order the
/// requests finished.
fn finish_order(
    a: &Tenant,
    b: &Tenant,
    heavy: usize,
    light: usize,
) -> (Vec<(String, usize)>, Engine) {
    let e = Engine::start(
        loaded(),
        EngineConfig {
            max_num_seqs: 1,
            ..Default::default()
        },
    )
    .unwrap();
    let gate = Tenant::named("gate", 1.0);
    let mut first = e.submit(req(&gate, 24)).unwrap();
    // The gate request runs: everything else queues behind it.
    while !matches!(first.blocking_recv(), Some(Event::Token { .. })) {}
    let mut rxs = Vec::new();
    for _ in 0..heavy {
        rxs.push((a.name.to_string(), e.submit(req(a, 4)).unwrap()));
    }
    for _ in 0..light {
        rxs.push((b.name.to_string(), e.submit(req(b, 4)).unwrap()));
    }
    while first.blocking_recv().is_some() {}
    // One reader per stream: each notes when its own request finished.
    let readers: Vec<_> = rxs
        .into_iter()
        .enumerate()
        .map(|(i, (who, mut rx))| {
            std::thread::spawn(move || {
                loop {
                    match rx.blocking_recv() {
                        Some(Event::Done { .. }) => break,
                        Some(Event::Error(e)) => panic!("engine error: {e}"),
                        Some(_) => {}
                        None => panic!("stream ended without Done"),
                    }
                }
                (Instant::now(), (who, i))
            })
        })
        .collect();
    let mut done: Vec<(Instant, (String, usize))> =
        readers.into_iter().map(|r| r.join().unwrap()).collect();
    done.sort_by_key(|d| d.0);
    (done.into_iter().map(|d| d.1).collect(), e)
}

#[test]
fn a_tenant_queueing_ten_times_more_does_not_get_more_while_both_wait() {
    let (a, b) = (Tenant::named("heavy", 1.0), Tenant::named("light", 1.0));
    let (order, e) = finish_order(&a, &b, 20, 2);
    // Both backlogged for the first four: light gets two of them (first
    // come first served would serve it 21st and 22nd).
    let light_in_first_four = order[..4].iter().filter(|w| w.0 == "light").count();
    assert_eq!(light_in_first_four, 2, "order: {order:?}");
    // The counters were published with the tokens served (4 prompt-sized
    // charges plus 4 output tokens each).
    std::thread::sleep(std::time::Duration::from_millis(600));
    let _ = e.submit(req(&a, 1)).unwrap(); // wakes the thread to publish
    std::thread::sleep(std::time::Duration::from_millis(300));
    let shares = e.fair_shares();
    let heavy = shares.iter().find(|(_, s)| &*s.name == "heavy").unwrap();
    let light = shares.iter().find(|(_, s)| &*s.name == "light").unwrap();
    assert!(heavy.1.served > 5 * light.1.served, "{shares:?}");
    assert!(heavy.1.counter > light.1.counter);
}

#[test]
fn weights_three_to_one_give_three_to_one() {
    let (a, b) = (Tenant::named("one", 1.0), Tenant::named("three", 3.0));
    let (order, _e) = finish_order(&a, &b, 20, 20);
    // While both are backlogged (all 40 wait), each run of four services
    // is three of weight 3 and one of weight 1, give or take a request.
    let three = order[..16].iter().filter(|w| w.0 == "three").count();
    assert!((11..=13).contains(&three), "order: {order:?}");
}

#[test]
fn one_tenant_alone_keeps_the_queue_order() {
    let (a, b) = (Tenant::named("solo", 1.0), Tenant::named("solo", 1.0));
    let (order, _e) = finish_order(&a, &b, 6, 0);
    let submitted: Vec<usize> = order.iter().map(|w| w.1).collect();
    assert_eq!(submitted, (0..6).collect::<Vec<_>>());
}
