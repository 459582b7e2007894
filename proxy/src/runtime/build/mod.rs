//! `validate()`: file structs -> the live `Snapshot`: the data sections
//! through `config::validate`, then the sections that become objects
//! (pools, routes, rate limits, keys, models, caches), collecting every
//! problem (not just the first) with the field path it belongs to. Locations are
//! resolved at the end against the original text. Nothing here panics on any
//! input: the property test in `tests/config_check.rs` feeds it arbitrary TOML.

use super::*;
use crate::admission::gate::Gate;
use crate::admission::queue::LaneSpec;
use crate::admission::ratelimit::{KeySource, Limiter};
use crate::config::file::{
    FileConfig, HeaderRules, LaneSection, ModelSection, PoolSection, RateLimitSection, RouteSection,
};
use crate::config::locate::FieldPath;
use crate::config::validate::{
    admin, admin_token, dns_settings, lanes, limits, listeners, log, ms, server, tracing,
    valid_host, Errors,
};
use crate::config::*;
use crate::routing::{Action, HeaderOps, PathMatch, Route, UpstreamHost, UpstreamPath};
use crate::upstream::dns::{Answer, NameTarget, PoolDns};
use crate::upstream::lb::HashKey;
use crate::upstream::retry_budget::RetryBudget;
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

use admission::{api_keys, cluster, rate_limits};
use pools::pool;
pub(in crate::runtime) use pools::{parse_member_addr, MemberAddr};

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
            metrics.admission.gate(name, &names),
            fair,
        ))
    })
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
    certificates(f, &mut errs);
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

/// Load every listener's certificates now, so a bad one is refused with
/// its location (`listeners[i].tls.certs[j].cert`), whatever else is wrong
/// with its listener.
fn certificates(f: &FileConfig, errs: &mut Errors) {
    use crate::edge::certs::{CertMetrics, CertStore};
    let metrics = CertMetrics::detached();
    for (i, l) in f.listeners.iter().enumerate() {
        let Some(tls) = &l.tls else { continue };
        for (j, c) in tls.certs.iter().enumerate() {
            let spec = crate::config::validate::cert_spec(c);
            if let Err(e) = CertStore::load(std::slice::from_ref(&spec), &metrics) {
                let at = FieldPath::key("listeners").i(i).k("tls").k("certs").i(j);
                errs.push(at.k("cert"), e);
            }
        }
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
        let upstream_path = match r.upstream_path.as_str() {
            "" | "normalized" => UpstreamPath::Normalized,
            "original" => UpstreamPath::Original,
            v => {
                errs.push(
                    at.k("upstream_path"),
                    format!("`{v}`: expected `normalized` or `original`"),
                );
                UpstreamPath::Normalized
            }
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
            upstream_path,
            allow_dot_parameters: r.allow_dot_parameters,
            lane,
            anonymous_lanes,
            limiters: route_limiters,
            budgets,
            request_buffering: r.request_buffering.unwrap_or(f.limits.request_buffering),
            response_buffering: r.response_buffering.unwrap_or(f.limits.response_buffering),
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
