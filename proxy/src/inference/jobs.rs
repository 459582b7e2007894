//! Async mode: `202 Accepted` now, events later.
//!
//! Each job keeps the SSE payloads of its chunks (so `Last-Event-ID` can
//! resume exactly where a client left off), its status and, when finished,
//! the whole result. The store is bounded in entries and bytes: finished
//! jobs expire after the TTL and the oldest finished ones are evicted first
//! when room is needed; when only running jobs remain, new async requests
//! are refused (503) rather than growing without bound.
//!
//! Every byte kept counts: events, and the result or error of a finished
//! job, kept as compact JSON text (a `Value` tree is several times its
//! text). Each owner (API key) has a share of the bounds, its fair part
//! among the owners holding entries: room is made from the asking owner's
//! own finished jobs, or from an owner holding more than its share, never
//! from another owner's results within its share, so one tenant cannot
//! evict another's unread results by flooding the store.

use parking_lot::Mutex;
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Where a job is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Waiting for admission or the backend.
    Queued,
    /// Generating.
    InProgress,
    /// Finished with a result.
    Completed,
    /// Finished with an error.
    Failed,
    /// Cancelled by `DELETE`.
    Cancelled,
}

impl Status {
    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Queued => "queued",
            Status::InProgress => "in_progress",
            Status::Completed => "completed",
            Status::Failed => "failed",
            Status::Cancelled => "cancelled",
        }
    }

    /// Whether the job is over.
    pub fn finished(self) -> bool {
        matches!(self, Status::Completed | Status::Failed | Status::Cancelled)
    }
}

struct Inner {
    status: Status,
    events: Vec<String>,
    /// The result and the error as compact JSON text.
    result: Option<String>,
    error: Option<String>,
    finished_at: Option<Instant>,
    /// Bytes of `events`, `result` and `error` counted in the store;
    /// changed only under this lock, together with the store's and the
    /// owner's totals, so they never disagree.
    bytes: usize,
    /// Taken out of the store (evicted, expired or replaced): nothing more
    /// is counted for it.
    removed: bool,
    /// Failed for want of room: its error is `store_full()`.
    full: bool,
}

/// One async request.
pub struct Job {
    /// Request id.
    pub id: String,
    /// The tenant (API key name) that created it; only it may read it.
    pub owner: Option<String>,
    /// Unix seconds at creation.
    pub created: u64,
    inner: Mutex<Inner>,
    /// Number of events so far (bumped on every change).
    changed: watch::Sender<usize>,
    cancel: watch::Sender<bool>,
    store: std::sync::Weak<Shared>,
    mirrored: std::sync::atomic::AtomicBool,
    /// What its owner holds, all its jobs together.
    usage: Arc<Usage>,
}

/// What one owner holds in the store.
#[derive(Debug, Default)]
struct Usage {
    bytes: AtomicUsize,
    entries: AtomicUsize,
}

impl Job {
    /// Status now.
    pub fn status(&self) -> Status {
        self.inner.lock().status
    }

    /// Mark as generating.
    pub fn start(&self) {
        let mut g = self.inner.lock();
        if g.status == Status::Queued {
            g.status = Status::InProgress;
            // Under the lock: a cancel cannot be written before it.
            self.mirror(|c, ttl| c.job_started(&self.id, ttl));
        }
    }

    /// With `[cluster]`, hand a change to the store's writer (the TTL is
    /// this store's, read now so a reload's applies).
    fn mirror(&self, f: impl FnOnce(&crate::cluster::Cluster, Duration)) {
        if !self.mirrored.load(Ordering::Relaxed) {
            return;
        }
        if let (Some(c), Some(st)) = (crate::cluster::get(), self.store.upgrade()) {
            f(c, st.ttl());
        }
    }

    /// With `[cluster]`: whether the store took the job's creation; when
    /// it did not, nothing more of it is mirrored (it stays this
    /// instance's).
    pub fn set_mirrored(&self, yes: bool) {
        self.mirrored.store(yes, Ordering::Relaxed);
    }

    /// Append one event payload; false when the store has no room left
    /// (the job is then failed).
    pub fn push(&self, payload: String) -> bool {
        let n = payload.len();
        let Some(st) = self.store.upgrade() else {
            return false;
        };
        st.make_room(&self.owner, n);
        let len = {
            let mut g = self.inner.lock();
            if g.status.finished() || g.removed {
                return false;
            }
            if !st.take(&self.usage, n) {
                drop(g);
                self.finish(Status::Failed, None, Some(store_full()));
                return false;
            }
            g.bytes += n;
            // Under the lock, so the store sees the events in their order.
            let index = g.events.len();
            self.mirror(|c, ttl| c.job_event(&self.id, index, &payload, ttl));
            g.events.push(payload);
            g.events.len()
        };
        self.changed.send_replace(len);
        true
    }

    /// End the job (the first call wins).
    pub fn finish(&self, status: Status, result: Option<Value>, error: Option<Value>) {
        let text = |v: &Option<Value>| v.as_ref().map(Value::to_string);
        let (mut result_text, mut error_text) = (text(&result), text(&error));
        let n = result_text.as_ref().map_or(0, String::len)
            + error_text.as_ref().map_or(0, String::len);
        let st = self.store.upgrade();
        if let Some(st) = &st {
            st.make_room(&self.owner, n);
        }
        let (mut status, mut result, mut error) = (status, result, error);
        let len = {
            let mut g = self.inner.lock();
            if g.status.finished() {
                return;
            }
            if let Some(st) = st.as_ref().filter(|_| !g.removed) {
                if !st.take(&self.usage, n) {
                    // The result does not fit: the job fails, its error
                    // (`store_full`) shown by `view` and kept as a flag, so
                    // the bound holds to the byte.
                    (status, result, error) = (Status::Failed, None, Some(store_full()));
                    (result_text, error_text) = (None, None);
                    g.full = true;
                } else {
                    g.bytes += n;
                }
            }
            g.status = status;
            g.finished_at = Some(Instant::now());
            let n = g.events.len();
            self.mirror(|c, ttl| {
                c.job_finished(
                    &self.id,
                    status.as_str(),
                    result.as_ref(),
                    error.as_ref(),
                    n,
                    ttl,
                )
            });
            g.result = result_text;
            g.error = error_text;
            g.events.len()
        };
        self.changed.send_replace(len);
    }

    /// Ask the runner to stop.
    pub fn cancel(&self) {
        self.cancel.send_replace(true);
        self.finish(Status::Cancelled, None, None);
    }

    /// Resolves when the job is cancelled.
    pub fn cancelled(&self) -> watch::Receiver<bool> {
        self.cancel.subscribe()
    }

    /// Events from index `from`, and whether the job is finished.
    pub fn events_from(&self, from: usize) -> (Vec<(usize, String)>, bool) {
        let g = self.inner.lock();
        let evs = g
            .events
            .iter()
            .enumerate()
            .skip(from)
            .map(|(i, e)| (i, e.clone()))
            .collect();
        (evs, g.status.finished())
    }

    /// Wakes on every new event or status change.
    pub fn subscribe(&self) -> watch::Receiver<usize> {
        self.changed.subscribe()
    }

    /// `GET /v1/requests/{id}`.
    pub fn view(&self) -> Value {
        let g = self.inner.lock();
        let mut v = serde_json::json!({"id": self.id, "object": "request", "created": self.created,
            "status": g.status.as_str(), "events": g.events.len()});
        let parse = |t: &str| serde_json::from_str(t).unwrap_or(Value::Null);
        if let Some(r) = &g.result {
            v["result"] = parse(r);
        }
        if let Some(e) = &g.error {
            v["error"] = parse(e);
        } else if g.full {
            v["error"] = store_full();
        }
        v
    }
}

/// The error of a job the store had no room for.
fn store_full() -> Value {
    serde_json::json!({"message": "the async result store is full", "type": "server_error", "code": "async_store_full"})
}

impl Shared {
    fn usage(&self) -> (usize, usize) {
        (self.jobs.lock().0.len(), self.bytes.load(Ordering::Relaxed))
    }

    fn remove(&self, map: &mut HashMap<String, Arc<Job>>, id: &str) {
        if let Some(j) = map.remove(id) {
            j.mirror(|c, _| c.job_removed(id));
            let mut g = j.inner.lock();
            self.bytes.fetch_sub(g.bytes, Ordering::Relaxed);
            j.usage.bytes.fetch_sub(g.bytes, Ordering::Relaxed);
            j.usage.entries.fetch_sub(1, Ordering::Relaxed);
            g.bytes = 0;
            g.removed = true;
            drop(g);
            let mut owners = self.owners.lock();
            if j.usage.entries.load(Ordering::Relaxed) == 0 {
                owners.remove(&j.owner);
            }
        }
    }

    /// Count `n` more bytes of the owner `usage`, if the bound has room
    /// (atomically: two jobs taking room at once never overshoot it).
    fn take(&self, usage: &Usage, n: usize) -> bool {
        let max = self.max_bytes();
        let room = self
            .bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                (b + n <= max).then_some(b + n)
            });
        if room.is_ok() {
            usage.bytes.fetch_add(n, Ordering::Relaxed);
        }
        room.is_ok()
    }

    /// When `n` more bytes would pass the bound, make room for `owner`.
    fn make_room(&self, owner: &Option<String>, n: usize) {
        if self.bytes.load(Ordering::Relaxed) + n > self.max_bytes() {
            let mut g = self.jobs.lock();
            self.evict(&mut g, self.max_entries(), n, owner);
        }
    }

    /// Whether `j`'s finished entry may go to make room for `asking`: its
    /// own, or an owner's holding more than its share of either bound.
    fn evictable(&self, j: &Job, asking: &Option<String>) -> bool {
        if &j.owner == asking {
            return true;
        }
        let owners = self.owners.lock().len().max(1);
        j.usage.bytes.load(Ordering::Relaxed) > self.max_bytes() / owners
            || j.usage.entries.load(Ordering::Relaxed) > self.max_entries() / owners
    }

    /// Drop expired jobs, then the oldest finished ones that may go for
    /// `asking` (`evictable`) while over `keep_entries` entries or over the
    /// byte bound with `need_bytes` more.
    fn evict(&self, g: &mut Jobs, keep_entries: usize, need_bytes: usize, asking: &Option<String>) {
        let now = Instant::now();
        let (map, order) = g;
        let expired: Vec<String> = order
            .iter()
            .filter(|id| {
                map.get(*id).is_none_or(|j| {
                    j.inner
                        .lock()
                        .finished_at
                        .is_some_and(|t| now.duration_since(t) >= self.ttl())
                })
            })
            .cloned()
            .collect();
        for id in &expired {
            self.remove(map, id);
        }
        order.retain(|id| map.contains_key(id));
        while map.len() > keep_entries
            || self.bytes.load(Ordering::Relaxed) + need_bytes > self.max_bytes()
        {
            let Some(pos) = order.iter().position(|id| {
                map.get(id)
                    .is_some_and(|j| j.status().finished() && self.evictable(j, asking))
            }) else {
                break;
            };
            if let Some(id) = order.remove(pos) {
                self.remove(map, &id);
            }
        }
    }
}

pub use crate::reqid::random_id;

/// Why a job could not be created.
#[derive(Debug, PartialEq, Eq)]
pub struct Full;

/// The bounded job store.
pub struct Store(Arc<Shared>);

type Jobs = (HashMap<String, Arc<Job>>, VecDeque<String>);

/// The store's state, shared with its jobs (which make room on push).
pub struct Shared {
    jobs: Mutex<Jobs>,
    /// What each owner holds; changed only under `jobs`' lock.
    owners: Mutex<HashMap<Option<String>, Arc<Usage>>>,
    bytes: Arc<AtomicUsize>,
    max_entries: AtomicUsize,
    max_bytes: AtomicUsize,
    ttl_ms: std::sync::atomic::AtomicU64,
}

impl Shared {
    fn max_entries(&self) -> usize {
        self.max_entries.load(Ordering::Relaxed)
    }

    fn max_bytes(&self) -> usize {
        self.max_bytes.load(Ordering::Relaxed)
    }

    fn ttl(&self) -> Duration {
        Duration::from_millis(self.ttl_ms.load(Ordering::Relaxed))
    }
}

impl Store {
    /// How long finished jobs are kept.
    pub fn ttl(&self) -> Duration {
        self.0.ttl()
    }

    /// Entries and bytes held.
    pub fn usage(&self) -> (usize, usize) {
        self.0.usage()
    }

    /// A store with these bounds.
    pub fn new(max_entries: usize, max_bytes: usize, ttl: Duration) -> Self {
        Store(Arc::new(Shared {
            jobs: Mutex::new((HashMap::new(), VecDeque::new())),
            owners: Mutex::new(HashMap::new()),
            bytes: Arc::new(AtomicUsize::new(0)),
            max_entries: AtomicUsize::new(max_entries.max(1)),
            max_bytes: AtomicUsize::new(max_bytes),
            ttl_ms: std::sync::atomic::AtomicU64::new(ttl.as_millis() as u64),
        }))
    }

    /// New bounds (a reload of `[inference]`); they apply from the next
    /// request on, and the entries held beyond them go as they finish.
    pub fn set_limits(&self, max_entries: usize, max_bytes: usize, ttl: Duration) {
        let s = &self.0;
        s.max_entries.store(max_entries.max(1), Ordering::Relaxed);
        s.max_bytes.store(max_bytes, Ordering::Relaxed);
        s.ttl_ms.store(ttl.as_millis() as u64, Ordering::Relaxed);
    }

    /// A new queued job, or `Full` when only unfinished jobs fill the store.
    pub fn create(&self, id: String) -> Result<Arc<Job>, Full> {
        self.create_for(id, None)
    }

    /// A new queued job of `owner`.
    pub fn create_for(&self, id: String, owner: Option<String>) -> Result<Arc<Job>, Full> {
        let st = &self.0;
        let mut g = st.jobs.lock();
        // Ids are random, but a reused one replaces its entry exactly: its
        // bytes leave the total and its place in the order goes.
        if g.0.contains_key(&id) {
            st.remove(&mut g.0, &id);
            g.1.retain(|x| x != &id);
        }
        st.evict(&mut g, st.max_entries() - 1, 1, &owner);
        if g.0.len() >= st.max_entries() || st.bytes.load(Ordering::Relaxed) >= st.max_bytes() {
            return Err(Full);
        }
        let usage = st.owners.lock().entry(owner.clone()).or_default().clone();
        usage.entries.fetch_add(1, Ordering::Relaxed);
        let job = Arc::new(Job {
            id: id.clone(),
            owner,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            inner: Mutex::new(Inner {
                status: Status::Queued,
                events: Vec::new(),
                result: None,
                error: None,
                finished_at: None,
                bytes: 0,
                removed: false,
                full: false,
            }),
            changed: watch::Sender::new(0),
            cancel: watch::Sender::new(false),
            store: Arc::downgrade(&self.0),
            mirrored: std::sync::atomic::AtomicBool::new(true),
            usage,
        });
        g.0.insert(id.clone(), job.clone());
        g.1.push_back(id);
        Ok(job)
    }

    /// A job by id (expired ones are gone).
    pub fn get(&self, id: &str) -> Option<Arc<Job>> {
        let st = &self.0;
        let mut g = st.jobs.lock();
        let j = g.0.get(id)?.clone();
        let expired = j
            .inner
            .lock()
            .finished_at
            .is_some_and(|t| t.elapsed() >= st.ttl());
        if expired {
            st.remove(&mut g.0, id);
            return None;
        }
        Some(j)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_in_entries_evicting_oldest_finished_first() {
        let s = Store::new(2, 1 << 20, Duration::from_secs(60));
        let a = s.create("a".into()).unwrap();
        let _b = s.create("b".into()).unwrap();
        assert_eq!(
            s.create("c".into()).err(),
            Some(Full),
            "two running jobs fill it"
        );
        a.finish(Status::Completed, None, None);
        assert!(s.create("c".into()).is_ok(), "finished a is evicted");
        assert!(s.get("a").is_none());
        assert!(s.get("b").is_some());
    }

    #[test]
    fn bounded_in_bytes() {
        let s = Store::new(10, 100, Duration::from_secs(60));
        let a = s.create("a".into()).unwrap();
        assert!(a.push("x".repeat(60)));
        assert!(!a.push("y".repeat(60)), "over the byte bound");
        assert_eq!(a.status(), Status::Failed);
        let b = s.create("b".into()).unwrap();
        assert!(b.push("z".repeat(70)), "the failed, finished a makes room");
        assert!(s.get("a").is_none());
        assert_eq!(s.usage(), (1, 70));
        assert!(
            !b.push("w".repeat(40)),
            "only running b is left: over the bound"
        );
    }

    #[test]
    fn expires_after_ttl_and_resumes_from_an_index() {
        let s = Store::new(10, 1 << 20, Duration::from_millis(30));
        let a = s.create("a".into()).unwrap();
        for i in 0..5 {
            assert!(a.push(format!("e{i}")));
        }
        let (evs, done) = a.events_from(3);
        assert_eq!(evs, vec![(3, "e3".to_string()), (4, "e4".to_string())]);
        assert!(!done);
        a.finish(Status::Completed, None, None);
        std::thread::sleep(Duration::from_millis(40));
        assert!(s.get("a").is_none());
    }

    #[test]
    fn results_count_as_compact_json_and_a_result_that_does_not_fit_fails_the_job() {
        let s = Store::new(10, 200, Duration::from_secs(60));
        let a = s.create("a".into()).unwrap();
        assert!(a.push("x".repeat(50)));
        let result = serde_json::json!({"metadata": {"k": "v".repeat(40)}});
        let text = result.to_string();
        a.finish(Status::Completed, Some(result), None);
        assert_eq!(s.usage(), (1, 50 + text.len()));
        assert_eq!(a.view()["result"]["metadata"]["k"], "v".repeat(40));
        let b = s.create_for("b".into(), None).unwrap();
        // a's result is b's owner's (None) own: it goes first.
        b.finish(
            Status::Completed,
            Some(serde_json::json!({"r": "y".repeat(300)})),
            None,
        );
        assert_eq!(b.status(), Status::Failed, "300 bytes never fit in 200");
        assert_eq!(b.view()["error"]["code"], "async_store_full");
        assert_eq!(s.usage(), (1, 0), "a made room, b kept nothing");
    }

    #[test]
    fn one_owner_cannot_evict_anothers_results_within_its_share() {
        let s = Store::new(8, 1000, Duration::from_secs(60));
        let own = |x: &str| Some(x.to_string());
        // The victim's two unread results: 2 of 8 entries, 200 of 1000 bytes.
        for id in ["v1", "v2"] {
            let j = s.create_for(id.into(), own("victim")).unwrap();
            j.finish(
                Status::Completed,
                Some(serde_json::json!({"r": "v".repeat(90)})),
                None,
            );
        }
        // The flood: entries and bytes, over and over.
        for i in 0..100 {
            let Ok(j) = s.create_for(format!("f{i}"), own("flood")) else {
                continue;
            };
            j.push("f".repeat(100));
            j.finish(
                Status::Completed,
                Some(serde_json::json!({"r": "f".repeat(90)})),
                None,
            );
        }
        assert!(
            s.get("v1").is_some() && s.get("v2").is_some(),
            "the victim's results stay"
        );
        assert!(s.get("f99").is_some(), "the flood makes room from its own");
        let (entries, bytes) = s.usage();
        assert!(entries <= 8 && bytes <= 1000, "{entries} {bytes}");
        // Over its share, the flood's results do go for another owner.
        let c = s.create_for("c".into(), own("third")).unwrap();
        assert!(c.push("c".repeat(150)));
        assert!(s.get("v1").is_some() && s.get("v2").is_some());
    }

    #[test]
    fn a_replaced_id_leaves_no_bytes_behind() {
        let s = Store::new(10, 100, Duration::from_secs(60));
        let a = s.create("a".into()).unwrap();
        assert!(a.push("x".repeat(60)));
        let a2 = s.create("a".into()).unwrap();
        assert!(!a.push("y".into()), "the replaced job counts nothing more");
        assert_eq!(s.usage(), (1, 0));
        assert!(a2.push("z".repeat(100)), "the whole bound is free again");
    }
}

#[cfg(test)]
mod props {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Create(u8),
        Push(u8, usize),
        Finish(u8),
        Cancel(u8),
        Get(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            2 => (0u8..12).prop_map(Op::Create),
            4 => (0u8..12, 1usize..40).prop_map(|(i, n)| Op::Push(i, n)),
            1 => (0u8..12).prop_map(Op::Finish),
            1 => (0u8..12).prop_map(Op::Cancel),
            1 => (0u8..12).prop_map(Op::Get),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

        /// The store's byte total is always exactly the bytes of the events
        /// its entries hold, whatever was replaced, evicted or expired, and
        /// the bounds hold.
        #[test]
        fn byte_accounting_is_exact(ops in proptest::collection::vec(op(), 1..120), expire in any::<bool>()) {
            let ttl = if expire { Duration::ZERO } else { Duration::from_secs(3600) };
            let s = Store::new(5, 200, ttl);
            let mut jobs: HashMap<u8, Arc<Job>> = HashMap::new();
            for op in ops {
                match op {
                    // Small ids on purpose: replacements happen often.
                    Op::Create(i) => {
                        if let Ok(j) = s.create(format!("j{}", i % 6)) {
                            jobs.insert(i % 6, j);
                        }
                    }
                    Op::Push(i, n) => {
                        if let Some(j) = jobs.get(&(i % 6)) {
                            j.push("p".repeat(n));
                        }
                    }
                    Op::Finish(i) => {
                        if let Some(j) = jobs.get(&(i % 6)) {
                            j.finish(Status::Completed, Some(serde_json::json!({"n": "r".repeat(i as usize * 5)})), None);
                        }
                    }
                    Op::Cancel(i) => {
                        if let Some(j) = jobs.get(&(i % 6)) {
                            j.cancel();
                        }
                    }
                    Op::Get(i) => {
                        let _ = s.get(&format!("j{}", i % 6));
                    }
                }
                let g = s.0.jobs.lock();
                let held: usize = g.0.values().map(|j| {
                    let i = j.inner.lock();
                    i.events.iter().map(String::len).sum::<usize>()
                        + i.result.as_ref().map_or(0, String::len)
                        + i.error.as_ref().map_or(0, String::len)
                }).sum();
                prop_assert_eq!(s.0.bytes.load(Ordering::Relaxed), held);
                prop_assert!(held <= 200);
                prop_assert!(g.0.len() <= 5);
                let mut order: Vec<&String> = g.1.iter().collect();
                order.sort();
                order.dedup();
                prop_assert_eq!(order.len(), g.1.len(), "an id twice in the order");
                // Ids taken out by a read are dropped from the order later;
                // every entry is in it.
                prop_assert!(g.0.keys().all(|id| g.1.contains(id)));
            }
        }
    }
}
