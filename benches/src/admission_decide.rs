//! The latency model's decision cost with thousands of streams in flight:
//! an admission decision (`Latency::admit`, a standard request with a
//! target, its ticket dropped at once) and a token (`Ticket::token`), timed
//! one at a time against a ledger holding N running streams of an
//! upstream-like backend (no slot limit), each part way through its
//! output, as under the 5,000-stream load of `benches/RESULTS.md`.
//!
//! usage: admission-decide [--streams 0,100,1000,5000] [--n 20000]
//! Prints one JSON line per N: p50/p99/mean in microseconds of each.

use std::sync::Arc;
use std::time::{Duration, Instant};
use ultrafast::inference::predict::{Cost, Latency, Verdict};
use ultrafast_engine::fair::Tenant;

#[path = "bench_util.rs"]
mod bench_util;
use bench_util::{arg, summary};

fn main() {
    let streams: Vec<usize> = arg("--streams")
        .unwrap_or_else(|| "0,100,1000,5000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let n: usize = arg("--n").and_then(|v| v.parse().ok()).unwrap_or(20_000);
    // An upstream's learned step model: 20 ms a step, 0.1 ms per sequence.
    let cost = Cost {
        step_fixed_s: 0.02,
        step_per_seq_s: 0.0001,
        prefill_per_token_s: 0.0005,
        chunk: None,
    };
    for s in streams {
        let m = Arc::new(Latency::new(true, 1 << 20, None, 2000.0, 30.0));
        let mut held = Vec::with_capacity(s);
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..s {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let max_out = 64 + (x % 1024) as usize;
            let (_, t) = m.admit(
                Some(cost),
                2,
                200,
                max_out,
                None,
                &[],
                None,
                &Tenant::anonymous(),
            );
            let Some(t) = t else { continue };
            t.dispatched();
            for _ in 0..(x % 64) {
                t.token(Some(Duration::from_millis(20)), None);
            }
            held.push(t);
        }
        let target = Some(Duration::from_secs(3600));
        let mut decide = Vec::with_capacity(n);
        let mut token = Vec::with_capacity(n);
        for i in 0..n {
            let t0 = Instant::now();
            let (v, t) = m.admit(
                Some(cost),
                2,
                200,
                256,
                target,
                &[],
                None,
                &Tenant::anonymous(),
            );
            decide.push(t0.elapsed().as_secs_f64() * 1e6);
            assert!(matches!(v, Verdict::Admit(_)));
            drop(t);
            if let Some(h) = held.get(i % held.len().max(1)) {
                let t0 = Instant::now();
                h.token(Some(Duration::from_millis(20)), None);
                token.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
        let mut out = serde_json::json!({"streams": held.len(), "decide": summary(decide)});
        if !token.is_empty() {
            out["token"] = summary(token);
        }
        println!("{out}");
    }
}
