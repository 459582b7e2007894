//! Configuration: the TOML file format (`file`), its validation into the
//! typed runtime config (`validate`), and error locations (`locate`).
//!
//! Three layers, as in river and pingora: what users write, a `validate()`
//! that reports every problem with file, line and field and never panics, and
//! the `Config` the proxy runs on. The live `Config` sits behind one
//! `ArcSwap` (`Shared`); each request loads a snapshot once and keeps it, so a
//! reload never changes a request midway.

pub mod file;
pub mod locate;
mod validate;

use crate::upstream::dns::{Answer, DnsSettings};
use std::collections::HashMap;
pub use validate::BuildCtx;

use crate::metrics::Metrics;
use crate::routing::Router;
use crate::upstream::Pool;
use arc_swap::ArcSwap;
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The live config, swapped whole on reload.
pub type Shared = Arc<ArcSwap<Config>>;

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

/// One problem in a config file, with where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The file.
    pub file: String,
    /// 1-based line.
    pub line: usize,
    /// 1-based column.
    pub col: usize,
    /// Dotted field path (may be empty for syntax errors).
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}: ", self.file, self.line, self.col)?;
        if !self.field.is_empty() {
            write!(f, "{}: ", self.field)?;
        }
        f.write_str(&self.message)
    }
}

/// Process-wide settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerSettings {
    /// Worker threads of the traffic service.
    pub threads: usize,
    /// Work stealing between worker threads.
    pub work_stealing: bool,
    /// SIGTERM drain window, seconds.
    pub grace_period_s: u64,
    /// Runtime stop timeout, seconds.
    pub shutdown_timeout_s: u64,
    /// Pid file.
    pub pid_file: String,
    /// Upgrade socket.
    pub upgrade_sock: String,
    /// Idle upstream connections kept, all pools together.
    pub keepalive_pool_size: usize,
}

/// Where access logs go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogTarget {
    /// No access log.
    Off,
    /// Standard output.
    Stdout,
    /// Appended to a file.
    File(PathBuf),
}

/// Access log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// One JSON object per line.
    Json,
    /// nginx's `combined` format plus request id and timings.
    Combined,
}

/// A listener's deadlines on its clients (`[limits]`'s unless the
/// listener sets its own); nginx's directive beside each.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Deadlines {
    /// Whole-request-head deadline, ms, 0 = none (`client_header_timeout`).
    pub client_header_timeout_ms: u64,
    /// Most time between two reads of a request body, `None`: no limit
    /// (`client_body_timeout`).
    pub client_body_timeout: Option<std::time::Duration>,
    /// Most time one write to the client may take, `None`: no limit
    /// (`send_timeout`).
    pub send_timeout: Option<std::time::Duration>,
    /// Idle keepalive between requests, seconds (`keepalive_timeout`).
    pub keepalive_timeout_s: u64,
    /// On an h2c listener, time to tell the HTTP/2 preface from HTTP/1;
    /// `None`: the head deadline.
    pub h2c_preface_timeout: Option<std::time::Duration>,
}

/// Downstream limits.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Max request body (0 = unlimited).
    pub client_max_body_bytes: u64,
    /// Max request head size.
    pub max_header_bytes: usize,
    /// Max header count.
    pub max_headers: usize,
    /// Open traffic connections at most (0 = no cap).
    pub max_connections: usize,
    /// Deadlines of listeners that set none of their own.
    pub deadlines: Deadlines,
    /// Proxied bodies are read whole before an upstream is taken.
    pub request_buffering: bool,
    /// Bytes of a buffered body held in memory.
    pub client_body_buffer_bytes: usize,
    /// Directory of spilled bodies.
    pub client_body_temp_path: PathBuf,
    /// Upgraded connections at most (0 = no cap).
    pub max_upgraded: usize,
    /// Most silence from an upgraded connection's client (`None`: none).
    pub upgraded_idle_timeout: Option<std::time::Duration>,
}

/// A traffic listener.
#[derive(Debug, Clone, PartialEq)]
pub struct Listener {
    /// Name.
    pub name: String,
    /// `ip:port`.
    pub address: String,
    /// TLS settings, for a TLS listener.
    pub tls: Option<TlsListener>,
    /// HTTP/2 with prior knowledge on a plain listener.
    pub h2c: bool,
    /// Redirect everything to HTTPS on this port (0 = off).
    pub redirect_https_port: u16,
    /// Its deadlines (`[limits]`'s where it sets none).
    pub deadlines: Deadlines,
}

/// TLS settings of a listener.
#[derive(Debug, Clone, PartialEq)]
pub struct TlsListener {
    /// Certificates.
    pub certs: Vec<crate::edge::certs::CertSpec>,
    /// Offer h2.
    pub h2: bool,
    /// Issue tickets.
    pub tickets: bool,
    /// Ticket key rotation period.
    pub rotation: std::time::Duration,
    /// Shared ticket secret, read at start.
    pub ticket_secret: Option<Vec<u8>>,
    /// Session cache size.
    pub cache_size: usize,
    /// Handshake deadline.
    pub handshake_timeout: std::time::Duration,
    /// HSTS max-age (None: no header).
    pub hsts_max_age_s: Option<u64>,
}

/// The validated runtime configuration.
#[derive(Debug)]
pub struct Config {
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

/// What a listener does to every request it receives.
#[derive(Debug, Clone, PartialEq)]
pub struct ListenerRule {
    /// The listener's address.
    pub addr: std::net::SocketAddr,
    /// Redirect to HTTPS on this port.
    pub redirect_https_port: Option<u16>,
    /// HSTS header value for responses.
    pub hsts: Option<http::HeaderValue>,
    /// The listener's deadlines.
    pub deadlines: Deadlines,
}

impl Config {
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

/// Rules for listeners that redirect, send HSTS or have deadlines of
/// their own (the others have none: the lookup stays short).
pub fn listener_rules(listeners: &[Listener], defaults: &Deadlines) -> Vec<ListenerRule> {
    listeners
        .iter()
        .filter_map(|l| {
            let addr = l.address.parse().ok()?;
            let redirect = (l.redirect_https_port != 0).then_some(l.redirect_https_port);
            let hsts = l
                .tls
                .as_ref()
                .and_then(|t| t.hsts_max_age_s)
                .and_then(|s| http::HeaderValue::from_str(&format!("max-age={s}")).ok());
            let own = l.deadlines != *defaults;
            (redirect.is_some() || hsts.is_some() || own).then_some(ListenerRule {
                addr,
                redirect_https_port: redirect,
                hsts,
                deadlines: l.deadlines,
            })
        })
        .collect()
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

/// A whole-file error (unreadable file, resolver failure) at line 1.
pub fn file_error(path: &Path, message: String) -> Vec<ConfigError> {
    vec![ConfigError {
        file: path.display().to_string(),
        line: 1,
        col: 1,
        field: String::new(),
        message,
    }]
}

/// Read a config file's text.
pub fn read(path: &Path) -> Result<String, Vec<ConfigError>> {
    std::fs::read_to_string(path)
        .map_err(|e| file_error(path, format!("cannot read config file: {e}")))
}

/// Parse TOML text into the file structs (syntax and unknown-key errors,
/// located).
pub fn parse_file(path: &Path, text: &str) -> Result<file::FileConfig, Vec<ConfigError>> {
    parse_toml(path, text)
}

/// Parse TOML text from `path` into `T`, with a syntax, type or unknown-key
/// error located (file:line:col and the field).
pub fn parse_toml<T: serde::de::DeserializeOwned>(
    path: &Path,
    text: &str,
) -> Result<T, Vec<ConfigError>> {
    toml::from_str(text).map_err(|e| {
        let (line, col) = e
            .span()
            .map(|s| locate::line_col(text, s.start))
            .unwrap_or((1, 1));
        vec![ConfigError {
            file: path.display().to_string(),
            line,
            col,
            field: field_from_toml_error(text, &e),
            message: e.message().trim().to_string(),
        }]
    })
}

/// Host names that must be resolved before `f` can be built: those of pools
/// that are new or changed relative to `prev`.
pub fn names_to_resolve(f: &file::FileConfig, prev: Option<&Config>) -> Vec<String> {
    let mut names = Vec::new();
    for (name, p) in &f.pools {
        if prev
            .and_then(|c| c.pools.get(name))
            .is_some_and(|old| old.def == *p)
        {
            continue;
        }
        for m in &p.members {
            if let Ok(validate::MemberAddr::Name(host, _)) = validate::parse_member_addr(&m.addr) {
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
    f: &file::FileConfig,
    path: &Path,
    text: &str,
    ctx: &BuildCtx,
) -> Result<Config, Vec<ConfigError>> {
    validate::validate(f, path, text, ctx)
}

/// Resolver settings of a parsed file (defaults where invalid: `build`
/// reports those errors).
pub fn dns_settings(f: &file::FileConfig) -> DnsSettings {
    validate::dns_settings_of(f)
}

/// Read, parse, resolve and validate a config file, blocking (for `check`,
/// startup and tests; a running server reloads through `reload`).
pub fn load(path: &Path, metrics: &Metrics) -> Result<Config, Vec<ConfigError>> {
    let text = read(path)?;
    parse(path, &text, metrics)
}

/// Parse, resolve and validate config text that came from `path`, blocking.
pub fn parse(path: &Path, text: &str, metrics: &Metrics) -> Result<Config, Vec<ConfigError>> {
    let f = parse_file(path, text)?;
    let names = names_to_resolve(&f, None);
    let settings = validate::dns_settings_of(&f);
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
        Ok(crate::upstream::dns::resolve_all(&resolver, names, metrics).await)
    })
}

/// toml names only the offending key; prefix it with the table header above
/// it (`[server]` + `threds` -> `server.threds`) so the field reads as a path.
fn field_from_toml_error(text: &str, e: &toml::de::Error) -> String {
    let Some(span) = e.span() else {
        return String::new();
    };
    let start = span.start.min(text.len());
    let line_start = text[..start].rfind('\n').map(|i| i + 1).unwrap_or(0);
    let line = text[line_start..].split('\n').next().unwrap_or("");
    let key = match line.split_once('=') {
        Some((k, _)) if !k.trim_start().starts_with('[') => k.trim(),
        _ => return String::new(),
    };
    let table = text[..line_start]
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('['))
        .map(|l| {
            l.trim_start_matches('[')
                .split(']')
                .next()
                .unwrap_or("")
                .trim()
        });
    match table {
        Some(t) if text[..line_start].contains(&format!("[[{t}]]")) => format!("{t}[].{key}"),
        Some(t) => format!("{t}.{key}"),
        None => key.to_string(),
    }
}

/// Default pid/upgrade paths: unique per config file, so two instances
/// started from different files never share them.
pub fn default_runtime_path(config_path: &Path, ext: &str) -> String {
    let canon = std::fs::canonicalize(config_path).unwrap_or_else(|_| config_path.to_path_buf());
    let h = crate::upstream::lb::hash_bytes(canon.to_string_lossy().as_bytes());
    format!("/tmp/ultrafast-{:08x}.{ext}", h as u32)
}
