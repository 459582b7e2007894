//! A rate limit's cost per request once its key table is full
//! (`max_keys`): the flood that fills it is random bearer tokens, since
//! rate limits run before keys are checked. The table is filled with
//! `--keys` distinct keys, then `--n` requests each with a new key are
//! checked one at a time, and then `--n` with keys already tracked.
//!
//! usage: ratelimit-full [--keys 100000] [--n 20000]
//! Prints one JSON line per case: p50/p99/mean in microseconds.

use std::time::Instant;
use ultrafast::admission::ratelimit::{KeyInput, KeySource, Limiter};

#[path = "bench_util.rs"]
mod bench_util;
use bench_util::{arg, summary};

fn main() {
    let keys: usize = arg("--keys")
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let n: usize = arg("--n").and_then(|v| v.parse().ok()).unwrap_or(20_000);
    let Some(l) = Limiter::new("bench", KeySource::ApiKey(None), 1.0, 5, keys) else {
        eprintln!("no limiter");
        return;
    };
    let check = |token: &str| {
        let mut h = http::HeaderMap::new();
        if let Ok(v) = http::HeaderValue::from_str(&format!("Bearer {token}")) {
            h.insert(http::header::AUTHORIZATION, v);
        }
        let input = KeyInput {
            client_ip: None,
            headers: &h,
            route: "r",
            pool: None,
        };
        let t = Instant::now();
        std::hint::black_box(l.check(&input));
        t.elapsed().as_secs_f64() * 1e6
    };
    for i in 0..keys {
        check(&format!("fill-{i}"));
    }
    let new: Vec<f64> = (0..n).map(|i| check(&format!("flood-{i}"))).collect();
    println!(
        "{}",
        serde_json::json!({"case": "new key at max_keys", "keys": keys, "tracked": l.tracked_keys(), "timing": summary(new)})
    );
    let known: Vec<f64> = (0..n)
        .map(|i| check(&format!("fill-{}", i % keys)))
        .collect();
    println!(
        "{}",
        serde_json::json!({"case": "tracked key at max_keys", "keys": keys, "timing": summary(known)})
    );
}
