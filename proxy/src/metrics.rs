//! Prometheus metrics. One `Metrics` registry is created at start and passed
//! by value (an `Arc`) to whatever records into it. Label handles are
//! resolved once, when a config is built (`routing::RouteMetrics`, `PoolMetrics`), so
//! the request path increments a pre-resolved counter and never hashes a
//! label set or takes the vec's lock.

use crate::upstream::metrics::{must, MemberRefs};
pub use crate::upstream::metrics::{MemberMetrics, PoolMetrics};
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use std::collections::BTreeMap;
use std::sync::Arc;

/// All metric families of the process.
pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    upstream_latency: HistogramVec,
    upstream_conns: IntCounterVec,
    member_healthy: IntGaugeVec,
    member_in_flight: IntGaugeVec,
    ejections: IntCounterVec,
    /// Live holders of each member's series; at 0 the series go.
    member_refs: MemberRefs,
    retries: IntCounterVec,
    /// Access-log lines dropped because the writer fell behind.
    pub access_log_dropped: IntCounter,
    /// Requests refused by downstream limits, by reason.
    pub rejected: IntCounterVec,
    /// Open traffic connections and those the connection guard closed.
    pub conns: crate::edge::conn::ConnMetrics,
    admitted: IntCounterVec,
    shed: IntCounterVec,
    queue_depth: IntGaugeVec,
    queue_wait: HistogramVec,
    in_use: IntGaugeVec,
    pool_members: IntGaugeVec,
    /// Config reloads by result.
    pub reloads: IntCounterVec,
    /// Active config hash (label) = 1.
    pub config_info: IntGaugeVec,
    /// When the active config was loaded (unix seconds).
    pub config_loaded: prometheus::Gauge,
    /// DNS queries by result.
    pub dns_queries: IntCounterVec,
    /// Age of the answer in use, by pool and name.
    pub dns_answer_age: prometheus::GaugeVec,
    /// 1 while a stale answer is served, by pool and name.
    pub dns_stale: IntGaugeVec,
    tls: crate::edge::tls::TlsMetrics,
    certs: crate::edge::certs::CertMetrics,
    tickets: IntCounterVec,
    /// Certificate reloads by result.
    pub cert_reloads: IntCounterVec,
    /// Inference front and engine families.
    pub inference: Arc<crate::inference::metrics::InferenceMetrics>,
    /// Upgraded (WebSocket) connections.
    pub upgrades: crate::edge::upgrade::UpgradeMetrics,
    /// The HTTP cache's zones.
    pub cache: crate::cache::CacheMetrics,
    /// The shared store of `[cluster]`.
    pub cluster: crate::cluster::ClusterMetrics,
    /// Each lane's TTFT and inter-token targets (seconds), for dashboards.
    lane_ttft_target: prometheus::GaugeVec,
    lane_itl_target: prometheus::GaugeVec,
}

impl Metrics {
    /// Create and register every family.
    pub fn new() -> Self {
        let registry = Registry::new();
        let requests = must(IntCounterVec::new(
            Opts::new(
                "ultrafast_requests_total",
                "Requests by route, pool and status class.",
            ),
            &["route", "pool", "class"],
        ));
        let upstream_latency = must(HistogramVec::new(
            HistogramOpts::new(
                "ultrafast_upstream_response_seconds",
                "Time from picking an upstream member to its response header.",
            )
            .buckets(vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0,
            ]),
            &["pool"],
        ));
        let upstream_conns = must(IntCounterVec::new(
            Opts::new(
                "ultrafast_upstream_connections_total",
                "Upstream connections used, new or reused from the keepalive pool.",
            ),
            &["pool", "reused"],
        ));
        let member_healthy = must(IntGaugeVec::new(
            Opts::new(
                "ultrafast_upstream_member_healthy",
                "1 when the member passes active health checks.",
            ),
            &["pool", "member"],
        ));
        let member_in_flight = must(IntGaugeVec::new(
            Opts::new(
                "ultrafast_upstream_member_in_flight",
                "Requests in flight to the member (read at scrape time).",
            ),
            &["pool", "member"],
        ));
        let lane_target = |name: &str, help: &str| {
            must(prometheus::GaugeVec::new(Opts::new(name, help), &["lane"]))
        };
        let lane_ttft_target = lane_target(
            "ultrafast_lane_ttft_target_seconds",
            "Each lane's time-to-first-token target (ttft_slo_ms).",
        );
        let lane_itl_target = lane_target(
            "ultrafast_lane_itl_target_seconds",
            "Each lane's inter-token target (itl_slo_ms).",
        );
        let ejections = must(IntCounterVec::new(
            Opts::new(
                "ultrafast_upstream_ejections_total",
                "Members ejected by passive health (consecutive failures).",
            ),
            &["pool", "member"],
        ));
        let retries = must(IntCounterVec::new(
            Opts::new("ultrafast_upstream_retries_total", "Retries, by outcome."),
            &["pool", "outcome"],
        ));
        let access_log_dropped = must(IntCounter::new(
            "ultrafast_access_log_dropped_total",
            "Access log lines dropped because the writer fell behind.",
        ));
        let rejected = must(IntCounterVec::new(
            Opts::new(
                "ultrafast_downstream_rejected_total",
                "Requests refused before routing, by reason.",
            ),
            &["reason"],
        ));
        let conns_open = must(IntGauge::new(
            "ultrafast_downstream_connections",
            "Traffic connections open now.",
        ));
        let conns_closed = must(IntCounterVec::new(
            Opts::new(
                "ultrafast_downstream_connections_closed_total",
                "Connections closed by a limit: header_timeout (client_header_timeout_ms), preface_timeout (h2c_preface_timeout_ms), body_timeout (client_body_timeout_ms), send_timeout (send_timeout_ms), max_connections.",
            ),
            &["reason"],
        ));
        let conns = crate::edge::conn::ConnMetrics {
            open: conns_open.clone(),
            header_timeout: conns_closed.with_label_values(&["header_timeout"]),
            max_connections: conns_closed.with_label_values(&["max_connections"]),
            preface_timeout: conns_closed.with_label_values(&["preface_timeout"]),
            body_timeout: conns_closed.with_label_values(&["body_timeout"]),
            send_timeout: conns_closed.with_label_values(&["send_timeout"]),
        };
        let admitted = must(IntCounterVec::new(
            Opts::new(
                "ultrafast_admission_admitted_total",
                "Requests admitted by a pool's lane queue.",
            ),
            &["lane"],
        ));
        let shed = must(IntCounterVec::new(
            Opts::new(
                "ultrafast_admission_shed_total",
                "Requests refused by admission, by lane and reason.",
            ),
            &["lane", "reason"],
        ));
        let queue_depth = must(IntGaugeVec::new(
            Opts::new(
                "ultrafast_admission_queue_depth",
                "Requests waiting, by pool and lane.",
            ),
            &["pool", "lane"],
        ));
        let queue_wait = must(HistogramVec::new(
            HistogramOpts::new(
                "ultrafast_admission_queue_wait_seconds",
                "Time admitted requests waited for a slot.",
            )
            .buckets(vec![
                0.0001, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            ]),
            &["lane"],
        ));
        let in_use = must(IntGaugeVec::new(
            Opts::new(
                "ultrafast_pool_concurrency_in_use",
                "Admission slots in use per pool.",
            ),
            &["pool"],
        ));
        let pool_members = must(IntGaugeVec::new(
            Opts::new("ultrafast_pool_members", "Member addresses in each pool."),
            &["pool"],
        ));
        let reloads = must(IntCounterVec::new(
            Opts::new(
                "ultrafast_config_reloads_total",
                "Config reloads by result.",
            ),
            &["result"],
        ));
        let config_info = must(IntGaugeVec::new(
            Opts::new(
                "ultrafast_config_info",
                "The active config: its hash is the label.",
            ),
            &["hash"],
        ));
        let config_loaded = must(prometheus::Gauge::new(
            "ultrafast_config_loaded_timestamp_seconds",
            "Unix time the active config was loaded.",
        ));
        let dns_queries = must(IntCounterVec::new(
            Opts::new(
                "ultrafast_dns_queries_total",
                "DNS queries for upstream names, by result.",
            ),
            &["result"],
        ));
        let dns_answer_age = must(prometheus::GaugeVec::new(
            Opts::new(
                "ultrafast_dns_answer_age_seconds",
                "Age of the DNS answer in use.",
            ),
            &["pool", "name"],
        ));
        let dns_stale = must(IntGaugeVec::new(
            Opts::new(
                "ultrafast_dns_stale_answer",
                "1 while a stale DNS answer is served (resolver failing).",
            ),
            &["pool", "name"],
        ));
        let tls = crate::edge::tls::TlsMetrics {
            handshakes: must(IntCounterVec::new(
                Opts::new(
                    "ultrafast_tls_handshakes_total",
                    "TLS handshakes by result: full, resumed_ticket, resumed_cache, failed.",
                ),
                &["result"],
            )),
            failures: must(IntCounterVec::new(
                Opts::new(
                    "ultrafast_tls_handshake_failures_total",
                    "Failed TLS handshakes by reason.",
                ),
                &["reason"],
            )),
            versions: must(IntCounterVec::new(
                Opts::new(
                    "ultrafast_tls_versions_total",
                    "Completed TLS handshakes by protocol version.",
                ),
                &["version"],
            )),
            alpn: must(IntCounterVec::new(
                Opts::new(
                    "ultrafast_tls_alpn_total",
                    "Completed TLS handshakes by negotiated ALPN protocol.",
                ),
                &["protocol"],
            )),
            duration: must(Histogram::with_opts(
                HistogramOpts::new("ultrafast_tls_handshake_seconds", "TLS handshake duration.")
                    .buckets(vec![
                        0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
                    ]),
            )),
        };
        let certs = crate::edge::certs::CertMetrics {
            expiry_s: must(IntGaugeVec::new(
                Opts::new(
                    "ultrafast_tls_cert_expiry_seconds",
                    "Seconds until each certificate expires.",
                ),
                &["cert"],
            )),
            stale_staples: must(IntCounter::new(
                "ultrafast_tls_ocsp_stale_total",
                "OCSP responses not stapled because past their nextUpdate.",
            )),
            unknown_sni: must(IntCounter::new(
                "ultrafast_tls_unknown_sni_total",
                "Handshakes refused for a name with no certificate (no default).",
            )),
        };
        let tickets = must(IntCounterVec::new(
            Opts::new(
                "ultrafast_tls_tickets_total",
                "Session tickets issued and refused.",
            ),
            &["event"],
        ));
        let cert_reloads = must(IntCounterVec::new(
            Opts::new(
                "ultrafast_tls_cert_reloads_total",
                "Certificate reloads by result.",
            ),
            &["result"],
        ));
        // Both outcomes exist from the start, so a dashboard or an alert
        // sees 0 rather than no series.
        for r in ["ok", "error"] {
            cert_reloads.with_label_values(&[r]);
        }
        let build = must(IntGaugeVec::new(
            Opts::new("ultrafast_build_info", "Build information."),
            &["version"],
        ));
        build.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        for c in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(upstream_latency.clone()),
            Box::new(upstream_conns.clone()),
            Box::new(member_healthy.clone()),
            Box::new(member_in_flight.clone()),
            Box::new(lane_ttft_target.clone()),
            Box::new(lane_itl_target.clone()),
            Box::new(ejections.clone()),
            Box::new(retries.clone()),
            Box::new(access_log_dropped.clone()),
            Box::new(rejected.clone()),
            Box::new(conns_open),
            Box::new(conns_closed),
            Box::new(admitted.clone()),
            Box::new(shed.clone()),
            Box::new(queue_depth.clone()),
            Box::new(queue_wait.clone()),
            Box::new(in_use.clone()),
            Box::new(pool_members.clone()),
            Box::new(reloads.clone()),
            Box::new(config_info.clone()),
            Box::new(config_loaded.clone()),
            Box::new(dns_queries.clone()),
            Box::new(dns_answer_age.clone()),
            Box::new(dns_stale.clone()),
            Box::new(tls.handshakes.clone()),
            Box::new(tls.failures.clone()),
            Box::new(tls.versions.clone()),
            Box::new(tls.alpn.clone()),
            Box::new(tls.duration.clone()),
            Box::new(certs.expiry_s.clone()),
            Box::new(certs.stale_staples.clone()),
            Box::new(certs.unknown_sni.clone()),
            Box::new(tickets.clone()),
            Box::new(cert_reloads.clone()),
            Box::new(build),
        ] {
            must(registry.register(c));
        }
        let inference = Arc::new(crate::inference::metrics::InferenceMetrics::new(
            &registry,
            shed.clone(),
            rejected.clone(),
        ));
        let upgrades = crate::edge::upgrade::UpgradeMetrics::new(&registry);
        let cache = crate::cache::CacheMetrics::new(&registry);
        let cluster = crate::cluster::ClusterMetrics::new(&registry);
        Metrics {
            cache,
            cluster,
            registry,
            inference,
            upgrades,
            requests,
            upstream_latency,
            upstream_conns,
            member_healthy,
            member_in_flight,
            ejections,
            lane_ttft_target,
            lane_itl_target,
            member_refs: Default::default(),
            retries,
            access_log_dropped,
            rejected,
            conns,
            admitted,
            shed,
            queue_depth,
            queue_wait,
            in_use,
            pool_members,
            reloads,
            config_info,
            config_loaded,
            dns_queries,
            dns_answer_age,
            dns_stale,
            tls,
            certs,
            tickets,
            cert_reloads,
        }
    }

    /// TLS listener handles.
    pub fn tls(&self) -> crate::edge::tls::TlsMetrics {
        self.tls.clone()
    }

    /// Certificate handles.
    pub fn certs(&self) -> crate::edge::certs::CertMetrics {
        self.certs.clone()
    }

    /// Ticket handles.
    pub fn tickets(&self) -> crate::edge::ticket::TicketMetrics {
        crate::edge::ticket::TicketMetrics {
            issued: self.tickets.with_label_values(&["issued"]),
            resumed: self.tls.handshakes.with_label_values(&["resumed_ticket"]),
            rejected: self.tickets.with_label_values(&["rejected"]),
        }
    }

    /// Count a refusal by admission.
    pub fn shed(&self, lane: &str, reason: &str) {
        self.shed.with_label_values(&[lane, reason]).inc();
    }

    /// Handles for one pool's admission gate, lanes in rank order.
    pub fn gate(&self, pool: &str, lanes: &[String]) -> crate::admission::gate::GateMetrics {
        crate::admission::gate::GateMetrics {
            depth: lanes
                .iter()
                .map(|l| self.queue_depth.with_label_values(&[pool, l]))
                .collect(),
            wait: lanes
                .iter()
                .map(|l| self.queue_wait.with_label_values(&[l]))
                .collect(),
            admitted: lanes
                .iter()
                .map(|l| self.admitted.with_label_values(&[l]))
                .collect(),
            in_use: self.in_use.with_label_values(&[pool]),
        }
    }

    /// Set the lane target gauges from a newly active config.
    pub fn set_lane_targets(&self, cfg: &dyn crate::inference::live::Live) {
        self.lane_ttft_target.reset();
        self.lane_itl_target.reset();
        for lane in cfg.lanes() {
            if let Some(t) = lane.ttft_slo {
                self.lane_ttft_target
                    .with_label_values(&[&lane.name])
                    .set(t.as_secs_f64());
            }
            let itl = cfg.file().lanes.get(&lane.name).map_or(0, |s| s.itl_slo_ms);
            if itl > 0 {
                self.lane_itl_target
                    .with_label_values(&[&lane.name])
                    .set(itl as f64 / 1000.0);
            }
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
        let c = |class: &str| self.requests.with_label_values(&[route, pool, class]);
        crate::routing::RouteMetrics::new([
            c("1xx"),
            c("2xx"),
            c("3xx"),
            c("4xx"),
            c("5xx"),
            c("other"),
        ])
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
            latency: self.upstream_latency.with_label_values(&[pool]),
            conn_new: self.upstream_conns.with_label_values(&[pool, "false"]),
            conn_reused: self.upstream_conns.with_label_values(&[pool, "true"]),
            retries: self.retries.with_label_values(&[pool, "attempted"]),
            retries_denied: self.retries.with_label_values(&[pool, "denied_by_budget"]),
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl crate::upstream::metrics::Sink for Metrics {
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
        Metrics::member(self, pool, member)
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
