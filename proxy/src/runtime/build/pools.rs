//! Validation of `[pools.*]`: members (literal or DNS names), balancing,
//! health, passive ejection, retries, admission gates and upstream TLS. An
//! unchanged pool is reused as the same object on reload.

use super::*;
use crate::reqid;
use crate::upstream::server_kind::ServerKind;
use crate::upstream::Protocol;

/// A member address: a literal `ip:port`, or `name:port` for DNS.
pub(in crate::runtime) enum MemberAddr {
    Literal(SocketAddr),
    Name(String, u16),
}

pub(in crate::runtime) fn parse_member_addr(addr: &str) -> Result<MemberAddr, String> {
    let addr = strip_scheme(addr);
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

/// `https://host:port/` -> `host:port` (the scheme is the pool's TLS setting).
fn strip_scheme(addr: &str) -> &str {
    addr.strip_prefix("https://")
        .or_else(|| addr.strip_prefix("http://"))
        .unwrap_or(addr)
        .trim_end_matches('/')
}

pub(super) fn pool(
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
    // `https://` members mean TLS with the defaults unless `tls` says more.
    let https = p
        .members
        .iter()
        .filter(|m| m.addr.starts_with("https://"))
        .count();
    if https > 0 && https < p.members.len() {
        errs.push(
            at.k("members"),
            "a pool cannot mix https:// and plain members",
        );
    }
    let tls_section = p.tls.clone().or_else(|| {
        (https > 0 && https == p.members.len())
            .then(crate::config::file::UpstreamTlsSection::default)
    });
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
                label: strip_scheme(&m.addr).to_string(),
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
    if !matches!(p.resume.as_str(), "" | "none" | "vllm") {
        errs.push(
            at.k("resume"),
            format!("`{}` is not one of none, vllm", p.resume),
        );
    }
    let dialect = match p.dialect.as_str() {
        "" => None,
        d => ServerKind::parse(d).or_else(|| {
            errs.push(
                at.k("dialect"),
                format!("`{d}` is not one of {}", ServerKind::NAMES),
            );
            None
        }),
    };
    let request_id = reqid::Upstream::parse(&p.request_id).unwrap_or_else(|| {
        errs.push(
            at.k("request_id"),
            format!("`{}` is not one of forward, uuid, none", p.request_id),
        );
        reqid::Upstream::Forward
    });
    if !(p.hash_load_factor >= 1.0 && p.hash_load_factor <= 100.0) {
        errs.push(at.k("hash_load_factor"), "must be between 1.0 and 100.0");
    }
    let lb = match p.lb.as_str() {
        "round_robin" => LbSpec::RoundRobin,
        "least_outstanding" | "least_conn" => LbSpec::LeastOutstanding,
        "consistent_hash" => LbSpec::ConsistentHash(hash_key, p.hash_load_factor),
        "peak_ewma" | "p2c" => LbSpec::PeakEwma,
        "queue_aware" => {
            if !(10..=60_000).contains(&p.scrape_interval_ms) {
                errs.push(at.k("scrape_interval_ms"), "must be between 10 and 60000");
            }
            // It goes into a request line: a path, nothing else.
            let path_ok = p.metrics_path.starts_with('/')
                && p.metrics_path.bytes().all(|b| b.is_ascii_graphic());
            if !path_ok {
                errs.push(
                    at.k("metrics_path"),
                    "must be a path starting with / (no spaces or control characters)",
                );
            }
            if p.tls.is_some() {
                errs.push(
                    at.k("lb"),
                    "`queue_aware` reads members' metrics over plain HTTP; this pool's members use TLS",
                );
            }
            LbSpec::QueueAware(crate::upstream::load::ScrapeSpec {
                interval: std::time::Duration::from_millis(p.scrape_interval_ms.max(10)),
                path: p.metrics_path.clone(),
            })
        }
        "predicted_latency" | "load_prefix" => {
            if !(1..=64).contains(&p.predict_k) {
                errs.push(at.k("predict_k"), "must be between 1 and 64");
            }
            if !(1..=1 << 20).contains(&p.member_slots) {
                errs.push(at.k("member_slots"), "must be between 1 and 1048576");
            }
            if !(1..=4096).contains(&p.prefix_block_tokens) {
                errs.push(at.k("prefix_block_tokens"), "must be between 1 and 4096");
            }
            if p.prefix_capacity_tokens > 1 << 30 {
                errs.push(at.k("prefix_capacity_tokens"), "must be at most 2^30");
            }
            let path_ok = p.metrics_path.starts_with('/')
                && p.metrics_path.bytes().all(|b| b.is_ascii_graphic());
            if !path_ok {
                errs.push(
                    at.k("metrics_path"),
                    "must be a path starting with / (no spaces or control characters)",
                );
            }
            // Members' own figures are read over plain HTTP only; 0 turns
            // the reading off.
            let scrape = (p.tls.is_none() && p.scrape_interval_ms > 0).then(|| {
                crate::upstream::load::ScrapeSpec {
                    interval: std::time::Duration::from_millis(p.scrape_interval_ms.max(10)),
                    path: p.metrics_path.clone(),
                }
            });
            LbSpec::Fleet(crate::upstream::FleetLb {
                load_prefix: p.lb == "load_prefix",
                k: p.predict_k.clamp(1, 64),
                slots: p.member_slots.max(1),
                chunk: (p.member_chunk_tokens > 0).then_some(p.member_chunk_tokens),
                block_tokens: p.prefix_block_tokens.max(1),
                capacity_tokens: p.prefix_capacity_tokens,
                scrape,
            })
        }
        other => {
            errs.push(
                at.k("lb"),
                format!("unknown policy `{other}` (round_robin, least_outstanding, consistent_hash, peak_ewma, queue_aware, predicted_latency, load_prefix)"),
            );
            LbSpec::LeastOutstanding
        }
    };
    let protocol = match p.protocol.as_str() {
        "http1" | "" => Protocol::Http1,
        "h2" => Protocol::H2,
        "h2c" => Protocol::H2c,
        other => {
            errs.push(
                at.k("protocol"),
                format!("unknown protocol `{other}` (http1, h2, h2c)"),
            );
            Protocol::Http1
        }
    };
    match (protocol, tls_section.is_some()) {
        (Protocol::H2, false) => errs.push(
            at.k("protocol"),
            "h2 is HTTP/2 over TLS: give the pool `tls`, or use h2c",
        ),
        (Protocol::H2c, true) => errs.push(
            at.k("protocol"),
            "h2c is HTTP/2 without TLS: use h2 for a pool with `tls`",
        ),
        _ => {}
    }
    if p.max_streams_per_connection == 0 {
        errs.push(at.k("max_streams_per_connection"), "must be at least 1");
    }
    let health = p.health_check.as_ref().map(|h| {
        let hat = at.k("health_check");
        if !h.path.is_empty() && !h.path.starts_with('/') {
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
        if h.grpc.is_some() && !protocol.is_h2() {
            errs.push(
                hat.k("grpc"),
                "a gRPC health check needs protocol = \"h2\" or \"h2c\"",
            );
        }
        let default_path = dialect.map_or("/", |d| d.caps().health_path);
        HealthSettings {
            path: if h.path.is_empty() {
                default_path.to_string()
            } else {
                h.path.clone()
            },
            interval: Duration::from_millis(h.interval_ms.max(1)),
            timeout: Duration::from_millis(h.timeout_ms.max(1)),
            rise: h.rise.max(1),
            fall: h.fall.max(1),
            host: (!h.host.is_empty()).then(|| h.host.clone()),
            grpc: h.grpc.clone(),
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
    // Plain proxied requests are all the anonymous tenant's: the costs
    // never matter.
    let costs = ultrafast_engine::fair::Costs::default();
    let gate = super::gate(name, lanes, p.max_concurrency, p.max_queued, metrics, costs);
    let dns = (!targets.is_empty()).then(|| {
        let fraction = ctx.prefetch_fraction;
        PoolDns::new(static_members.clone(), targets, answers, fraction)
    });
    let members = match &dns {
        Some(d) => d.compose(name, &old_members, &metrics.upstream),
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
            tls: tls_section
                .as_ref()
                .and_then(|t| upstream_tls(t, &at.k("tls"), errs)),
            max_fails: p.passive.max_fails,
            cooldown: Duration::from_millis(p.passive.cooldown_ms),
            attempts: p.retry.attempts,
            server_kind: dialect.unwrap_or_default(),
            request_id,
            protocol,
            max_streams: p.max_streams_per_connection.max(1),
        },
        health,
        budget: RetryBudget::new(p.retry.budget_ratio, p.retry.budget_min_per_s),
        metrics: pool_metrics,
        health_due_ms: AtomicU64::new(0),
        scrape_due_ms: AtomicU64::new(0),
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
                optional: false,
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
