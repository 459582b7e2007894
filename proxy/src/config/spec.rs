//! The typed, comparable settings the file's data sections become (the
//! lanes, the resolver's settings); the subsystems that act on them
//! re-export them where they are used.

use std::net::SocketAddr;
use std::time::Duration;

/// One lane's rules.
#[derive(Debug, Clone, PartialEq)]
pub struct LaneSpec {
    /// Name (`ultra`, `standard`, ...).
    pub name: String,
    /// Lower is served first.
    pub rank: u32,
    /// Most waiters in this lane's queue.
    pub queue_len: usize,
    /// Longest a request may wait.
    pub max_wait: Duration,
    /// Fraction of pool capacity reserved for this lane.
    pub reserved_share: f64,
    /// May evict queued lower-lane work when the pool queue is full.
    pub preempt: bool,
    /// Fraction of `queue_len` above which shedding starts.
    pub high_watermark: f64,
    /// Aging weight: microseconds of queue position per unit of work.
    pub sjf_us_per_unit: u64,
    /// Time-to-first-token target (p99) of inference requests; None: no
    /// target, only `max_wait`.
    pub ttft_slo: Option<Duration>,
    /// What happens to a request that cannot meet the target even on an
    /// idle backend.
    pub on_miss: OnMiss,
    /// What happens to a request for this lane from a key (or an
    /// anonymous request on a route) not granted it: refused (403
    /// `lane_not_allowed`) or moved to the next lower lane it is granted.
    pub on_forbidden: OnMiss,
}

/// What a lane does with a request that could never meet its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnMiss {
    /// Refuse it with a 422.
    Reject,
    /// Move it to the next lower lane (and say so in `x-ultrafast-lane`).
    Downgrade,
}

/// Default TTFT targets (ms; 0 = none) and high watermarks of the lanes
/// ultra, standard and batch. The targets are what the default model (a
/// 135M model on two CPU cores) meets when not overloaded: a chat turn of
/// up to ~200 prompt tokens in ultra, ~1,500 in standard; batch has none.
pub const DEFAULT_SLO_MS: [(u64, f64); 3] = [(1_500, 1.0), (10_000, 0.9), (0, 0.9)];

/// Lanes used when the config defines none.
pub fn default_lanes() -> Vec<LaneSpec> {
    let lane = |name: &str, rank: u32, queue_len, max_wait_ms, reserved_share, preempt| {
        let (ttft_slo_ms, high_watermark) = DEFAULT_SLO_MS[rank as usize];
        LaneSpec {
            name: name.into(),
            rank,
            queue_len,
            max_wait: Duration::from_millis(max_wait_ms),
            reserved_share,
            preempt,
            high_watermark,
            sjf_us_per_unit: 0,
            ttft_slo: (ttft_slo_ms > 0).then(|| Duration::from_millis(ttft_slo_ms)),
            on_miss: if rank < 2 {
                OnMiss::Downgrade
            } else {
                OnMiss::Reject
            },
            on_forbidden: OnMiss::Reject,
        }
    };
    vec![
        lane("ultra", 0, 256, 2_000, 0.2, true),
        lane("standard", 1, 1024, 15_000, 0.0, false),
        lane("batch", 2, 4096, 60_000, 0.0, false),
    ]
}

/// Resolver settings (`[dns]`).
#[derive(Debug, Clone, PartialEq)]
pub struct DnsSettings {
    /// Nameservers (`ip:port`); empty = the system's (`/etc/resolv.conf`).
    pub nameservers: Vec<SocketAddr>,
    /// Refresh when this fraction of the TTL has passed.
    pub prefetch_fraction: f64,
    /// TTL floor.
    pub min_ttl: Duration,
    /// TTL ceiling.
    pub max_ttl: Duration,
    /// How long past its TTL a last good answer may be served.
    pub stale_max: Duration,
    /// Per-query timeout.
    pub timeout: Duration,
    /// Consult `/etc/hosts` first.
    pub use_hosts_file: bool,
}

/// An address block (`10.0.0.0/8`, `2001:db8::/32`, or one address).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    net: std::net::IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Parse `ip/prefix` or a bare address (a block of one); the host
    /// bits past the prefix must be zero, as a typo there (`10.0.0.1/8`)
    /// usually means a different block than the one written.
    pub fn parse(s: &str) -> Result<Cidr, String> {
        let (ip, prefix) = match s.split_once('/') {
            Some((ip, p)) => (ip, Some(p)),
            None => (s, None),
        };
        let net: std::net::IpAddr = ip
            .trim()
            .parse()
            .map_err(|_| format!("`{s}` is not an address or address/prefix"))?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => match p.trim().parse::<u8>() {
                Ok(p) if p <= max => p,
                _ => return Err(format!("`{s}`: the prefix must be 0 to {max}")),
            },
        };
        let c = Cidr { net, prefix };
        if !c.contains(net) || c.mask(net) != bits(net) {
            return Err(format!("`{s}` has bits set past its /{prefix}"));
        }
        Ok(c)
    }

    /// Whether `ip` is in the block (an IPv4-mapped IPv6 address counts as
    /// its IPv4 address).
    pub fn contains(&self, ip: std::net::IpAddr) -> bool {
        let ip = match ip {
            std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, std::net::IpAddr::V4),
            v4 => v4,
        };
        ip.is_ipv4() == self.net.is_ipv4() && self.mask(ip) == self.mask(self.net)
    }

    fn mask(&self, ip: std::net::IpAddr) -> u128 {
        let width = if ip.is_ipv4() { 32 } else { 128 };
        let keep = u32::from(self.prefix);
        match keep {
            0 => 0,
            k => bits(ip) & (u128::MAX << (width - k)) & (u128::MAX >> (128 - width)),
        }
    }
}

fn bits(ip: std::net::IpAddr) -> u128 {
    match ip {
        std::net::IpAddr::V4(v4) => u128::from(u32::from(v4)),
        std::net::IpAddr::V6(v6) => u128::from(v6),
    }
}

/// A listener's PROXY protocol settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ProxyProtocol {
    /// The balancers allowed to send the header.
    pub from: Vec<Cidr>,
    /// The most time to receive it.
    pub timeout: Duration,
}
