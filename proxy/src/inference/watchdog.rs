//! The SLA watchdog: per model and lane, rolling windows (1 and 5 minutes)
//! of TTFT and delivered inter-token latency from real traffic, plus
//! synthetic probes (a short prompt, a few tokens, straight to the backend,
//! not counted in user metrics) while real traffic is too thin to judge or
//! the lane is on its fallback. Every `window_ms` the last window is judged
//! against the targets (the watchdog's own `ttft_ms`/`itl_ms`, else the
//! lane's `ttft_slo_ms`/`itl_slo_ms`) at the configured percentile; the lane's state moves with hysteresis:
//!
//! - `ok` -> `at_risk` on a bad window (a warning: nothing is rerouted);
//! - `at_risk` -> `violated` after `enter_after` bad windows in a row;
//! - `at_risk` or `violated` -> `ok` after `leave_after` good ones.
//!
//! While a lane is `violated`, a model with `fallback = "OTHER"` sends that
//! lane's new requests to OTHER; probes of the primary decide when it comes
//! back. Each change is one JSON log line and a metric.

use super::live::Live;
use crate::config::file::WatchdogSection;
use crate::inference::metrics::InferenceMetrics;
use parking_lot::Mutex;
use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A lane's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Meeting its targets.
    Ok,
    /// Missed a window; not yet acted on.
    AtRisk,
    /// Missed `enter_after` windows: its fallback takes new requests.
    Violated,
}

impl State {
    /// Name in logs and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Ok => "ok",
            State::AtRisk => "at_risk",
            State::Violated => "violated",
        }
    }
}

/// The longest window kept, and samples kept per series at most.
const KEEP: Duration = Duration::from_secs(300);
const MAX_SAMPLES: usize = 50_000;

/// Timed samples of one series, oldest first.
#[derive(Debug, Default)]
struct Series(VecDeque<(Instant, Duration)>);

impl Series {
    fn push(&mut self, at: Instant, d: Duration) {
        if self.0.len() >= MAX_SAMPLES {
            self.0.pop_front();
        }
        self.0.push_back((at, d));
    }

    fn prune(&mut self, now: Instant) {
        while self
            .0
            .front()
            .is_some_and(|(t, _)| now.saturating_duration_since(*t) > KEEP)
        {
            self.0.pop_front();
        }
    }

    /// How many samples are newer than `span` (no copy, no sort).
    fn count_within(&self, now: Instant, span: Duration) -> usize {
        self.0
            .iter()
            .rev()
            .take_while(|(t, _)| now.saturating_duration_since(*t) <= span)
            .count()
    }

    /// Samples newer than `span`, sorted.
    fn within(&self, now: Instant, span: Duration) -> Vec<Duration> {
        let mut v: Vec<Duration> = self
            .0
            .iter()
            .rev()
            .take_while(|(t, _)| now.saturating_duration_since(*t) <= span)
            .map(|(_, d)| *d)
            .collect();
        v.sort_unstable();
        v
    }
}

/// A percentile written `pNN` (`p50`, `p90`, `p99.9`) as a quantile.
pub fn percentile(v: &str) -> Option<f64> {
    let q: f64 = v.strip_prefix('p')?.parse().ok()?;
    (q > 0.0 && q < 100.0).then_some(q / 100.0)
}

/// The `q` quantile of sorted samples.
pub(crate) fn quantile(sorted: &[Duration], q: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    Some(sorted[i])
}

fn ms(d: Option<Duration>) -> Value {
    d.map_or(Value::Null, |d| {
        json!((d.as_secs_f64() * 1e4).round() / 10.0)
    })
}

/// P50/P90/P99 and the count of sorted samples, as JSON.
fn summary(v: &[Duration]) -> Value {
    json!({"count": v.len(), "p50_ms": ms(quantile(v, 0.5)), "p90_ms": ms(quantile(v, 0.9)),
        "p99_ms": ms(quantile(v, 0.99))})
}

/// The watch of one model's lane.
#[derive(Debug)]
pub struct LaneWatch {
    ttft: Series,
    itl: Series,
    state: State,
    bad: u32,
    good: u32,
    judged_at: Option<Instant>,
    last: Value,
    probing: bool,
    probed_at: Option<Instant>,
}

impl LaneWatch {
    fn new() -> Self {
        LaneWatch {
            ttft: Series::default(),
            itl: Series::default(),
            state: State::Ok,
            bad: 0,
            good: 0,
            judged_at: None,
            last: Value::Null,
            probing: false,
            probed_at: None,
        }
    }

    /// A time to first token (of a user request or a probe).
    pub fn ttft(&mut self, d: Duration) {
        self.ttft.push(Instant::now(), d);
    }

    /// A delivered inter-token interval.
    pub fn itl(&mut self, d: Duration) {
        self.itl.push(Instant::now(), d);
    }

    /// The probe sent for this lane is over.
    pub fn probe_done(&mut self) {
        self.probing = false;
    }
}

/// A lane's targets and the watchdog's settings for its model.
#[derive(Debug, Clone, Copy)]
pub struct Targets {
    /// TTFT target.
    pub ttft: Option<Duration>,
    /// Inter-token target.
    pub itl: Option<Duration>,
    /// The judged quantile.
    pub q: f64,
    /// Window length.
    pub window: Duration,
    /// Bad windows to enter `violated`.
    pub enter_after: u32,
    /// Good windows to leave it.
    pub leave_after: u32,
    /// Samples a window needs.
    pub min_samples: usize,
    /// Probe interval.
    pub probe_every: Duration,
}

impl Targets {
    /// Targets of `lane` under `w` (None: the lane has no target to judge).
    pub fn of(cfg: &dyn Live, lane: &str, w: &WatchdogSection) -> Option<Targets> {
        let spec = cfg.lanes().iter().find(|l| l.name == lane)?;
        let lane_itl = cfg.file().lanes.get(lane).map_or(0, |s| s.itl_slo_ms);
        let pick = |own: u64, lane: Option<Duration>| match own {
            0 => lane,
            ms => Some(Duration::from_millis(ms)),
        };
        let ttft = pick(w.ttft_ms, spec.ttft_slo);
        let itl = pick(
            w.itl_ms,
            (lane_itl > 0).then(|| Duration::from_millis(lane_itl)),
        );
        if ttft.is_none() && itl.is_none() {
            return None;
        }
        Some(Targets {
            ttft,
            itl,
            q: percentile(&w.percentile).unwrap_or(0.99),
            window: Duration::from_millis(w.window_ms.max(1)),
            enter_after: w.enter_after.max(1),
            leave_after: w.leave_after.max(1),
            min_samples: w.min_samples.max(1),
            probe_every: Duration::from_millis(w.probe_interval_ms.max(1)),
        })
    }
}

/// What one judged window said.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// Too few samples.
    Thin,
    /// Met the targets.
    Good,
    /// Missed one.
    Bad,
}

/// A transition, for the log line.
struct Transition {
    from: State,
    to: State,
    detail: Value,
}

impl LaneWatch {
    /// Judge the window ending now; returns the verdict and any change.
    fn judge(&mut self, now: Instant, t: &Targets) -> (Verdict, Option<Transition>) {
        self.ttft.prune(now);
        self.itl.prune(now);
        self.judged_at = Some(now);
        let ttft = self.ttft.within(now, t.window);
        let itl = self.itl.within(now, t.window);
        let (tq, iq) = (quantile(&ttft, t.q), quantile(&itl, t.q));
        let miss_ttft = t.ttft.zip(tq).is_some_and(|(goal, p)| p > goal);
        let miss_itl = t.itl.zip(iq).is_some_and(|(goal, p)| p > goal);
        let verdict = if ttft.len() < t.min_samples {
            Verdict::Thin
        } else if miss_ttft || (itl.len() >= t.min_samples && miss_itl) {
            Verdict::Bad
        } else {
            Verdict::Good
        };
        let detail = json!({"samples": ttft.len(), "quantile": t.q,
            "ttft_p50_ms": ms(quantile(&ttft, 0.5)), "ttft_p90_ms": ms(quantile(&ttft, 0.9)),
            "ttft_p99_ms": ms(quantile(&ttft, 0.99)), "ttft_target_ms": ms(t.ttft),
            "itl_p50_ms": ms(quantile(&itl, 0.5)), "itl_p90_ms": ms(quantile(&itl, 0.9)),
            "itl_p99_ms": ms(quantile(&itl, 0.99)), "itl_target_ms": ms(t.itl),
            "verdict": format!("{verdict:?}").to_lowercase()});
        self.last = detail.clone();
        let from = self.state;
        match verdict {
            Verdict::Thin => {}
            Verdict::Bad => {
                self.good = 0;
                self.bad += 1;
                self.state = if self.bad >= t.enter_after {
                    State::Violated
                } else if self.state == State::Ok {
                    State::AtRisk
                } else {
                    self.state
                };
            }
            Verdict::Good => {
                self.bad = 0;
                self.good += 1;
                if self.state != State::Ok && self.good >= t.leave_after {
                    self.state = State::Ok;
                }
            }
        }
        let change = (self.state != from).then_some(Transition {
            from,
            to: self.state,
            detail,
        });
        (verdict, change)
    }

    /// Whether a probe is due: real traffic in the current window is below
    /// what a verdict needs, or the lane is on its fallback.
    fn probe_due(&self, now: Instant, t: &Targets) -> bool {
        if self.probing || self.probed_at.is_some_and(|p| now - p < t.probe_every) {
            return false;
        }
        self.state == State::Violated || self.ttft.count_within(now, t.window) < t.min_samples
    }
}

/// A watched lane, shared by the requests that feed it.
pub type Watched = Arc<Mutex<LaneWatch>>;

/// All watched lanes of the process (kept across reloads, by name).
#[derive(Debug, Default)]
pub struct Watchdog {
    lanes: Mutex<HashMap<(String, String), Watched>>,
}

impl Watchdog {
    /// The watch of `model`'s `lane` (created on first use).
    pub fn lane(&self, model: &str, lane: &str) -> Watched {
        self.lanes
            .lock()
            .entry((model.to_string(), lane.to_string()))
            .or_insert_with(|| Arc::new(Mutex::new(LaneWatch::new())))
            .clone()
    }

    /// The state of `model`'s `lane` (`ok` when not watched).
    pub fn state(&self, model: &str, lane: &str) -> State {
        let key = (model.to_string(), lane.to_string());
        let w = self.lanes.lock().get(&key).cloned();
        w.map_or(State::Ok, |w| w.lock().state)
    }

    /// Judge every watched lane whose window has passed; returns the lanes
    /// that need a probe now.
    pub fn tick(&self, cfg: &dyn Live, metrics: &InferenceMetrics, now: Instant) -> Vec<Probe> {
        let mut probes = Vec::new();
        for (name, m, w, lane, t) in watched(cfg) {
            let watch = self.lane(name, &lane.name);
            let mut g = watch.lock();
            let due = g.judged_at.is_none_or(|j| now - j >= t.window);
            if due {
                let (_, change) = g.judge(now, &t);
                metrics
                    .slo_state
                    .with_label_values(&[name, &lane.name])
                    .set(g.state as i64);
                if let Some(c) = change {
                    log_transition(name, &lane.name, &m.def.fallback, &c);
                    metrics
                        .slo_transitions
                        .with_label_values(&[name, &lane.name, c.from.as_str(), c.to.as_str()])
                        .inc();
                }
            }
            if g.probe_due(now, &t) {
                g.probing = true;
                g.probed_at = Some(now);
                probes.push(Probe {
                    model: name.clone(),
                    lane: lane.name.clone(),
                    rank: lane.rank,
                    max_tokens: w.probe_max_tokens.max(1),
                    timeout: t.ttft.map_or(Duration::from_secs(10), |d| d * 4),
                    watch: watch.clone(),
                });
            }
        }
        probes
    }

    /// `/admin/slo`: windows, states and active fallbacks.
    pub fn report(&self, cfg: &dyn Live) -> Value {
        let now = Instant::now();
        let mut out = Vec::new();
        for (name, m, _, lane, t) in watched(cfg) {
            let watch = self.lane(name, &lane.name);
            let g = watch.lock();
            let win = |s: &Series, span: u64| summary(&s.within(now, Duration::from_secs(span)));
            let fallback = (!m.def.fallback.is_empty()).then(|| m.def.fallback.clone());
            out.push(json!({
                "model": name, "lane": lane.name, "state": g.state.as_str(),
                "fallback": fallback,
                "fallback_active": g.state == State::Violated && fallback.is_some(),
                "targets": {"ttft_ms": ms(t.ttft), "itl_ms": ms(t.itl), "quantile": t.q,
                    "window_ms": t.window.as_millis() as u64},
                "bad_windows": g.bad, "good_windows": g.good,
                "last_window": g.last,
                "windows": {
                    "1m": {"ttft": win(&g.ttft, 60), "itl": win(&g.itl, 60)},
                    "5m": {"ttft": win(&g.ttft, 300), "itl": win(&g.itl, 300)},
                },
            }));
        }
        json!({"lanes": out})
    }
}

/// Every watched (model, lane) of `cfg` with its watchdog and targets.
/// Whether `cfg` has a lane the watchdog judges (its background loop
/// sleeps until a reload otherwise).
pub fn watches(cfg: &dyn Live) -> bool {
    watched(cfg).next().is_some()
}

fn watched(
    cfg: &dyn Live,
) -> impl Iterator<
    Item = (
        &String,
        &Arc<crate::inference::Model>,
        &WatchdogSection,
        &crate::admission::queue::LaneSpec,
        Targets,
    ),
> {
    cfg.models().iter().flat_map(move |(name, m)| {
        cfg.lanes().iter().filter_map(move |lane| {
            let w = m.def.watchdog.as_ref()?;
            Some((name, m, w, lane, Targets::of(cfg, &lane.name, w)?))
        })
    })
}

fn log_transition(model: &str, lane: &str, fallback: &str, c: &Transition) {
    let line = json!({"event": "slo_transition", "model": model, "lane": lane,
        "from": c.from.as_str(), "to": c.to.as_str(),
        "fallback": (!fallback.is_empty()).then_some(fallback), "window": c.detail});
    log::warn!("{line}");
}

/// A probe to send: a short prompt to `model` as `lane`.
pub struct Probe {
    /// Model.
    pub model: String,
    /// Lane judged.
    pub lane: String,
    /// Its rank (the probe's priority).
    pub rank: u32,
    /// Tokens asked for.
    pub max_tokens: usize,
    /// Longest wait for the first token; a probe without one by then (or
    /// one that failed) counts as this long.
    pub timeout: Duration,
    /// Where its sample goes.
    pub watch: Watched,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn targets() -> Targets {
        Targets {
            ttft: Some(Duration::from_millis(100)),
            itl: None,
            q: 0.99,
            window: Duration::from_secs(1),
            enter_after: 2,
            leave_after: 2,
            min_samples: 3,
            probe_every: Duration::from_millis(200),
        }
    }

    fn window(w: &mut LaneWatch, ms: u64, n: usize) {
        for _ in 0..n {
            w.ttft(Duration::from_millis(ms));
        }
    }

    /// Judge a window of `n` samples of `ms` each (the previous window's
    /// samples cleared).
    fn step(w: &mut LaneWatch, t: &Targets, ms: u64, n: usize) -> (Verdict, Option<State>) {
        w.ttft.0.clear();
        window(w, ms, n);
        let (v, c) = w.judge(Instant::now(), t);
        (v, c.map(|c| c.to))
    }

    #[test]
    fn hysteresis_enters_after_n_bad_windows_and_leaves_after_m_good() {
        let t = targets();
        let mut w = LaneWatch::new();
        assert_eq!(step(&mut w, &t, 10, 5), (Verdict::Good, None));
        assert_eq!(
            step(&mut w, &t, 500, 5),
            (Verdict::Bad, Some(State::AtRisk))
        );
        assert_eq!(
            step(&mut w, &t, 500, 5),
            (Verdict::Bad, Some(State::Violated))
        );
        assert!(w.probe_due(Instant::now(), &t), "a violated lane is probed");
        assert_eq!(step(&mut w, &t, 10, 5), (Verdict::Good, None));
        assert_eq!(step(&mut w, &t, 500, 5), (Verdict::Bad, None));
        assert_eq!(step(&mut w, &t, 10, 5), (Verdict::Good, None));
        assert_eq!(step(&mut w, &t, 10, 5), (Verdict::Good, Some(State::Ok)));
    }

    #[test]
    fn thin_windows_change_nothing_and_ask_for_probes() {
        let t = targets();
        let mut w = LaneWatch::new();
        window(&mut w, 500, 2);
        let (v, c) = w.judge(Instant::now(), &t);
        assert_eq!(v, Verdict::Thin);
        assert!(c.is_none());
        assert!(w.probe_due(Instant::now(), &t));
        w.probing = true;
        assert!(!w.probe_due(Instant::now(), &t), "one probe at a time");
    }

    #[test]
    fn the_judged_percentile_decides() {
        let mut t = targets();
        let mut w = LaneWatch::new();
        // 10% slow: p99 misses, p50 does not.
        for i in 0..100 {
            w.ttft(Duration::from_millis(if i % 10 == 0 { 500 } else { 10 }));
        }
        assert_eq!(w.judge(Instant::now(), &t).0, Verdict::Bad);
        t.q = 0.5;
        assert_eq!(w.judge(Instant::now(), &t).0, Verdict::Good);
    }
}
