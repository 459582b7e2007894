//! What the status page shows: a sampler that reads the metric registry
//! once a second and keeps five minutes of compact snapshots, from which
//! `/admin/stats` derives percentiles over the last minute (from histogram
//! bucket deltas, as `histogram_quantile` over `rate(...[1m])` would),
//! rates, and the plots' history. Every figure comes from the same
//! registry `/metrics` exposes, so the page and a scrape agree by
//! construction, and the request path pays nothing for the page.

use crate::inference::{Front, ModelBackend};
use crate::metrics::Metrics;
use crate::runtime::reload::Manager;
use crate::runtime::Snapshot as Config;
use parking_lot::Mutex;
use prometheus::proto::MetricFamily;
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Snapshots kept: five minutes at one a second.
const KEEP: usize = 300;

/// (model, lane).
pub(super) type LaneKey = (String, String);

/// Cumulative bucket counts (upper bound, count) and the total count.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Buckets {
    pub bounds: Vec<(f64, u64)>,
    pub count: u64,
}

impl Buckets {
    fn add(&mut self, h: &prometheus::proto::Histogram) {
        let b = h.get_bucket();
        if self.bounds.len() != b.len() {
            self.bounds = b.iter().map(|b| (b.upper_bound(), 0)).collect();
        }
        for (mine, theirs) in self.bounds.iter_mut().zip(b) {
            mine.1 += theirs.cumulative_count();
        }
        self.count += h.get_sample_count();
    }

    /// What was observed after `old`.
    pub fn since(&self, old: Option<&Buckets>) -> Buckets {
        let Some(old) = old.filter(|o| o.bounds.len() == self.bounds.len()) else {
            return self.clone();
        };
        Buckets {
            bounds: self
                .bounds
                .iter()
                .zip(&old.bounds)
                .map(|(n, o)| (n.0, n.1.saturating_sub(o.1)))
                .collect(),
            count: self.count.saturating_sub(old.count),
        }
    }

    /// The q-quantile, interpolated within its bucket the way Prometheus's
    /// `histogram_quantile` does; None without samples.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let rank = q * self.count as f64;
        let mut lower = (0.0, 0u64);
        for &(upper, cum) in &self.bounds {
            if cum as f64 >= rank {
                let span = cum.saturating_sub(lower.1) as f64;
                let frac = if span == 0.0 {
                    1.0
                } else {
                    (rank - lower.1 as f64) / span
                };
                return Some(lower.0 + (upper - lower.0) * frac);
            }
            lower = (upper, cum);
        }
        // In the +Inf bucket: the highest finite bound, as Prometheus says.
        Some(lower.0)
    }
}

/// One (model, lane)'s figures at one instant.
#[derive(Debug, Clone, Default)]
pub(super) struct LaneSnap {
    pub backend: String,
    pub ttft: Buckets,
    pub itl: Buckets,
    pub requests: f64,
    pub queue: i64,
}

/// The registry's figures the page needs, at one instant.
#[derive(Debug, Clone, Default)]
pub(super) struct Snap {
    /// Unix seconds.
    pub t: f64,
    pub lanes: BTreeMap<LaneKey, LaneSnap>,
    /// (lane, reason) -> shed so far.
    pub shed: BTreeMap<(String, String), f64>,
    /// model -> completion tokens so far.
    pub generated: BTreeMap<String, f64>,
}

fn label<'a>(m: &'a prometheus::proto::Metric, name: &str) -> &'a str {
    m.get_label()
        .iter()
        .find(|l| l.name() == name)
        .map_or("", |l| l.value())
}

impl Snap {
    /// Read the figures out of a gather.
    pub fn from_families(t: f64, families: &[MetricFamily]) -> Snap {
        let mut s = Snap {
            t,
            ..Snap::default()
        };
        for f in families {
            for m in f.get_metric() {
                let key = || (label(m, "model").to_string(), label(m, "lane").to_string());
                match f.name() {
                    "ultrafast_inference_ttft_seconds" => {
                        let l = s.lanes.entry(key()).or_default();
                        l.backend = label(m, "backend").to_string();
                        l.ttft.add(m.get_histogram());
                    }
                    "ultrafast_inference_inter_token_seconds" => {
                        s.lanes.entry(key()).or_default().itl.add(m.get_histogram());
                    }
                    "ultrafast_inference_requests_total" => {
                        s.lanes.entry(key()).or_default().requests += m.get_counter().get_value();
                    }
                    "ultrafast_admission_shed_total" => {
                        let k = (label(m, "lane").into(), label(m, "reason").into());
                        *s.shed.entry(k).or_default() += m.get_counter().get_value();
                    }
                    "ultrafast_inference_tokens_total" if label(m, "kind") == "completion" => {
                        *s.generated.entry(label(m, "model").into()).or_default() +=
                            m.get_counter().get_value();
                    }
                    _ => {}
                }
            }
        }
        s
    }
}

/// Five minutes of snapshots, and whether older ones were dropped (until
/// then, the process start is an all-zero snapshot before the first).
#[derive(Debug, Default)]
struct History {
    snaps: VecDeque<Snap>,
    truncated: bool,
}

/// Takes a snapshot a second and answers `/admin/stats`.
pub struct Sampler {
    metrics: Arc<Metrics>,
    manager: Arc<Manager>,
    front: Option<Arc<Front>>,
    history: Mutex<History>,
    started: f64,
}

pub(super) fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Sampler {
    /// A sampler over `metrics`, with its thread started (it stops when
    /// the sampler is dropped).
    pub fn start(
        metrics: Arc<Metrics>,
        manager: Arc<Manager>,
        front: Option<Arc<Front>>,
    ) -> Arc<Sampler> {
        let s = Arc::new(Sampler {
            metrics,
            manager,
            front,
            history: Mutex::new(History::default()),
            started: unix_now(),
        });
        let weak: Weak<Sampler> = Arc::downgrade(&s);
        let spawned = std::thread::Builder::new()
            .name("stats-sampler".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_secs(1));
                let Some(s) = weak.upgrade() else { return };
                s.record();
            });
        if let Err(e) = spawned {
            log::warn!("status page history is off: no sampler thread: {e}");
        }
        s
    }

    /// A snapshot now.
    pub(super) fn sample(&self) -> Snap {
        let cfg = self.manager.shared().load_full();
        self.metrics.refresh_pools(&cfg.pools);
        let mut snap = Snap::from_families(unix_now(), &self.metrics.gather());
        queue_depths(&cfg, self.front.as_deref(), &mut snap);
        snap
    }

    fn record(&self) {
        let snap = self.sample();
        let mut h = self.history.lock();
        if h.snaps.len() >= KEEP {
            h.snaps.pop_front();
            h.truncated = true;
        }
        h.snaps.push_back(snap);
    }

    /// The history (oldest first) and the baseline before it: the process
    /// start's zeros while nothing was dropped.
    pub(super) fn history(&self) -> (Vec<Snap>, Option<Snap>) {
        let h = self.history.lock();
        let start = (!h.truncated).then(|| Snap {
            t: self.started,
            ..Snap::default()
        });
        (h.snaps.iter().cloned().collect(), start)
    }
}

/// Requests waiting for each (model, lane) now: in the model's gate and in
/// its engine's queue.
fn queue_depths(cfg: &Config, front: Option<&Front>, snap: &mut Snap) {
    for (name, m) in &cfg.models {
        let gate = m.gate.as_ref().map(|g| g.depths()).unwrap_or_default();
        let engine = front
            .and_then(|f| f.engines.get(name))
            .and_then(|s| s.engine());
        for (i, lane) in cfg.lanes.iter().enumerate() {
            let l = snap
                .lanes
                .entry((name.clone(), lane.name.clone()))
                .or_default();
            if l.backend.is_empty() {
                l.backend = match m.backend {
                    ModelBackend::Engine(_) => "engine",
                    ModelBackend::Upstream(_) => "upstream",
                }
                .into();
            }
            let mut depth = gate.get(i).copied().unwrap_or(0);
            if let Some(e) = &engine {
                let rank = (lane.rank as usize).min(3);
                depth += e.stats().waiting_by_rank[rank].load(std::sync::atomic::Ordering::Relaxed)
                    as i64;
            }
            l.queue = depth;
        }
    }
}

/// The snapshot to measure `span` seconds back from `now_t`: the oldest one
/// no older than that, else the baseline.
pub(super) fn back<'a>(
    snaps: &'a [Snap],
    base: Option<&'a Snap>,
    now_t: f64,
    span: f64,
) -> Option<&'a Snap> {
    snaps
        .iter()
        .find(|s| now_t - s.t <= span + 0.5)
        .filter(|s| base.is_none() || now_t - s.t >= span - 0.5)
        .or(base)
        .or_else(|| snaps.first())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buckets(counts: &[u64]) -> Buckets {
        let bounds = [0.01, 0.1, 1.0];
        Buckets {
            bounds: bounds.iter().copied().zip(counts.iter().copied()).collect(),
            count: *counts.last().unwrap_or(&0),
        }
    }

    #[test]
    fn quantile_interpolates_like_prometheus() {
        // 10 in (0, 0.01], 90 in (0.01, 0.1]: the median is 4/9 of the way
        // through the second bucket, p99 at 89/90.
        let b = buckets(&[10, 100, 100]);
        let p50 = b.quantile(0.5).unwrap();
        assert!((p50 - (0.01 + 0.09 * 40.0 / 90.0)).abs() < 1e-12, "{p50}");
        let p99 = b.quantile(0.99).unwrap();
        assert!((p99 - (0.01 + 0.09 * 89.0 / 90.0)).abs() < 1e-12, "{p99}");
        assert_eq!(buckets(&[0, 0, 0]).quantile(0.5), None);
    }

    #[test]
    fn quantile_in_the_inf_bucket_is_the_top_bound() {
        let b = Buckets {
            bounds: vec![(0.1, 1), (1.0, 1)],
            count: 5,
        };
        assert_eq!(b.quantile(0.99), Some(1.0));
    }

    #[test]
    fn since_subtracts_and_tolerates_a_missing_baseline() {
        let new = buckets(&[10, 20, 30]);
        let old = buckets(&[5, 5, 5]);
        assert_eq!(new.since(Some(&old)), buckets(&[5, 15, 25]));
        assert_eq!(new.since(None), new);
    }

    #[test]
    fn back_picks_the_window_start_or_the_baseline() {
        let snap = |t: f64| Snap {
            t,
            ..Snap::default()
        };
        let snaps: Vec<Snap> = (0..100).map(|i| snap(1000.0 + i as f64)).collect();
        let base = snap(999.0);
        // 60 s back from the newest: the snapshot taken at t = 1039.
        let got = back(&snaps, Some(&base), 1099.0, 60.0).map(|s| s.t);
        assert_eq!(got, Some(1039.0));
        // Only 10 s of history: from the process start.
        let got = back(&snaps[..10], Some(&base), 1009.0, 60.0).map(|s| s.t);
        assert_eq!(got, Some(999.0));
        // History truncated: the oldest kept.
        let got = back(&snaps[..10], None, 1009.0, 60.0).map(|s| s.t);
        assert_eq!(got, Some(1000.0));
    }
}
