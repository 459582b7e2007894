//! The edge's families: connections and their guard, refusals before
//! routing, TLS handshakes, certificates and tickets, defined and
//! registered here.

use super::certs::CertMetrics;
use super::conn::ConnMetrics;
use super::spool::SpoolMetrics;
use super::ticket::TicketMetrics;
use super::tls::TlsMetrics;
use crate::prom::registered;
use prometheus::{
    Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

/// The edge's families.
#[derive(Clone)]
pub struct EdgeMetrics {
    /// Requests refused by downstream limits, by reason.
    pub rejected: IntCounterVec,
    /// Open traffic connections and those the connection guard closed.
    pub conns: ConnMetrics,
    /// TLS listener handles.
    pub tls: TlsMetrics,
    /// Certificate handles.
    pub certs: CertMetrics,
    tickets: IntCounterVec,
    /// Certificate reloads by result.
    pub cert_reloads: IntCounterVec,
    /// Connections of PROXY protocol listeners by result.
    pub proxy_protocol: IntCounterVec,
    /// Response buffering.
    pub spool: std::sync::Arc<SpoolMetrics>,
    /// ACME orders and certificate lifetimes.
    pub acme: super::acme::AcmeMetrics,
    /// HTTP/3 connections and requests.
    pub h3: super::h3::H3Metrics,
    /// Requests by protocol (HTTP/1.1, HTTP/2, HTTP/3).
    pub protocols: IntCounterVec,
}

/// The response buffering's families.
fn spool_metrics(r: &Registry, conns: &ConnMetrics) -> SpoolMetrics {
    let bytes = registered(
        r,
        IntGaugeVec::new(
            Opts::new(
                "ultrafast_response_buffer_bytes",
                "Bytes of buffered responses held, not yet sent, by store: memory, disk (temporary files).",
            ),
            &["store"],
        ),
    );
    let overflows = registered(
        r,
        IntCounterVec::new(
            Opts::new(
                "ultrafast_response_buffer_overflows_total",
                "Buffered responses that met a bound and streamed unbuffered from there, by bound: temp_file (max_temp_file_bytes), disk_total (temp_files_total_mb), temp_file_error (the file system refused).",
            ),
            &["bound"],
        ),
    );
    for bound in ["temp_file", "disk_total", "temp_file_error"] {
        overflows.with_label_values(&[bound]);
    }
    SpoolMetrics {
        buffered: registered(
            r,
            IntCounter::new(
                "ultrafast_responses_buffered_total",
                "Proxied responses read into a buffer (response_buffering).",
            ),
        ),
        overflows,
        memory: bytes.with_label_values(&["memory"]),
        disk: bytes.with_label_values(&["disk"]),
        detached: registered(
            r,
            IntGauge::new(
                "ultrafast_response_buffer_draining",
                "Buffered responses still being sent to their clients after their requests (and origin connections) ended.",
            ),
        ),
        send_timeout: conns.send_timeout.clone(),
    }
}

impl EdgeMetrics {
    /// Create and register the families.
    pub fn new(r: &Registry) -> Self {
        let rejected = registered(
            r,
            IntCounterVec::new(
                Opts::new(
                    "ultrafast_downstream_rejected_total",
                    "Requests refused before routing, by reason.",
                ),
                &["reason"],
            ),
        );
        let conns_open = registered(
            r,
            IntGauge::new(
                "ultrafast_downstream_connections",
                "Traffic connections open now.",
            ),
        );
        let conns_closed = registered(
            r,
            IntCounterVec::new(
                Opts::new(
                    "ultrafast_downstream_connections_closed_total",
                    "Connections closed by a limit: header_timeout (client_header_timeout_ms), preface_timeout (h2c_preface_timeout_ms), body_timeout (client_body_timeout_ms), send_timeout (send_timeout_ms), max_connections.",
                ),
                &["reason"],
            ),
        );
        let conns = ConnMetrics {
            open: conns_open,
            header_timeout: conns_closed.with_label_values(&["header_timeout"]),
            max_connections: conns_closed.with_label_values(&["max_connections"]),
            preface_timeout: conns_closed.with_label_values(&["preface_timeout"]),
            body_timeout: conns_closed.with_label_values(&["body_timeout"]),
            send_timeout: conns_closed.with_label_values(&["send_timeout"]),
        };
        let tls = TlsMetrics {
            handshakes: registered(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "ultrafast_tls_handshakes_total",
                        "TLS handshakes by result: full, resumed_ticket, resumed_cache, failed.",
                    ),
                    &["result"],
                ),
            ),
            failures: registered(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "ultrafast_tls_handshake_failures_total",
                        "Failed TLS handshakes by reason.",
                    ),
                    &["reason"],
                ),
            ),
            versions: registered(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "ultrafast_tls_versions_total",
                        "Completed TLS handshakes by protocol version.",
                    ),
                    &["version"],
                ),
            ),
            alpn: registered(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "ultrafast_tls_alpn_total",
                        "Completed TLS handshakes by negotiated ALPN protocol.",
                    ),
                    &["protocol"],
                ),
            ),
            duration: registered(
                r,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "ultrafast_tls_handshake_seconds",
                        "TLS handshake duration.",
                    )
                    .buckets(vec![
                        0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
                    ]),
                ),
            ),
        };
        let certs = CertMetrics {
            expiry_s: registered(
                r,
                IntGaugeVec::new(
                    Opts::new(
                        "ultrafast_tls_cert_expiry_seconds",
                        "Seconds until each certificate expires.",
                    ),
                    &["cert"],
                ),
            ),
            stale_staples: registered(
                r,
                IntCounter::new(
                    "ultrafast_tls_ocsp_stale_total",
                    "OCSP responses not stapled because past their nextUpdate.",
                ),
            ),
            unknown_sni: registered(
                r,
                IntCounter::new(
                    "ultrafast_tls_unknown_sni_total",
                    "Handshakes refused for a name with no certificate (no default).",
                ),
            ),
        };
        let tickets = registered(
            r,
            IntCounterVec::new(
                Opts::new(
                    "ultrafast_tls_tickets_total",
                    "Session tickets issued and refused.",
                ),
                &["event"],
            ),
        );
        let cert_reloads = registered(
            r,
            IntCounterVec::new(
                Opts::new(
                    "ultrafast_tls_cert_reloads_total",
                    "Certificate reloads by result.",
                ),
                &["result"],
            ),
        );
        // Both outcomes exist from the start, so a dashboard or an alert
        // sees 0 rather than no series.
        for outcome in ["ok", "error"] {
            cert_reloads.with_label_values(&[outcome]);
        }
        let proxy_protocol = registered(
            r,
            IntCounterVec::new(
                Opts::new(
                    "ultrafast_proxy_protocol_total",
                    "Connections of PROXY protocol listeners by result: proxied, local (the balancer's own), refused_source, malformed, missing, timeout.",
                ),
                &["result"],
            ),
        );
        let spool = std::sync::Arc::new(spool_metrics(r, &conns));
        let protocols = registered(
            r,
            IntCounterVec::new(
                Opts::new(
                    "ultrafast_downstream_requests_total",
                    "Requests by the protocol they came in: HTTP/1.1 (or 1.0), HTTP/2, HTTP/3.",
                ),
                &["protocol"],
            ),
        );
        for p in ["HTTP/1.1", "HTTP/2", "HTTP/3"] {
            protocols.with_label_values(&[p]);
        }
        EdgeMetrics {
            acme: super::acme::AcmeMetrics::new(r),
            h3: super::h3::H3Metrics::new(r),
            protocols,
            spool,
            proxy_protocol,
            rejected,
            conns,
            tls,
            certs,
            tickets,
            cert_reloads,
        }
    }

    /// Ticket handles.
    pub fn tickets(&self) -> TicketMetrics {
        TicketMetrics {
            issued: self.tickets.with_label_values(&["issued"]),
            resumed: self.tls.handshakes.with_label_values(&["resumed_ticket"]),
            rejected: self.tickets.with_label_values(&["rejected"]),
        }
    }
}
