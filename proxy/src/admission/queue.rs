//! The lane queue of one pool as a plain data structure: no clock, no
//! channels, no randomness of its own (the caller passes time and a random
//! draw), so every rule can be property-tested.
//!
//! Rules:
//! - `capacity` slots. Lane `l` may take a free slot unless it would eat
//!   into the unused reservation of a lane ranked above it: a lower lane can
//!   never use a higher lane's reserved slots, a higher lane may borrow any
//!   idle slot.
//! - Dequeue is strict priority between lanes; within a lane, ordered by a
//!   key: arrival time plus `work * sjf_us_per_unit`, i.e. shortest work first
//!   with aging (a long request's key is fixed at arrival, so newer short
//!   ones stop overtaking it once their arrival time passes its key); FIFO
//!   when the work is unknown or `sjf_us_per_unit` is 0.
//! - Refusals at the door: lane queue full; pool-wide queue full (unless the
//!   lane may preempt, in which case the newest waiter of the lowest lower
//!   lane is evicted instead); above the high watermark, refused with a
//!   probability rising linearly to 1 at the bound; or an expected wait
//!   (work ahead / measured drain rate) beyond the lane's max wait.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The client is over its rate limit.
    RateLimit,
    /// The lane's (or the pool's) queue is full.
    QueueFull,
    /// The request could not be served within its lane's max wait.
    MaxWait,
    /// Probabilistic early shedding above the high watermark.
    Watermark,
    /// Evicted from the queue by higher-priority work.
    Preempted,
    /// The predicted time to first token exceeds the lane's target.
    Slo,
    /// The client's token budget cannot cover the request now.
    TokenBudget,
    /// The shared limit store is unreachable and the limit fails closed.
    StoreDown,
}

impl Reason {
    /// The `x-ultrafast-shed` value and metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::RateLimit => "rate_limit",
            Reason::QueueFull => "queue_full",
            Reason::MaxWait => "max_wait",
            Reason::Watermark => "watermark",
            Reason::Preempted => "preempted",
            Reason::Slo => "slo",
            Reason::TokenBudget => "token_budget",
            Reason::StoreDown => "store_unavailable",
        }
    }
}

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

/// The outcome of offering a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Offer {
    /// A slot was taken at once.
    Granted,
    /// Queued with this many requests ahead of it.
    Queued {
        /// Requests that will be served before it (at this moment).
        ahead: usize,
    },
    /// Queued after evicting another waiter, whose payload is returned.
    QueuedEvicting {
        /// Requests ahead.
        ahead: usize,
        /// The evicted waiter's id.
        evicted: u64,
    },
    /// Refused.
    Refused(Reason),
}

#[derive(Debug)]
struct Waiter<T> {
    id: u64,
    payload: T,
}

/// A pool's lanes, slots and waiters.
#[derive(Debug)]
pub struct LaneQueue<T> {
    lanes: Vec<LaneSpec>,
    reserved: Vec<usize>,
    capacity: usize,
    max_queued: usize,
    in_use: usize,
    in_use_lane: Vec<usize>,
    /// Per lane: (key, seq) -> waiter.
    waiting: Vec<BTreeMap<(u64, u64), Waiter<T>>>,
    /// id -> (lane, key, seq), for O(log n) removal.
    index: HashMap<u64, (usize, u64, u64)>,
    seq: u64,
}

impl<T> LaneQueue<T> {
    /// A queue with `capacity` slots; `lanes` in any order.
    pub fn new(mut lanes: Vec<LaneSpec>, capacity: usize, max_queued: usize) -> Self {
        lanes.sort_by_key(|l| l.rank);
        let reserved = lanes
            .iter()
            .map(|l| ((l.reserved_share * capacity as f64).floor() as usize).min(capacity))
            .collect();
        let n = lanes.len();
        LaneQueue {
            lanes,
            reserved,
            capacity,
            max_queued,
            in_use: 0,
            in_use_lane: vec![0; n],
            waiting: (0..n).map(|_| BTreeMap::new()).collect(),
            index: HashMap::new(),
            seq: 0,
        }
    }

    /// Lane index by name.
    pub fn lane(&self, name: &str) -> Option<usize> {
        self.lanes.iter().position(|l| l.name == name)
    }

    /// The lanes, by rank.
    pub fn lanes(&self) -> &[LaneSpec] {
        &self.lanes
    }

    /// Slots in use.
    pub fn in_use(&self) -> usize {
        self.in_use
    }

    /// Slots in use by a lane.
    pub fn in_use_by(&self, lane: usize) -> usize {
        self.in_use_lane[lane]
    }

    /// Waiters in a lane.
    pub fn depth(&self, lane: usize) -> usize {
        self.waiting[lane].len()
    }

    /// Waiters in all lanes.
    pub fn queued(&self) -> usize {
        self.index.len()
    }

    /// Slots.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn can_take(&self, lane: usize) -> bool {
        if self.in_use >= self.capacity {
            return false;
        }
        let free = self.capacity - self.in_use;
        let protected: usize = (0..lane)
            .map(|m| self.reserved[m].saturating_sub(self.in_use_lane[m]))
            .sum();
        free > protected
    }

    fn take(&mut self, lane: usize) {
        self.in_use += 1;
        self.in_use_lane[lane] += 1;
    }

    /// Requests that would be served before one with `key` in `lane`.
    pub fn ahead_of(&self, lane: usize, key: u64) -> usize {
        let higher: usize = self.waiting[..lane].iter().map(|w| w.len()).sum();
        higher + self.waiting[lane].range(..(key, u64::MAX)).count()
    }

    /// Offer request `id` to `lane`. `work` is its expected size if known,
    /// `now_us` the current time, `draw` a uniform random number in [0, 1),
    /// `drain_per_s` the measured completion rate if known.
    #[allow(clippy::too_many_arguments)]
    pub fn offer(
        &mut self,
        id: u64,
        lane: usize,
        work: Option<u64>,
        now_us: u64,
        draw: f64,
        drain_per_s: Option<f64>,
        payload: T,
    ) -> Offer {
        if self.waiting[lane].is_empty() && self.can_take(lane) {
            self.take(lane);
            return Offer::Granted;
        }
        let spec = &self.lanes[lane];
        let depth = self.waiting[lane].len();
        if depth >= spec.queue_len {
            return Offer::Refused(Reason::QueueFull);
        }
        let mark = spec.high_watermark * spec.queue_len as f64;
        if spec.high_watermark < 1.0 && depth as f64 >= mark {
            let p = (depth as f64 - mark + 1.0) / (spec.queue_len as f64 - mark + 1.0);
            if draw < p {
                return Offer::Refused(Reason::Watermark);
            }
        }
        let key = now_us.saturating_add(work.unwrap_or(0).saturating_mul(spec.sjf_us_per_unit));
        let ahead = self.ahead_of(lane, key);
        if let Some(rate) = drain_per_s.filter(|r| *r > 0.0) {
            let expected = (ahead + 1) as f64 / rate;
            if expected > spec.max_wait.as_secs_f64() {
                return Offer::Refused(Reason::MaxWait);
            }
        }
        let mut evicted = None;
        if self.index.len() >= self.max_queued {
            if !spec.preempt {
                return Offer::Refused(Reason::QueueFull);
            }
            // Evict the newest waiter of the lowest lane ranked below us.
            let victim = (lane + 1..self.lanes.len()).rev().find_map(|l| {
                self.waiting[l]
                    .iter()
                    .max_by_key(|(k, _)| k.1)
                    .map(|(_, w)| w.id)
            });
            match victim {
                Some(v) => evicted = Some(v),
                None => return Offer::Refused(Reason::QueueFull),
            }
        }
        if let Some(v) = evicted {
            self.cancel(v);
        }
        self.seq += 1;
        self.waiting[lane].insert((key, self.seq), Waiter { id, payload });
        self.index.insert(id, (lane, key, self.seq));
        match evicted {
            Some(evicted) => Offer::QueuedEvicting { ahead, evicted },
            None => Offer::Queued { ahead },
        }
    }

    /// Remove waiter `id` (gave up, disconnected, evicted). Returns its
    /// payload, or None if it is not waiting (already granted or gone).
    pub fn cancel(&mut self, id: u64) -> Option<T> {
        let (lane, key, seq) = self.index.remove(&id)?;
        self.waiting[lane].remove(&(key, seq)).map(|w| w.payload)
    }

    /// A slot of `lane` was released. Returns the waiters granted a slot
    /// now (id, lane and payload), in grant order.
    pub fn release(&mut self, lane: usize) -> Vec<(u64, usize, T)> {
        self.in_use = self.in_use.saturating_sub(1);
        self.in_use_lane[lane] = self.in_use_lane[lane].saturating_sub(1);
        self.grant()
    }

    /// Give free slots to waiters, best lane first: (id, lane, payload).
    pub fn grant(&mut self) -> Vec<(u64, usize, T)> {
        let mut out = Vec::new();
        'outer: loop {
            for l in 0..self.lanes.len() {
                if self.waiting[l].is_empty() || !self.can_take(l) {
                    continue;
                }
                if let Some((_, w)) = self.waiting[l].pop_first() {
                    self.index.remove(&w.id);
                    self.take(l);
                    out.push((w.id, l, w.payload));
                    continue 'outer;
                }
            }
            return out;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn lanes() -> Vec<LaneSpec> {
        let l = |name: &str, rank, queue_len, reserved_share, preempt| LaneSpec {
            name: name.into(),
            rank,
            queue_len,
            max_wait: Duration::from_secs(10),
            reserved_share,
            preempt,
            high_watermark: 1.0,
            sjf_us_per_unit: 1000,
            ttft_slo: None,
            on_miss: OnMiss::Reject,
            on_forbidden: OnMiss::Reject,
        };
        vec![l("standard", 1, 4, 0.0, false), l("ultra", 0, 4, 0.5, true)]
    }

    #[test]
    fn reservation_keeps_slots_for_the_higher_lane() {
        let mut q = LaneQueue::new(lanes(), 4, 100);
        let (u, s) = (q.lane("ultra").unwrap(), q.lane("standard").unwrap());
        assert_eq!(q.offer(1, s, None, 0, 0.0, None, ()), Offer::Granted);
        assert_eq!(q.offer(2, s, None, 0, 0.0, None, ()), Offer::Granted);
        // Two slots remain, both reserved for ultra.
        assert!(matches!(
            q.offer(3, s, None, 0, 0.0, None, ()),
            Offer::Queued { .. }
        ));
        assert_eq!(q.offer(4, u, None, 0, 0.0, None, ()), Offer::Granted);
        assert_eq!(q.offer(5, u, None, 0, 0.0, None, ()), Offer::Granted);
        // Full: ultra now queues too, and is served before standard.
        assert!(matches!(
            q.offer(6, u, None, 0, 0.0, None, ()),
            Offer::Queued { ahead: 0 }
        ));
        let granted: Vec<u64> = q.release(s).into_iter().map(|(id, _, _)| id).collect();
        assert_eq!(granted, vec![6]);
    }

    #[test]
    fn shortest_first_with_aging() {
        let mut q = LaneQueue::new(lanes(), 1, 100);
        let s = q.lane("standard").unwrap();
        assert_eq!(q.offer(1, s, Some(1), 0, 0.0, None, ()), Offer::Granted);
        // Long job (1000 units = 1 s of aging) at t=0, short ones later.
        q.offer(2, s, Some(1000), 0, 0.0, None, ());
        q.offer(3, s, Some(10), 100_000, 0.0, None, ());
        q.offer(4, s, Some(10), 2_000_000, 0.0, None, ());
        let order: Vec<u64> = (0..3).map(|_| q.release(s)[0].0).collect();
        // 3 (key 0.11 s) beats the long one (key 1 s); 4 (key 2.01 s) does not.
        assert_eq!(order, vec![3, 2, 4]);
    }

    #[test]
    fn refusals() {
        let mut ls = lanes();
        ls[0].high_watermark = 0.5; // standard: shed from depth 2 of 4
        let mut q = LaneQueue::new(ls, 1, 5);
        let (u, s) = (q.lane("ultra").unwrap(), q.lane("standard").unwrap());
        assert_eq!(q.offer(1, u, None, 0, 0.0, None, ()), Offer::Granted);
        q.offer(2, s, None, 0, 0.99, None, ());
        q.offer(3, s, None, 0, 0.99, None, ());
        // depth 2 >= 2: p = 1/3; a draw of 0.1 sheds, 0.9 passes.
        assert_eq!(
            q.offer(4, s, None, 0, 0.1, None, ()),
            Offer::Refused(Reason::Watermark)
        );
        assert!(matches!(
            q.offer(5, s, None, 0, 0.9, None, ()),
            Offer::Queued { .. }
        ));
        // Drain of 1/s with 3 ahead: 4 s > 10 s? no; make max_wait bite:
        assert_eq!(
            q.offer(6, s, None, 0, 0.99, Some(0.1), ()),
            Offer::Refused(Reason::MaxWait)
        );
        q.offer(7, s, None, 0, 0.99, None, ());
        assert_eq!(
            q.offer(8, s, None, 0, 0.99, None, ()),
            Offer::Refused(Reason::QueueFull)
        );
        // Pool queue (5) not yet full: 4 standard waiting; ultra queues once more...
        assert!(matches!(
            q.offer(9, u, None, 0, 0.0, None, ()),
            Offer::Queued { .. }
        ));
        // ...and then preempts the newest standard waiter.
        assert_eq!(
            q.offer(10, u, None, 0, 0.0, None, ()),
            Offer::QueuedEvicting {
                ahead: 1,
                evicted: 7
            }
        );
        assert!(q.cancel(7).is_none());
    }
}

#[cfg(test)]
mod props {
    use super::tests::lanes;
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap as Map, HashSet};

    #[derive(Debug, Clone)]
    enum Op {
        Arrive { ultra: bool, work: u64, draw: f64 },
        Complete(usize),
        Cancel(usize),
        Tick(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (any::<bool>(), 0u64..5000, 0.0f64..1.0).prop_map(|(ultra, work, draw)| Op::Arrive { ultra, work, draw }),
            3 => (0usize..64).prop_map(Op::Complete),
            1 => (0usize..64).prop_map(Op::Cancel),
            1 => (1u64..1_000_000).prop_map(Op::Tick),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

        /// Under any interleaving: nothing lost, nothing served twice, bounds
        /// hold, and grants follow lane priority then key order.
        #[test]
        fn queue_invariants(ops in proptest::collection::vec(op(), 1..200), capacity in 1usize..6, max_queued in 1usize..10) {
            let mut ls = lanes();
            ls[0].high_watermark = 0.75;
            let mut q: LaneQueue<()> = LaneQueue::new(ls, capacity, max_queued);
            let lane_ids = [q.lane("ultra").unwrap(), q.lane("standard").unwrap()];
            let mut now = 0u64;
            let mut next = 0u64;
            let mut in_flight: Map<u64, usize> = Map::new();
            let mut waiting: Map<u64, (usize, u64)> = Map::new();
            let mut done: HashSet<u64> = HashSet::new();
            let check_grants = |granted: Vec<(u64, usize, ())>, waiting: &mut Map<u64, (usize, u64)>, in_flight: &mut Map<u64, usize>| -> Result<(), TestCaseError> {
                for (id, granted_lane, ()) in granted {
                    let (lane, key) = waiting.remove(&id).ok_or_else(|| TestCaseError::fail("granted a request that was not waiting"))?;
                    prop_assert_eq!(granted_lane, lane, "grant names the waiter's own lane");
                    for (_, (l, k)) in waiting.iter() {
                        prop_assert!(*l >= lane, "a higher lane was still waiting");
                        if *l == lane { prop_assert!(*k >= key, "lane order broken"); }
                    }
                    prop_assert!(in_flight.insert(id, lane).is_none());
                }
                Ok(())
            };
            for op in ops {
                match op {
                    Op::Arrive { ultra, work, draw } => {
                        let lane = lane_ids[ultra as usize];
                        let id = next; next += 1;
                        let key = now + work * q.lanes()[lane].sjf_us_per_unit;
                        match q.offer(id, lane, Some(work), now, draw, None, ()) {
                            Offer::Granted => { in_flight.insert(id, lane); }
                            Offer::Queued { .. } => { waiting.insert(id, (lane, key)); }
                            Offer::QueuedEvicting { evicted, .. } => {
                                let (el, _) = waiting.remove(&evicted).ok_or_else(|| TestCaseError::fail("evicted a non-waiter"))?;
                                prop_assert!(el > lane, "evicted an equal or higher lane");
                                waiting.insert(id, (lane, key));
                            }
                            Offer::Refused(_) => {}
                        }
                    }
                    Op::Complete(k) => {
                        if let Some((&id, &lane)) = in_flight.iter().nth(k % in_flight.len().max(1)) {
                            in_flight.remove(&id);
                            prop_assert!(done.insert(id), "served twice");
                            let g = q.release(lane);
                            check_grants(g, &mut waiting, &mut in_flight)?;
                        }
                    }
                    Op::Cancel(k) => {
                        if let Some(&id) = waiting.keys().nth(k % waiting.len().max(1)) {
                            prop_assert!(q.cancel(id).is_some());
                            waiting.remove(&id);
                        }
                    }
                    Op::Tick(d) => now += d,
                }
                prop_assert_eq!(q.in_use(), in_flight.len());
                prop_assert!(q.in_use() <= capacity);
                prop_assert_eq!(q.queued(), waiting.len());
                prop_assert!(q.queued() <= max_queued);
                for (l, spec) in q.lanes().iter().enumerate() {
                    prop_assert!(q.depth(l) <= spec.queue_len);
                }
                // Nobody waits while their lane could take a free slot.
                if !waiting.is_empty() {
                    prop_assert!(q.grant().is_empty(), "a waiter could have been served");
                }
            }
        }
    }
}
