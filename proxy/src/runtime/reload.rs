//! Hot reload: load -> validate -> diff -> warm -> swap, all or nothing.
//!
//! A reload reads the file, resolves the host names of new or changed pools
//! (before anything is swapped, so a name that does not resolve fails the
//! reload instead of the running config), builds the new `Config` reusing
//! every unchanged pool and rate limit as the same object (connections,
//! health, ejections, balancer and queue state carry on), probes new members
//! once, and only then swaps the `ArcSwap`. Requests in flight keep the
//! snapshot they started with, so nothing in flight (an SSE stream
//! included) is cut. Settings that cannot change in a running process
//! (listeners, threads, admin address, pid/upgrade paths, log target) are
//! reported as pending and keep their old values until a graceful upgrade.
//!
//! Triggers: SIGHUP, `POST /admin/reload`, `ultrafast reload`, and the
//! optional file watcher; all go through `Manager::reload`, one at a time.

use crate::config::{self, ConfigError};
use crate::metrics::Metrics;
use crate::runtime::{self as rt, BuildCtx, Shared, Snapshot as Config};
use crate::upstream::dns::{resolve_all, Resolver};
use crate::upstream::{health, Pool};
use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// What a reload changed.
#[derive(Debug, Default, Clone, Serialize, PartialEq)]
pub struct Diff {
    /// Pools that are new.
    pub pools_added: Vec<String>,
    /// Pools that are gone.
    pub pools_removed: Vec<String>,
    /// Pools whose definition changed (rebuilt, member state carried over).
    pub pools_changed: Vec<String>,
    /// Routes added, removed or changed.
    pub routes_changed: usize,
    /// Lanes or rate limits changed.
    pub admission_changed: bool,
    /// Settings that need a graceful upgrade to take effect.
    pub pending_upgrade: Vec<String>,
    /// Models by what the reload did to them: `added`, `reloaded` (a new
    /// engine, loaded and warmed before the swap), `settings`, `removed`.
    pub models: std::collections::BTreeMap<String, String>,
}

/// The outcome of a successful reload.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Hash of the new config text.
    pub hash: String,
    /// What changed.
    pub diff: Diff,
}

/// Owns the live config and performs reloads.
pub struct Manager {
    path: PathBuf,
    metrics: Arc<Metrics>,
    shared: Shared,
    lock: tokio::sync::Mutex<()>,
    front: Option<Arc<crate::inference::Front>>,
    last: parking_lot::Mutex<Option<LastReload>>,
}

/// The outcome of the latest reload, for the status page.
#[derive(Debug, Clone)]
pub struct LastReload {
    /// Unix time it finished.
    pub at_unix: f64,
    /// Whether it took effect.
    pub ok: bool,
    /// Why not (`file:line:col: field: message` each).
    pub errors: Vec<String>,
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl Manager {
    /// A manager over the already-loaded live config.
    pub fn new(path: PathBuf, metrics: Arc<Metrics>, shared: Shared) -> Self {
        let m = Manager {
            path,
            metrics,
            shared,
            lock: tokio::sync::Mutex::new(()),
            front: None,
            last: parking_lot::Mutex::new(None),
        };
        // Both outcomes exist from the start, so an alert on errors sees 0
        // rather than no series.
        for r in ["ok", "error"] {
            m.metrics.reloads.with_label_values(&[r]);
        }
        m.publish(&m.shared.load());
        m
    }

    /// Also reconcile the engines and the async store of `front`.
    pub fn with_front(mut self, front: Arc<crate::inference::Front>) -> Self {
        self.front = Some(front);
        self
    }

    /// The live config.
    pub fn shared(&self) -> &Shared {
        &self.shared
    }

    /// The latest reload's outcome (None before the first).
    pub fn last_reload(&self) -> Option<LastReload> {
        self.last.lock().clone()
    }

    /// The config file.
    pub fn path(&self) -> &PathBuf {
        &self.path
    }

    fn publish(&self, cfg: &Config) {
        self.metrics.config_info.reset();
        self.metrics
            .config_info
            .with_label_values(&[&cfg.hash])
            .set(1);
        self.metrics.config_loaded.set(unix_now());
        self.metrics
            .admission
            .set_lane_targets(&cfg.lanes, &cfg.file);
    }

    /// Reload from the file. On any error the live config is untouched.
    pub async fn reload(&self) -> Result<Report, Vec<ConfigError>> {
        let _one_at_a_time = self.lock.lock().await;
        let result = self.try_reload().await;
        *self.last.lock() = Some(LastReload {
            at_unix: unix_now(),
            ok: result.is_ok(),
            errors: result
                .as_ref()
                .err()
                .map(|errs| errs.iter().map(|e| e.to_string()).collect())
                .unwrap_or_default(),
        });
        match &result {
            Ok(r) => {
                self.metrics.reloads.with_label_values(&["ok"]).inc();
                let d = &r.diff;
                log::info!(
                    "config reloaded from {} (hash {}): pools +{:?} -{:?} ~{:?}, {} route(s) changed, admission changed: {}, models {:?}{}",
                    self.path.display(),
                    r.hash,
                    d.pools_added,
                    d.pools_removed,
                    d.pools_changed,
                    d.routes_changed,
                    d.admission_changed,
                    d.models,
                    if d.pending_upgrade.is_empty() {
                        String::new()
                    } else {
                        format!("; pending a graceful upgrade: {}", d.pending_upgrade.join("; "))
                    }
                );
            }
            Err(errs) => {
                self.metrics.reloads.with_label_values(&["error"]).inc();
                for e in errs {
                    log::error!("reload refused, old config keeps serving: {e}");
                }
            }
        }
        result
    }

    async fn try_reload(&self) -> Result<Report, Vec<ConfigError>> {
        let path = self.path.clone();
        let text = config::read(&path)?;
        let file = config::parse_file(&path, &text)?;
        let old = self.shared.load_full();
        let names = rt::names_to_resolve(&file, Some(&old));
        let settings = rt::dns_settings(&file);
        let resolved = if names.is_empty() {
            Default::default()
        } else {
            let resolver =
                Resolver::new(settings.clone()).map_err(|e| config::file_error(&path, e))?;
            resolve_all(&resolver, names, &self.metrics.upstream).await
        };
        let ctx = BuildCtx {
            metrics: &self.metrics,
            resolved: &resolved,
            prev: Some(&old),
            prefetch_fraction: settings.prefetch_fraction,
        };
        let mut new = rt::build(&file, &path, &text, &ctx)?;
        // A listener the upgrade could not bind refuses the reload now, and
        // the old listeners keep serving.
        let unbound = crate::edge::listener::unbindable(&old.listeners, &new.listeners);
        if !unbound.is_empty() {
            return Err(unbound
                .into_iter()
                .flat_map(|e| config::file_error(&path, e))
                .collect());
        }
        let mut diff = diff(&old, &new);
        keep_process_settings(&old, &mut new, &mut diff);
        warm(&old, &new).await;
        // An unchanged `[api_keys]` section keeps the live key store: read
        // its file again (a bad file keeps the old keys; it is logged).
        if let Some(keys) = new.api_keys.clone() {
            let _ = tokio::task::spawn_blocking(move || keys.reload()).await;
        }
        // New or changed engines load and warm up beside the running ones;
        // one that fails fails the reload, naming it.
        let staged = match &self.front {
            None => None,
            Some(f) => {
                let staged = f
                    .engines
                    .stage(&old.models, &new.models, &self.metrics.inference)
                    .await
                    .map_err(|(model, why)| model_error(&path, &text, &model, &why))?;
                Some((f, staged))
            }
        };
        let hash = new.hash.clone();
        self.publish(&new);
        let inf = new.file.inference.clone();
        let caching: Vec<&str> = new
            .router
            .routes()
            .iter()
            .filter(|r| r.cache.is_some())
            .map(|r| r.name.as_str())
            .collect();
        crate::cache::retain(&caching);
        self.shared.store(Arc::new(new));
        crate::runtime::swapped();
        if let Some((f, staged)) = staged {
            diff.models = staged.changes.clone();
            f.engines.commit(staged, &self.metrics.inference);
            f.jobs.set_limits(
                inf.async_max_entries,
                inf.async_max_bytes,
                Duration::from_secs(inf.async_ttl_s),
            );
        }
        Ok(Report { hash, diff })
    }
}

/// The error of a model that failed to load, at its section.
fn model_error(path: &std::path::Path, text: &str, model: &str, why: &str) -> Vec<ConfigError> {
    let at = config::locate::FieldPath::key("models").k(model);
    config::locate::located(
        path,
        text,
        [(
            at,
            format!("model `{model}` failed to load; the old one keeps serving: {why}"),
        )],
    )
}

fn diff(old: &Config, new: &Config) -> Diff {
    let mut d = Diff::default();
    for (name, p) in &new.pools {
        match old.pools.get(name) {
            None => d.pools_added.push(name.clone()),
            Some(o) if !Arc::ptr_eq(o, p) => d.pools_changed.push(name.clone()),
            _ => {}
        }
    }
    d.pools_removed = old
        .pools
        .keys()
        .filter(|n| !new.pools.contains_key(*n))
        .cloned()
        .collect();
    let (a, b) = (&old.file.routes, &new.file.routes);
    d.routes_changed =
        a.iter().zip(b.iter()).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len());
    d.admission_changed =
        old.file.lanes != new.file.lanes || old.file.rate_limits != new.file.rate_limits;
    d
}

/// Settings bound to sockets, threads or files opened at start keep their
/// running values; the difference is reported, never silently ignored.
fn keep_process_settings(old: &Config, new: &mut Config, d: &mut Diff) {
    let upgrade = "apply with a graceful upgrade (`ultrafast serve --upgrade`, then SIGQUIT to the old process)";
    if old.listeners != new.listeners {
        d.pending_upgrade
            .push(format!("listeners changed: {upgrade}"));
        new.listeners = old.listeners.clone();
        new.listener_rules = old.listener_rules.clone();
    }
    if old.server != new.server {
        d.pending_upgrade
            .push(format!("[server] changed: {upgrade}"));
        new.server = old.server.clone();
    }
    if old.admin_listen != new.admin_listen {
        d.pending_upgrade
            .push(format!("admin.listen changed: {upgrade}"));
        new.admin_listen = old.admin_listen.clone();
    }
    if old.log_target != new.log_target || old.log_format != new.log_format {
        d.pending_upgrade.push(format!("[log] changed: {upgrade}"));
        new.log_target = old.log_target.clone();
        new.log_format = old.log_format;
    }
}

/// Probe the members that a reload brings in, so a dead new member starts
/// out marked down instead of taking traffic until its first failures.
async fn warm(old: &Config, new: &Config) {
    for (name, p) in &new.pools {
        if old.pools.get(name).is_some_and(|o| Arc::ptr_eq(o, p)) {
            continue;
        }
        warm_pool(old.pools.get(name), p).await;
    }
}

async fn warm_pool(old: Option<&Arc<Pool>>, pool: &Arc<Pool>) {
    if pool.health.is_none() {
        return;
    }
    let carried: Vec<std::net::SocketAddr> = old
        .map(|o| o.members().members.iter().map(|m| m.addr).collect())
        .unwrap_or_default();
    health::probe_new_members(pool, &carried).await;
}

/// A SIGHUP that arrived before [`SighupService`] took the signal over.
static EARLY_HUP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn note_early_hup(_: libc::c_int) {
    // Async-signal-safe: one atomic store.
    EARLY_HUP.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// Catch SIGHUP from the start of `serve`: the listening sockets are bound
/// (and accept connections) before the services run, so a SIGHUP sent as
/// soon as the port answers would otherwise find the default action, which
/// ends the process. The service reloads for it once it runs.
#[allow(unsafe_code)]
pub fn catch_early_sighup() {
    // SAFETY: installs a handler that only stores to an atomic (async-
    // signal-safe), before any other thread uses SIGHUP; tokio's handler
    // replaces it when the service starts.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = note_early_hup as extern "C" fn(libc::c_int) as usize;
        libc::sigemptyset(&mut act.sa_mask);
        act.sa_flags = libc::SA_RESTART;
        if libc::sigaction(libc::SIGHUP, &act, std::ptr::null_mut()) != 0 {
            log::warn!("cannot catch SIGHUP before the services start");
        }
    }
}

/// SIGHUP triggers a reload.
pub struct SighupService(pub Arc<Manager>);

#[async_trait]
impl BackgroundService for SighupService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let Ok(mut hup) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        else {
            log::error!("cannot install the SIGHUP handler; reload through the admin API");
            return;
        };
        // Taken over: one that came before is answered now.
        if EARLY_HUP.swap(false, std::sync::atomic::Ordering::SeqCst) {
            log::info!(
                "SIGHUP (during startup): reloading {}",
                self.0.path().display()
            );
            let _ = self.0.reload().await;
        }
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                Some(()) = hup.recv() => {
                    log::info!("SIGHUP: reloading {}", self.0.path().display());
                    let _ = self.0.reload().await;
                }
            }
        }
    }
}

/// Reloads when the config file changes (when `[reload] watch = true`).
pub struct WatchService(pub Arc<Manager>);

fn stamp(path: &std::path::Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

#[async_trait]
impl BackgroundService for WatchService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut last = stamp(self.0.path());
        loop {
            let interval = self.0.shared().load().reload_watch;
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tokio::time::sleep(interval.unwrap_or(Duration::from_secs(1))) => {}
            }
            if interval.is_none() {
                continue;
            }
            let now = stamp(self.0.path());
            if now != last {
                last = now;
                log::info!("{} changed: reloading", self.0.path().display());
                let _ = self.0.reload().await;
            }
        }
    }
}

/// Keeps DNS answers of every pool fresh (see `upstream::dns`).
pub struct DnsRefresher {
    /// Live config.
    pub shared: Shared,
    /// Metrics.
    pub metrics: Arc<Metrics>,
}

impl DnsRefresher {
    /// One round: the pools' names that are due, with a resolver for the
    /// current `[dns]` settings.
    async fn refresh(&self, cfg: &crate::runtime::Snapshot, resolver: &mut Option<Resolver>) {
        if resolver.as_ref().is_none_or(|r| r.settings != cfg.dns) {
            match Resolver::new(cfg.dns.clone()) {
                Ok(r) => *resolver = Some(r),
                Err(e) => {
                    log::error!("DNS resolver: {e}");
                    return;
                }
            }
        }
        let Some(r) = resolver.as_ref() else { return };
        for pool in cfg.pools.values() {
            crate::upstream::dns::refresh(pool, r, &self.metrics.upstream).await;
        }
    }
}

#[async_trait]
impl BackgroundService for DnsRefresher {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut resolver: Option<Resolver> = None;
        loop {
            let seen = crate::runtime::reloads();
            let cfg = self.shared.load_full();
            let busy = cfg.pools.values().any(|p| p.dns.is_some());
            if busy {
                self.refresh(&cfg, &mut resolver).await;
            }
            drop(cfg);
            let every = Duration::from_millis(100);
            if !crate::runtime::next_round(busy, every, seen, &mut shutdown).await {
                return;
            }
        }
    }
}
