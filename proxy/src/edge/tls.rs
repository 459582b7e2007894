//! TLS on the edge: the rustls `ServerConfig` of a TLS listener (SNI
//! resolver, rotating ticketer, bounded session cache, ALPN h2/http1.1, TLS
//! 1.2 and 1.3 only) and its metric handles.
//!
//! Pingora's rustls wrapper builds its `ServerConfig` itself, with no place
//! for a ticketer or a session cache, so we build it here and the listener
//! (`listener`) runs the handshake through Pingora's
//! `Acceptor::from_server_config`.

use super::certs::SniResolver;
use super::ticket::RotatingTicketer;
use prometheus::{Histogram, IntCounterVec};
use rustls::server::{ServerSessionMemoryCache, StoresServerSessions};
use std::sync::Arc;

/// Metric handles of TLS listeners.
#[derive(Clone)]
pub struct TlsMetrics {
    /// Handshakes by result (full, resumed_ticket, resumed_cache, failed).
    pub handshakes: IntCounterVec,
    /// Failed handshakes by reason.
    pub failures: IntCounterVec,
    /// Negotiated TLS versions.
    pub versions: IntCounterVec,
    /// Negotiated ALPN protocols.
    pub alpn: IntCounterVec,
    /// Handshake duration.
    pub duration: Histogram,
}

/// A bounded session cache that counts resumptions through it.
#[derive(Debug)]
pub struct CountingCache {
    inner: Arc<ServerSessionMemoryCache>,
    hits: prometheus::IntCounter,
}

impl CountingCache {
    /// A cache of `size` sessions.
    pub fn new(size: usize, hits: prometheus::IntCounter) -> Self {
        CountingCache {
            inner: ServerSessionMemoryCache::new(size.max(1)),
            hits,
        }
    }
}

impl StoresServerSessions for CountingCache {
    fn put(&self, key: Vec<u8>, value: Vec<u8>) -> bool {
        self.inner.put(key, value)
    }
    fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        let v = self.inner.get(key);
        if v.is_some() {
            self.hits.inc();
        }
        v
    }
    fn take(&self, key: &[u8]) -> Option<Vec<u8>> {
        let v = self.inner.take(key);
        if v.is_some() {
            self.hits.inc();
        }
        v
    }
    fn can_cache(&self) -> bool {
        true
    }
}

/// What a TLS listener needs to build its `ServerConfig`.
pub struct TlsBuild {
    /// SNI certificate selection.
    pub resolver: Arc<SniResolver>,
    /// Ticketer, when tickets are on.
    pub ticketer: Option<Arc<RotatingTicketer>>,
    /// Session cache size (0 = off).
    pub cache_size: usize,
    /// Offer h2 in ALPN.
    pub h2: bool,
    /// Accept `acme-tls/1` (the listener answers TLS-ALPN-01).
    pub acme_alpn: bool,
}

/// Build the rustls server config of a TLS listener.
pub fn server_config(b: TlsBuild, metrics: &TlsMetrics) -> Arc<rustls::ServerConfig> {
    pingora::tls::install_default_crypto_provider();
    let mut cfg = rustls::ServerConfig::builder_with_protocol_versions(&[
        &rustls::version::TLS13,
        &rustls::version::TLS12,
    ])
    .with_no_client_auth()
    .with_cert_resolver(b.resolver);
    cfg.alpn_protocols = if b.h2 {
        vec![b"h2".to_vec(), b"http/1.1".to_vec()]
    } else {
        vec![b"http/1.1".to_vec()]
    };
    if b.acme_alpn {
        // Last: rustls picks in this order, and only a validator offers it.
        cfg.alpn_protocols.push(super::acme::ACME_TLS_ALPN.to_vec());
    }
    if let Some(t) = b.ticketer {
        cfg.ticketer = t;
    }
    cfg.session_storage = if b.cache_size > 0 {
        Arc::new(CountingCache::new(
            b.cache_size,
            metrics.handshakes.with_label_values(&["resumed_cache"]),
        ))
    } else {
        Arc::new(rustls::server::NoServerSessionStorage {})
    };
    Arc::new(cfg)
}

/// The failure label of a handshake error.
pub(super) fn failure_reason(e: &str) -> &'static str {
    let e = e.to_ascii_lowercase();
    if e.contains("no server certificate")
        || e.contains("unrecognised name")
        || e.contains("unrecognized name")
    {
        "unknown_sni"
    } else if e.contains("protocol version")
        || e.contains("incompatible")
        || e.contains("no cipher")
    {
        "incompatible"
    } else if e.contains("corrupt") || e.contains("invalid") || e.contains("decode") {
        "malformed"
    } else if e.contains("eof") || e.contains("reset") || e.contains("closed") {
        "client_closed"
    } else {
        "other"
    }
}
