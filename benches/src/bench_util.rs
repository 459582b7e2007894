//! What the in-process decision benches share: their flag reader and the
//! summary they print (included with `#[path]` by each binary).

/// The value after `--name` on the command line.
pub fn arg(name: &str) -> Option<String> {
    let a: Vec<String> = std::env::args().collect();
    a.iter()
        .position(|x| x == name)
        .and_then(|i| a.get(i + 1).cloned())
}

/// p50, p99 and mean of timings in microseconds, as one JSON object.
pub fn summary(mut us: Vec<f64>) -> serde_json::Value {
    us.sort_by(f64::total_cmp);
    let q = |p: f64| us[((us.len() as f64 - 1.0) * p).round() as usize];
    let mean = us.iter().sum::<f64>() / us.len() as f64;
    serde_json::json!({"p50_us": q(0.5), "p99_us": q(0.99), "mean_us": mean, "n": us.len()})
}
