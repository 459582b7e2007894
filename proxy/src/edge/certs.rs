//! Certificates for TLS listeners: loading, SNI selection, OCSP staples and
//! hot reload.
//!
//! A `CertStore` maps SNI names (exact, then `*.suffix`, then the default
//! certificate) to `rustls` certified keys. The `SniResolver` holds the store
//! in an `ArcSwap`, so new material applies to the next handshake while
//! established connections keep theirs; a store that fails to load never
//! replaces the working one. A staple is attached only while its
//! `nextUpdate` is in the future: serving a stale staple is worse than none.

use super::der;
use arc_swap::ArcSwap;
use prometheus::{IntCounter, IntGaugeVec};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

pub use crate::config::CertSpec;

/// Metric handles of the certificate layer.
#[derive(Clone)]
pub struct CertMetrics {
    /// Seconds until each certificate expires, by first name.
    pub expiry_s: IntGaugeVec,
    /// Staples not served because past `nextUpdate`.
    pub stale_staples: IntCounter,
    /// Handshakes refused for an unknown SNI name (no default certificate).
    pub unknown_sni: IntCounter,
}

/// Counts full handshakes: rustls asks for a certificate only when it does
/// not resume a session.
#[derive(Clone)]
pub struct FullHandshakes(pub IntCounter);

impl CertMetrics {
    /// Handles registered nowhere (validation, unit tests).
    pub fn detached() -> Self {
        #[allow(clippy::expect_used)]
        let g = IntGaugeVec::new(
            prometheus::Opts::new("detached_expiry", "unregistered"),
            &["cert"],
        )
        .expect("static metric definition");
        #[allow(clippy::expect_used)]
        let c = |n: &str| IntCounter::new(n, "unregistered").expect("static metric definition");
        CertMetrics {
            expiry_s: g,
            stale_staples: c("detached_stale"),
            unknown_sni: c("detached_sni"),
        }
    }
}

/// Certified keys by SNI name.
#[derive(Debug, Default)]
pub struct CertStore {
    exact: HashMap<String, Arc<CertifiedKey>>,
    wildcard: HashMap<String, Arc<CertifiedKey>>,
    default: Option<Arc<CertifiedKey>>,
    /// Earliest `nextUpdate` of a stapled response (unix seconds): the
    /// store must be rebuilt then, so the staple stops being served.
    pub staple_expires: Option<i64>,
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// Whether an OCSP response speaks for the chain's leaf: a single response
/// whose CertID has the leaf's serial and the hash of its issuer's name,
/// and, when the chain carries the issuer, the hash of the issuer's key. A
/// staple for another certificate would make clients that check it fail
/// (or worse, trust a status that is not this certificate's).
fn staple_matches(
    ocsp: &[u8],
    chain: &[rustls::pki_types::CertificateDer<'_>],
) -> Result<(), String> {
    let leaf = chain.first().ok_or("empty chain")?;
    let (serial, issuer) =
        der::cert_serial_and_issuer(leaf.as_ref()).ok_or("cannot read the certificate")?;
    let issuer_key = chain
        .get(1)
        .and_then(|c| der::cert_subject_and_key(c.as_ref()))
        .filter(|(subject, _)| *subject == issuer)
        .map(|(_, key)| key);
    let ids = der::ocsp_cert_ids(ocsp).ok_or("not a successful DER OCSP response")?;
    let hash = |oid: &[u8], data: &[u8]| -> Option<Vec<u8>> {
        let alg = match oid {
            der::OID_SHA1 => &ring::digest::SHA1_FOR_LEGACY_USE_ONLY,
            der::OID_SHA256 => &ring::digest::SHA256,
            _ => return None,
        };
        Some(ring::digest::digest(alg, data).as_ref().to_vec())
    };
    let matches = ids.iter().any(|id| {
        id.serial == serial
            && hash(&id.hash_oid, issuer).is_some_and(|h| h == id.issuer_name_hash)
            && issuer_key
                .is_none_or(|k| hash(&id.hash_oid, k).is_some_and(|h| h == id.issuer_key_hash))
    });
    if matches {
        Ok(())
    } else {
        Err("the OCSP response is for another certificate (no CertID matches the certificate's serial and issuer); not loading it".into())
    }
}

fn load_one(
    spec: &CertSpec,
    metrics: &CertMetrics,
) -> Result<(Arc<CertifiedKey>, Option<i64>), String> {
    let (cert, key) = (
        spec.cert.display().to_string(),
        spec.key.display().to_string(),
    );
    let (chain, key_der) = pingora::tls::load_certs_and_key_files(&cert, &key)
        .map_err(|e| format!("{cert} / {key}: {e}"))?
        .ok_or_else(|| format!("{cert} / {key}: no certificate or no key found"))?;
    let leaf = chain
        .first()
        .ok_or_else(|| format!("{cert}: empty chain"))?;
    let not_after = der::cert_not_after(leaf.as_ref());
    let signer = rustls::crypto::ring::sign::any_supported_type(&key_der)
        .map_err(|e| format!("{key}: unsupported key: {e}"))?;
    let mut ck = CertifiedKey::new(chain.clone(), signer);
    ck.keys_match()
        .map_err(|e| format!("{cert} / {key}: key does not match the certificate: {e}"))?;
    let mut staple_expires = None;
    if let Some(ocsp) = &spec.ocsp {
        let bytes = std::fs::read(ocsp).map_err(|e| format!("{}: {e}", ocsp.display()))?;
        staple_matches(&bytes, &chain).map_err(|e| format!("{}: {e}", ocsp.display()))?;
        match der::ocsp_next_update(&bytes) {
            Some(next) if next > unix_now() => {
                ck.ocsp = Some(bytes);
                staple_expires = Some(next);
            }
            Some(_) => {
                metrics.stale_staples.inc();
                log::warn!(
                    "{}: OCSP response is past its nextUpdate; not stapling it",
                    ocsp.display()
                );
            }
            None => {
                return Err(format!(
                    "{}: not a successful DER OCSP response",
                    ocsp.display()
                ))
            }
        }
    }
    let label = spec.names.first().cloned().unwrap_or_else(|| cert.clone());
    if let Some(t) = not_after {
        metrics
            .expiry_s
            .with_label_values(&[&label])
            .set(t - unix_now());
    }
    Ok((Arc::new(ck), staple_expires))
}

impl CertStore {
    /// Load every entry; any failure fails the whole store.
    pub fn load(specs: &[CertSpec], metrics: &CertMetrics) -> Result<Self, String> {
        let mut store = CertStore::default();
        for spec in specs {
            if spec.optional && !spec.cert.exists() {
                continue;
            }
            let (ck, expires) = load_one(spec, metrics)?;
            if let Some(e) = expires {
                store.staple_expires = Some(store.staple_expires.map_or(e, |s| s.min(e)));
            }
            for name in &spec.names {
                let name = name.to_ascii_lowercase();
                match name.strip_prefix("*.") {
                    Some(suffix) => store.wildcard.insert(suffix.to_string(), ck.clone()),
                    None => store.exact.insert(name, ck.clone()),
                };
            }
            if spec.default {
                store.default = Some(ck);
            }
        }
        Ok(store)
    }

    fn find(&self, sni: Option<&str>) -> Option<Arc<CertifiedKey>> {
        if let Some(name) = sni {
            let name = name.to_ascii_lowercase();
            if let Some(ck) = self.exact.get(&name) {
                return Some(ck.clone());
            }
            if let Some((_, parent)) = name.split_once('.') {
                if let Some(ck) = self.wildcard.get(parent) {
                    return Some(ck.clone());
                }
            }
        }
        self.default.clone()
    }
}

/// SNI certificate selection over a swappable store.
pub struct SniResolver {
    store: ArcSwap<CertStore>,
    metrics: CertMetrics,
    full: Option<FullHandshakes>,
}

impl std::fmt::Debug for SniResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SniResolver")
    }
}

impl SniResolver {
    /// A resolver over a loaded store.
    pub fn new(store: CertStore, metrics: CertMetrics, full: Option<FullHandshakes>) -> Self {
        SniResolver {
            store: ArcSwap::from_pointee(store),
            metrics,
            full,
        }
    }

    /// Replace the certificates for future handshakes.
    pub fn replace(&self, store: CertStore) {
        self.store.store(Arc::new(store));
    }

    /// When the current store's earliest staple expires.
    pub fn staple_expires(&self) -> Option<i64> {
        self.store.load().staple_expires
    }

    /// Metric handles.
    pub fn metrics(&self) -> &CertMetrics {
        &self.metrics
    }
}

impl ResolvesServerCert for SniResolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        // An ACME validator's TLS-ALPN-01 handshake offers `acme-tls/1`
        // alone (RFC 8737 3): it gets the challenge's certificate, or
        // nothing; never the names' real one.
        if super::acme::is_challenge_hello(hello.alpn()) {
            return hello.server_name().and_then(super::acme::alpn_certificate);
        }
        let found = self.store.load().find(hello.server_name());
        match (&found, &self.full) {
            (None, _) => self.metrics.unknown_sni.inc(),
            (Some(_), Some(full)) => full.0.inc(),
            _ => {}
        }
        found
    }
}

/// Watches certificate, key and OCSP files and reloads a listener's store
/// when one changes (or when a stapled response reaches its `nextUpdate`).
/// A store that fails to load is logged and counted; the old one stays.
pub struct CertWatcher {
    entries: Vec<(Arc<SniResolver>, Vec<CertSpec>)>,
    reloads: prometheus::IntCounterVec,
}

impl CertWatcher {
    /// Watch these listeners' certificates.
    pub fn new(
        entries: Vec<(Arc<SniResolver>, Vec<CertSpec>)>,
        reloads: prometheus::IntCounterVec,
    ) -> Self {
        CertWatcher { entries, reloads }
    }
}

fn stamps(specs: &[CertSpec]) -> Vec<Option<(SystemTime, u64)>> {
    let stamp = |p: &PathBuf| {
        let m = std::fs::metadata(p).ok()?;
        Some((m.modified().ok()?, m.len()))
    };
    specs
        .iter()
        .flat_map(|s| [Some(&s.cert), Some(&s.key), s.ocsp.as_ref()])
        .map(|p| p.and_then(stamp))
        .collect()
}

#[async_trait::async_trait]
impl pingora::services::background::BackgroundService for CertWatcher {
    async fn start(&self, mut shutdown: pingora::server::ShutdownWatch) {
        let mut last: Vec<_> = self.entries.iter().map(|(_, s)| stamps(s)).collect();
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tokio::time::sleep(std::time::Duration::from_millis(500)) => {}
            }
            for (i, (resolver, specs)) in self.entries.iter().enumerate() {
                let now = stamps(specs);
                let staple_due = resolver.staple_expires().is_some_and(|t| t <= unix_now());
                if now == last[i] && !staple_due {
                    continue;
                }
                last[i] = now;
                match CertStore::load(specs, resolver.metrics()) {
                    Ok(store) => {
                        resolver.replace(store);
                        self.reloads.with_label_values(&["ok"]).inc();
                        log::info!("TLS certificates reloaded ({} entries)", specs.len());
                    }
                    Err(e) => {
                        self.reloads.with_label_values(&["error"]).inc();
                        log::error!("TLS certificate reload failed, previous certificates keep serving: {e}");
                    }
                }
            }
        }
    }
}
