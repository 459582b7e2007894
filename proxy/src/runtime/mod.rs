//! The runtime layer: builds the live snapshot from the config (the only
//! place that constructs pools, gates, limiters, budgets, keys, models,
//! the router and certificates), carries over unchanged objects by
//! comparing the section they were built from, swaps it whole (`Shared`),
//! owns reload (`reload`: SIGHUP, file watch, the admin API) and the loops
//! that walk the snapshot (`loops`). Each request loads a snapshot once and
//! keeps it, so a reload never changes a request midway; the subsystems
//! see narrow views of it (traits they own, implemented in `views`).

mod build;
pub mod loops;
pub mod reload;
mod views;

pub use build::BuildCtx;

use crate::config::file::{self, FileConfig};
use crate::config::{
    file_error, parse_file, read, ConfigError, Deadlines, Limits, Listener, ListenerRule,
    LogFormat, LogTarget, ServerSettings,
};
use crate::metrics::Metrics;
use crate::routing::Router;
use crate::upstream::dns::{Answer, DnsSettings};
use crate::upstream::Pool;
use arc_swap::ArcSwap;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The live config, swapped whole on reload.
pub type Shared = Arc<ArcSwap<Snapshot>>;

/// Told each time a reload swaps the live config: the background loops
/// that sleep while the config gives them nothing to do wake on it
/// ([`next_round`]).
static RELOADED: tokio::sync::Notify = tokio::sync::Notify::const_new();

static RELOADS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many times a reload has swapped the live config.
pub(crate) fn reloads() -> u64 {
    RELOADS.load(std::sync::atomic::Ordering::Acquire)
}

/// Count a swap of the live config and wake the loops waiting for one
/// (the reload manager calls it after each swap).
pub(crate) fn swapped() {
    RELOADS.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    RELOADED.notify_waiters();
}

/// Wait before a periodic background loop's next round (health checks,
/// load scrapes, DNS refresh, the SLA watchdog): `every` while the config
/// gives the loop work (`busy`), otherwise until a reload swaps the config
/// (or a minute). Idle loops that ticked every 50-100 ms woke a CPU about
/// 60 times a second for nothing; on these VMs a wake costs tens of
/// microseconds, and the caches of whatever request shares that CPU
/// (benches/RESULTS.md section 15). `seen` is [`reloads`]
/// read before the round read the config, so a reload during the round is
/// not missed. False once the server shuts down.
pub(crate) async fn next_round(
    busy: bool,
    every: std::time::Duration,
    seen: u64,
    shutdown: &mut pingora::server::ShutdownWatch,
) -> bool {
    const IDLE: std::time::Duration = std::time::Duration::from_secs(60);
    let reloaded = RELOADED.notified();
    tokio::pin!(reloaded);
    reloaded.as_mut().enable();
    if !busy && reloads() != seen {
        return true;
    }
    tokio::select! {
        _ = shutdown.changed() => false,
        _ = tokio::time::sleep(if busy { every } else { IDLE }) => true,
        _ = reloaded, if !busy => true,
    }
}

/// The live snapshot: the validated config with the objects built from
/// it (router, pools, limiters, keys, models), swapped whole on reload.
#[derive(Debug)]
pub struct Snapshot {
    /// File it came from.
    pub path: PathBuf,
    /// Process settings.
    pub server: ServerSettings,
    /// Admin listener address, if enabled.
    pub admin_listen: Option<String>,
    /// Bearer token of the admin endpoints, if set.
    pub admin_token: Option<String>,
    /// Access log target.
    pub log_target: LogTarget,
    /// Access log format.
    pub log_format: LogFormat,
    /// Downstream limits.
    pub limits: Limits,
    /// Traffic listeners.
    pub listeners: Vec<Listener>,
    /// Routes.
    pub router: Router,
    /// Pools by name.
    pub pools: BTreeMap<String, Arc<Pool>>,
    /// Priority lanes in rank order.
    pub lanes: Vec<crate::admission::queue::LaneSpec>,
    /// Rate limits and token budgets by name, with the definition they were
    /// built from.
    pub limiters: LimiterMap,
    /// API keys from `[api_keys] file`, if configured.
    pub api_keys: Option<Arc<crate::admission::keys::ApiKeys>>,
    /// Resolver settings.
    pub dns: DnsSettings,
    /// Poll interval of the config file watcher, if enabled.
    pub reload_watch: Option<std::time::Duration>,
    /// Hash of the file text.
    pub hash: String,
    /// When this config was built.
    pub loaded_at: std::time::SystemTime,
    /// The file structs it came from (for `/admin/config` and diffs).
    pub file: file::FileConfig,
    /// Per-listener request rules (HTTPS redirect, HSTS); empty on the fast path.
    pub listener_rules: Vec<ListenerRule>,
    /// Models on inference routes, by name.
    pub models: BTreeMap<String, Arc<crate::inference::Model>>,
    /// Stream pacing per lane (same order as `lanes`).
    pub pacing: Vec<crate::inference::pacer::PaceSpec>,
    /// Where a request without an API key finds its tenant (`[inference]
    /// tenant`, parsed once).
    pub tenant_source: crate::inference::tenant::TenantSource,
    /// Fair shares refuse inference while the cluster store is down
    /// (`[cluster] fair_on_store_error = "closed"`).
    pub fair_closed: bool,
}

impl Snapshot {
    /// The rule of the listener a request arrived on, if it has one.
    pub fn listener_rule(&self, local: Option<std::net::SocketAddr>) -> Option<&ListenerRule> {
        if self.listener_rules.is_empty() {
            return None;
        }
        let local = local?;
        self.listener_rules.iter().find(|r| r.addr == local)
    }

    /// The deadlines of the listener at `local`.
    pub fn deadlines(&self, local: Option<std::net::SocketAddr>) -> &Deadlines {
        self.listener_rule(local)
            .map_or(&self.limits.deadlines, |r| &r.deadlines)
    }
}

/// One `[rate_limits.NAME]`: a request limit, a token budget, or both.
#[derive(Debug, Clone)]
pub struct RateLimit {
    /// The definition it was built from (unchanged ones carry over on reload).
    pub def: file::RateLimitSection,
    /// The request rate limit, unless the section limits tokens only.
    pub requests: Option<Arc<crate::admission::ratelimit::Limiter>>,
    /// The token budget, if the section sets `tokens_per_min`.
    pub tokens: Option<Arc<crate::admission::budget::TokenBudget>>,
}

/// Rate limits by name.
pub type LimiterMap = BTreeMap<String, RateLimit>;

/// Host names that must be resolved before `f` can be built: those of pools
/// that are new or changed relative to `prev`.
pub fn names_to_resolve(f: &FileConfig, prev: Option<&Snapshot>) -> Vec<String> {
    let mut names = Vec::new();
    for (name, p) in &f.pools {
        if prev
            .and_then(|c| c.pools.get(name))
            .is_some_and(|old| old.def == *p)
        {
            continue;
        }
        for m in &p.members {
            if let Ok(build::MemberAddr::Name(host, _)) = build::parse_member_addr(&m.addr) {
                if !names.contains(&host) {
                    names.push(host);
                }
            }
        }
    }
    names
}

/// Validate parsed file structs into a runtime config.
pub fn build(
    f: &FileConfig,
    path: &Path,
    text: &str,
    ctx: &BuildCtx,
) -> Result<Snapshot, Vec<ConfigError>> {
    build::validate(f, path, text, ctx)
}

/// Resolver settings of a parsed file (defaults where invalid: `build`
/// reports those errors).
pub fn dns_settings(f: &FileConfig) -> DnsSettings {
    crate::config::validate::dns_settings(f, &mut crate::config::validate::Errors(Vec::new()))
}

/// Read, parse, resolve and validate a config file, blocking (for `check`,
/// startup and tests; a running server reloads through `reload`).
pub fn load(path: &Path, metrics: &Metrics) -> Result<Snapshot, Vec<ConfigError>> {
    let text = read(path)?;
    parse(path, &text, metrics)
}

/// Parse, resolve and validate config text that came from `path`, blocking.
pub fn parse(path: &Path, text: &str, metrics: &Metrics) -> Result<Snapshot, Vec<ConfigError>> {
    let f = parse_file(path, text)?;
    let names = names_to_resolve(&f, None);
    let settings = dns_settings(&f);
    let resolved = if names.is_empty() {
        HashMap::new()
    } else {
        resolve_blocking(settings.clone(), names, metrics).map_err(|e| file_error(path, e))?
    };
    let ctx = BuildCtx {
        metrics,
        resolved: &resolved,
        prev: None,
        prefetch_fraction: settings.prefetch_fraction,
    };
    build(&f, path, text, &ctx)
}

/// Resolve names on a private runtime (outside any server runtime).
pub fn resolve_blocking(
    settings: DnsSettings,
    names: Vec<String>,
    metrics: &Metrics,
) -> Result<HashMap<String, Result<Answer, String>>, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a resolver runtime: {e}"))?;
    rt.block_on(async {
        let resolver = crate::upstream::dns::Resolver::new(settings)?;
        Ok(crate::upstream::dns::resolve_all(&resolver, names, &metrics.upstream).await)
    })
}
