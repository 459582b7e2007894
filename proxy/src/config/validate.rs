//! `validate()`: file structs -> runtime `Config`, collecting every problem
//! (not just the first) with the field path it belongs to. Locations are
//! resolved at the end against the original text. Nothing here panics on any
//! input: the property test in `tests/config_check.rs` feeds it arbitrary TOML.

use super::file::{FileConfig, HeaderRules, PoolSection, RouteSection};
use super::locate::{locate, FieldPath};
use super::*;
use crate::admission::gate::Gate;
use crate::admission::queue::LaneSpec;
use crate::admission::ratelimit::{KeySource, Limiter};
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

struct Errors(Vec<(FieldPath, String)>);

impl Errors {
    fn push(&mut self, at: FieldPath, msg: impl Into<String>) {
        self.0.push((at, msg.into()));
    }
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
    pub prev: Option<&'a Config>,
    /// DNS prefetch fraction for new pools.
    pub prefetch_fraction: f64,
}

pub(super) fn validate(
    f: &FileConfig,
    path: &Path,
    text: &str,
    ctx: &BuildCtx,
) -> Result<Config, Vec<ConfigError>> {
    let metrics = ctx.metrics;
    let mut errs = Errors(Vec::new());
    let dns = dns_settings(f, &mut errs);
    let reload_watch = f
        .reload
        .watch
        .then(|| Duration::from_millis(f.reload.watch_interval_ms.max(50)));
    let server = server(f, path, &mut errs);
    let admin_listen = admin(f, &mut errs);
    let (log_target, log_format) = log(f, &mut errs);
    let limits = limits(f, &mut errs);
    let listeners = listeners(f, &mut errs);
    let listener_rules = super::listener_rules(&listeners);
    let lanes = lanes(f, &mut errs);
    let limiters = rate_limits(f, ctx.prev, &mut errs);
    let mut pools = BTreeMap::new();
    for (name, p) in &f.pools {
        let at = FieldPath::key("pools").k(name);
        if let Some(pool) = pool(name, p, &at, &lanes, ctx, &mut errs) {
            pools.insert(name.clone(), pool);
        }
    }
    let router = routes(f, &pools, &lanes, &limiters, metrics, &mut errs);
    if !errs.0.is_empty() {
        let file = path.display().to_string();
        return Err(errs
            .0
            .into_iter()
            .map(|(at, message)| {
                let (line, col) = locate(text, &at);
                ConfigError {
                    file: file.clone(),
                    line,
                    col,
                    field: at.to_string(),
                    message,
                }
            })
            .collect());
    }
    Ok(Config {
        path: path.to_path_buf(),
        server,
        admin_listen,
        log_target,
        log_format,
        limits,
        listeners,
        router,
        pools,
        lanes,
        limiters,
        dns,
        reload_watch,
        hash: format!("{:016x}", crate::upstream::lb::hash_bytes(text.as_bytes())),
        loaded_at: std::time::SystemTime::now(),
        file: f.clone(),
        listener_rules,
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

fn lanes(f: &FileConfig, errs: &mut Errors) -> Vec<LaneSpec> {
    if f.lanes.is_empty() {
        return crate::admission::default_lanes();
    }
    let mut out = Vec::new();
    for (name, l) in &f.lanes {
        let at = FieldPath::key("lanes").k(name);
        if l.queue_len == 0 {
            errs.push(at.k("queue_len"), "must be at least 1");
        }
        if l.max_wait_ms == 0 {
            errs.push(at.k("max_wait_ms"), "must be > 0");
        }
        if !(0.0..=1.0).contains(&l.reserved_share) {
            errs.push(at.k("reserved_share"), "must be between 0.0 and 1.0");
        }
        if !(0.0..=1.0).contains(&l.high_watermark) {
            errs.push(at.k("high_watermark"), "must be between 0.0 and 1.0");
        }
        if f.lanes.iter().any(|(n, o)| n < name && o.rank == l.rank) {
            errs.push(
                at.k("rank"),
                format!("rank {} is used by another lane", l.rank),
            );
        }
        out.push(LaneSpec {
            name: name.clone(),
            rank: l.rank,
            queue_len: l.queue_len.max(1),
            max_wait: Duration::from_millis(l.max_wait_ms.max(1)),
            reserved_share: l.reserved_share.clamp(0.0, 1.0),
            preempt: l.preempt,
            high_watermark: l.high_watermark.clamp(0.0, 1.0),
            sjf_us_per_unit: l.sjf_us_per_unit,
        });
    }
    let reserved: f64 = out.iter().map(|l| l.reserved_share).sum();
    if reserved > 1.0 {
        errs.push(
            FieldPath::key("lanes"),
            "reserved_share of all lanes adds up to more than 1.0",
        );
    }
    out.sort_by_key(|l| l.rank);
    out
}

fn rate_limits(f: &FileConfig, prev: Option<&Config>, errs: &mut Errors) -> LimiterMap {
    let mut out = BTreeMap::new();
    for (name, r) in &f.rate_limits {
        let at = FieldPath::key("rate_limits").k(name);
        // An unchanged limit keeps its buckets across a reload.
        if let Some((def, l)) = prev.and_then(|c| c.limiters.get(name)) {
            if def == r {
                out.insert(name.clone(), (def.clone(), l.clone()));
                continue;
            }
        }
        let source = match r.key.as_str() {
            "client_ip" => Some(KeySource::ClientIp),
            "api_key" => Some(KeySource::ApiKey(None)),
            "route" => Some(KeySource::Route),
            "pool" => Some(KeySource::Pool),
            k => match k.split_once(':') {
                Some(("api_key", h)) => HeaderName::from_bytes(h.as_bytes())
                    .ok()
                    .map(|h| KeySource::ApiKey(Some(h))),
                Some(("header", h)) => HeaderName::from_bytes(h.as_bytes())
                    .ok()
                    .map(KeySource::Header),
                _ => None,
            },
        };
        let Some(source) = source else {
            errs.push(
                at.k("key"),
                format!(
                    "`{}` is not client_ip, api_key, api_key:HEADER, header:NAME, route or pool",
                    r.key
                ),
            );
            continue;
        };
        if !(r.rate_per_s > 0.0 && r.rate_per_s <= 1e9) {
            errs.push(at.k("rate_per_s"), "must be > 0");
            continue;
        }
        if r.burst == 0 {
            errs.push(at.k("burst"), "must be at least 1");
            continue;
        }
        match Limiter::new(name, source, r.rate_per_s, r.burst, r.max_keys) {
            Some(l) => {
                out.insert(name.clone(), (r.clone(), Arc::new(l)));
            }
            None => errs.push(at.clone(), "invalid rate limit"),
        }
    }
    out
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
    Limits {
        client_max_body_bytes: l.client_max_body_bytes,
        max_header_bytes: l.max_header_bytes,
        max_headers: l.max_headers,
        keepalive_timeout_s: l.keepalive_timeout_s,
    }
}

fn listeners(f: &FileConfig, errs: &mut Errors) -> Vec<Listener> {
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

/// A member address: a literal `ip:port`, or `name:port` for DNS.
pub(super) enum MemberAddr {
    Literal(SocketAddr),
    Name(String, u16),
}

pub(super) fn parse_member_addr(addr: &str) -> Result<MemberAddr, String> {
    if let Ok(a) = addr.parse::<SocketAddr>() {
        return Ok(MemberAddr::Literal(a));
    }
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err(format!("`{addr}` needs a port (host:port)"));
    };
    let port: u16 = port.parse().map_err(|_| format!("`{addr}`: bad port"))?;
    let valid = !host.is_empty()
        && host.len() <= 253
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b'_');
    if !valid {
        return Err(format!(
            "`{addr}` is neither ip:port nor a host name with a port"
        ));
    }
    Ok(MemberAddr::Name(host.to_ascii_lowercase(), port))
}

fn pool(
    name: &str,
    p: &PoolSection,
    at: &FieldPath,
    lanes: &[LaneSpec],
    ctx: &BuildCtx,
    errs: &mut Errors,
) -> Option<Arc<Pool>> {
    let metrics = ctx.metrics;
    let before = errs.0.len();
    if p.members.is_empty() {
        errs.push(at.k("members"), "a pool needs at least one member");
    }
    let prev = ctx.prev.and_then(|c| c.pools.get(name));
    // An unchanged pool is kept as it is: connections, health, ejections,
    // balancer state, DNS answers and admission queue all carry on.
    if let Some(old) = prev {
        if old.def == *p && ctx.prev.is_some_and(|c| c.lanes == lanes) {
            return Some(old.clone());
        }
    }
    let old_members: Vec<Member> = prev
        .map(|o| o.members().members.clone())
        .unwrap_or_default();
    let state_for = |addr: SocketAddr| {
        old_members
            .iter()
            .find(|m| m.addr == addr)
            .map(|m| m.state.clone())
            .unwrap_or_else(|| Arc::new(MemberState::new(metrics.member(name, &addr.to_string()))))
    };
    let mut static_members = Vec::new();
    let mut targets = Vec::new();
    let mut answers = Vec::new();
    for (i, m) in p.members.iter().enumerate() {
        let mat = at.k("members").i(i);
        if !(1..=1000).contains(&m.weight) {
            errs.push(mat.k("weight"), "must be between 1 and 1000");
        }
        let weight = m.weight.clamp(1, 1000);
        match parse_member_addr(&m.addr) {
            Ok(MemberAddr::Literal(a)) => static_members.push(Member {
                addr: a,
                label: m.addr.clone(),
                weight,
                state: state_for(a),
            }),
            Ok(MemberAddr::Name(host, port)) => match ctx.resolved.get(&host) {
                Some(Ok(answer)) => {
                    targets.push(NameTarget {
                        name: host,
                        port,
                        weight,
                    });
                    answers.push(answer.clone());
                }
                Some(Err(e)) => errs.push(mat.k("addr"), e.clone()),
                None => errs.push(mat.k("addr"), format!("`{host}` was not resolved")),
            },
            Err(e) => errs.push(mat.k("addr"), e),
        }
    }
    let hash_key = match p.hash_key.as_str() {
        "client_ip" => Some(HashKey::ClientIp),
        k => match k.split_once(':') {
            Some(("header", h)) => HeaderName::from_bytes(h.as_bytes())
                .ok()
                .map(HashKey::Header),
            Some(("cookie", c)) if !c.is_empty() => Some(HashKey::Cookie(c.to_string())),
            _ => None,
        },
    };
    let hash_key = hash_key.unwrap_or_else(|| {
        errs.push(
            at.k("hash_key"),
            format!(
                "`{}` is not client_ip, header:NAME or cookie:NAME",
                p.hash_key
            ),
        );
        HashKey::ClientIp
    });
    if !(p.hash_load_factor >= 1.0 && p.hash_load_factor <= 100.0) {
        errs.push(at.k("hash_load_factor"), "must be between 1.0 and 100.0");
    }
    let lb = match p.lb.as_str() {
        "round_robin" => LbSpec::RoundRobin,
        "least_outstanding" | "least_conn" => LbSpec::LeastOutstanding,
        "consistent_hash" => LbSpec::ConsistentHash(hash_key, p.hash_load_factor),
        "peak_ewma" | "p2c" => LbSpec::PeakEwma,
        other => {
            errs.push(
                at.k("lb"),
                format!("unknown policy `{other}` (round_robin, least_outstanding, consistent_hash, peak_ewma)"),
            );
            LbSpec::LeastOutstanding
        }
    };
    let health = p.health_check.as_ref().map(|h| {
        let hat = at.k("health_check");
        if !h.path.starts_with('/') {
            errs.push(hat.k("path"), "must start with /");
        }
        if h.interval_ms == 0 {
            errs.push(hat.k("interval_ms"), "must be > 0");
        }
        if h.timeout_ms == 0 {
            errs.push(hat.k("timeout_ms"), "must be > 0");
        }
        if h.rise == 0 {
            errs.push(hat.k("rise"), "must be >= 1");
        }
        if h.fall == 0 {
            errs.push(hat.k("fall"), "must be >= 1");
        }
        HealthSettings {
            path: h.path.clone(),
            interval: Duration::from_millis(h.interval_ms.max(1)),
            timeout: Duration::from_millis(h.timeout_ms.max(1)),
            rise: h.rise.max(1),
            fall: h.fall.max(1),
            host: (!h.host.is_empty()).then(|| h.host.clone()),
        }
    });
    if !(1..=10).contains(&p.retry.attempts) {
        errs.push(at.k("retry").k("attempts"), "must be between 1 and 10");
    }
    if !(0.0..=1.0).contains(&p.retry.budget_ratio) {
        errs.push(
            at.k("retry").k("budget_ratio"),
            "must be between 0.0 and 1.0",
        );
    }
    if errs.0.len() != before {
        return None;
    }
    let gate = (p.max_concurrency > 0).then(|| {
        let names: Vec<String> = lanes.iter().map(|l| l.name.clone()).collect();
        let max_queued = match p.max_queued {
            0 => lanes.iter().map(|l| l.queue_len).sum(),
            n => n,
        };
        Arc::new(Gate::new(
            lanes.to_vec(),
            p.max_concurrency,
            max_queued,
            metrics.gate(name, &names),
        ))
    });
    let dns = (!targets.is_empty()).then(|| {
        let fraction = ctx.prefetch_fraction;
        PoolDns::new(static_members.clone(), targets, answers, fraction)
    });
    let members = match &dns {
        Some(d) => d.compose(name, &old_members, metrics),
        None => static_members,
    };
    let pool_metrics = metrics.pool(name);
    pool_metrics.members.set(members.len() as i64);
    let balancer = lb.build(&members);
    Some(Arc::new(Pool {
        name: name.to_string(),
        membership: ArcSwap::from_pointee(Membership { members, balancer }),
        lb,
        settings: PoolSettings {
            connect_timeout: ms(p.connect_timeout_ms),
            total_connect_timeout: ms(p.total_connect_timeout_ms),
            read_timeout: ms(p.read_timeout_ms),
            write_timeout: ms(p.write_timeout_ms),
            keepalive_idle: (p.keepalive_idle_s > 0)
                .then(|| Duration::from_secs(p.keepalive_idle_s)),
            tls: p
                .tls
                .as_ref()
                .and_then(|t| upstream_tls(t, &at.k("tls"), errs)),
            max_fails: p.passive.max_fails,
            cooldown: Duration::from_millis(p.passive.cooldown_ms),
            attempts: p.retry.attempts,
        },
        health,
        budget: RetryBudget::new(p.retry.budget_ratio, p.retry.budget_min_per_s),
        metrics: pool_metrics,
        health_due_ms: AtomicU64::new(0),
        gate,
        dns,
        def: p.clone(),
    }))
}

fn upstream_tls(
    t: &super::file::UpstreamTlsSection,
    at: &FieldPath,
    errs: &mut Errors,
) -> Option<crate::upstream::UpstreamTls> {
    use pingora::utils::tls::{parse_x509, CertKey, WrappedX509};
    use rustls::pki_types::{pem::PemObject, CertificateDer};
    let mut ok = true;
    let ca = if t.ca_file.is_empty() {
        None
    } else {
        let certs: Result<Vec<CertificateDer<'static>>, _> =
            CertificateDer::pem_file_iter(&t.ca_file).and_then(|it| it.collect());
        match certs {
            Ok(certs) if !certs.is_empty() => {
                let mut store = rustls::RootCertStore::empty();
                // Parse-check every certificate: pingora's own parser panics on bad DER.
                if certs.iter().all(|c| store.add(c.clone()).is_ok()) {
                    let wrapped: Vec<WrappedX509> = certs
                        .into_iter()
                        .map(|c| WrappedX509::new(c.to_vec(), parse_x509))
                        .collect();
                    Some(Arc::from(wrapped))
                } else {
                    errs.push(
                        at.k("ca_file"),
                        format!("{}: a certificate does not parse", t.ca_file),
                    );
                    ok = false;
                    None
                }
            }
            _ => {
                errs.push(
                    at.k("ca_file"),
                    format!("{}: no PEM certificates found", t.ca_file),
                );
                ok = false;
                None
            }
        }
    };
    let client = match (t.client_cert.is_empty(), t.client_key.is_empty()) {
        (true, true) => None,
        (false, false) => {
            let spec = crate::edge::certs::CertSpec {
                cert: PathBuf::from(&t.client_cert),
                key: PathBuf::from(&t.client_key),
                ocsp: None,
                names: vec![],
                default: false,
            };
            let metrics = crate::edge::certs::CertMetrics::detached();
            match crate::edge::certs::CertStore::load(std::slice::from_ref(&spec), &metrics) {
                Ok(_) => {
                    match pingora::tls::load_certs_and_key_files(&t.client_cert, &t.client_key) {
                        Ok(Some((chain, key))) => Some(Arc::new(CertKey::new(
                            chain.iter().map(|c| c.to_vec()).collect(),
                            key.secret_der().to_vec(),
                        ))),
                        _ => {
                            errs.push(at.k("client_cert"), "cannot load the client certificate");
                            ok = false;
                            None
                        }
                    }
                }
                Err(e) => {
                    errs.push(at.k("client_cert"), e);
                    ok = false;
                    None
                }
            }
        }
        _ => {
            errs.push(at.k("client_key"), "client_cert and client_key go together");
            ok = false;
            None
        }
    };
    ok.then(|| crate::upstream::UpstreamTls {
        sni: t.sni.clone(),
        verify: t.verify,
        ca,
        client,
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
    let n = r.pool.is_some() as u8 + r.fixed.is_some() as u8 + r.redirect.is_some() as u8;
    if n != 1 {
        errs.push(
            at.clone(),
            "a route needs exactly one of `pool`, `return` or `redirect`",
        );
        return None;
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
        let mut route_limiters = Vec::new();
        for (j, name) in r.rate_limits.iter().enumerate() {
            match limiters.get(name) {
                Some((_, l)) => route_limiters.push(l.clone()),
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
        let route = Route {
            metrics: metrics.route(&name, &pool_name),
            name,
            path,
            action,
            request_headers,
            response_headers,
            upstream_host,
            lane,
            limiters: route_limiters,
        };
        out.push((Arc::new(route), r.hosts.clone()));
    }
    Router::new(out)
}
