//! Upstream pools: members with their live state, the load balancer that
//! picks among them, passive ejection, and the retry budget.
//!
//! A `Pool` is built once per config load and shared by reference with every
//! request that routes to it. All per-member state is atomics so the request
//! path never takes a lock: picking a member is a few loads and one
//! `fetch_add`. Active health checks (`health`) flip `Member::healthy`; the
//! proxy reports outcomes back through `Pool::record_*`.

pub mod budget;
pub mod health;
pub mod lb;

use crate::metrics::PoolMetrics;
use budget::RetryBudget;
use lb::Balancer;
use pingora::upstreams::peer::HttpPeer;
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
}

/// One upstream member and its live state.
#[derive(Debug)]
pub struct Member {
    /// Resolved address.
    pub addr: SocketAddr,
    /// Address as written in the config, for logs and labels.
    pub label: String,
    /// Relative weight.
    pub weight: u32,
    /// Result of active health checks (true until proven otherwise).
    pub healthy: AtomicBool,
    /// Requests in flight to this member.
    pub outstanding: AtomicU64,
    consecutive_fails: AtomicU32,
    ejected_until_ms: AtomicU64,
    /// Peak-EWMA of response latency, nanoseconds.
    ewma_ns: AtomicU64,
    ewma_stamp_ms: AtomicU64,
}

impl Member {
    /// A new member, healthy and idle.
    pub fn new(addr: SocketAddr, label: String, weight: u32) -> Self {
        Member {
            addr,
            label,
            weight,
            healthy: AtomicBool::new(true),
            outstanding: AtomicU64::new(0),
            consecutive_fails: AtomicU32::new(0),
            ejected_until_ms: AtomicU64::new(0),
            ewma_ns: AtomicU64::new(0),
            ewma_stamp_ms: AtomicU64::new(0),
        }
    }

    /// Whether the member may take new requests now.
    pub fn available(&self, now_ms: u64) -> bool {
        self.healthy.load(Ordering::Relaxed)
            && self.ejected_until_ms.load(Ordering::Relaxed) <= now_ms
    }

    /// Current peak-EWMA latency estimate in nanoseconds.
    pub fn ewma_ns(&self) -> u64 {
        self.ewma_ns.load(Ordering::Relaxed)
    }
}

/// An upstream pool.
#[derive(Debug)]
pub struct Pool {
    /// Name from the config.
    pub name: String,
    /// Members in config order.
    pub members: Vec<Member>,
    /// The load-balancing policy and its state.
    pub balancer: Balancer,
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
    /// Admission gate (concurrency limit with lane queues), if configured.
    pub gate: Option<Arc<crate::admission::gate::Gate>>,
}

/// Milliseconds on a process-wide monotonic clock.
pub fn now_ms() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

impl Pool {
    /// Build the pingora peer for member `idx` with this pool's timeouts.
    pub fn peer(&self, idx: usize) -> Box<HttpPeer> {
        let m = &self.members[idx];
        let mut peer = HttpPeer::new(m.addr, false, String::new());
        let s = &self.settings;
        peer.options.connection_timeout = s.connect_timeout;
        peer.options.total_connection_timeout = s.total_connect_timeout;
        peer.options.read_timeout = s.read_timeout;
        peer.options.write_timeout = s.write_timeout;
        // Without keepalive the request carries `Connection: close` (see the
        // proxy), so the connection is never offered back to the pool.
        peer.options.idle_timeout = s.keepalive_idle;
        Box::new(peer)
    }

    /// Pick a member for a request, skipping `tried` members.
    pub fn select(&self, hash: u64, tried: &[usize]) -> Option<usize> {
        self.balancer.select(&self.members, hash, tried, now_ms())
    }

    /// A request to member `idx` failed (connect error, reset, timeout).
    pub fn record_failure(&self, idx: usize) {
        let m = &self.members[idx];
        let max = self.settings.max_fails;
        if max == 0 {
            return;
        }
        let fails = m.consecutive_fails.fetch_add(1, Ordering::Relaxed) + 1;
        if fails >= max {
            m.consecutive_fails.store(0, Ordering::Relaxed);
            let until = now_ms() + self.settings.cooldown.as_millis() as u64;
            m.ejected_until_ms.store(until, Ordering::Relaxed);
            self.metrics.ejected(idx);
            log::warn!(
                "pool {}: member {} ejected for {:?} after {fails} consecutive failures",
                self.name,
                m.label,
                self.settings.cooldown
            );
        }
    }

    /// A request to member `idx` got a response after `latency`.
    pub fn record_success(&self, idx: usize, latency: Duration) {
        let m = &self.members[idx];
        if m.consecutive_fails.load(Ordering::Relaxed) != 0 {
            m.consecutive_fails.store(0, Ordering::Relaxed);
        }
        lb::update_peak_ewma(m, latency, now_ms());
    }

    /// Count a request that enters this pool (feeds the retry budget).
    pub fn record_request(&self) {
        self.budget.deposit();
    }
}

/// Holds one unit of a member's outstanding count and gives it back on drop,
/// so every exit path (error, retry, client gone) releases it exactly once.
#[derive(Debug)]
pub struct Outstanding {
    pool: Arc<Pool>,
    idx: usize,
}

impl Outstanding {
    /// Take one unit of member `idx`'s outstanding count.
    pub fn acquire(pool: Arc<Pool>, idx: usize) -> Self {
        pool.members[idx]
            .outstanding
            .fetch_add(1, Ordering::Relaxed);
        Outstanding { pool, idx }
    }
}

impl Drop for Outstanding {
    fn drop(&mut self) {
        self.pool.members[self.idx]
            .outstanding
            .fetch_sub(1, Ordering::Relaxed);
    }
}
