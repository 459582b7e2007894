//! Prometheus metrics, assembled: each subsystem defines and registers
//! its own families (`edge::metrics`, `admission::metrics`,
//! `upstream::metrics`, `routing::RequestMetrics`, `accesslog`, `cache`,
//! `cluster`, `inference::metrics`, `edge::upgrade`) into the one registry
//! made here, which also holds the process's own (build info, config
//! reloads). One `Metrics` is created at start and passed by value (an
//! `Arc`) to whatever records into it. Label handles are resolved once,
//! when a config is built (`routing::RouteMetrics`, `PoolMetrics`), so the
//! request path increments a pre-resolved counter and never hashes a
//! label set or takes the vec's lock.

use crate::admission::metrics::AdmissionMetrics;
use crate::edge::metrics::EdgeMetrics;
use crate::prom::registered;
use crate::routing::RequestMetrics;
use crate::upstream::metrics::UpstreamMetrics;
pub use crate::upstream::metrics::{MemberMetrics, PoolMetrics};
use prometheus::{
    Encoder, Gauge, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder,
};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Every metric family of the process.
pub struct Metrics {
    registry: Registry,
    requests: RequestMetrics,
    /// Pools, members, retries and DNS.
    pub upstream: UpstreamMetrics,
    /// Lanes' queues and gates, refusals, lane targets.
    pub admission: AdmissionMetrics,
    /// Connections, refusals before routing, TLS, certificates, tickets.
    pub edge: EdgeMetrics,
    /// Access-log lines dropped because the writer fell behind.
    pub access_log_dropped: IntCounter,
    /// Config reloads by result.
    pub reloads: IntCounterVec,
    /// Active config hash (label) = 1.
    pub config_info: IntGaugeVec,
    /// When the active config was loaded (unix seconds).
    pub config_loaded: Gauge,
    /// Inference front and engine families.
    pub inference: Arc<crate::inference::metrics::InferenceMetrics>,
    /// Upgraded (WebSocket) connections.
    pub upgrades: crate::edge::upgrade::UpgradeMetrics,
    /// The HTTP cache's zones.
    pub cache: crate::cache::CacheMetrics,
    /// The shared store of `[cluster]`.
    pub cluster: crate::cluster::ClusterMetrics,
}

impl Metrics {
    /// Create and register every family.
    pub fn new() -> Self {
        let r = Registry::new();
        let edge = EdgeMetrics::new(&r);
        let admission = AdmissionMetrics::new(&r);
        let inference = Arc::new(crate::inference::metrics::InferenceMetrics::new(
            &r,
            admission.clone(),
            edge.rejected.clone(),
        ));
        // The process's own families.
        let reloads = registered(
            &r,
            IntCounterVec::new(
                Opts::new(
                    "ultrafast_config_reloads_total",
                    "Config reloads by result.",
                ),
                &["result"],
            ),
        );
        let config_info = registered(
            &r,
            IntGaugeVec::new(
                Opts::new(
                    "ultrafast_config_info",
                    "The active config: its hash is the label.",
                ),
                &["hash"],
            ),
        );
        let config_loaded = registered(
            &r,
            Gauge::new(
                "ultrafast_config_loaded_timestamp_seconds",
                "Unix time the active config was loaded.",
            ),
        );
        let build = registered(
            &r,
            IntGaugeVec::new(
                Opts::new("ultrafast_build_info", "Build information."),
                &["version"],
            ),
        );
        build.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        Metrics {
            requests: RequestMetrics::new(&r),
            upstream: UpstreamMetrics::new(&r),
            access_log_dropped: crate::accesslog::dropped_metric(&r),
            upgrades: crate::edge::upgrade::UpgradeMetrics::new(&r),
            cache: crate::cache::CacheMetrics::new(&r),
            cluster: crate::cluster::ClusterMetrics::new(&r),
            edge,
            admission,
            inference,
            reloads,
            config_info,
            config_loaded,
            registry: r,
        }
    }

    /// Read what is only known at scrape time from `cfg`: each member's
    /// requests in flight.
    pub fn refresh_pools(&self, pools: &BTreeMap<String, Arc<crate::upstream::Pool>>) {
        for pool in pools.values() {
            for m in &pool.members().members {
                m.state.metrics.in_flight.set(m.outstanding() as i64);
            }
        }
    }

    /// The latency models' correction factors of the lanes with a target,
    /// read at a scrape (not paid for by every request).
    pub fn refresh_latency(&self, cfg: &dyn crate::inference::live::Live) {
        self.inference.refresh_fair(cfg);
        for (name, model) in cfg.models() {
            for lane in cfg.lanes().iter().filter(|l| l.ttft_slo.is_some()) {
                self.inference
                    .ttft_correction
                    .with_label_values(&[name, &lane.name])
                    .set(model.latency.correction(lane.rank));
            }
        }
    }

    /// Every family, with the scrape-time engine gauges read first.
    pub fn gather(&self) -> Vec<prometheus::proto::MetricFamily> {
        self.inference.refresh();
        self.registry.gather()
    }

    /// Prometheus text exposition of everything.
    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 * 1024);
        // Encoding into a Vec cannot fail for well-formed families.
        let _ = TextEncoder::new().encode(&self.gather(), &mut out);
        out
    }

    /// Pre-resolved handles for one route.
    pub fn route(&self, route: &str, pool: &str) -> crate::routing::RouteMetrics {
        self.requests.route(route, pool)
    }

    /// Handles of one member address of a pool (`UpstreamMetrics::member`).
    pub fn member(&self, pool: &str, member: &str) -> MemberMetrics {
        self.upstream.member(pool, member)
    }

    /// Pre-resolved handles for one pool.
    pub fn pool(&self, pool: &str) -> PoolMetrics {
        self.upstream.pool(pool)
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_series_go_with_the_last_handle() {
        let m = Metrics::new();
        let a = m.member("p", "10.0.0.1:80");
        let a2 = m.member("p", "10.0.0.1:80");
        let b = m.member("p", "10.0.0.2:80");
        a.healthy.set(1);
        b.healthy.set(1);
        let text = || String::from_utf8(m.render()).unwrap();
        assert!(text().contains("10.0.0.1:80"));
        drop(a);
        assert!(text().contains("10.0.0.1:80"), "a2 still holds it");
        drop(a2);
        assert!(!text().contains("10.0.0.1:80"), "{}", text());
        assert!(text().contains("10.0.0.2:80"));
        drop(b);
        assert!(!text().contains("10.0.0.2:80"));
    }
}
