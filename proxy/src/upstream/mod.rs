//! Upstream pools: members with their live state, the load balancer that
//! picks among them, passive ejection, and the retry budget.
//!
//! A `Pool` is built once per config load and shared by reference with every
//! request that routes to it. All per-member state is atomics so the request
//! path never takes a lock: picking a member is a few loads and one
//! `fetch_add`. Active health checks (`health`) flip `Member::healthy`; the
//! proxy reports outcomes back through `Pool::record_*`.

pub mod dns;
pub mod grpc_health;
pub mod health;
pub mod lb;
pub mod load;
pub mod retry_budget;
pub mod server_kind;

pub mod metrics;
use arc_swap::ArcSwap;
use lb::Balancer;
use metrics::{MemberMetrics, PoolMetrics};
use pingora::upstreams::peer::HttpPeer;
use retry_budget::RetryBudget;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Health-check settings of a pool.
#[derive(Debug, Clone, PartialEq)]
pub struct HealthSettings {
    /// Path probed with GET.
    pub path: String,
    /// Time between rounds.
    pub interval: Duration,
    /// Time one probe may take.
    pub timeout: Duration,
    /// Successes to mark up.
    pub rise: u32,
    /// Failures to mark down.
    pub fall: u32,
    /// Host header of the probe (None: the member's address).
    pub host: Option<String>,
    /// The gRPC health service probed instead of `path` (`Some("")`: the
    /// server as a whole).
    pub grpc: Option<String>,
}

/// What a pool's members speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    /// HTTP/1.1 (over TLS when the pool has `tls`).
    #[default]
    Http1,
    /// HTTP/2 over TLS, negotiated by ALPN.
    H2,
    /// HTTP/2 over TCP with prior knowledge.
    H2c,
}

impl Protocol {
    /// Whether members speak HTTP/2.
    pub fn is_h2(self) -> bool {
        self != Protocol::Http1
    }
}

/// Per-pool connection and retry settings.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolSettings {
    /// Connect timeout.
    pub connect_timeout: Option<Duration>,
    /// Connect + handshake timeout.
    pub total_connect_timeout: Option<Duration>,
    /// Per-read timeout.
    pub read_timeout: Option<Duration>,
    /// Per-write timeout.
    pub write_timeout: Option<Duration>,
    /// Idle time of a pooled upstream connection (None: no keepalive).
    pub keepalive_idle: Option<Duration>,
    /// Consecutive failures that eject a member (0: never).
    pub max_fails: u32,
    /// How long an ejected member is skipped.
    pub cooldown: Duration,
    /// Total tries per request.
    pub attempts: u32,
    /// HTTPS to the members.
    pub tls: Option<UpstreamTls>,
    /// The kind of inference server (what it accepts).
    pub server_kind: server_kind::ServerKind,
    /// What members are sent as `X-Request-Id`.
    pub request_id: crate::reqid::Upstream,
    /// What members speak.
    pub protocol: Protocol,
    /// HTTP/2 requests on one connection at most.
    pub max_streams: usize,
}

/// TLS towards a pool's members.
#[derive(Clone)]
pub struct UpstreamTls {
    /// SNI (empty: the member's host name, or none for an IP).
    pub sni: String,
    /// Verify certificate and host name.
    pub verify: bool,
    /// CA certificates (None: system roots).
    pub ca: Option<Arc<pingora::protocols::tls::CaType>>,
    /// Client certificate and key for mTLS.
    pub client: Option<Arc<pingora::utils::tls::CertKey>>,
}

impl std::fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "UpstreamTls(sni={:?}, verify={}, ca={}, mtls={})",
            self.sni,
            self.verify,
            self.ca.is_some(),
            self.client.is_some()
        )
    }
}

impl PartialEq for UpstreamTls {
    fn eq(&self, o: &Self) -> bool {
        self.sni == o.sni
            && self.verify == o.verify
            && self.ca.is_some() == o.ca.is_some()
            && self.client.is_some() == o.client.is_some()
    }
}

/// The live state of one member address. Shared (`Arc`) so it survives a
/// change of the pool's membership (DNS update, reload) for addresses that
/// stay: health, ejection, latency estimate and in-flight count carry over.
#[derive(Debug)]
pub struct MemberState {
    /// Result of active health checks (true until proven otherwise).
    pub healthy: AtomicBool,
    /// Requests in flight to this member.
    pub outstanding: AtomicU64,
    consecutive_fails: AtomicU32,
    ejected_until_ms: AtomicU64,
    /// Peak-EWMA of response latency, nanoseconds.
    ewma_ns: AtomicU64,
    ewma_stamp_ms: AtomicU64,
    /// What the member's own metrics say (queue-aware pools).
    pub load: load::MemberLoad,
    /// This member's metric handles.
    pub metrics: MemberMetrics,
}

impl MemberState {
    /// A healthy, idle member state.
    pub fn new(metrics: MemberMetrics) -> Self {
        metrics.healthy.set(1);
        MemberState {
            healthy: AtomicBool::new(true),
            outstanding: AtomicU64::new(0),
            consecutive_fails: AtomicU32::new(0),
            ejected_until_ms: AtomicU64::new(0),
            ewma_ns: AtomicU64::new(0),
            ewma_stamp_ms: AtomicU64::new(0),
            load: load::MemberLoad::default(),
            metrics,
        }
    }
}

/// One upstream member address.
#[derive(Debug, Clone)]
pub struct Member {
    /// Resolved address.
    pub addr: SocketAddr,
    /// Address as written in the config (a name keeps its name), for logs.
    pub label: String,
    /// Relative weight.
    pub weight: u32,
    /// Live state.
    pub state: Arc<MemberState>,
}

impl Member {
    /// Whether the member may take new requests now.
    pub fn available(&self, now_ms: u64) -> bool {
        self.state.healthy.load(Ordering::Relaxed)
            && self.state.ejected_until_ms.load(Ordering::Relaxed) <= now_ms
    }

    /// Current peak-EWMA latency estimate in nanoseconds.
    pub fn ewma_ns(&self) -> u64 {
        self.state.ewma_ns.load(Ordering::Relaxed)
    }

    /// Requests in flight.
    pub fn outstanding(&self) -> u64 {
        self.state.outstanding.load(Ordering::Relaxed)
    }
}

/// The pool's current member set and the balancer built over it; swapped
/// whole when the set changes.
#[derive(Debug)]
pub struct Membership {
    /// Members.
    pub members: Vec<Member>,
    /// Balancer over exactly these members.
    pub balancer: Balancer,
}

/// How to build a balancer for a member set.
#[derive(Debug, Clone, PartialEq)]
pub enum LbSpec {
    /// Smooth weighted round robin.
    RoundRobin,
    /// Least outstanding.
    LeastOutstanding,
    /// Consistent hash with bounded load.
    ConsistentHash(lb::HashKey, f64),
    /// Peak EWMA P2C.
    PeakEwma,
    /// By the members' own queue and KV figures, scraped.
    QueueAware(load::ScrapeSpec),
    /// An inference fleet's placement (`inference::fleet`): by each
    /// member's predicted latency, or (`load_prefix`) by llm-d's default
    /// scores. Retries and hedges go by least outstanding.
    Fleet(FleetLb),
}

/// The settings of a fleet policy the pool carries (the fleet itself is
/// the model's).
#[derive(Debug, Clone, PartialEq)]
pub struct FleetLb {
    /// `load_prefix` rather than `predicted_latency`.
    pub load_prefix: bool,
    /// Members scored per decision.
    pub k: usize,
    /// Sequences a member runs at once.
    pub slots: usize,
    /// Tokens a member's step takes at most (None: whole prompts).
    pub chunk: Option<usize>,
    /// Tokens per prefix block.
    pub block_tokens: usize,
    /// Prompt tokens a member's prefix cache holds.
    pub capacity_tokens: usize,
    /// How the members' own figures are read (None: over TLS, not read).
    pub scrape: Option<load::ScrapeSpec>,
}

impl LbSpec {
    /// A balancer over `members`.
    pub fn build(&self, members: &[Member]) -> Balancer {
        match self {
            LbSpec::RoundRobin => Balancer::round_robin(members),
            LbSpec::LeastOutstanding => Balancer::LeastOutstanding {
                next: AtomicU64::new(0),
            },
            LbSpec::ConsistentHash(_, factor) => Balancer::consistent_hash(members, *factor),
            LbSpec::PeakEwma => Balancer::PeakEwma {
                rng: AtomicU64::new(0x5eed),
            },
            LbSpec::QueueAware(spec) => Balancer::QueueAware {
                next: AtomicU64::new(0),
                stale_ms: spec.stale_ms(),
            },
            LbSpec::Fleet(_) => Balancer::LeastOutstanding {
                next: AtomicU64::new(0),
            },
        }
    }

    /// How the members' own figures are read, if they are.
    pub fn scrape(&self) -> Option<&load::ScrapeSpec> {
        match self {
            LbSpec::QueueAware(s) => Some(s),
            LbSpec::Fleet(f) => f.scrape.as_ref(),
            _ => None,
        }
    }
}

/// An upstream pool.
#[derive(Debug)]
pub struct Pool {
    /// Name from the config.
    pub name: String,
    /// Current members and balancer.
    pub membership: ArcSwap<Membership>,
    /// Balancing policy, to rebuild the balancer when members change.
    pub lb: LbSpec,
    /// Connection and retry settings.
    pub settings: PoolSettings,
    /// Active health checks, if configured.
    pub health: Option<HealthSettings>,
    /// Caps retries to a fraction of recent requests.
    pub budget: RetryBudget,
    /// Pre-resolved metric handles.
    pub metrics: PoolMetrics,
    /// Next due time of the health check, ms on the process clock.
    pub(crate) health_due_ms: AtomicU64,
    /// Next due time of the load scrape (queue-aware pools).
    pub(crate) scrape_due_ms: AtomicU64,
    /// Admission gate (concurrency limit with lane queues), if configured.
    pub gate: Option<Arc<crate::admission::gate::Gate>>,
    /// Members given by host name, kept fresh by DNS prefetch.
    pub dns: Option<dns::PoolDns>,
    /// The definition this pool was built from (reload reuses equal pools).
    pub def: crate::config::file::PoolSection,
}

/// Whether the periodic work timed by `due` (ms on `now_ms`'s clock) is
/// due now; if so, the next time is set `every` from now. The health
/// checks and the load scrapes time their rounds with it.
pub(crate) fn take_due(due: &AtomicU64, every: Duration) -> bool {
    let now = now_ms();
    if due.load(Ordering::Relaxed) > now {
        return false;
    }
    due.store(now + every.as_millis() as u64, Ordering::Relaxed);
    true
}

/// Milliseconds on a process-wide monotonic clock.
pub fn now_ms() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

impl Pool {
    /// The current membership.
    pub fn members(&self) -> Arc<Membership> {
        self.membership.load_full()
    }

    /// Replace the member set, keeping the state of addresses that stay.
    pub fn set_members(&self, members: Vec<Member>) {
        self.metrics.members.set(members.len() as i64);
        let balancer = self.lb.build(&members);
        self.membership
            .store(Arc::new(Membership { members, balancer }));
    }

    /// Build the pingora peer for `m` with this pool's timeouts.
    pub fn peer(&self, m: &Member) -> Box<HttpPeer> {
        let s = &self.settings;
        let mut peer = match &s.tls {
            None => HttpPeer::new(m.addr, false, String::new()),
            Some(t) => {
                let sni = if t.sni.is_empty() {
                    let host = m.label.rsplit_once(':').map(|(h, _)| h).unwrap_or(&m.label);
                    if host.parse::<std::net::IpAddr>().is_ok() {
                        String::new()
                    } else {
                        host.to_string()
                    }
                } else {
                    t.sni.clone()
                };
                let mut p = HttpPeer::new(m.addr, true, sni);
                p.options.verify_cert = t.verify;
                p.options.verify_hostname = t.verify;
                p.options.ca = t.ca.clone();
                p.client_cert_key = t.client.clone();
                p
            }
        };
        peer.options.connection_timeout = s.connect_timeout;
        peer.options.total_connection_timeout = s.total_connect_timeout;
        peer.options.read_timeout = s.read_timeout;
        peer.options.write_timeout = s.write_timeout;
        // Without keepalive the request carries `Connection: close` (see the
        // proxy), so the connection is never offered back to the pool.
        peer.options.idle_timeout = s.keepalive_idle;
        if s.protocol.is_h2() {
            // h2 over TLS by ALPN; over TCP, Pingora's connector speaks
            // h2c with prior knowledge to a peer that must speak h2.
            peer.options.alpn = pingora::protocols::ALPN::H2;
            peer.options.max_h2_streams = s.max_streams.max(1);
        }
        Box::new(peer)
    }

    /// A request to `m` failed (connect error, reset, timeout).
    pub fn record_failure(&self, m: &Member) {
        let max = self.settings.max_fails;
        if max == 0 {
            return;
        }
        let st = &m.state;
        let now = now_ms();
        // Failures of requests already in flight when the member was ejected
        // are the same outage, not new evidence.
        if st.ejected_until_ms.load(Ordering::Relaxed) > now {
            return;
        }
        let fails = st.consecutive_fails.fetch_add(1, Ordering::Relaxed) + 1;
        // Only the failure that reaches the limit ejects: concurrent ones
        // past it would count (and log) the same ejection again.
        if fails == max {
            st.consecutive_fails.store(0, Ordering::Relaxed);
            let until = now + self.settings.cooldown.as_millis() as u64;
            st.ejected_until_ms.store(until, Ordering::Relaxed);
            st.metrics.ejections.inc();
            log::warn!(
                "pool {}: member {} ({}) ejected for {:?} after {fails} consecutive failures",
                self.name,
                m.label,
                m.addr,
                self.settings.cooldown
            );
        }
    }

    /// A request to `m` got a response after `latency`.
    pub fn record_success(&self, m: &Member, latency: Duration) {
        if m.state.consecutive_fails.load(Ordering::Relaxed) != 0 {
            m.state.consecutive_fails.store(0, Ordering::Relaxed);
        }
        lb::update_peak_ewma(&m.state, latency, now_ms());
    }

    /// Count a request that enters this pool (feeds the retry budget).
    pub fn record_request(&self) {
        self.budget.deposit();
    }
}

/// Holds one unit of a member's outstanding count and gives it back on drop,
/// so every exit path (error, retry, client gone) releases it exactly once.
#[derive(Debug)]
pub struct Outstanding(Arc<MemberState>);

impl Outstanding {
    /// Take one unit of `m`'s outstanding count.
    pub fn acquire(m: &Member) -> Self {
        m.state.outstanding.fetch_add(1, Ordering::Relaxed);
        Outstanding(m.state.clone())
    }
}

impl Drop for Outstanding {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}
