//! Certificates that issue and renew themselves (ACME, RFC 8555), for TLS
//! listeners with `tls.acme`.
//!
//! One `Issuer` per such listener runs as a background service:
//! - at start it serves `state_dir/certificate.pem` if that covers the
//!   configured names (a restart reuses the stored account and
//!   certificate, and orders nothing);
//! - it orders when there is none, and renews when the directory's
//!   Renewal Information (RFC 9773) says, or else at two thirds of the
//!   lifetime; a failed order is retried with jittered exponential backoff
//!   (10 s doubling to an hour) while the old certificate keeps serving;
//! - an issued certificate is written next to its key (one file, renamed
//!   into place) and swapped into the listener's resolver: the next
//!   handshake gets it, open connections keep theirs;
//! - with `[cluster]`, one instance orders at a time (a lock in the store)
//!   and puts the result in the store, where the others pick it up;
//!   HTTP-01 answers go to the store too, so the validator may reach any
//!   instance.
//!
//! `challenge` holds the validators' answers, `order` one order's steps,
//! `client` the HTTP client, `state` what is kept on disk.

mod challenge;
mod client;
mod order;
mod seal;
pub mod state;

pub use challenge::{
    alpn_certificate, http_answer, is_challenge_hello, ACME_TLS_ALPN, HTTP01_PREFIX,
};

use super::certs::{CertSpec, CertStore, SniResolver};
use crate::config::{AcmeChallenge, AcmeSpec};
use crate::prom::registered;
use instant_acme::Account;
use parking_lot::Mutex;
use prometheus::{GaugeVec, IntCounterVec, Opts, Registry};
use state::Issued;
use std::sync::{Arc, LazyLock};
use std::time::{Duration, SystemTime};

/// How often the schedule is looked at again (the file, the store).
const CHECK_EVERY: Duration = Duration::from_secs(30);
/// First retry after a failed order; it doubles up to `MAX_BACKOFF`.
const BASE_BACKOFF: Duration = Duration::from_secs(10);
/// Longest wait between two failed orders.
const MAX_BACKOFF: Duration = Duration::from_secs(3600);
/// Wait while another instance holds the order lock.
const BUSY_WAIT: Duration = Duration::from_secs(3);
/// The order lock's lease (an order takes seconds; a dead holder's lock
/// lapses).
const LOCK_TTL: Duration = Duration::from_secs(300);
/// Least time between two Renewal Information queries.
const ARI_MIN_RECHECK: Duration = Duration::from_secs(60);

/// The ACME metric families.
#[derive(Clone)]
pub struct AcmeMetrics {
    orders: IntCounterVec,
    expiry_days: GaugeVec,
    next_renewal_s: GaugeVec,
}

impl AcmeMetrics {
    /// Register the families.
    pub fn new(r: &Registry) -> Self {
        AcmeMetrics {
            orders: registered(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "ultrafast_acme_orders_total",
                        "ACME certificates by listener and result: issued (this instance ordered it), shared (another instance's, from the cluster store), failed (an order or its validation failed; the old certificate keeps serving).",
                    ),
                    &["listener", "result"],
                ),
            ),
            expiry_days: registered(
                r,
                GaugeVec::new(
                    Opts::new(
                        "ultrafast_acme_certificate_expiry_days",
                        "Days until the listener's ACME certificate expires (absent until one is issued).",
                    ),
                    &["listener"],
                ),
            ),
            next_renewal_s: registered(
                r,
                GaugeVec::new(
                    Opts::new(
                        "ultrafast_acme_next_renewal_seconds",
                        "Seconds until the listener's next ACME order (0: due now).",
                    ),
                    &["listener"],
                ),
            ),
        }
    }
}

/// What `/admin/certs` shows of an ACME certificate's life.
#[derive(Debug, Default, Clone)]
pub struct Status {
    next_renewal: Option<SystemTime>,
    last_error: Option<String>,
    failures: u32,
    advised_by_directory: bool,
}

/// Why an order did not end with a certificate.
enum Failed {
    /// Another instance holds the order lock.
    Busy,
    /// The order failed.
    Error(String),
}

/// Orders and renews one listener's certificate.
pub struct Issuer {
    listener: String,
    spec: AcmeSpec,
    resolver: Arc<SniResolver>,
    specs: Vec<CertSpec>,
    metrics: AcmeMetrics,
    status: Arc<Mutex<Status>>,
}

fn unix(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// A number in [0, 1) that differs between calls and instances.
fn random_unit() -> f64 {
    (crate::reqid::random_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// The wait after `failures` failed orders in a row: exponential, capped,
/// and jittered into its upper half so that instances spread out.
fn backoff(failures: u32) -> Duration {
    let exp = BASE_BACKOFF.saturating_mul(1 << failures.saturating_sub(1).min(20));
    exp.min(MAX_BACKOFF).mul_f64(0.5 + random_unit() / 2.0)
}

impl Issuer {
    /// An issuer for `listener`, whose resolver serves `specs` (the ACME
    /// entry among them).
    pub fn new(
        listener: String,
        spec: AcmeSpec,
        resolver: Arc<SniResolver>,
        specs: Vec<CertSpec>,
        metrics: AcmeMetrics,
    ) -> Self {
        let status = Arc::new(Mutex::new(Status::default()));
        register(&listener, &specs, Some((spec.clone(), status.clone())));
        if crate::cluster::get().is_some() && spec.shared_key.is_none() {
            log::warn!(
                "listener {listener}: ACME with [cluster] but no acme.shared_key_file: nothing is shared through the store, and each instance orders its own certificate (mind the directory's duplicate-certificate limits)"
            );
        }
        Issuer {
            listener,
            spec,
            resolver,
            specs,
            metrics,
            status,
        }
    }

    fn shared_name(&self) -> String {
        format!("acme:cert:{}", self.spec.domains.join(","))
    }

    fn lock_name(&self) -> String {
        format!("acme:{}", self.spec.domains.join(","))
    }

    fn count(&self, result: &str) {
        self.metrics
            .orders
            .with_label_values(&[&self.listener, result])
            .inc();
    }

    /// Write the chain and key, and serve them from the next handshake.
    fn install(&self, pem: &str) -> Result<Issued, String> {
        let issued = Issued::from_pem(pem.as_bytes())
            .ok_or("the directory's answer holds no certificate")?;
        if !issued.covers(&self.spec.domains) {
            return Err(format!(
                "the certificate is for {:?}, not {:?}",
                issued.names, self.spec.domains
            ));
        }
        state::write_atomic(&self.spec.cert_file(), pem.as_bytes())?;
        let store = CertStore::load(&self.specs, self.resolver.metrics())?;
        self.resolver.replace(store);
        Ok(issued)
    }

    /// A newer certificate another instance put in the cluster's store.
    async fn take_shared(&self, current: Option<&Issued>) -> Option<Issued> {
        let c = crate::cluster::get()?;
        let secret = self.spec.shared_key.as_ref()?;
        let name = self.shared_name();
        let sealed = c.fetch(&name).await.ok().flatten()?;
        let Some(pem) = seal::open(secret, &name, &sealed) else {
            log::warn!(
                "listener {}: the cluster store's certificate is not sealed with this shared_key_file: ignored",
                self.listener
            );
            return None;
        };
        if let Err(e) = seal::chains_to(&pem, &self.spec.issuer_roots, &self.spec.domains) {
            log::warn!(
                "listener {}: the cluster store's certificate does not chain to the issuer's roots: {e}",
                self.listener
            );
            return None;
        }
        let theirs = Issued::from_pem(pem.as_bytes())?;
        let newer = current.is_none_or(|c| theirs.not_after > c.not_after);
        if !newer || !theirs.covers(&self.spec.domains) || theirs.not_after <= SystemTime::now() {
            return None;
        }
        match self.install(&pem) {
            Ok(i) => {
                self.count("shared");
                log::info!(
                    "listener {}: ACME certificate taken from the cluster store (expires {})",
                    self.listener,
                    unix(i.not_after)
                );
                Some(i)
            }
            Err(e) => {
                log::warn!("listener {}: the store's certificate: {e}", self.listener);
                None
            }
        }
    }

    async fn account(&self, account: &mut Option<Account>) -> Result<Account, String> {
        if let Some(a) = account {
            return Ok(a.clone());
        }
        let a = order::account(&self.spec).await?;
        *account = Some(a.clone());
        Ok(a)
    }

    /// When the directory advises renewing `current` (a random point of
    /// its suggested window) and when to ask again; `None` where it gives
    /// no advice.
    async fn advised(
        &self,
        account: &mut Option<Account>,
        current: &Issued,
    ) -> Option<(SystemTime, Duration)> {
        let a = self.account(account).await.ok()?;
        let (info, retry) = a.renewal_info(&current.cert_id()?).await.ok()?;
        let (start, end): (SystemTime, SystemTime) = (
            info.suggested_window.start.into(),
            info.suggested_window.end.into(),
        );
        let span = end.duration_since(start).unwrap_or_default();
        Some((start + span.mul_f64(random_unit()), retry))
    }

    /// One order, under the cluster's lock when there is a cluster (a
    /// store that is down does not stop this instance from ordering).
    async fn renew(
        &self,
        account: &mut Option<Account>,
        current: Option<&Issued>,
        ari: bool,
    ) -> Result<Issued, Failed> {
        let cluster = crate::cluster::get();
        let lock = self.lock_name();
        let mut locked = false;
        if let Some(c) = cluster {
            match c.try_lock(&lock, LOCK_TTL).await {
                Ok(true) => locked = true,
                Ok(false) => return Err(Failed::Busy),
                Err(_) => {}
            }
        }
        let result = self.order(account, current, ari).await;
        if let (Some(c), true) = (cluster, locked) {
            if let Ok(pem) = &result {
                let ttl = Issued::from_pem(pem.as_bytes())
                    .and_then(|i| i.not_after.duration_since(SystemTime::now()).ok())
                    .unwrap_or(LOCK_TTL);
                // Shared only sealed, and only where a key is configured.
                let name = self.shared_name();
                if let Some(sealed) = self
                    .spec
                    .shared_key
                    .as_ref()
                    .and_then(|k| seal::seal(k, &name, pem))
                {
                    let _ = c.put(&name, sealed, ttl).await;
                }
            }
            let _ = c.unlock(&lock).await;
        }
        self.install(&result.map_err(Failed::Error)?)
            .map_err(Failed::Error)
    }

    /// The chain and key of a new order, PEM (a directory that lost the
    /// account gets a new one, once).
    async fn order(
        &self,
        account: &mut Option<Account>,
        current: Option<&Issued>,
        ari: bool,
    ) -> Result<String, String> {
        let replaces = current.filter(|_| ari).and_then(Issued::cert_id);
        for attempt in 0..2 {
            let a = self.account(account).await?;
            match order::order(&self.spec, &a, replaces.clone()).await {
                Err(e) if attempt == 0 && order::unknown_account(&e) => {
                    log::warn!(
                        "listener {}: the directory no longer knows the stored account ({e}); making a new one",
                        self.listener
                    );
                    state::drop_account(&self.spec.state_dir);
                    *account = None;
                }
                Err(e) => return Err(e),
                Ok(c) => return Ok(format!("{}{}", c.chain, c.key)),
            }
        }
        Err("the directory refused a new account".into())
    }

    fn show(&self, current: Option<&Issued>, due: SystemTime) {
        let now = SystemTime::now();
        if let Some(c) = current {
            let left = unix(c.not_after) - unix(now);
            self.metrics
                .expiry_days
                .with_label_values(&[&self.listener])
                .set(left as f64 / 86_400.0);
        }
        let wait = due.duration_since(now).unwrap_or_default();
        self.metrics
            .next_renewal_s
            .with_label_values(&[&self.listener])
            .set(wait.as_secs_f64());
        self.status.lock().next_renewal = Some(due);
    }
}

#[async_trait::async_trait]
impl pingora::services::background::BackgroundService for Issuer {
    async fn start(&self, mut shutdown: pingora::server::ShutdownWatch) {
        if let Err(e) = state::ensure_dir(&self.spec.state_dir) {
            log::error!("listener {}: ACME state_dir: {e}", self.listener);
            self.status.lock().last_error = Some(e);
            return;
        }
        let mut account = None;
        let mut failures = 0u32;
        let mut retry_at: Option<SystemTime> = None;
        // The directory's advice: when, and when to ask again.
        let mut advice: Option<(SystemTime, std::time::Instant)> = None;
        loop {
            let file =
                Issued::read(&self.spec.cert_file()).filter(|i| i.covers(&self.spec.domains));
            let current = match self.take_shared(file.as_ref()).await {
                Some(i) => Some(i),
                None => file,
            };
            let now = SystemTime::now();
            let mut due = now;
            if let Some(c) = &current {
                if advice.is_none_or(|(_, recheck)| recheck <= std::time::Instant::now()) {
                    advice = self.advised(&mut account, c).await.map(|(t, retry)| {
                        (t, std::time::Instant::now() + retry.max(ARI_MIN_RECHECK))
                    });
                    self.status.lock().advised_by_directory = advice.is_some();
                }
                due = advice.map_or_else(|| c.two_thirds(), |(t, _)| t);
            }
            if let Some(r) = retry_at {
                due = due.max(r);
            }
            self.show(current.as_ref(), due);
            if due > now {
                let wait = due.duration_since(now).unwrap_or_default().min(CHECK_EVERY);
                tokio::select! {
                    _ = shutdown.changed() => return,
                    _ = tokio::time::sleep(wait) => continue,
                }
            }
            // A renewal the directory advised names what it replaces.
            let ari = advice.is_some();
            match self.renew(&mut account, current.as_ref(), ari).await {
                Ok(i) => {
                    self.count("issued");
                    log::info!(
                        "listener {}: ACME certificate issued for {:?} by {} (valid until {})",
                        self.listener,
                        i.names,
                        i.issuer,
                        unix(i.not_after)
                    );
                    failures = 0;
                    retry_at = None;
                    advice = None;
                    let mut s = self.status.lock();
                    s.failures = 0;
                    s.last_error = None;
                }
                Err(Failed::Busy) => retry_at = Some(SystemTime::now() + BUSY_WAIT),
                Err(Failed::Error(e)) => {
                    failures += 1;
                    let wait = backoff(failures);
                    self.count("failed");
                    log::error!(
                        "listener {}: ACME order for {:?} failed ({e}); {} the current certificate, next try in {:.0} s",
                        self.listener,
                        self.spec.domains,
                        if current.is_some() { "keeping" } else { "still without" },
                        wait.as_secs_f64()
                    );
                    retry_at = Some(SystemTime::now() + wait);
                    let mut s = self.status.lock();
                    s.failures = failures;
                    s.last_error = Some(e);
                }
            }
        }
    }
}

/// One TLS listener's certificates, for `/admin/certs`.
struct View {
    listener: String,
    specs: Vec<CertSpec>,
    acme: Option<(AcmeSpec, Arc<Mutex<Status>>)>,
}

static VIEWS: LazyLock<Mutex<Vec<View>>> = LazyLock::new(Default::default);

/// Show a TLS listener's certificates on `/admin/certs` (`acme`: the
/// issuer's settings and state, for a listener that has one).
pub fn register(listener: &str, specs: &[CertSpec], acme: Option<(AcmeSpec, Arc<Mutex<Status>>)>) {
    let mut views = VIEWS.lock();
    views.retain(|v| v.listener != listener);
    views.push(View {
        listener: listener.to_string(),
        specs: specs.to_vec(),
        acme,
    });
}

/// Whether `host` (a request's Host, any port and one trailing dot
/// aside) is a name of a listener's ACME order answered by HTTP-01: only
/// such requests for a challenge are looked up (and, with `[cluster]`,
/// asked of the store), so that no other probe costs a store round trip.
pub fn serves_http01(host: &str) -> bool {
    let name = crate::uri::strip_port(host);
    let name = name.strip_suffix('.').unwrap_or(name);
    VIEWS.lock().iter().any(|v| {
        v.acme.as_ref().is_some_and(|(spec, _)| {
            spec.challenge == AcmeChallenge::Http01
                && spec.domains.iter().any(|d| d.eq_ignore_ascii_case(name))
        })
    })
}

/// `/admin/certs`: every TLS listener's certificates, their source
/// (file or ACME), names, issuer and expiry, and for ACME the next
/// renewal and the last error.
pub fn view() -> serde_json::Value {
    let now = unix(SystemTime::now());
    let views = VIEWS.lock();
    let listeners: Vec<_> = views
        .iter()
        .map(|v| {
            let certs: Vec<_> = v
                .specs
                .iter()
                .map(|s| {
                    let issued = Issued::read(&s.cert);
                    let mut o = serde_json::json!({
                        "source": if s.optional { "acme" } else { "file" },
                        "file": s.cert.display().to_string(),
                        "names": s.names,
                        "default": s.default,
                        "issued": issued.is_some(),
                    });
                    if let Some(i) = &issued {
                        o["issuer"] = i.issuer.clone().into();
                        o["not_after"] = unix(i.not_after).into();
                        o["days_left"] = ((unix(i.not_after) - now) as f64 / 86_400.0).into();
                    }
                    if let (true, Some((spec, status))) = (s.optional, &v.acme) {
                        let st = status.lock().clone();
                        o["directory"] = spec.directory.clone().into();
                        o["challenge"] = match spec.challenge {
                            AcmeChallenge::Http01 => "http-01",
                            AcmeChallenge::TlsAlpn01 => "tls-alpn-01",
                        }
                        .into();
                        o["next_renewal"] = st.next_renewal.map(unix).into();
                        o["renewal_advised_by_directory"] = st.advised_by_directory.into();
                        o["failures"] = st.failures.into();
                        o["last_error"] = st.last_error.into();
                    }
                    o
                })
                .collect();
            serde_json::json!({"listener": v.listener, "certificates": certs})
        })
        .collect();
    serde_json::json!({ "listeners": listeners })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_an_hour_within_its_upper_half() {
        for (n, full) in [(1, 10), (2, 20), (3, 40), (12, 3600), (40, 3600)] {
            let b = backoff(n).as_secs_f64();
            assert!(
                b >= full as f64 / 2.0 && b <= full as f64,
                "{n} failures: {b}"
            );
        }
    }
}
