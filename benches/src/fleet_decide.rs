//! The fleet's routing decision at scale: `Fleet::place` (prediction on
//! `k` members drawn at random plus the prefix-hit holders, admission on
//! the best, its ticket dropped at once) against N members each holding
//! `--streams` running streams part way through their output, as a fleet
//! at work holds them; and llm-d's scorer (`pick_load_prefix`, every
//! member) beside it.
//!
//! usage: fleet-decide [--members 100,1000] [--streams 16] [--k 4] [--n 20000] [--no-scorer 1]
//! Prints one JSON line per N: p50/p99/mean in microseconds. For
//! instructions, run it under `valgrind --tool=callgrind` with `--n` of
//! two sizes and take the difference per decision.

use std::net::SocketAddr;
use std::time::{Duration, Instant};
use ultrafast::inference::fleet::{prefix, Ask, Fleet, FleetSpec, Policy, Reported};
use ultrafast_engine::fair::Tenant;

#[path = "bench_util.rs"]
mod bench_util;
use bench_util::{arg, summary};

fn main() {
    let members: Vec<usize> = arg("--members")
        .unwrap_or_else(|| "100,1000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let streams: usize = arg("--streams").and_then(|v| v.parse().ok()).unwrap_or(16);
    let k: usize = arg("--k").and_then(|v| v.parse().ok()).unwrap_or(4);
    let n: usize = arg("--n").and_then(|v| v.parse().ok()).unwrap_or(20_000);
    // Under callgrind: the decisions alone (the scorer counted apart).
    let scorer_every = if arg("--no-scorer").is_some() { usize::MAX } else { 10 };
    let anon = Tenant::anonymous();
    for m in members {
        let fleet = Fleet::new(FleetSpec {
            policy: Policy::PredictedLatency,
            k,
            block_tokens: 16,
            capacity_tokens: 65_536,
            slots: 16,
            chunk: Some(512),
            prefill_tps: 10_000.0,
            decode_tps: 95.0,
            window: Duration::from_secs(30),
        });
        let addrs: Vec<SocketAddr> = (0..m)
            .map(|i| SocketAddr::from(([10, 0, (i >> 8) as u8, i as u8], 8000)))
            .collect();
        let a = fleet.align(&addrs);
        // Each member: `streams` running streams, part way through.
        let mut held = Vec::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for r in &a.replicas {
            for _ in 0..streams {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let (_, t) = r.latency.admit(None, 1, 200, 64 + (x % 256) as usize, None, &[], None, &anon);
                let Some(t) = t else { continue };
                t.dispatched();
                t.token(None, None);
                for _ in 0..(x % 32) {
                    t.token(Some(Duration::from_millis(18)), None);
                }
                held.push(t);
            }
        }
        let up = |_: usize| Reported {
            up: true,
            outstanding: streams as u64,
            scraped: Some((0, 0.3)),
        };
        // Eight tenants' system prompts, as the fleet benchmark's trace.
        let prompts: Vec<Vec<u64>> = (0..8)
            .map(|t| prefix::blocks(format!("system\0tenant {t} {}\0user\0q\0", "sys ".repeat(1000)).as_bytes(), 16))
            .collect();
        let mut decide = Vec::with_capacity(n);
        let mut scorer = Vec::with_capacity(n / 10);
        for i in 0..n {
            let blocks = &prompts[i % prompts.len()];
            let ask = Ask {
                rank: 1,
                prompt: 1_100,
                max_out: 100,
                ttft: Some(Duration::from_secs(1)),
                tpot: None,
                reserved: &[],
                tenant: &anon,
                blocks,
            };
            let t0 = Instant::now();
            let p = fleet.place(&a, &up, &ask);
            decide.push(t0.elapsed().as_secs_f64() * 1e6);
            drop(p);
            if i % scorer_every == 0 {
                let t0 = Instant::now();
                let j = fleet.pick_load_prefix(&a, &up, blocks, &[]);
                scorer.push(t0.elapsed().as_secs_f64() * 1e6);
                assert!(j.is_some());
            }
        }
        println!(
            "{}",
            serde_json::json!({"members": m, "streams_each": streams, "k": k,
                "predicted_latency": summary(decide), "load_prefix": summary(scorer)})
        );
    }
}
