//! The upstream pools' metric handles, owned here: a pool's pre-resolved
//! handles, a member's (whose series go with its last handle), and what
//! the DNS refresh reports (`Sink`, which the assembled metrics implement).

use prometheus::{Histogram, IntCounter, IntCounterVec, IntGauge, IntGaugeVec};
use std::fmt;

/// What the DNS refresh and the pool builders report to: the upstream
/// families implement it (a trait, so `dns` tests can count calls).
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

pub(crate) use crate::prom::must;
use crate::prom::registered;
use prometheus::{GaugeVec, HistogramOpts, HistogramVec, Opts, Registry};

/// The upstream families: pools, members, retries and DNS, defined and
/// registered here.
#[derive(Clone)]
pub struct UpstreamMetrics {
    latency: HistogramVec,
    conns: IntCounterVec,
    member_healthy: IntGaugeVec,
    member_in_flight: IntGaugeVec,
    ejections: IntCounterVec,
    retries: IntCounterVec,
    pool_members: IntGaugeVec,
    /// DNS queries by result.
    pub dns_queries: IntCounterVec,
    /// Age of the answer in use, by pool and name.
    pub dns_answer_age: GaugeVec,
    /// 1 while a stale answer is served, by pool and name.
    pub dns_stale: IntGaugeVec,
    /// Live holders of each member's series; at 0 the series go.
    member_refs: MemberRefs,
}

impl UpstreamMetrics {
    /// Create and register the families.
    pub fn new(r: &Registry) -> Self {
        let by = |name: &str, help: &str, labels: &[&str]| {
            registered(r, IntCounterVec::new(Opts::new(name, help), labels))
        };
        let gauges = |name: &str, help: &str, labels: &[&str]| {
            registered(r, IntGaugeVec::new(Opts::new(name, help), labels))
        };
        UpstreamMetrics {
            latency: registered(
                r,
                HistogramVec::new(
                    HistogramOpts::new(
                        "ultrafast_upstream_response_seconds",
                        "Time from picking an upstream member to its response header.",
                    )
                    .buckets(vec![
                        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                        5.0, 10.0,
                    ]),
                    &["pool"],
                ),
            ),
            conns: by(
                "ultrafast_upstream_connections_total",
                "Upstream connections used, new or reused from the keepalive pool.",
                &["pool", "reused"],
            ),
            member_healthy: gauges(
                "ultrafast_upstream_member_healthy",
                "1 when the member passes active health checks.",
                &["pool", "member"],
            ),
            member_in_flight: gauges(
                "ultrafast_upstream_member_in_flight",
                "Requests in flight to the member (read at scrape time).",
                &["pool", "member"],
            ),
            ejections: by(
                "ultrafast_upstream_ejections_total",
                "Members ejected by passive health (consecutive failures).",
                &["pool", "member"],
            ),
            retries: by(
                "ultrafast_upstream_retries_total",
                "Retries, by outcome.",
                &["pool", "outcome"],
            ),
            pool_members: gauges(
                "ultrafast_pool_members",
                "Member addresses in each pool.",
                &["pool"],
            ),
            dns_queries: by(
                "ultrafast_dns_queries_total",
                "DNS queries for upstream names, by result.",
                &["result"],
            ),
            dns_answer_age: registered(
                r,
                GaugeVec::new(
                    Opts::new(
                        "ultrafast_dns_answer_age_seconds",
                        "Age of the DNS answer in use.",
                    ),
                    &["pool", "name"],
                ),
            ),
            dns_stale: gauges(
                "ultrafast_dns_stale_answer",
                "1 while a stale DNS answer is served (resolver failing).",
                &["pool", "name"],
            ),
            member_refs: Default::default(),
        }
    }

    /// Handles of one member address of a pool. Its series stay while any
    /// handle for that pool and address lives (a member kept across a
    /// reload or a DNS swap keeps them) and are removed with the last one,
    /// so DNS churn cannot grow `/metrics` without bound.
    pub fn member(&self, pool: &str, member: &str) -> MemberMetrics {
        MemberMetrics::tracked(
            (pool.to_string(), member.to_string()),
            self.member_refs.clone(),
            &self.member_healthy,
            &self.ejections,
            &self.member_in_flight,
        )
    }

    /// Pre-resolved handles for one pool.
    pub fn pool(&self, pool: &str) -> PoolMetrics {
        PoolMetrics {
            members: self.pool_members.with_label_values(&[pool]),
            latency: self.latency.with_label_values(&[pool]),
            conn_new: self.conns.with_label_values(&[pool, "false"]),
            conn_reused: self.conns.with_label_values(&[pool, "true"]),
            retries: self.retries.with_label_values(&[pool, "attempted"]),
            retries_denied: self.retries.with_label_values(&[pool, "denied_by_budget"]),
        }
    }
}

impl Sink for UpstreamMetrics {
    fn dns_query(&self, outcome: &str) {
        self.dns_queries.with_label_values(&[outcome]).inc();
    }

    fn dns_stale(&self, pool: &str, name: &str) -> IntGauge {
        self.dns_stale.with_label_values(&[pool, name])
    }

    fn dns_answer_age(&self, pool: &str, name: &str, age_s: f64) {
        self.dns_answer_age
            .with_label_values(&[pool, name])
            .set(age_s);
    }

    fn member(&self, pool: &str, member: &str) -> MemberMetrics {
        UpstreamMetrics::member(self, pool, member)
    }
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
