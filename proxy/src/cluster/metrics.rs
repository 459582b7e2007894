//! The cluster's metric families (registered even without `[cluster]`, so
//! dashboards see a zero rather than a missing series).

use prometheus::{Histogram, HistogramOpts, IntCounterVec, IntGauge, Opts, Registry};

/// Handles of the `ultrafast_cluster_*` families.
#[derive(Clone)]
pub struct ClusterMetrics {
    /// 1 while the store answers.
    pub up: IntGauge,
    /// Store state changes, by the state entered (`up`, `down`).
    pub transitions: IntCounterVec,
    /// Live instances last seen.
    pub members: IntGauge,
    /// Decisions taken without the store, by `on_store_error` mode.
    pub fallbacks: IntCounterVec,
    /// Time of one shared admission decision (one round trip).
    pub decision: Histogram,
    /// Async-request writes dropped because the writer fell behind.
    pub dropped_writes: prometheus::IntCounter,
}

impl ClusterMetrics {
    /// Register the families in `registry`.
    #[allow(clippy::expect_used)] // static definitions: a failure is a bug seen by any test
    pub fn new(registry: &Registry) -> Self {
        let up = IntGauge::new(
            "ultrafast_cluster_store_up",
            "1 while the cluster's Redis answers within its timeout (0 without [cluster]).",
        )
        .expect("static metric");
        let transitions = IntCounterVec::new(
            Opts::new(
                "ultrafast_cluster_store_transitions_total",
                "Changes of the cluster store's state, by the state entered.",
            ),
            &["to"],
        )
        .expect("static metric");
        let members = IntGauge::new(
            "ultrafast_cluster_members",
            "Live instances last seen through the heartbeat.",
        )
        .expect("static metric");
        let fallbacks = IntCounterVec::new(
            Opts::new(
                "ultrafast_cluster_fallback_decisions_total",
                "Limit decisions taken without the store, by on_store_error mode.",
            ),
            &["mode"],
        )
        .expect("static metric");
        let decision = Histogram::with_opts(
            HistogramOpts::new(
                "ultrafast_cluster_decision_seconds",
                "Time of one shared admission decision (one Redis round trip).",
            )
            .buckets(vec![
                0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1,
            ]),
        )
        .expect("static metric");
        let dropped_writes = prometheus::IntCounter::new(
            "ultrafast_cluster_dropped_writes_total",
            "Async-request writes to the store dropped because its writer fell behind.",
        )
        .expect("static metric");
        for t in ["up", "down"] {
            transitions.with_label_values(&[t]);
        }
        let _ = registry.register(Box::new(up.clone()));
        let _ = registry.register(Box::new(transitions.clone()));
        let _ = registry.register(Box::new(members.clone()));
        let _ = registry.register(Box::new(fallbacks.clone()));
        let _ = registry.register(Box::new(decision.clone()));
        let _ = registry.register(Box::new(dropped_writes.clone()));
        ClusterMetrics {
            up,
            transitions,
            members,
            fallbacks,
            decision,
            dropped_writes,
        }
    }
}
