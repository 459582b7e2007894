//! Admission decision latency, in memory vs through the shared store: the
//! same request-rate check (`admission::shared::check_rates`, one limiter
//! keyed by client IP, a limit high enough never to refuse), timed one
//! decision at a time from a task on a Tokio runtime like the proxy's.
//! The in-memory decisions run first: once `[cluster]` is started, every
//! decision of the process goes to the store.
//!
//! usage: cluster-decide --redis redis://127.0.0.1:PORT/0 [--n 20000]
//! Prints one JSON line: p50/p99/mean in microseconds for each mode.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Instant;
use ultrafast::admission::ratelimit::{KeyInput, KeySource, Limiter};
use ultrafast::admission::shared::check_rates;

#[path = "bench_util.rs"]
mod bench_util;
use bench_util::{arg, summary};

async fn run(limiters: &[Arc<Limiter>], n: usize) -> Vec<f64> {
    let headers = http::HeaderMap::new();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        // 256 clients, so the limiter keeps several keys as in production.
        let ip = IpAddr::V4(Ipv4Addr::new(10, 0, 0, (i % 256) as u8));
        let input = KeyInput {
            client_ip: Some(ip),
            headers: &headers,
            route: "r",
            pool: None,
        };
        let t = Instant::now();
        let v = check_rates(limiters, None, &input).await;
        out.push(t.elapsed().as_secs_f64() * 1e6);
        if v.is_err() {
            eprintln!("refused: {v:?}");
            std::process::exit(1);
        }
    }
    out
}

fn main() {
    let Some(redis) = arg("--redis") else {
        eprintln!("usage: cluster-decide --redis redis://127.0.0.1:PORT/0 [--n 20000]");
        std::process::exit(2);
    };
    let n: usize = arg("--n").and_then(|v| v.parse().ok()).unwrap_or(20_000);
    let Some(l) = Limiter::new("bench", KeySource::ClientIp, 1e9, 1_000_000, 100_000) else {
        std::process::exit(2);
    };
    let limiters = vec![Arc::new(l)];
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    let memory = rt.block_on(async {
        run(&limiters, n / 10).await; // warm-up
        run(&limiters, n).await
    });
    let metrics = ultrafast::metrics::Metrics::new();
    let section = ultrafast::config::file::ClusterSection {
        redis,
        prefix: format!("bench{}:", std::process::id()),
        ..Default::default()
    };
    if let Err(e) = ultrafast::cluster::init(&section, &metrics.cluster) {
        eprintln!("{e}");
        std::process::exit(1);
    }
    let shared = rt.block_on(async {
        run(&limiters, n / 10).await;
        run(&limiters, n).await
    });
    // A decision that fell back to memory would flatter the store.
    let fallbacks = metrics
        .cluster
        .fallbacks
        .with_label_values(&["local"])
        .get();
    let decisions = metrics.cluster.decision.get_sample_count();
    println!(
        "{}",
        serde_json::json!({"memory": summary(memory), "shared": summary(shared),
            "store_decisions": decisions, "fallbacks": fallbacks})
    );
}
