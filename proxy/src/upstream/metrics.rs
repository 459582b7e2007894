//! The upstream pools' metric handles, owned here: a pool's pre-resolved
//! handles, a member's (whose series go with its last handle), and what
//! the DNS refresh reports (`Sink`, which the assembled metrics implement).

use prometheus::{Histogram, IntCounter, IntCounterVec, IntGauge, IntGaugeVec};
use std::fmt;

/// What the DNS refresh and the pool builders report to: the process's
/// metrics (the `metrics` module's assembly, a rank above) implement it.
pub trait Sink: Send + Sync {
    /// Count one DNS query by outcome (`ok`, `error`, `timeout`, `empty`).
    fn dns_query(&self, outcome: &str);
    /// The gauge that says `name` of `pool` is served from a stale answer.
    fn dns_stale(&self, pool: &str, name: &str) -> IntGauge;
    /// Set the age (seconds) of the last good answer for `name` of `pool`.
    fn dns_answer_age(&self, pool: &str, name: &str, age_s: f64);
    /// Handles of one member address of `pool`.
    fn member(&self, pool: &str, member: &str) -> MemberMetrics;
}

/// A metric built from static arguments: a failure here is a programming
/// error caught by the first test run, never something input can cause.
#[allow(clippy::expect_used)]
pub(crate) fn must<T>(r: prometheus::Result<T>) -> T {
    r.expect("static metric definition")
}

impl MemberMetrics {
    /// Handles whose series are removed with the last handle of
    /// (`pool`, `member`), counted in `refs`.
    pub fn tracked(
        key: (String, String),
        refs: MemberRefs,
        healthy: &IntGaugeVec,
        ejections: &IntCounterVec,
        in_flight: &IntGaugeVec,
    ) -> Self {
        *refs.lock().entry(key.clone()).or_insert(0) += 1;
        let labels = [key.0.as_str(), key.1.as_str()];
        MemberMetrics {
            healthy: healthy.with_label_values(&labels),
            ejections: ejections.with_label_values(&labels),
            in_flight: in_flight.with_label_values(&labels),
            _series: Some(MemberSeries {
                key,
                refs,
                healthy: healthy.clone(),
                in_flight: in_flight.clone(),
                ejections: ejections.clone(),
            }),
        }
    }
}

/// Handles of one pool.
#[derive(Clone)]
pub struct PoolMetrics {
    /// Upstream response-header latency.
    pub latency: Histogram,
    /// New upstream connections.
    pub conn_new: IntCounter,
    /// Reused upstream connections.
    pub conn_reused: IntCounter,
    /// Retries attempted.
    pub retries: IntCounter,
    /// Retries refused by the budget.
    pub retries_denied: IntCounter,
    /// Members in the pool now.
    pub members: IntGauge,
}

/// Handles of one member address.
#[derive(Clone)]
pub struct MemberMetrics {
    /// 1 while healthy.
    pub healthy: IntGauge,
    /// Passive ejections.
    pub ejections: IntCounter,
    /// Requests in flight, set when `/metrics` is read.
    pub in_flight: IntGauge,
    _series: Option<MemberSeries>,
}

/// Handles alive per (pool, member) label set.
pub type MemberRefs =
    std::sync::Arc<parking_lot::Mutex<std::collections::HashMap<(String, String), usize>>>;

/// What removes a member's series when its last handle goes.
struct MemberSeries {
    key: (String, String),
    refs: MemberRefs,
    healthy: IntGaugeVec,
    in_flight: IntGaugeVec,
    ejections: IntCounterVec,
}

impl Clone for MemberSeries {
    fn clone(&self) -> Self {
        *self.refs.lock().entry(self.key.clone()).or_insert(0) += 1;
        MemberSeries {
            key: self.key.clone(),
            refs: self.refs.clone(),
            healthy: self.healthy.clone(),
            in_flight: self.in_flight.clone(),
            ejections: self.ejections.clone(),
        }
    }
}

impl Drop for MemberSeries {
    fn drop(&mut self) {
        let mut refs = self.refs.lock();
        let Some(n) = refs.get_mut(&self.key) else {
            return;
        };
        *n -= 1;
        if *n == 0 {
            refs.remove(&self.key);
            let labels = [self.key.0.as_str(), self.key.1.as_str()];
            let _ = self.healthy.remove_label_values(&labels);
            let _ = self.in_flight.remove_label_values(&labels);
            let _ = self.ejections.remove_label_values(&labels);
        }
    }
}

impl MemberMetrics {
    /// Handles registered nowhere (unit tests).
    pub fn detached() -> Self {
        MemberMetrics {
            healthy: must(IntGauge::new("detached_healthy", "unregistered")),
            ejections: must(IntCounter::new("detached_ejections_total", "unregistered")),
            in_flight: must(IntGauge::new("detached_in_flight", "unregistered")),
            _series: None,
        }
    }
}

impl fmt::Debug for MemberMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MemberMetrics")
    }
}

impl fmt::Debug for PoolMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PoolMetrics")
    }
}
