//! The figures a run is judged by: admitted share, TTFT and end-to-end
//! percentiles of the admitted, the share within the TTFT target, goodput
//! (output tokens per second of requests within target).

/// The `q` quantile (0..1) of `v` (sorted here), nearest rank; None when empty.
pub fn quantile(v: &mut [f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let at = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1;
    Some(v[at])
}

/// One request as the figures need it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Done {
    /// Arrival (s from the start).
    pub at: f64,
    /// Admitted.
    pub admitted: bool,
    /// TTFT (s), if a first token came.
    pub ttft: Option<f64>,
    /// End to end (s), if it finished.
    pub e2e: Option<f64>,
    /// Output tokens.
    pub tokens: usize,
    /// Time to its refusal (s), when refused.
    pub refused_in: Option<f64>,
}

/// A run's figures.
#[derive(Debug, Clone, Copy, Default)]
pub struct Summary {
    /// Requests sent.
    pub sent: usize,
    /// Admitted.
    pub admitted: usize,
    /// TTFT p50 / p99 of the admitted (ms).
    pub ttft_p50: f64,
    /// p99.
    pub ttft_p99: f64,
    /// End-to-end p50 of the admitted (ms).
    pub e2e_p50: f64,
    /// Share of the admitted with a first token within the target.
    pub within: f64,
    /// Output tokens per second of requests within the target.
    pub goodput: f64,
    /// Refusal time p99 (ms).
    pub refused_p99: f64,
}

/// The figures of `done` against `target_s`, over `seconds` of arrivals.
pub fn summarize(done: &[Done], target_s: f64, seconds: f64) -> Summary {
    let adm: Vec<&Done> = done.iter().filter(|d| d.admitted).collect();
    let mut ttft: Vec<f64> = adm
        .iter()
        .map(|d| d.ttft.unwrap_or(f64::INFINITY) * 1e3)
        .collect();
    let mut e2e: Vec<f64> = adm
        .iter()
        .map(|d| d.e2e.unwrap_or(f64::INFINITY) * 1e3)
        .collect();
    let mut refused: Vec<f64> = done
        .iter()
        .filter_map(|d| d.refused_in.map(|r| r * 1e3))
        .collect();
    let good: Vec<&&Done> = adm
        .iter()
        .filter(|d| d.ttft.is_some_and(|t| t <= target_s))
        .collect();
    Summary {
        sent: done.len(),
        admitted: adm.len(),
        ttft_p50: quantile(&mut ttft, 0.5).unwrap_or(0.0),
        ttft_p99: quantile(&mut ttft, 0.99).unwrap_or(0.0),
        e2e_p50: quantile(&mut e2e, 0.5).unwrap_or(0.0),
        within: good.len() as f64 / adm.len().max(1) as f64,
        goodput: good.iter().map(|d| d.tokens).sum::<usize>() as f64 / seconds.max(1e-9),
        refused_p99: quantile(&mut refused, 0.99).unwrap_or(0.0),
    }
}

/// A table row.
pub fn row(name: &str, s: &Summary) -> String {
    format!(
        "| {name} | {} / {} ({:.0}%) | {:.0} / {:.0} | {:.0} | {:.1}% | {:.0} | {:.1} |",
        s.admitted,
        s.sent,
        100.0 * s.admitted as f64 / s.sent.max(1) as f64,
        s.ttft_p50,
        s.ttft_p99,
        s.e2e_p50,
        100.0 * s.within,
        s.goodput,
        s.refused_p99,
    )
}

/// The table's head.
pub const HEAD: &str = "| policy | admitted | TTFT p50 / p99 ms | e2e p50 ms | within target | goodput tok/s | refusal p99 ms |\n|---|---|---|---|---|---|---|";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_and_goodput() {
        let mut v = vec![5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(quantile(&mut v, 0.5), Some(3.0));
        assert_eq!(quantile(&mut v, 0.99), Some(5.0));
        let d = [
            Done {
                admitted: true,
                ttft: Some(0.5),
                e2e: Some(2.0),
                tokens: 10,
                ..Done::default()
            },
            Done {
                admitted: true,
                ttft: Some(1.5),
                e2e: Some(3.0),
                tokens: 10,
                ..Done::default()
            },
            Done {
                refused_in: Some(0.001),
                ..Done::default()
            },
        ];
        let s = summarize(&d, 1.0, 10.0);
        assert_eq!((s.sent, s.admitted), (3, 2));
        assert!((s.within - 0.5).abs() < 1e-9);
        assert!((s.goodput - 1.0).abs() < 1e-9);
    }
}
