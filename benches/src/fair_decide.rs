//! The cost of one fair-share scheduling decision in a lane gate: a slot
//! is released and the next waiter is chosen (the backlogged tenant with
//! the smallest virtual counter, its first request), with the grant's
//! prompt charge and a batch of output charges, against a queue holding
//! T tenants with W waiters each. `--decisions` repeats it; run it twice
//! under callgrind with two counts and the difference over the count
//! difference is instructions per decision (`benches/scripts/fair_bench.py
//! --decide` does this), free of wall-clock noise.
//!
//! usage: fair-decide [--tenants 2,100,1000] [--waiters 4] [--decisions 20000]
//! Prints one JSON line per T: p50/p99/mean in microseconds of a decision.

use std::time::{Duration, Instant};
use ultrafast::admission::queue::{LaneQueue, LaneSpec, OnMiss, Who};
use ultrafast_engine::fair::Tenant;

#[path = "bench_util.rs"]
mod bench_util;
use bench_util::{arg, summary};

fn lane() -> LaneSpec {
    LaneSpec {
        name: "standard".into(),
        rank: 1,
        queue_len: 1 << 20,
        max_wait: Duration::from_secs(60),
        reserved_share: 0.0,
        preempt: false,
        high_watermark: 1.0,
        sjf_us_per_unit: 0,
        ttft_slo: None,
        on_miss: OnMiss::Reject,
        on_forbidden: OnMiss::Reject,
    }
}

fn main() {
    let tenants: Vec<usize> = arg("--tenants")
        .unwrap_or_else(|| "2,100,1000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let waiters: usize = arg("--waiters").and_then(|v| v.parse().ok()).unwrap_or(4);
    let n: usize = arg("--decisions")
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    for t in tenants {
        let who: Vec<Who> = (0..t)
            .map(|i| Who {
                tenant: Tenant::named(&format!("tenant-{i}"), 1.0 + (i % 3) as f64),
                prompt: 50 + (i % 7) * 30,
            })
            .collect();
        // Each waiter's payload is its tenant's index.
        let mut q: LaneQueue<usize> = LaneQueue::new(vec![lane()], 1, 1 << 22);
        let mut id = 0u64;
        let mut offer = |q: &mut LaneQueue<usize>, i: usize| {
            id += 1;
            q.offer_as(&who[i], id, 0, Some(100), id, 0.5, None, i);
        };
        // The slot's holder, then every tenant's backlog.
        offer(&mut q, 0);
        let mut holder = 0;
        for _ in 0..waiters {
            for i in 0..t {
                offer(&mut q, i);
            }
        }
        let mut us = Vec::with_capacity(n);
        for _ in 0..n {
            let held = who[holder].tenant.id;
            let t0 = Instant::now();
            // The holder's last output, its release, the next grant.
            q.produced(0, held, 8);
            let granted = q.release_for(0, held);
            us.push(t0.elapsed().as_secs_f64() * 1e6);
            let Some(&(_, _, next)) = granted.first() else {
                panic!("no grant with {t} tenants waiting");
            };
            // The granted tenant queues again (outside the timed part),
            // so every tenant stays backlogged.
            holder = next;
            offer(&mut q, next);
        }
        let mut line = summary(us);
        line["tenants"] = serde_json::json!(t);
        line["waiters_per_tenant"] = serde_json::json!(waiters);
        println!("{line}");
    }
}
