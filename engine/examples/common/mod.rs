//! What the engine's benchmark examples share: the median of runs and the
//! CPU model written next to every figure, and the decode rate of part of
//! a batch.
// Each example uses a part of these.
#![allow(dead_code)]

/// The median (upper middle) of `v`.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// This machine's CPU model, from `/proc/cpuinfo`.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default()
}

/// Tokens/s of streams `0..half` while every stream decodes: their token
/// times between the last first token and the first end, over that window.
pub fn half_rate(arrivals: &[Vec<std::time::Instant>], half: usize) -> f64 {
    let start = arrivals.iter().filter_map(|a| a.first()).max().copied();
    let end = arrivals.iter().filter_map(|a| a.last()).min().copied();
    let (Some(start), Some(end)) = (start, end) else {
        return 0.0;
    };
    let n = arrivals[..half]
        .iter()
        .flat_map(|a| a.iter())
        .filter(|t| **t > start && **t <= end)
        .count();
    n as f64 / end.duration_since(start).as_secs_f64()
}
