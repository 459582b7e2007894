//! The cache's memory tier: a `pingora::cache::Storage` over one hash map.
//!
//! Pingora's own `MemCache` says "for testing only" (it copies every body
//! on every read and never bounds itself), so the zone keeps its objects
//! here: a body is one `Bytes` shared by every reader (a hit copies
//! nothing), the bound is kept by Pingora's LRU eviction manager (which
//! tells us what to drop), and Pingora's cache lock coalesces fills.
//! Objects are whole before they are visible: a fill lands on `finish`.

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::RwLock;
use pingora::cache::key::{CompactCacheKey, HashBinary};
use pingora::cache::storage::{
    HandleHit, HandleMiss, HitHandler, MissFinishType, MissHandler, PurgeOutcome, PurgeTarget,
    PurgeType,
};
use pingora::cache::trace::SpanHandle;
use pingora::cache::{CacheKey, CacheMeta, Storage};
use pingora::http::ResponseHeader;
use pingora::{Error, ErrorType, Result};
use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

/// A stored response: Pingora's serialized meta (what it weighs), the
/// same meta kept parsed, and the body.
struct Object {
    meta: (Vec<u8>, Vec<u8>),
    parsed: Parsed,
    body: Bytes,
}

/// A meta's fields, so that a hit rebuilds it instead of deserializing it
/// (Pingora stores the head zstd-compressed: decompressing and parsing it
/// was about a tenth of a 1 KiB hit's CPU).
struct Parsed {
    fresh_until: SystemTime,
    created: SystemTime,
    epoch: SystemTime,
    swr: u32,
    sie: u32,
    variance: Option<HashBinary>,
    header: ResponseHeader,
}

impl Parsed {
    fn of(m: &CacheMeta) -> Self {
        Parsed {
            fresh_until: m.fresh_until(),
            created: m.created(),
            epoch: m.epoch(),
            swr: m.stale_while_revalidate_sec(),
            sie: m.stale_if_error_sec(),
            variance: m.variance(),
            header: m.response_header_copy(),
        }
    }

    fn meta(&self) -> CacheMeta {
        let mut m = CacheMeta::new(
            self.fresh_until,
            self.created,
            self.swr,
            self.sie,
            self.header.clone(),
        );
        // Age and freshness count from the last update (a revalidation),
        // which `new` cannot be told.
        if self.epoch != self.created {
            m.set_epoch_override(self.epoch);
        }
        if let Some(v) = self.variance {
            m.set_variance(v);
        }
        m
    }
}

impl Object {
    /// What it costs the zone (the eviction weight): both forms of the
    /// meta (the parsed head at its bytes plus a map slot per header),
    /// the body and the entry.
    fn weight(&self) -> usize {
        let parsed: usize = self
            .parsed
            .header
            .headers
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len() + 48)
            .sum();
        self.meta.0.len() + self.meta.1.len() + parsed + self.body.len() + OVERHEAD
    }
}

/// The map entry, key and bookkeeping, counted against the zone so that a
/// flood of tiny objects cannot outgrow it.
const OVERHEAD: usize = 160;

/// The objects of one zone.
#[derive(Default)]
pub struct Store {
    objects: RwLock<HashMap<CompactCacheKey, Arc<Object>>>,
    bytes: AtomicUsize,
}

impl Store {
    /// Bytes held (bodies, metas and per-object overhead).
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Objects held.
    pub fn len(&self) -> usize {
        self.objects.read().len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn insert(&self, key: CompactCacheKey, obj: Object) {
        let w = obj.weight();
        if let Some(old) = self.objects.write().insert(key, Arc::new(obj)) {
            self.bytes.fetch_sub(old.weight(), Ordering::Relaxed);
        }
        self.bytes.fetch_add(w, Ordering::Relaxed);
    }

    fn remove(&self, key: &CompactCacheKey) -> bool {
        match self.objects.write().remove(key) {
            Some(old) => {
                self.bytes.fetch_sub(old.weight(), Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    /// Drop every variant stored under `primary` (every `Vary` variant of
    /// one URL); returns their keys, for the eviction manager to forget.
    pub fn remove_primary(&self, primary: &HashBinary) -> Vec<CompactCacheKey> {
        self.remove_where(|k| &k.primary == primary)
    }

    /// Drop everything; returns the keys removed.
    pub fn clear(&self) -> Vec<CompactCacheKey> {
        self.remove_where(|_| true)
    }

    fn remove_where(&self, f: impl Fn(&CompactCacheKey) -> bool) -> Vec<CompactCacheKey> {
        let mut map = self.objects.write();
        let keys: Vec<_> = map.keys().filter(|k| f(k)).cloned().collect();
        for k in &keys {
            if let Some(old) = map.remove(k) {
                self.bytes.fetch_sub(old.weight(), Ordering::Relaxed);
            }
        }
        keys
    }
}

#[async_trait]
impl Storage for Store {
    async fn lookup(
        &'static self,
        key: &CacheKey,
        _trace: &SpanHandle,
    ) -> Result<Option<(CacheMeta, HitHandler)>> {
        let found = self.objects.read().get(&key.to_compact()).cloned();
        let Some(obj) = found else {
            return Ok(None);
        };
        let meta = obj.parsed.meta();
        let hit = Hit {
            end: obj.body.len(),
            weight: obj.weight(),
            body: obj.body.clone(),
            start: 0,
            done: false,
        };
        Ok(Some((meta, Box::new(hit))))
    }

    async fn get_miss_handler(
        &'static self,
        key: &CacheKey,
        meta: &CacheMeta,
        _trace: &SpanHandle,
    ) -> Result<MissHandler> {
        Ok(Box::new(Fill {
            store: self,
            key: key.to_compact(),
            meta: meta.serialize()?,
            parsed: Parsed::of(meta),
            body: Vec::new(),
        }))
    }

    async fn purge(
        &'static self,
        target: PurgeTarget<'_>,
        _purge_type: PurgeType,
        _trace: &SpanHandle,
    ) -> Result<PurgeOutcome> {
        Ok(if self.remove(target.key()) {
            PurgeOutcome::Purged(None)
        } else {
            PurgeOutcome::NotFound
        })
    }

    async fn update_meta(
        &'static self,
        key: &CacheKey,
        meta: &CacheMeta,
        _trace: &SpanHandle,
    ) -> Result<bool> {
        let key = key.to_compact();
        let body = self.objects.read().get(&key).map(|o| o.body.clone());
        let Some(body) = body else {
            return Ok(false);
        };
        // A revalidation (304) freshens the meta; the body stays shared.
        self.insert(
            key,
            Object {
                meta: meta.serialize()?,
                parsed: Parsed::of(meta),
                body,
            },
        );
        Ok(true)
    }

    fn as_any(&self) -> &(dyn Any + Send + Sync + 'static) {
        self
    }
}

/// A reader of one stored body (seekable, for ranges).
struct Hit {
    body: Bytes,
    start: usize,
    end: usize,
    done: bool,
    weight: usize,
}

#[async_trait]
impl HandleHit for Hit {
    async fn read_body(&mut self) -> Result<Option<Bytes>> {
        if self.done {
            return Ok(None);
        }
        self.done = true;
        Ok(Some(self.body.slice(self.start..self.end)))
    }

    async fn finish(
        self: Box<Self>,
        _storage: &'static (dyn Storage + Sync),
        _key: &CacheKey,
        _trace: &SpanHandle,
    ) -> Result<()> {
        Ok(())
    }

    fn can_seek(&self) -> bool {
        true
    }

    fn seek(&mut self, start: usize, end: Option<usize>) -> Result<()> {
        let len = self.body.len();
        if start >= len {
            return Error::e_explain(
                ErrorType::InternalError,
                format!("seek start {start} past the body ({len} bytes)"),
            );
        }
        self.start = start;
        self.end = end.map_or(len, |e| e.min(len));
        self.done = false;
        Ok(())
    }

    fn get_eviction_weight(&self) -> usize {
        self.weight
    }

    fn as_any(&self) -> &(dyn Any + Send + Sync) {
        self
    }

    fn as_any_mut(&mut self) -> &mut (dyn Any + Send + Sync) {
        self
    }
}

/// A fill in progress: invisible to readers until `finish`.
struct Fill {
    store: &'static Store,
    key: CompactCacheKey,
    meta: (Vec<u8>, Vec<u8>),
    parsed: Parsed,
    body: Vec<u8>,
}

#[async_trait]
impl HandleMiss for Fill {
    async fn write_body(&mut self, data: Bytes, _eof: bool) -> Result<()> {
        self.body.extend_from_slice(&data);
        Ok(())
    }

    async fn finish(self: Box<Self>) -> Result<MissFinishType> {
        let obj = Object {
            meta: self.meta,
            parsed: self.parsed,
            body: Bytes::from(self.body),
        };
        let w = obj.weight();
        self.store.insert(self.key, obj);
        Ok(MissFinishType::Created(w))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> CompactCacheKey {
        CacheKey::new(s, "zone").to_compact()
    }

    #[test]
    fn bytes_follow_inserts_replacements_and_removals() {
        let s = Store::default();
        let obj = |n| {
            let head = ResponseHeader::build(200, None).expect("a head");
            let meta = CacheMeta::new(SystemTime::now(), SystemTime::now(), 0, 0, head);
            Object {
                meta: (vec![0; 10], vec![0; 20]),
                parsed: Parsed::of(&meta),
                body: Bytes::from(vec![b'x'; n]),
            }
        };
        s.insert(key("a"), obj(100));
        assert_eq!(s.bytes(), 130 + OVERHEAD);
        s.insert(key("a"), obj(50));
        assert_eq!(s.bytes(), 80 + OVERHEAD);
        s.insert(key("b"), obj(0));
        assert_eq!(s.len(), 2);
        assert!(s.remove(&key("a")));
        assert!(!s.remove(&key("a")));
        assert_eq!(s.bytes(), 30 + OVERHEAD);
        let w = obj(0).weight();
        assert_eq!(
            w,
            30 + OVERHEAD,
            "a head without headers weighs nothing more"
        );
        assert_eq!(s.clear().len(), 1);
        assert_eq!(s.bytes(), 0);
        assert!(s.is_empty());
    }

    #[test]
    fn a_rebuilt_meta_keeps_freshness_age_variance_and_head() {
        let t0 = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000);
        let mut head = ResponseHeader::build(203, None).expect("a head");
        head.insert_header("etag", "\"x\"").expect("a header");
        let mut m = CacheMeta::new(t0 + std::time::Duration::from_secs(60), t0, 7, 9, head);
        m.set_variance([3; 16]);
        m.set_epoch_override(t0 + std::time::Duration::from_secs(30));
        let r = Parsed::of(&m).meta();
        assert_eq!(r.fresh_until(), m.fresh_until());
        assert_eq!(r.created(), m.created());
        assert_eq!(r.epoch(), m.epoch());
        assert_eq!(r.fresh_sec(), 30);
        assert_eq!(r.stale_while_revalidate_sec(), 7);
        assert_eq!(r.stale_if_error_sec(), 9);
        assert_eq!(r.variance(), Some([3; 16]));
        assert_eq!(r.response_header().status.as_u16(), 203);
        assert_eq!(
            r.headers().get("etag").map(|v| v.as_bytes()),
            Some(&b"\"x\""[..])
        );
    }

    #[test]
    fn a_hit_seeks_within_the_body_and_refuses_past_it() {
        let mut h = Hit {
            body: Bytes::from_static(b"0123456789"),
            start: 0,
            end: 10,
            done: false,
            weight: 0,
        };
        assert!(h.seek(3, Some(6)).is_ok());
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        let got = rt.block_on(h.read_body()).ok().flatten();
        assert_eq!(got.as_deref(), Some(&b"345"[..]));
        assert!(rt.block_on(h.read_body()).ok().flatten().is_none());
        assert!(h.seek(10, None).is_err());
        assert!(h.seek(8, Some(100)).is_ok());
        let got = rt.block_on(h.read_body()).ok().flatten();
        assert_eq!(got.as_deref(), Some(&b"89"[..]));
    }
}
