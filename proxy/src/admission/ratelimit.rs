//! Rate limits (GCRA through `governor`), keyed by client IP, API key, a
//! header, or one shared bucket per route or pool.
//!
//! This module also owns the key derivation (`KeySource::key`) that token
//! budgets (`budget`) share, so both kinds of limit key a request the same
//! way.
//!
//! Keys are 64-bit hashes, so the per-key state is a fixed small size. The
//! keyed map is bounded: when it reaches `max_keys`, idle keys are evicted
//! (`retain_recent`, a walk of the whole map, so at most once a second:
//! `SWEEP_EVERY`); while it is still full, new keys share one overflow
//! bucket instead of growing memory. A request at the bound so costs what
//! any other does, however many distinct keys a flood sends. A refusal carries the
//! exact time until the limiter would allow the key again.

use crate::hash::hash_bytes;
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use http::HeaderName;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::time::Duration;

/// Where a limiter's key comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// The client IP.
    ClientIp,
    /// The bearer token of `Authorization`, or a configured header's value.
    ApiKey(Option<HeaderName>),
    /// A header's value.
    Header(HeaderName),
    /// One bucket for each route that uses the limiter.
    Route,
    /// One bucket for each pool behind the routes that use it.
    Pool,
}

impl KeySource {
    /// Parse a config `key` value: `client_ip`, `api_key`, `api_key:HEADER`,
    /// `header:NAME`, `route` or `pool`.
    pub fn parse(s: &str) -> Option<KeySource> {
        match s {
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
        }
    }

    /// The 64-bit key of a request; shared by request limits (`Limiter`)
    /// and token budgets (`budget::TokenBudget`). A missing IP or header is
    /// key 0 (all such requests share one bucket); a malformed
    /// `Authorization` or an oversized header is an error (a 400).
    pub fn key(&self, input: &KeyInput) -> Result<u64, &'static str> {
        Ok(match self {
            KeySource::ClientIp => match input.client_ip {
                Some(IpAddr::V4(a)) => hash_bytes(&a.octets()),
                Some(IpAddr::V6(a)) => hash_bytes(&a.octets()),
                None => 0,
            },
            KeySource::ApiKey(None) => match presented_key(input.headers)? {
                Some(k) => hash_bytes(k),
                None => 0,
            },
            KeySource::ApiKey(Some(h)) | KeySource::Header(h) => match input.headers.get(h) {
                Some(v) if v.len() > 4096 => return Err("key header too long"),
                Some(v) => hash_bytes(v.as_bytes()),
                None => 0,
            },
            KeySource::Route => hash_bytes(input.route.as_bytes()),
            KeySource::Pool => hash_bytes(input.pool.unwrap_or("").as_bytes()),
        })
    }
}

/// The request facts a key is derived from.
pub struct KeyInput<'a> {
    /// Client IP.
    pub client_ip: Option<IpAddr>,
    /// Request headers.
    pub headers: &'a http::HeaderMap,
    /// Route name.
    pub route: &'a str,
    /// Pool name, if any.
    pub pool: Option<&'a str>,
}

/// Result of a check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Within the limit.
    Allow,
    /// Over the limit; retry after this long.
    Limited(Duration),
    /// The key could not be derived (malformed input): a 400.
    BadKey(&'static str),
    /// The shared store is unreachable and the limit fails closed: a 503.
    StoreDown,
}

const OVERFLOW_KEY: u64 = u64::MAX;

/// How often a full map may be swept for idle keys (the token budgets'
/// table sweeps as rarely).
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// One configured rate limit.
pub struct Limiter {
    /// Name from the config.
    pub name: String,
    source: KeySource,
    limiter: DefaultKeyedRateLimiter<u64>,
    clock: DefaultClock,
    max_keys: usize,
    rate_per_s: f64,
    burst: u32,
    /// When the limiter was made: the origin of `swept_ms`.
    born: std::time::Instant,
    /// When the map was last swept, ms after `born` (`u64::MAX`: never).
    swept_ms: std::sync::atomic::AtomicU64,
    /// What it does with `[cluster]` while the store is down.
    pub on_store_error: crate::cluster::OnStoreError,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Limiter({})", self.name)
    }
}

/// The GCRA cells one request costs when `share` instances each keep their
/// own state (the `local` fallback of `[cluster]`): `share`, capped at the
/// burst so one request always fits.
pub(crate) fn cells(share: usize, burst: u32) -> NonZeroU32 {
    NonZeroU32::new(share.clamp(1, burst.max(1) as usize) as u32).unwrap_or(NonZeroU32::MIN)
}

/// Parse `Authorization: Bearer <token>` strictly.
/// The API key a request presents: `Authorization: Bearer <key>` (OpenAI)
/// or, without it, `x-api-key: <key>` (Anthropic). None: neither header.
pub(crate) fn presented_key(h: &http::HeaderMap) -> Result<Option<&[u8]>, &'static str> {
    if let Some(v) = h.get(http::header::AUTHORIZATION) {
        return bearer(v.as_bytes()).map(Some);
    }
    let Some(v) = h.get("x-api-key") else {
        return Ok(None);
    };
    let k = v.as_bytes();
    if k.is_empty() || k.len() > 4096 || !k.iter().all(|b| b.is_ascii_graphic()) {
        return Err("malformed x-api-key");
    }
    Ok(Some(k))
}

pub(crate) fn bearer(v: &[u8]) -> Result<&[u8], &'static str> {
    let rest = v
        .strip_prefix(b"Bearer ")
        .or_else(|| v.strip_prefix(b"bearer "))
        .ok_or("Authorization must be `Bearer <token>`")?;
    if rest.is_empty() || rest.len() > 4096 || !rest.iter().all(|b| b.is_ascii_graphic()) {
        return Err("malformed bearer token");
    }
    Ok(rest)
}

/// The GCRA quota of `rate_per_s` with `burst`; None when the rate is not
/// positive and finite, its period does not fit a `Duration`, or `burst` is 0.
pub(crate) fn quota(rate_per_s: f64, burst: u32) -> Option<Quota> {
    let period = Duration::try_from_secs_f64(1.0 / rate_per_s).ok()?;
    Some(Quota::with_period(period)?.allow_burst(NonZeroU32::new(burst)?))
}

impl Limiter {
    /// A limiter of `rate_per_s` with `burst`, keyed by `source`.
    pub fn new(
        name: &str,
        source: KeySource,
        rate_per_s: f64,
        burst: u32,
        max_keys: usize,
    ) -> Option<Self> {
        let quota = quota(rate_per_s, burst)?;
        Some(Limiter {
            name: name.to_string(),
            source,
            limiter: RateLimiter::keyed(quota),
            clock: DefaultClock::default(),
            max_keys: max_keys.max(1),
            rate_per_s,
            burst,
            born: std::time::Instant::now(),
            swept_ms: std::sync::atomic::AtomicU64::new(u64::MAX),
            on_store_error: crate::cluster::OnStoreError::Local,
        })
    }

    /// Check (and count) one request.
    pub fn check(&self, input: &KeyInput) -> Verdict {
        self.check_scaled(input, 1)
    }

    /// Check one request as `share` requests' worth of cells: with `share`
    /// live instances each keeping its own state, each gets 1/`share` of
    /// the rate and burst (the `local` fallback of `[cluster]`). The share
    /// is capped at the burst so one request always fits.
    pub fn check_scaled(&self, input: &KeyInput, share: usize) -> Verdict {
        let mut key = match self.source.key(input) {
            Ok(k) => k,
            Err(why) => return Verdict::BadKey(why),
        };
        if self.limiter.len() >= self.max_keys {
            if self.may_sweep() {
                self.limiter.retain_recent();
            }
            if self.limiter.len() >= self.max_keys {
                key = OVERFLOW_KEY;
            }
        }
        if share <= 1 {
            return match self.limiter.check_key(&key) {
                Ok(()) => Verdict::Allow,
                Err(not_until) => Verdict::Limited(not_until.wait_time_from(self.clock.now())),
            };
        }
        match self.limiter.check_key_n(&key, cells(share, self.burst)) {
            Ok(Ok(())) => Verdict::Allow,
            Ok(Err(not_until)) => Verdict::Limited(not_until.wait_time_from(self.clock.now())),
            // Cannot happen (cells <= burst); refuse for a period if it does.
            Err(_) => Verdict::Limited(Duration::from_secs_f64(1.0 / self.rate_per_s)),
        }
    }

    /// Whether this request may sweep the full map: the first since
    /// `SWEEP_EVERY` (one caller wins the race; the others go on).
    fn may_sweep(&self) -> bool {
        use std::sync::atomic::Ordering;
        let now = self.born.elapsed().as_millis() as u64;
        let last = self.swept_ms.load(Ordering::Relaxed);
        if last != u64::MAX && now.saturating_sub(last) < SWEEP_EVERY.as_millis() as u64 {
            return false;
        }
        self.swept_ms
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }

    /// When the full map was last swept, ms after the limiter was made.
    #[cfg(test)]
    fn last_sweep_ms(&self) -> u64 {
        self.swept_ms.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sustained requests per second and burst.
    pub fn rate(&self) -> (f64, u32) {
        (self.rate_per_s, self.burst)
    }

    /// Where this limiter's key comes from.
    pub fn source(&self) -> &KeySource {
        &self.source
    }

    /// Keys currently tracked.
    pub fn tracked_keys(&self) -> usize {
        self.limiter.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input<'a>(h: &'a http::HeaderMap) -> KeyInput<'a> {
        KeyInput {
            client_ip: None,
            headers: h,
            route: "r",
            pool: None,
        }
    }

    #[test]
    fn burst_then_refusal_with_wait() {
        let l = Limiter::new("t", KeySource::Route, 2.0, 3, 10).unwrap();
        let h = http::HeaderMap::new();
        for _ in 0..3 {
            assert_eq!(l.check(&input(&h)), Verdict::Allow);
        }
        match l.check(&input(&h)) {
            Verdict::Limited(d) => assert!(
                d > Duration::from_millis(300) && d <= Duration::from_millis(500),
                "{d:?}"
            ),
            v => panic!("{v:?}"),
        }
    }

    /// A limit keyed by `x-k`, 1/s with a burst of 1, of 1,000 keys.
    fn by_header() -> Limiter {
        Limiter::new(
            "t",
            KeySource::Header(HeaderName::from_static("x-k")),
            1.0,
            1,
            1000,
        )
        .unwrap()
    }

    #[test]
    fn keyed_state_stays_bounded_under_100k_keys() {
        let l = by_header();
        for i in 0..100_000u32 {
            let mut h = http::HeaderMap::new();
            h.insert("x-k", i.to_string().parse().unwrap());
            l.check(&input(&h));
        }
        assert!(l.tracked_keys() <= 1001, "{}", l.tracked_keys());
    }

    #[test]
    fn a_full_map_is_swept_at_most_once_a_second() {
        // Before: every request at the bound walked the whole map (1,000
        // entries here, 100k by default) for idle keys.
        let l = by_header();
        let mut h = http::HeaderMap::new();
        for i in 0..1000u32 {
            h.insert("x-k", i.to_string().parse().unwrap());
            l.check(&input(&h));
        }
        assert_eq!(l.last_sweep_ms(), u64::MAX, "not full before now");
        h.insert("x-k", "first".parse().unwrap());
        l.check(&input(&h));
        let first = l.last_sweep_ms();
        assert_ne!(first, u64::MAX, "the first request at the bound sweeps");
        let mut allowed = 0;
        for i in 0..5000u32 {
            h.insert("x-k", format!("n{i}").parse().unwrap());
            allowed += usize::from(l.check(&input(&h)) == Verdict::Allow);
        }
        // New keys share the overflow bucket (burst 1, 1/s).
        assert!(allowed <= 2, "{allowed} allowed");
        // Well inside a second: no sweep since the first.
        if l.born.elapsed() < Duration::from_millis(900) {
            assert_eq!(l.last_sweep_ms(), first);
        }
        assert!(l.tracked_keys() <= 1001, "{}", l.tracked_keys());
    }

    #[test]
    fn malformed_authorization_is_a_bad_key() {
        let l = Limiter::new("t", KeySource::ApiKey(None), 1.0, 1, 10).unwrap();
        for bad in ["Basic abc", "Bearer ", "Bearer a b"] {
            let mut h = http::HeaderMap::new();
            h.insert(http::header::AUTHORIZATION, bad.parse().unwrap());
            assert!(matches!(l.check(&input(&h)), Verdict::BadKey(_)), "{bad}");
        }
        let mut h = http::HeaderMap::new();
        h.insert(http::header::AUTHORIZATION, "Bearer sk-1".parse().unwrap());
        assert_eq!(l.check(&input(&h)), Verdict::Allow);
    }
}
