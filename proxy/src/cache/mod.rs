//! The HTTP cache of proxy routes (nginx `proxy_cache`), on `pingora-cache`.
//!
//! Pingora does the HTTP caching (freshness from `Cache-Control` and
//! `Expires`, `Vary`, revalidation with `ETag`/`Last-Modified`, request
//! coalescing through its cache lock, `stale-while-revalidate` in a
//! background subrequest, `stale-if-error`); this module gives it a
//! bounded memory tier per route (a *zone*), decides what may be stored,
//! writes RFC 9211's `Cache-Status` and purges on the admin API's request.
//!
//! A zone outlives configs: Pingora wants its storage, eviction manager and
//! lock `'static`, and a reload must not empty a warm cache. Zones live in
//! one registry by route name; a reload that keeps the name keeps the
//! objects (a new `size_mb` resizes the LRU), and a route that goes away
//! has its zone emptied (the few hundred bytes of its struct stay).

pub mod status;
pub mod store;

use pingora::cache::eviction::{lru, CacheEntryKeyRef, EvictionManager};
use pingora::cache::key::{hash_key, CompactCacheKey};
use pingora::cache::lock::CacheLock;
use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, OnceLock};
use std::time::Duration;
use store::Store;

/// A route's `cache = { ... }`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheSpec {
    /// The zone's bound (bodies, metas and per-object overhead), bytes.
    pub size_bytes: usize,
    /// Largest body stored (nginx `proxy_max_temp_file_size`-like); larger
    /// responses pass through uncached.
    pub max_object_bytes: usize,
    /// Freshness of a response that says nothing about it (no
    /// `Cache-Control` max-age, no `Expires`): nginx `proxy_cache_valid`;
    /// 0 stores only what the origin says may be stored.
    pub default_ttl: Duration,
    /// How long concurrent misses of one key wait for the first one's fill
    /// (nginx `proxy_cache_lock_timeout`), after which they go upstream.
    pub lock_timeout: Duration,
}

/// Shards of each zone's LRU (Pingora's sharded manager: hits on
/// different keys do not share a lock).
const SHARDS: usize = 8;

/// One cache zone: its objects, LRU and fill lock.
pub struct Zone {
    /// The route name (the `Cache-Status` and metrics label).
    pub name: String,
    /// The objects.
    pub store: Store,
    /// The LRU that keeps `store` within its bound.
    pub eviction: lru::Manager<SHARDS>,
    /// Coalesces concurrent misses of one key into one origin fetch.
    pub lock: CacheLock,
}

impl Zone {
    /// Forget `keys` in the LRU too (a purge), so their weight stops
    /// counting against the zone.
    fn forget(&self, keys: &[CompactCacheKey]) {
        for k in keys {
            self.eviction
                .remove(CacheEntryKeyRef::from_entry_id(k, None));
        }
    }
}

/// A route's cache: its settings and (from the first request on) its zone.
#[derive(Debug)]
pub struct RouteCache {
    /// The route name, which names the zone.
    pub name: String,
    /// The settings.
    pub spec: CacheSpec,
    /// The zone's series, resolved with the config.
    pub metrics: ZoneMetrics,
    zone: OnceLock<&'static Zone>,
}

impl RouteCache {
    /// A route's cache; the zone is looked up when first used, so that
    /// checking a config that is then refused resizes nothing.
    pub fn new(name: &str, spec: CacheSpec, metrics: &CacheMetrics) -> Self {
        RouteCache {
            name: name.to_string(),
            spec,
            metrics: metrics.zone(name),
            zone: OnceLock::new(),
        }
    }

    /// The zone (one registry lookup per config, then a load).
    pub fn zone(&self) -> &'static Zone {
        self.zone.get_or_init(|| zone(&self.name, &self.spec))
    }
}

impl std::fmt::Debug for Zone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Zone({})", self.name)
    }
}

static ZONES: LazyLock<Mutex<HashMap<String, &'static Zone>>> = LazyLock::new(Default::default);

fn zones() -> std::sync::MutexGuard<'static, HashMap<String, &'static Zone>> {
    ZONES.lock().unwrap_or_else(|e| e.into_inner())
}

/// The zone of route `name`, created on first use; an existing one is
/// resized to `spec` and keeps its objects.
pub fn zone(name: &str, spec: &CacheSpec) -> &'static Zone {
    let mut all = zones();
    if let Some(z) = all.get(name) {
        z.eviction.set_weight_limit(spec.size_bytes);
        return z;
    }
    let z: &'static Zone = Box::leak(Box::new(Zone {
        name: name.to_string(),
        store: Store::default(),
        // Capacity is a hint (objects of about 4 KiB).
        eviction: lru::Manager::with_capacity(spec.size_bytes, spec.size_bytes / 4096 + 16),
        lock: CacheLock::new(spec.lock_timeout),
    }));
    all.insert(name.to_string(), z);
    z
}

/// Empty the zones of routes no longer configured (after a reload).
pub fn retain(names: &[&str]) {
    for (name, z) in zones().iter() {
        if !names.contains(&name.as_str()) {
            let keys = z.store.clear();
            z.forget(&keys);
        }
    }
}

/// Every zone: name, bytes held, objects held.
pub fn usage() -> Vec<(String, usize, usize)> {
    let mut v: Vec<_> = zones()
        .values()
        .map(|z| (z.name.clone(), z.store.bytes(), z.store.len()))
        .collect();
    v.sort();
    v
}

/// The primary key of a request: scheme, host, normalized path and query
/// (nginx's default key is `$scheme$proxy_host$request_uri`), as a
/// length-delimited tuple, so that no part can spill into another: a Host
/// `a/b` with path `/c` and a Host `a` with path `/b/c` are different keys.
/// `query` is None without a `?`.
pub fn primary(scheme: &str, host: &str, path: &str, query: Option<&str>) -> String {
    use std::fmt::Write;
    let mut k = String::with_capacity(scheme.len() + host.len() + path.len() + 24);
    for part in [scheme, host, path] {
        let _ = write!(k, "{}:{part}", part.len());
    }
    match query {
        Some(q) => {
            let _ = write!(k, "?{}:{q}", q.len());
        }
        None => k.push('-'),
    }
    k
}

/// What a purge removes.
pub enum Purge<'a> {
    /// Every variant of one URL: its primary key (`primary`).
    Url(&'a str),
    /// Everything.
    All,
}

/// Remove from `zone` (or from every zone) what `what` names; returns the
/// objects removed, or `None` for a zone that does not exist.
pub fn purge(zone: Option<&str>, what: Purge<'_>) -> Option<usize> {
    let all = zones();
    let targets: Vec<&'static Zone> = match zone {
        Some(name) => vec![*all.get(name)?],
        None => all.values().copied().collect(),
    };
    drop(all);
    let mut n = 0;
    for z in targets {
        let keys = match what {
            Purge::Url(url) => z.store.remove_primary(&hash_key(url)),
            Purge::All => z.store.clear(),
        };
        z.forget(&keys);
        n += keys.len();
    }
    Some(n)
}

/// The cache's families.
pub struct CacheMetrics {
    requests: prometheus::IntCounterVec,
    bytes: prometheus::IntGaugeVec,
    objects: prometheus::IntGaugeVec,
}

impl CacheMetrics {
    /// Create and register the families.
    pub fn new(registry: &prometheus::Registry) -> Self {
        use prometheus::{IntCounterVec, IntGaugeVec, Opts};
        #[allow(clippy::expect_used)]
        let requests = IntCounterVec::new(
            Opts::new(
                "ultrafast_cache_requests_total",
                "Requests of caching routes by zone and outcome: hit, stale, revalidated, expired, miss, uncacheable, bypass, error.",
            ),
            &["zone", "outcome"],
        )
        .expect("static metric");
        #[allow(clippy::expect_used)]
        let bytes = IntGaugeVec::new(
            Opts::new("ultrafast_cache_bytes", "Bytes held by each cache zone."),
            &["zone"],
        )
        .expect("static metric");
        #[allow(clippy::expect_used)]
        let objects = IntGaugeVec::new(
            Opts::new(
                "ultrafast_cache_objects",
                "Objects held by each cache zone.",
            ),
            &["zone"],
        )
        .expect("static metric");
        let _ = registry.register(Box::new(requests.clone()));
        let _ = registry.register(Box::new(bytes.clone()));
        let _ = registry.register(Box::new(objects.clone()));
        CacheMetrics {
            requests,
            bytes,
            objects,
        }
    }

    /// The series of zone `name`, resolved once (a config build), so a
    /// request increments a handle and never hashes a label set.
    pub fn zone(&self, name: &str) -> ZoneMetrics {
        ZoneMetrics {
            outcomes: OUTCOMES.map(|o| self.requests.with_label_values(&[name, o])),
            bytes: self.bytes.with_label_values(&[name]),
            objects: self.objects.with_label_values(&[name]),
        }
    }
}

/// The `outcome` label's values; the last stands for anything else.
const OUTCOMES: [&str; 8] = [
    "hit",
    "stale",
    "revalidated",
    "expired",
    "miss",
    "uncacheable",
    "bypass",
    "error",
];

/// One zone's series.
pub struct ZoneMetrics {
    outcomes: [prometheus::IntCounter; 8],
    bytes: prometheus::IntGauge,
    objects: prometheus::IntGauge,
}

impl std::fmt::Debug for ZoneMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ZoneMetrics")
    }
}

impl ZoneMetrics {
    /// Count one request by its outcome (`""`: it ended in an error) and
    /// refresh the zone's usage.
    pub fn observe(&self, zone: &Zone, outcome: &str) {
        let i = OUTCOMES
            .iter()
            .position(|o| *o == outcome)
            .unwrap_or(OUTCOMES.len() - 1);
        self.outcomes[i].inc();
        self.bytes.set(zone.store.bytes() as i64);
        self.objects.set(zone.store.len() as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_primary_key_is_a_tuple_no_part_can_spill_into_another() {
        assert_eq!(
            primary("https", "example.com", "/a", Some("b=1")),
            "5:https11:example.com2:/a?3:b=1"
        );
        assert_ne!(
            primary("http", "example.com/a", "/b", None),
            primary("http", "example.com", "/a/b", None)
        );
        assert_ne!(
            primary("http", "h", "/a", Some("")),
            primary("http", "h", "/a", None)
        );
    }

    #[test]
    fn purging_a_zone_that_does_not_exist_says_so() {
        assert_eq!(purge(Some("no-such-zone"), Purge::All), None);
        let spec = CacheSpec {
            size_bytes: 1 << 20,
            max_object_bytes: 1 << 10,
            default_ttl: Duration::ZERO,
            lock_timeout: Duration::from_secs(1),
        };
        let z = zone("unit-zone", &spec);
        assert!(std::ptr::eq(z, zone("unit-zone", &spec)));
        assert_eq!(purge(Some("unit-zone"), Purge::Url("http://x/")), Some(0));
    }
}
