//! Validation of the file's data sections into the typed settings
//! (`[server]`, `[admin]`, `[log]`, `[tracing]`, `[limits]`,
//! `[[listeners]]`, `[dns]`, `[lanes]`), collecting every problem with the
//! field path it belongs to. `runtime::build` runs these first, then the
//! sections that become objects, and locates all problems together.
//! Nothing here panics on any input.

use super::file::{CertSection, FileConfig, ListenerSection, TlsSection};
use super::locate::FieldPath;
use super::spec::{default_lanes, Cidr, DnsSettings, LaneSpec, OnMiss, ProxyProtocol};
use super::{
    default_runtime_path, CertSpec, Deadlines, Limits, Listener, LogFormat, LogTarget,
    ServerSettings, TlsListener,
};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The problems found so far, each at its field.
pub struct Errors(pub Vec<(FieldPath, String)>);

impl Errors {
    /// One more problem at `at`.
    pub fn push(&mut self, at: FieldPath, msg: impl Into<String>) {
        self.0.push((at, msg.into()));
    }
}

/// A duration in ms where 0 means none.
pub fn ms(v: u64) -> Option<Duration> {
    (v > 0).then(|| Duration::from_millis(v))
}

/// `[dns]`.
pub fn dns_settings(f: &FileConfig, errs: &mut Errors) -> DnsSettings {
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

/// `[server]`.
pub fn server(f: &FileConfig, path: &Path, errs: &mut Errors) -> ServerSettings {
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

/// `[tracing]`.
pub fn tracing(f: &FileConfig, errs: &mut Errors) {
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

/// `[admin] listen`.
pub fn admin(f: &FileConfig, errs: &mut Errors) -> Option<String> {
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
pub fn admin_token(
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

/// `[log]`.
pub fn log(f: &FileConfig, errs: &mut Errors) -> (LogTarget, LogFormat) {
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

/// `[limits]`.
pub fn limits(f: &FileConfig, errs: &mut Errors) -> Limits {
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
    if l.response_buffer_kb == 0 || l.response_buffer_kb > 1024 {
        errs.push(at.k("response_buffer_kb"), "must be 1 to 1024");
    }
    let proxy_temp = match l.proxy_temp_path.as_str() {
        "" => std::env::temp_dir(),
        p => PathBuf::from(p),
    };
    if l.response_buffering && l.max_temp_file_bytes > 0 && !proxy_temp.is_dir() {
        errs.push(
            at.k("proxy_temp_path"),
            format!("`{}` is not a directory", proxy_temp.display()),
        );
    }
    Limits {
        client_max_body_bytes: l.client_max_body_bytes,
        max_header_bytes: l.max_header_bytes,
        max_headers: l.max_headers,
        max_connections: l.max_connections,
        deadlines: Deadlines {
            client_header_timeout_ms: l.client_header_timeout_ms,
            client_body_timeout: ms(l.client_body_timeout_ms),
            send_timeout: ms(l.send_timeout_ms),
            keepalive_timeout_s: l.keepalive_timeout_s,
            h2c_preface_timeout: ms(l.h2c_preface_timeout_ms),
        },
        request_buffering: l.request_buffering,
        client_body_buffer_bytes: l.client_body_buffer_kb.clamp(1, 64) * 1024,
        client_body_temp_path: temp,
        response_buffering: l.response_buffering,
        response_buffer_bytes: l.response_buffer_kb.clamp(1, 1024) * 1024,
        response_buffers_total_bytes: l.response_buffers_total_mb.saturating_mul(1 << 20),
        max_temp_file_bytes: l.max_temp_file_bytes,
        temp_files_total_bytes: l.temp_files_total_mb.saturating_mul(1 << 20),
        proxy_temp_path: proxy_temp.into(),
        max_upgraded: l.max_upgraded,
        upgraded_idle_timeout: ms(l.upgraded_idle_timeout_s.saturating_mul(1000)),
    }
}

/// A listener's deadlines: its own where it sets them, else `defaults`.
fn listener_deadlines(l: &ListenerSection, defaults: &Deadlines) -> Deadlines {
    let or = |own: Option<u64>, d: Option<Duration>| own.map_or(d, ms);
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

/// `[[listeners]]`, their TLS settings included (the certificates
/// themselves are loaded and checked by `runtime::build`).
pub fn listeners(f: &FileConfig, defaults: &Deadlines, errs: &mut Errors) -> Vec<Listener> {
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
        let http01 = tls
            .as_ref()
            .and_then(|t| t.acme.as_ref())
            .is_some_and(|a| a.challenge == super::AcmeChallenge::Http01);
        if http01 && f.listeners.iter().all(|o| o.tls.is_some()) {
            errs.push(
                at.i(i).k("tls").k("acme").k("challenge"),
                "http-01 is answered on a plain listener (port 80), and there is none",
            );
        }
        let proxy_protocol = proxy_protocol(l, &at.i(i), errs);
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
            proxy_protocol,
        });
    }
    out
}

/// A listener's PROXY protocol settings (None: it does not speak it).
fn proxy_protocol(l: &ListenerSection, at: &FieldPath, errs: &mut Errors) -> Option<ProxyProtocol> {
    if !l.proxy_protocol {
        if !l.proxy_protocol_from.is_empty() || l.proxy_protocol_timeout_ms.is_some() {
            errs.push(
                at.k("proxy_protocol_from"),
                "applies to a listener with proxy_protocol = true only",
            );
        }
        return None;
    }
    if l.tls.as_ref().is_some_and(|t| t.http3) {
        // QUIC has no PROXY header: its clients would reach the listener
        // directly, past the load balancers the TCP side trusts only.
        errs.push(
            at.k("proxy_protocol"),
            "cannot be used with tls.http3 (QUIC carries no PROXY header, so HTTP/3 clients would come without it); serve HTTP/3 on a listener without proxy_protocol",
        );
    }
    if l.proxy_protocol_from.is_empty() {
        errs.push(
            at.k("proxy_protocol_from"),
            "list the load balancers allowed to send the PROXY header (addresses or CIDR blocks)",
        );
    }
    let mut from = Vec::new();
    for (i, c) in l.proxy_protocol_from.iter().enumerate() {
        match Cidr::parse(c) {
            Ok(c) => from.push(c),
            Err(e) => errs.push(at.k("proxy_protocol_from").i(i), e),
        }
    }
    let timeout_ms = l.proxy_protocol_timeout_ms.unwrap_or(5_000);
    if timeout_ms == 0 || timeout_ms > 600_000 {
        errs.push(at.k("proxy_protocol_timeout_ms"), "must be 1 to 600000");
    }
    Some(ProxyProtocol {
        from,
        timeout: Duration::from_millis(timeout_ms.clamp(1, 600_000)),
    })
}

fn tls_listener(t: &TlsSection, at: &FieldPath, errs: &mut Errors) -> Option<TlsListener> {
    let before = errs.0.len();
    if t.certs.is_empty() && t.acme.is_none() {
        errs.push(
            at.k("certs"),
            "a TLS listener needs at least one certificate (or `acme`)",
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
        match read_ticket_key_file(Path::new(&t.ticket_key_file)) {
            Ok(k) => Some(k),
            Err(e) => {
                errs.push(at.k("ticket_key_file"), e);
                None
            }
        }
    };
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
        let spec = cert_spec(c);
        certs.push(spec);
    }
    let acme = t
        .acme
        .as_ref()
        .and_then(|a| super::acme::acme(a, &at.k("acme"), errs));
    if let Some(a) = &acme {
        // The issued certificate answers names no file serves, and every
        // name when no file is the default.
        let default = !certs.iter().any(|c| c.default);
        certs.push(a.cert_spec(default));
    }
    let http3 = t.http3.then(|| http3(t, at, errs));
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
        acme,
        http3,
    })
}

/// A TLS listener's HTTP/3 settings.
fn http3(t: &TlsSection, at: &FieldPath, errs: &mut Errors) -> super::Http3 {
    if !(1..=10_000).contains(&t.http3_max_streams) {
        errs.push(at.k("http3_max_streams"), "must be 1..=10000");
    }
    if t.http3_idle_timeout_ms == 0 {
        errs.push(at.k("http3_idle_timeout_ms"), "must be > 0");
    }
    if t.http3_max_connections == 0 {
        errs.push(at.k("http3_max_connections"), "must be > 0");
    }
    let retry = match t.http3_retry.as_str() {
        "auto" => super::QuicRetry::Auto,
        "always" => super::QuicRetry::Always,
        "never" => super::QuicRetry::Never,
        other => {
            errs.push(
                at.k("http3_retry"),
                format!("`{other}` is not one of auto, always, never"),
            );
            super::QuicRetry::Auto
        }
    };
    super::Http3 {
        max_streams: t.http3_max_streams,
        idle_timeout: Duration::from_millis(t.http3_idle_timeout_ms.clamp(1, 3_600_000)),
        max_connections: t.http3_max_connections,
        retry,
        early_data: t.http3_early_data,
        alt_svc_max_age_s: t.http3_alt_svc_max_age_s,
    }
}

/// The certificate entry a `[[listeners.tls.certs]]` section names.
pub fn cert_spec(c: &CertSection) -> CertSpec {
    CertSpec {
        cert: PathBuf::from(&c.cert),
        key: PathBuf::from(&c.key),
        ocsp: (!c.ocsp.is_empty()).then(|| PathBuf::from(&c.ocsp)),
        names: c.names.clone(),
        default: c.default,
        optional: false,
    }
}

/// A host name or `*.suffix` as a route or a certificate names it.
pub fn valid_host(h: &str) -> bool {
    let body = h.strip_prefix("*.").unwrap_or(h);
    !body.is_empty()
        && body
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
}

/// `[lanes]` (the default lanes where none are set), in rank order.
pub fn lanes(f: &FileConfig, errs: &mut Errors) -> Vec<LaneSpec> {
    if f.lanes.is_empty() {
        return default_lanes();
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
        let on_miss = match l.on_miss.as_str() {
            "reject" => OnMiss::Reject,
            "downgrade" => OnMiss::Downgrade,
            other => {
                errs.push(
                    at.k("on_miss"),
                    format!("`{other}` is not one of reject, downgrade"),
                );
                OnMiss::Reject
            }
        };
        let on_forbidden = match l.on_forbidden.as_str() {
            "reject" => OnMiss::Reject,
            "downgrade" => OnMiss::Downgrade,
            other => {
                errs.push(
                    at.k("on_forbidden"),
                    format!("`{other}` is not one of reject, downgrade"),
                );
                OnMiss::Reject
            }
        };
        out.push(LaneSpec {
            ttft_slo: ms(l.ttft_slo_ms),
            on_miss,
            on_forbidden,
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

/// Read a shared ticket secret: hex, at least 32 bytes, not readable by
/// other users.
pub fn read_ticket_key_file(path: &Path) -> Result<Vec<u8>, String> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if meta.permissions().mode() & 0o004 != 0 {
        return Err(format!(
            "{}: secret file is world-readable; chmod 600 it",
            path.display()
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let hex: String = text.chars().filter(|c| !c.is_whitespace()).collect();
    if hex.len() < 64 || !hex.len().is_multiple_of(2) {
        return Err(format!(
            "{}: expected at least 64 hex digits (32 bytes)",
            path.display()
        ));
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
        .collect::<Result<Vec<u8>, _>>()
        .map_err(|_| format!("{}: not hex", path.display()))
}

/// A model's `sampling` defaults, bounded as a request's fields are.
pub fn sampling(s: &super::file::SamplingSection, at: &FieldPath, errs: &mut Errors) {
    let at = at.k("sampling");
    for (key, v, lo, hi) in [
        ("temperature", s.temperature, 0.0, 2.0),
        ("top_p", s.top_p, 0.0, 1.0),
        ("min_p", s.min_p, 0.0, 1.0),
        ("frequency_penalty", s.frequency_penalty, -2.0, 2.0),
        ("presence_penalty", s.presence_penalty, -2.0, 2.0),
    ] {
        if v.is_some_and(|x| !(lo..=hi).contains(&x)) {
            errs.push(at.k(key), format!("must be {lo} to {hi}"));
        }
    }
    if s.repetition_penalty
        .is_some_and(|r| !(r > 0.0 && r <= 10.0))
    {
        errs.push(
            at.k("repetition_penalty"),
            "must be above 0, at most 10 (1 = off)",
        );
    }
    if s.top_k.is_some_and(|k| k > 1_000_000) {
        errs.push(at.k("top_k"), "must be at most 1000000 (0 = off)");
    }
}
