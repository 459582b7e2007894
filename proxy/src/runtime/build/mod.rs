//! `validate()`: file structs -> runtime `Config`, collecting every problem
//! (not just the first) with the field path it belongs to. Locations are
//! resolved at the end against the original text. Nothing here panics on any
//! input: the property test in `tests/config_check.rs` feeds it arbitrary TOML.

use super::*;
use crate::admission::gate::Gate;
use crate::admission::queue::{LaneSpec, OnMiss};
use crate::admission::ratelimit::{KeySource, Limiter};
use crate::config::file::{
    FileConfig, HeaderRules, LaneSection, ModelSection, PoolSection, RateLimitSection, RouteSection,
};
use crate::config::locate::FieldPath;
use crate::config::*;
use crate::routing::{Action, HeaderOps, PathMatch, Route, UpstreamHost};
use crate::upstream::budget::RetryBudget;
use crate::upstream::dns::{Answer, DnsSettings, NameTarget, PoolDns};
use crate::upstream::lb::HashKey;
use crate::upstream::{HealthSettings, LbSpec, Member, MemberState, Membership, PoolSettings};
use arc_swap::ArcSwap;
use http::{HeaderName, HeaderValue};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

mod admission;
mod models;
mod pools;

use admission::{api_keys, cluster, lanes, rate_limits};
use pools::pool;
pub(in crate::runtime) use pools::{parse_member_addr, MemberAddr};

struct Errors(Vec<(FieldPath, String)>);

impl Errors {
    fn push(&mut self, at: FieldPath, msg: impl Into<String>) {
        self.0.push((at, msg.into()));
    }
}

/// The admission gate of a pool or model (None without a concurrency
/// limit); `max_queued` 0 means the sum of the lanes' queue lengths.
fn gate(
    name: &str,
    lanes: &[LaneSpec],
    max_concurrency: usize,
    max_queued: usize,
    metrics: &Metrics,
    fair: ultrafast_engine::fair::Costs,
) -> Option<Arc<Gate>> {
    (max_concurrency > 0).then(|| {
        let names: Vec<String> = lanes.iter().map(|l| l.name.clone()).collect();
        let max_queued = match max_queued {
            0 => lanes.iter().map(|l| l.queue_len).sum(),
            n => n,
        };
        Arc::new(Gate::with_costs(
            lanes.to_vec(),
            max_concurrency,
            max_queued,
            metrics.gate(name, &names),
            fair,
        ))
    })
}

fn ms(v: u64) -> Option<Duration> {
    (v > 0).then(|| Duration::from_millis(v))
}

/// What `validate` needs besides the file: metrics, the DNS answers obtained
/// before the swap, and the config being replaced (to keep unchanged pools).
pub struct BuildCtx<'a> {
    /// Metrics registry.
    pub metrics: &'a Metrics,
    /// Answers for the names of new or changed pools.
    pub resolved: &'a HashMap<String, Result<Answer, String>>,
    /// The live config, on reload.
    pub prev: Option<&'a Snapshot>,
    /// DNS prefetch fraction for new pools.
    pub prefetch_fraction: f64,
}

pub(super) fn validate(
    f: &FileConfig,
    path: &Path,
    text: &str,
    ctx: &BuildCtx,
) -> Result<Snapshot, Vec<ConfigError>> {
    let metrics = ctx.metrics;
    let mut errs = Errors(Vec::new());
    let dns = dns_settings(f, &mut errs);
    let reload_watch = f
        .reload
        .watch
        .then(|| Duration::from_millis(f.reload.watch_interval_ms.max(50)));
    let server = server(f, path, &mut errs);
    let admin_listen = admin(f, &mut errs);
    tracing(f, &mut errs);
    let fair_closed = cluster(f, &mut errs);
    let admin_token = admin_token(f, path, admin_listen.as_deref(), &mut errs);
    let (log_target, log_format) = log(f, &mut errs);
    let limits = limits(f, &mut errs);
    let listeners = listeners(f, &limits.deadlines, &mut errs);
    let listener_rules = crate::config::listener_rules(&listeners, &limits.deadlines);
    let lanes = lanes(f, &mut errs);
    let limiters = rate_limits(f, ctx.prev, &mut errs);
    let (api_keys, key_file_errors) = api_keys(f, path, ctx.prev, &mut errs);
    let mut pools = BTreeMap::new();
    for (name, p) in &f.pools {
        let at = FieldPath::key("pools").k(name);
        if let Some(pool) = pool(name, p, &at, &lanes, ctx, &mut errs) {
            pools.insert(name.clone(), pool);
        }
    }
    let router = routes(f, &pools, &lanes, &limiters, metrics, &mut errs);
    let pacing = models::pacing(f, &lanes, &mut errs);
    let tenant_source = models::inference(f, &mut errs);
    let models = models::models(f, &pools, &lanes, ctx, &mut errs);
    if !errs.0.is_empty() || !key_file_errors.is_empty() {
        let mut out = crate::config::locate::located(path, text, errs.0);
        out.extend(key_file_errors);
        return Err(out);
    }
    Ok(Snapshot {
        path: path.to_path_buf(),
        server,
        admin_listen,
        admin_token,
        log_target,
        log_format,
        limits,
        listeners,
        router,
        pools,
        lanes,
        limiters,
        api_keys,
        dns,
        reload_watch,
        hash: format!("{:016x}", crate::upstream::lb::hash_bytes(text.as_bytes())),
        loaded_at: std::time::SystemTime::now(),
        file: f.clone(),
        listener_rules,
        models,
        pacing,
        tenant_source,
        fair_closed,
    })
}

pub(super) fn dns_settings_of(f: &FileConfig) -> DnsSettings {
    dns_settings(f, &mut Errors(Vec::new()))
}

fn dns_settings(f: &FileConfig, errs: &mut Errors) -> DnsSettings {
    let d = &f.dns;
    let at = FieldPath::key("dns");
    let mut nameservers = Vec::new();
    for (i, ns) in d.nameservers.iter().enumerate() {
        match ns.parse::<SocketAddr>() {
            Ok(a) => nameservers.push(a),
            Err(_) => match ns.parse::<std::net::IpAddr>() {
                Ok(ip) => nameservers.push(SocketAddr::new(ip, 53)),
                Err(_) => errs.push(
                    at.k("nameservers").i(i),
                    format!("`{ns}` is not ip or ip:port"),
                ),
            },
        }
    }
    if !(d.prefetch_fraction > 0.0 && d.prefetch_fraction <= 1.0) {
        errs.push(at.k("prefetch_fraction"), "must be in (0, 1]");
    }
    if d.min_ttl_s > d.max_ttl_s {
        errs.push(at.k("min_ttl_s"), "must not exceed max_ttl_s");
    }
    if d.timeout_ms == 0 {
        errs.push(at.k("timeout_ms"), "must be > 0");
    }
    DnsSettings {
        nameservers,
        prefetch_fraction: d.prefetch_fraction.clamp(0.01, 1.0),
        min_ttl: Duration::from_secs(d.min_ttl_s),
        max_ttl: Duration::from_secs(d.max_ttl_s.max(d.min_ttl_s)),
        stale_max: Duration::from_secs(d.stale_max_s),
        timeout: Duration::from_millis(d.timeout_ms.max(1)),
        use_hosts_file: d.use_hosts_file,
    }
}

fn server(f: &FileConfig, path: &Path, errs: &mut Errors) -> ServerSettings {
    let s = &f.server;
    let at = FieldPath::key("server");
    if s.threads > 1024 {
        errs.push(at.k("threads"), "must be at most 1024 (0 = one per CPU)");
    }
    if s.upstream_keepalive_pool_size > 1_000_000 {
        errs.push(
            at.k("upstream_keepalive_pool_size"),
            "must be at most 1000000",
        );
    }
    let threads = match s.threads {
        0 => std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        n => n,
    };
    let or_default = |v: &str, ext: &str| {
        if v.is_empty() {
            default_runtime_path(path, ext)
        } else {
            v.to_string()
        }
    };
    ServerSettings {
        threads,
        work_stealing: s.work_stealing,
        grace_period_s: s.shutdown_grace_period_s,
        shutdown_timeout_s: s.shutdown_timeout_s,
        pid_file: or_default(&s.pid_file, "pid"),
        upgrade_sock: or_default(&s.upgrade_sock, "upgrade.sock"),
        keepalive_pool_size: s.upstream_keepalive_pool_size,
    }
}

fn tracing(f: &FileConfig, errs: &mut Errors) {
    let e = f.tracing.otlp_endpoint.trim();
    if e.is_empty() {
        return;
    }
    let host = e
        .strip_prefix("http://")
        .map(|r| r.split('/').next().unwrap_or(""));
    if host.is_none_or(|h| h.is_empty()) {
        errs.push(
            FieldPath::key("tracing").k("otlp_endpoint"),
            format!("`{e}` is not an http://host:port URL (a TLS collector: run a local agent)"),
        );
    }
}

fn admin(f: &FileConfig, errs: &mut Errors) -> Option<String> {
    let l = f.admin.listen.trim();
    if l.is_empty() {
        return None;
    }
    if l.parse::<SocketAddr>().is_err() {
        errs.push(
            FieldPath::key("admin").k("listen"),
            format!("`{l}` is not an ip:port address"),
        );
    }
    Some(l.to_string())
}

/// The admin token from `token` or `token_file`. Off loopback one is
/// required: the admin endpoints reload the config and show it.
fn admin_token(
    f: &FileConfig,
    path: &Path,
    listen: Option<&str>,
    errs: &mut Errors,
) -> Option<String> {
    let at = FieldPath::key("admin");
    let token = match f.admin.resolve_token(path) {
        Ok(t) => t,
        Err((field, e)) => {
            errs.push(at.k(field), e);
            return None;
        }
    };
    if token.as_deref().is_some_and(|t| t.len() < 16) {
        errs.push(
            at.k("token"),
            "the admin token must be at least 16 characters".to_string(),
        );
    }
    let loopback = listen
        .and_then(|l| l.parse::<SocketAddr>().ok())
        .is_none_or(|a| a.ip().is_loopback());
    if !loopback && token.is_none() {
        errs.push(
            at.k("listen"),
            format!(
                "`{}` is not a loopback address: set admin.token (or admin.token_file), which every admin endpoint but /healthz and /readyz then requires as `Authorization: Bearer <token>`",
                listen.unwrap_or_default()
            ),
        );
    }
    token
}

fn log(f: &FileConfig, errs: &mut Errors) -> (LogTarget, LogFormat) {
    let at = FieldPath::key("log");
    let target = match f.log.access_log.as_str() {
        "off" => LogTarget::Off,
        "stdout" => LogTarget::Stdout,
        "" => {
            errs.push(
                at.k("access_log"),
                "must be \"stdout\", \"off\" or a file path",
            );
            LogTarget::Off
        }
        p => LogTarget::File(PathBuf::from(p)),
    };
    let format = match f.log.format.as_str() {
        "json" => LogFormat::Json,
        "combined" => LogFormat::Combined,
        other => {
            errs.push(
                at.k("format"),
                format!("unknown format `{other}` (json or combined)"),
            );
            LogFormat::Json
        }
    };
    (target, format)
}

fn limits(f: &FileConfig, errs: &mut Errors) -> Limits {
    let l = &f.limits;
    let at = FieldPath::key("limits");
    if l.max_header_bytes < 1024 {
        errs.push(at.k("max_header_bytes"), "must be at least 1024");
    }
    if l.max_headers == 0 {
        errs.push(at.k("max_headers"), "must be at least 1");
    }
    // Pingora keeps at most 64 KiB of a body for a retry, and a buffered
    // body reaches the upstream through that buffer (`proxy::buffering`).
    if l.client_body_buffer_kb == 0 || l.client_body_buffer_kb > 64 {
        errs.push(at.k("client_body_buffer_kb"), "must be 1 to 64");
    }
    let temp = match l.client_body_temp_path.as_str() {
        "" => std::env::temp_dir(),
        p => PathBuf::from(p),
    };
    if l.request_buffering && !temp.is_dir() {
        errs.push(
            at.k("client_body_temp_path"),
            format!("`{}` is not a directory", temp.display()),
        );
    }
    Limits {
        client_max_body_bytes: l.client_max_body_bytes,
        max_header_bytes: l.max_header_bytes,
        max_headers: l.max_headers,
        max_connections: l.max_connections,
        deadlines: Deadlines {
            client_header_timeout_ms: l.client_header_timeout_ms,
            client_body_timeout: millis(l.client_body_timeout_ms),
            send_timeout: millis(l.send_timeout_ms),
            keepalive_timeout_s: l.keepalive_timeout_s,
            h2c_preface_timeout: millis(l.h2c_preface_timeout_ms),
        },
        request_buffering: l.request_buffering,
        client_body_buffer_bytes: l.client_body_buffer_kb.clamp(1, 64) * 1024,
        client_body_temp_path: temp,
        max_upgraded: l.max_upgraded,
        upgraded_idle_timeout: millis(l.upgraded_idle_timeout_s.saturating_mul(1000)),
    }
}

/// A route's `cache`, checked.
fn cache(
    c: &super::file::CacheSection,
    name: &str,
    metrics: &crate::cache::CacheMetrics,
    at: &FieldPath,
    errs: &mut Errors,
) -> Option<Arc<crate::cache::RouteCache>> {
    let before = errs.0.len();
    if c.size_mb == 0 || c.size_mb > 1 << 20 {
        errs.push(at.k("size_mb"), "must be 1 to 1048576 (MiB)");
    }
    if c.max_object_kb == 0 || c.max_object_kb.saturating_mul(1024) > c.size_mb << 20 {
        errs.push(
            at.k("max_object_kb"),
            "must be at least 1 and fit in size_mb",
        );
    }
    if c.lock_timeout_ms == 0 || c.lock_timeout_ms > 600_000 {
        errs.push(at.k("lock_timeout_ms"), "must be 1 to 600000");
    }
    (errs.0.len() == before).then(|| {
        Arc::new(crate::cache::RouteCache::new(
            name,
            crate::cache::CacheSpec {
                size_bytes: (c.size_mb << 20) as usize,
                max_object_bytes: (c.max_object_kb << 10) as usize,
                default_ttl: std::time::Duration::from_secs(c.default_ttl_s),
                lock_timeout: std::time::Duration::from_millis(c.lock_timeout_ms),
            },
            metrics,
        ))
    })
}

/// A route's `compress`, checked.
fn compress(
    c: &super::file::CompressSection,
    at: &FieldPath,
    errs: &mut Errors,
) -> Option<Arc<crate::compress::CompressSpec>> {
    let before = errs.0.len();
    for (key, level, max) in [("gzip", c.gzip, 9), ("br", c.br, 11), ("zstd", c.zstd, 19)] {
        if level > max {
            errs.push(at.k(key), format!("must be 0 (off) to {max}"));
        }
    }
    if c.gzip == 0 && c.br == 0 && c.zstd == 0 {
        errs.push(at.clone(), "offers no coding (gzip, br and zstd are all 0)");
    }
    let mut types = Vec::new();
    for (i, t) in c.types.iter().enumerate() {
        let t = t.trim().to_ascii_lowercase();
        match t.split_once('/') {
            Some((a, b)) if !a.is_empty() && !b.is_empty() && a != "*" => types.push(t),
            _ => errs.push(
                at.k("types").i(i),
                format!("`{t}` is not a media type (`type/subtype` or `type/*`)"),
            ),
        }
    }
    (errs.0.len() == before).then(|| {
        Arc::new(crate::compress::CompressSpec {
            gzip: c.gzip,
            br: c.br,
            zstd: c.zstd,
            min_bytes: c.min_bytes,
            types,
        })
    })
}

/// A listener's deadlines: its own where it sets them, else `defaults`.
fn listener_deadlines(l: &super::file::ListenerSection, defaults: &Deadlines) -> Deadlines {
    let or = |own: Option<u64>, d: Option<Duration>| own.map_or(d, millis);
    Deadlines {
        client_header_timeout_ms: l
            .client_header_timeout_ms
            .unwrap_or(defaults.client_header_timeout_ms),
        client_body_timeout: or(l.client_body_timeout_ms, defaults.client_body_timeout),
        send_timeout: or(l.send_timeout_ms, defaults.send_timeout),
        keepalive_timeout_s: l
            .keepalive_timeout_s
            .unwrap_or(defaults.keepalive_timeout_s),
        h2c_preface_timeout: or(l.h2c_preface_timeout_ms, defaults.h2c_preface_timeout),
    }
}

/// A timeout in ms where 0 means none.
fn millis(ms: u64) -> Option<Duration> {
    (ms > 0).then(|| Duration::from_millis(ms))
}

fn listeners(f: &FileConfig, defaults: &Deadlines, errs: &mut Errors) -> Vec<Listener> {
    let at = FieldPath::key("listeners");
    if f.listeners.is_empty() {
        errs.push(at.clone(), "at least one [[listeners]] entry is required");
    }
    let mut out: Vec<Listener> = Vec::new();
    for (i, l) in f.listeners.iter().enumerate() {
        if l.address.parse::<SocketAddr>().is_err() {
            errs.push(
                at.i(i).k("address"),
                format!("`{}` is not an ip:port address", l.address),
            );
        } else if out.iter().any(|o| o.address == l.address) || f.admin.listen == l.address {
            errs.push(
                at.i(i).k("address"),
                format!("`{}` is already used by another listener", l.address),
            );
        }
        let tls = l
            .tls
            .as_ref()
            .and_then(|t| tls_listener(t, &at.i(i).k("tls"), errs));
        if l.h2c_preface_timeout_ms.is_some() && !l.h2c {
            errs.push(
                at.i(i).k("h2c_preface_timeout_ms"),
                "applies to a listener with h2c = true only",
            );
        }
        if tls.is_some() && (l.h2c || l.redirect_https_port != 0) {
            errs.push(
                at.i(i),
                "h2c and redirect_https_port apply to plain listeners only",
            );
        }
        let name = if l.name.is_empty() {
            format!("listener{i}")
        } else {
            l.name.clone()
        };
        out.push(Listener {
            name,
            address: l.address.clone(),
            tls,
            h2c: l.h2c,
            redirect_https_port: l.redirect_https_port,
            deadlines: listener_deadlines(l, defaults),
        });
    }
    out
}

fn tls_listener(
    t: &super::file::TlsSection,
    at: &FieldPath,
    errs: &mut Errors,
) -> Option<TlsListener> {
    use crate::edge::certs::{CertMetrics, CertSpec, CertStore};
    let before = errs.0.len();
    if t.certs.is_empty() {
        errs.push(
            at.k("certs"),
            "a TLS listener needs at least one certificate",
        );
    }
    if t.certs.iter().filter(|c| c.default).count() > 1 {
        errs.push(at.k("certs"), "at most one certificate may be the default");
    }
    if t.ticket_rotation_s == 0 {
        errs.push(at.k("ticket_rotation_s"), "must be > 0");
    }
    if t.handshake_timeout_ms == 0 {
        errs.push(at.k("handshake_timeout_ms"), "must be > 0");
    }
    let ticket_secret = if t.ticket_key_file.is_empty() {
        None
    } else {
        match crate::edge::ticket::read_key_file(Path::new(&t.ticket_key_file)) {
            Ok(k) => Some(k),
            Err(e) => {
                errs.push(at.k("ticket_key_file"), e);
                None
            }
        }
    };
    let metrics = CertMetrics::detached();
    let mut certs = Vec::new();
    for (j, c) in t.certs.iter().enumerate() {
        let cat = at.k("certs").i(j);
        for (k, n) in c.names.iter().enumerate() {
            if !valid_host(&n.to_ascii_lowercase()) {
                errs.push(
                    cat.k("names").i(k),
                    format!("`{n}` is not a host name or *.suffix"),
                );
            }
        }
        let spec = CertSpec {
            cert: PathBuf::from(&c.cert),
            key: PathBuf::from(&c.key),
            ocsp: (!c.ocsp.is_empty()).then(|| PathBuf::from(&c.ocsp)),
            names: c.names.clone(),
            default: c.default,
        };
        // Load now so a bad certificate is refused with its location.
        if let Err(e) = CertStore::load(std::slice::from_ref(&spec), &metrics) {
            errs.push(cat.k("cert"), e);
        }
        certs.push(spec);
    }
    if errs.0.len() != before {
        return None;
    }
    Some(TlsListener {
        certs,
        h2: t.h2,
        tickets: t.session_tickets,
        rotation: Duration::from_secs(t.ticket_rotation_s.max(1)),
        ticket_secret,
        cache_size: t.session_cache_size,
        handshake_timeout: Duration::from_millis(t.handshake_timeout_ms.max(1)),
        hsts_max_age_s: (t.hsts_max_age_s > 0).then_some(t.hsts_max_age_s),
    })
}

fn header_ops(r: &HeaderRules, at: &FieldPath, errs: &mut Errors) -> HeaderOps {
    let mut pairs = |m: &BTreeMap<String, String>, what: &str| -> Vec<(HeaderName, HeaderValue)> {
        m.iter()
            .filter_map(|(k, v)| {
                let n = HeaderName::from_bytes(k.as_bytes());
                let val = HeaderValue::from_str(v);
                match (n, val) {
                    (Ok(n), Ok(v)) => Some((n, v)),
                    _ => {
                        errs.push(at.k(what).k(k), "invalid header name or value");
                        None
                    }
                }
            })
            .collect()
    };
    let set = pairs(&r.set, "set");
    let add = pairs(&r.add, "add");
    let mut remove = Vec::new();
    for (i, k) in r.remove.iter().enumerate() {
        match HeaderName::from_bytes(k.as_bytes()) {
            Ok(n) => remove.push(n),
            Err(_) => errs.push(at.k("remove").i(i), format!("`{k}` is not a header name")),
        }
    }
    HeaderOps { set, add, remove }
}

fn valid_host(h: &str) -> bool {
    let body = h.strip_prefix("*.").unwrap_or(h);
    !body.is_empty()
        && body
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
}

fn path_match(r: &RouteSection, at: &FieldPath, errs: &mut Errors) -> PathMatch {
    let p = if r.path.is_empty() {
        "/".to_string()
    } else {
        r.path.clone()
    };
    let kind = if r.match_kind.is_empty() {
        "prefix"
    } else {
        r.match_kind.as_str()
    };
    if kind != "regex" && !p.starts_with('/') {
        errs.push(at.k("path"), "must start with /");
    }
    match kind {
        "prefix" => PathMatch::Prefix(p),
        "exact" => PathMatch::Exact(p),
        "priority_prefix" => PathMatch::PriorityPrefix(p),
        "regex" => match regex::Regex::new(&p) {
            Ok(re) => PathMatch::Regex(re),
            Err(e) => {
                let msg = e
                    .to_string()
                    .lines()
                    .last()
                    .unwrap_or("")
                    .trim()
                    .to_string();
                errs.push(at.k("path"), format!("invalid regex: {msg}"));
                PathMatch::Prefix(p)
            }
        },
        other => {
            errs.push(
                at.k("match"),
                format!("unknown match `{other}` (prefix, exact, priority_prefix, regex)"),
            );
            PathMatch::Prefix(p)
        }
    }
}

fn action(
    r: &RouteSection,
    at: &FieldPath,
    pools: &BTreeMap<String, Arc<Pool>>,
    file_pools: &[&String],
    errs: &mut Errors,
) -> Option<(Action, String)> {
    let n = r.pool.is_some() as u8
        + r.fixed.is_some() as u8
        + r.redirect.is_some() as u8
        + r.inference as u8;
    if n != 1 {
        errs.push(
            at.clone(),
            "a route needs exactly one of `pool`, `return`, `redirect` or `inference = true`",
        );
        return None;
    }
    if r.inference {
        return Some((Action::Inference, "inference".into()));
    }
    if let Some(p) = &r.pool {
        return match pools.get(p) {
            Some(pool) => Some((Action::Proxy(pool.clone()), p.clone())),
            None => {
                // A pool that exists but failed validation has its own error.
                if !file_pools.contains(&p) {
                    errs.push(at.k("pool"), format!("unknown pool `{p}`"));
                }
                None
            }
        };
    }
    if let Some(fx) = &r.fixed {
        if !(100..=599).contains(&fx.status) {
            errs.push(at.k("return").k("status"), "must be between 100 and 599");
        }
        let ct = if fx.content_type.is_empty() {
            "text/plain".into()
        } else {
            fx.content_type.clone()
        };
        if HeaderValue::from_str(&ct).is_err() {
            errs.push(at.k("return").k("content_type"), "invalid header value");
        }
        return Some((
            Action::Fixed {
                status: fx.status,
                body: bytes::Bytes::from(fx.body.clone()),
                content_type: ct,
            },
            "none".into(),
        ));
    }
    let rd = r.redirect.as_ref()?;
    if ![301, 302, 303, 307, 308].contains(&rd.status) {
        errs.push(
            at.k("redirect").k("status"),
            "must be 301, 302, 303, 307 or 308",
        );
    }
    if rd.location.is_empty() || HeaderValue::from_str(&rd.location).is_err() {
        errs.push(at.k("redirect").k("location"), "must be a non-empty URL");
    }
    Some((
        Action::Redirect {
            status: rd.status,
            location: rd.location.clone(),
        },
        "none".into(),
    ))
}

fn routes(
    f: &FileConfig,
    pools: &BTreeMap<String, Arc<Pool>>,
    lanes: &[LaneSpec],
    limiters: &LimiterMap,
    metrics: &Metrics,
    errs: &mut Errors,
) -> Router {
    let file_pools: Vec<&String> = f.pools.keys().collect();
    let mut out = Vec::new();
    let mut names: Vec<String> = Vec::new();
    for (i, r) in f.routes.iter().enumerate() {
        let at = FieldPath::key("routes").i(i);
        let name = if r.name.is_empty() {
            format!("route{i}")
        } else {
            r.name.clone()
        };
        if names.contains(&name) {
            errs.push(at.k("name"), format!("duplicate route name `{name}`"));
        }
        names.push(name.clone());
        for (j, h) in r.hosts.iter().enumerate() {
            if !valid_host(h) {
                errs.push(
                    at.k("hosts").i(j),
                    format!("`{h}` is not a lowercase host name or *.suffix"),
                );
            }
        }
        let path = path_match(r, &at, errs);
        let request_headers = header_ops(&r.headers.request, &at.k("headers").k("request"), errs);
        let response_headers =
            header_ops(&r.headers.response, &at.k("headers").k("response"), errs);
        let upstream_host = match r.upstream_host.as_str() {
            "" | "passthrough" => UpstreamHost::Passthrough,
            "upstream" => UpstreamHost::Member,
            v => match HeaderValue::from_str(v) {
                Ok(hv) => UpstreamHost::Fixed(hv),
                Err(_) => {
                    errs.push(at.k("upstream_host"), "invalid host value");
                    UpstreamHost::Passthrough
                }
            },
        };
        let lane_name = if r.lane.is_empty() {
            "standard"
        } else {
            r.lane.as_str()
        };
        let lane = lanes
            .iter()
            .position(|l| l.name == lane_name)
            .unwrap_or_else(|| {
                errs.push(at.k("lane"), format!("unknown lane `{lane_name}`"));
                0
            });
        let anonymous_lanes = r.anonymous_lanes.as_ref().map(|names| {
            names
                .iter()
                .enumerate()
                .filter_map(|(j, n)| {
                    let i = lanes.iter().position(|l| &l.name == n);
                    if i.is_none() {
                        errs.push(at.k("anonymous_lanes").i(j), format!("unknown lane `{n}`"));
                    }
                    i
                })
                .collect::<Vec<usize>>()
        });
        let mut route_limiters = Vec::new();
        let mut budgets = Vec::new();
        for (j, name) in r.rate_limits.iter().enumerate() {
            match limiters.get(name) {
                Some(l) => {
                    route_limiters.extend(l.requests.clone());
                    budgets.extend(l.tokens.clone());
                }
                None if f.rate_limits.contains_key(name) => {}
                None => errs.push(
                    at.k("rate_limits").i(j),
                    format!("unknown rate limit `{name}`"),
                ),
            }
        }
        let Some((action, pool_name)) = action(r, &at, pools, &file_pools, errs) else {
            continue;
        };
        let route_cache = match (&r.cache, &action) {
            (Some(c), Action::Proxy(_)) => cache(c, &name, &metrics.cache, &at.k("cache"), errs),
            (Some(_), _) => {
                errs.push(at.k("cache"), "only a route with a pool can cache");
                None
            }
            (None, _) => None,
        };
        let route = Route {
            metrics: metrics.route(&name, &pool_name),
            name,
            path,
            action,
            request_headers,
            response_headers,
            upstream_host,
            lane,
            anonymous_lanes,
            limiters: route_limiters,
            budgets,
            request_buffering: r.request_buffering.unwrap_or(f.limits.request_buffering),
            compress: r
                .compress
                .as_ref()
                .and_then(|c| compress(c, &at.k("compress"), errs)),
            cache: route_cache,
        };
        out.push((Arc::new(route), r.hosts.clone()));
    }
    Router::new(out)
}
