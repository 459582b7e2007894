//! DNS prefetch for upstream names, with `hickory-resolver`.
//!
//! A member written as `name:port` becomes one member per A/AAAA record of
//! the name, each with the configured weight (the weight applies per
//! address, so a name with more addresses takes proportionally more traffic,
//! as nginx does for `server name` with several records). Names are resolved
//! before a config is swapped in (load or reload), then refreshed in the
//! background when `prefetch_fraction` of the TTL has passed (TTL clamped to
//! `[min_ttl, max_ttl]`). A request never waits on DNS: it only ever reads
//! the membership already built. When the resolver fails, the last good
//! answer is served for up to `stale_max` past its TTL, then dropped. When
//! an answer changes, the member set is rebuilt keeping the live state (and
//! so the pooled connections, keyed by address) of addresses that stayed.

use super::metrics::Sink;
use super::{Member, MemberState, Pool};
use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolveHosts, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::TokioResolver;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::config::spec::DnsSettings;

/// A resolver built from `DnsSettings`.
pub struct Resolver {
    inner: TokioResolver,
    /// The settings it was built from.
    pub settings: DnsSettings,
}

impl std::fmt::Debug for Resolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Resolver({:?})", self.settings.nameservers)
    }
}

/// A resolved name: its addresses and clamped TTL.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// Addresses, sorted.
    pub addrs: Vec<IpAddr>,
    /// TTL after clamping.
    pub ttl: Duration,
}

impl Resolver {
    /// Build a resolver (must run inside a tokio runtime).
    pub fn new(settings: DnsSettings) -> Result<Self, String> {
        let builder = if settings.nameservers.is_empty() {
            TokioResolver::builder_tokio().map_err(|e| format!("system resolver config: {e}"))?
        } else {
            let servers = settings
                .nameservers
                .iter()
                .map(|ns| {
                    let conn = |mut c: ConnectionConfig| {
                        c.port = ns.port();
                        c
                    };
                    NameServerConfig::new(
                        ns.ip(),
                        true,
                        vec![conn(ConnectionConfig::udp()), conn(ConnectionConfig::tcp())],
                    )
                })
                .collect();
            let cfg = ResolverConfig::from_parts(None, vec![], servers);
            TokioResolver::builder_with_config(cfg, TokioRuntimeProvider::default())
        };
        let mut builder = builder;
        let opts = builder.options_mut();
        opts.timeout = settings.timeout;
        opts.attempts = 1;
        // Our own refresh schedule is the cache; hickory's would hide changes.
        opts.cache_size = 0;
        opts.use_hosts_file = if settings.use_hosts_file {
            ResolveHosts::Always
        } else {
            ResolveHosts::Never
        };
        let inner = builder.build().map_err(|e| format!("resolver: {e}"))?;
        Ok(Resolver { inner, settings })
    }

    /// Resolve `name` to its addresses and clamped TTL.
    pub async fn resolve(&self, name: &str, metrics: &dyn Sink) -> Result<Answer, String> {
        let r = tokio::time::timeout(self.settings.timeout * 2, self.inner.lookup_ip(name)).await;
        let lookup = match r {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => {
                metrics.dns_query("error");
                return Err(format!("`{name}` does not resolve: {e}"));
            }
            Err(_) => {
                metrics.dns_query("timeout");
                return Err(format!("`{name}`: DNS timed out"));
            }
        };
        let mut addrs: Vec<IpAddr> = lookup.iter().collect();
        addrs.sort();
        addrs.dedup();
        if addrs.is_empty() {
            metrics.dns_query("empty");
            return Err(format!("`{name}` resolves to no address"));
        }
        metrics.dns_query("ok");
        let ttl = lookup
            .valid_until()
            .saturating_duration_since(Instant::now())
            .clamp(self.settings.min_ttl, self.settings.max_ttl);
        Ok(Answer { addrs, ttl })
    }
}

/// A pool member given by name.
#[derive(Debug, Clone, PartialEq)]
pub struct NameTarget {
    /// Host name.
    pub name: String,
    /// Port.
    pub port: u16,
    /// Weight of each address.
    pub weight: u32,
}

#[derive(Debug, Clone)]
struct NameState {
    answer: Answer,
    next_due: Instant,
    last_ok: Instant,
    expired: bool,
}

/// DNS-managed part of a pool.
#[derive(Debug)]
pub struct PoolDns {
    /// Members given as literal addresses.
    pub static_members: Vec<Member>,
    /// Members given by name.
    pub targets: Vec<NameTarget>,
    state: Mutex<Vec<NameState>>,
}

impl PoolDns {
    /// From the answers obtained before the swap (one per target).
    pub fn new(
        static_members: Vec<Member>,
        targets: Vec<NameTarget>,
        answers: Vec<Answer>,
        prefetch_fraction: f64,
    ) -> Self {
        let now = Instant::now();
        let state = answers
            .into_iter()
            .map(|answer| NameState {
                next_due: now + answer.ttl.mul_f64(prefetch_fraction),
                answer,
                last_ok: now,
                expired: false,
            })
            .collect();
        PoolDns {
            static_members,
            targets,
            state: Mutex::new(state),
        }
    }

    /// The full member list for the current answers, reusing `old` states.
    pub fn compose(&self, pool: &str, old: &[Member], metrics: &dyn Sink) -> Vec<Member> {
        let state = self.state.lock();
        let mut out = self.static_members.clone();
        for (t, s) in self.targets.iter().zip(state.iter()) {
            if s.expired {
                continue;
            }
            for ip in &s.answer.addrs {
                let addr = SocketAddr::new(*ip, t.port);
                let st = old
                    .iter()
                    .find(|m| m.addr == addr)
                    .map(|m| m.state.clone())
                    .unwrap_or_else(|| {
                        Arc::new(MemberState::new(metrics.member(pool, &addr.to_string())))
                    });
                out.push(Member {
                    addr,
                    label: format!("{}:{}", t.name, t.port),
                    weight: t.weight,
                    state: st,
                });
            }
        }
        out
    }
}

/// Refresh the pool's names that are due; rebuild its members if an answer
/// changed or expired. Runs on the background refresher, never on a request.
pub async fn refresh(pool: &Pool, resolver: &Resolver, metrics: &dyn Sink) {
    let Some(dns) = &pool.dns else { return };
    let s = &resolver.settings;
    let now = Instant::now();
    let due: Vec<usize> = {
        let state = dns.state.lock();
        state
            .iter()
            .enumerate()
            .filter(|(_, st)| now >= st.next_due)
            .map(|(i, _)| i)
            .collect()
    };
    let mut changed = false;
    for i in due {
        let name = dns.targets[i].name.clone();
        let result = resolver.resolve(&name, metrics).await;
        let mut state = dns.state.lock();
        let st = &mut state[i];
        let now = Instant::now();
        let stale = metrics.dns_stale(&pool.name, &name);
        match result {
            Ok(answer) => {
                if answer.addrs != st.answer.addrs || st.expired {
                    log::info!(
                        "pool {}: {name} now resolves to {:?}",
                        pool.name,
                        answer.addrs
                    );
                    changed = true;
                }
                st.next_due = now + answer.ttl.mul_f64(s.prefetch_fraction);
                st.answer = answer;
                st.last_ok = now;
                st.expired = false;
                stale.set(0);
            }
            Err(e) => {
                let limit = st.last_ok + st.answer.ttl + s.stale_max;
                if now >= limit {
                    if !st.expired {
                        log::error!(
                            "pool {}: {e}; stale answer for {name} dropped after {:?}",
                            pool.name,
                            s.stale_max
                        );
                        st.expired = true;
                        changed = true;
                    }
                    stale.set(0);
                } else {
                    log::warn!(
                        "pool {}: {e}; serving the last good answer for {name}",
                        pool.name
                    );
                    stale.set(1);
                }
                // Retry a failing name sooner than its TTL.
                st.next_due = now
                    + st.answer
                        .ttl
                        .mul_f64(s.prefetch_fraction)
                        .min(Duration::from_secs(1));
            }
        }
        metrics.dns_answer_age(
            &pool.name,
            &name,
            now.duration_since(st.last_ok).as_secs_f64(),
        );
    }
    if changed {
        let old = pool.members();
        pool.set_members(dns.compose(&pool.name, &old.members, metrics));
    }
}

/// Resolve every distinct name, for a load or reload (before the swap).
pub async fn resolve_all(
    resolver: &Resolver,
    names: Vec<String>,
    metrics: &dyn Sink,
) -> HashMap<String, Result<Answer, String>> {
    let mut out = HashMap::new();
    for n in names {
        if let std::collections::hash_map::Entry::Vacant(slot) = out.entry(n) {
            let r = resolver.resolve(slot.key(), metrics).await;
            slot.insert(r);
        }
    }
    out
}
