//! The lane queue of one pool as a plain data structure: no clock, no
//! channels, no randomness of its own (the caller passes time and a random
//! draw), so every rule can be property-tested.
//!
//! Rules:
//! - `capacity` slots. Lane `l` may take a free slot unless it would eat
//!   into the unused reservation of a lane ranked above it: a lower lane can
//!   never use a higher lane's reserved slots, a higher lane may borrow any
//!   idle slot.
//! - Dequeue is strict priority between lanes; within a lane, fair shares
//!   between tenants (virtual token counters, `ultrafast_engine::fair`):
//!   the next slot goes to the backlogged tenant with the smallest
//!   counter, and among its requests by a key: arrival time plus
//!   `work * sjf_us_per_unit`, i.e. shortest work first with aging (a long
//!   request's key is fixed at arrival, so newer short ones stop
//!   overtaking it once their arrival time passes its key); FIFO when the
//!   work is unknown or `sjf_us_per_unit` is 0. One tenant alone is served
//!   in key order.
//! - Refusals at the door: lane queue full; pool-wide queue full (unless the
//!   lane may preempt, in which case the newest waiter of the lowest lower
//!   lane is evicted instead); above the high watermark, refused with a
//!   probability rising linearly to 1 at the bound; or an expected wait
//!   (work ahead / measured drain rate) beyond the lane's max wait.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use ultrafast_engine::fair::{Costs, Share, Tenant, Vtc};

/// Waiters of its own tenant an arrival counts one by one (see
/// [`LaneQueue::ahead_of_tenant`]).
const AHEAD_COUNTED: usize = 256;

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

pub use crate::config::spec::{LaneSpec, OnMiss};

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
    /// Prompt tokens, charged to its tenant when granted.
    prompt: usize,
    payload: T,
}

/// Who a request is for and what its grant charges.
#[derive(Debug, Clone)]
pub struct Who {
    /// Its tenant.
    pub tenant: Tenant,
    /// Its prompt tokens.
    pub prompt: usize,
}

impl Who {
    /// A request of the anonymous tenant (plain proxied requests).
    pub fn anonymous() -> Who {
        Who {
            tenant: Tenant::anonymous(),
            prompt: 0,
        }
    }
}

/// One lane's waiters.
#[derive(Debug)]
struct Lane<T> {
    /// Every waiter by (key, seq): the order eviction reads.
    order: BTreeMap<(u64, u64), (u64, u64)>,
    /// Per tenant: its waiters by (key, seq).
    by_tenant: HashMap<u64, BTreeMap<(u64, u64), Waiter<T>>>,
    /// The lane's virtual token counters.
    fair: Vtc,
}

impl<T> Lane<T> {
    fn new(costs: Costs) -> Self {
        Lane {
            order: BTreeMap::new(),
            by_tenant: HashMap::new(),
            fair: Vtc::new(costs),
        }
    }

    fn len(&self) -> usize {
        self.order.len()
    }

    fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    fn remove(&mut self, tenant: u64, at: (u64, u64)) -> Option<Waiter<T>> {
        self.order.remove(&at)?;
        let q = self.by_tenant.get_mut(&tenant)?;
        let w = q.remove(&at);
        if q.is_empty() {
            self.by_tenant.remove(&tenant);
        }
        w
    }

    /// The next waiter by fair share, out of the lane, charged to its
    /// tenant.
    fn pop(&mut self) -> Option<(u64, Waiter<T>)> {
        let tenant = self.fair.next()?;
        let at = *self.by_tenant.get(&tenant)?.keys().next()?;
        let w = self.remove(tenant, at)?;
        self.fair.start(tenant, w.prompt);
        Some((tenant, w))
    }
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
    /// Per lane, its waiters.
    waiting: Vec<Lane<T>>,
    /// id -> (lane, tenant, key, seq), for O(log n) removal.
    index: HashMap<u64, (usize, u64, u64, u64)>,
    seq: u64,
}

impl<T> LaneQueue<T> {
    /// A queue with `capacity` slots; `lanes` in any order.
    pub fn new(lanes: Vec<LaneSpec>, capacity: usize, max_queued: usize) -> Self {
        Self::with_costs(lanes, capacity, max_queued, Costs::default())
    }

    /// A queue whose fair shares charge `costs`.
    pub fn with_costs(
        mut lanes: Vec<LaneSpec>,
        capacity: usize,
        max_queued: usize,
        costs: Costs,
    ) -> Self {
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
            waiting: (0..n).map(|_| Lane::new(costs)).collect(),
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

    /// Up to `n` tenants of `lane`, served most first, with their counters.
    pub fn shares(&self, lane: usize, n: usize) -> Vec<Share> {
        self.waiting[lane].fair.top(n)
    }

    /// The virtual counter of `tenant` in `lane`.
    pub fn counter(&self, lane: usize, tenant: u64) -> Option<f64> {
        self.waiting[lane].fair.counter(tenant)
    }

    /// What `lane` charged since the last call (see
    /// `Vtc::drain_unsynced`).
    pub fn drain_unsynced(&mut self, lane: usize, max: usize) -> Vec<(u64, Arc<str>, f64)> {
        self.waiting[lane].fair.drain_unsynced(max)
    }

    /// Other instances charged `tenant` in `lane` by `amount`.
    pub fn absorb(&mut self, lane: usize, tenant: u64, amount: f64) {
        self.waiting[lane].fair.absorb(tenant, amount);
    }

    /// A granted request of `tenant` in `lane` produced `n` tokens.
    pub fn produced(&mut self, lane: usize, tenant: u64, n: usize) {
        self.waiting[lane].fair.produced(tenant, n);
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

    /// Requests waiting in `lane` and the lanes above it: all that would be
    /// served before a newcomer there.
    pub fn waiting_through(&self, lane: usize) -> usize {
        self.waiting[..=lane].iter().map(|w| w.len()).sum()
    }

    /// Requests served before one of `tenant` with `key` in `lane`, as
    /// fair shares serve a lane: higher lanes' waiters, then in its own
    /// lane its tenant's waiters before it, each of them after one request
    /// of every other backlogged tenant (round robin, the shape VTC takes
    /// between equal backlogged tenants), at most the whole lane. One
    /// tenant alone: its own waiters before it in key order. Its cost is
    /// bounded: past [`AHEAD_COUNTED`] of its own, the whole lane counts
    /// (an over-count, so the expected-wait refusal errs early, never late).
    pub fn ahead_of_tenant(&self, lane: usize, tenant: u64, key: u64) -> usize {
        let higher: usize = self.waiting[..lane].iter().map(|w| w.len()).sum();
        let own = &self.waiting[lane];
        let mine = own.by_tenant.get(&tenant).map_or(0, |q| {
            q.range(..(key, u64::MAX)).take(AHEAD_COUNTED).count()
        });
        let others = own.by_tenant.len() - usize::from(own.by_tenant.contains_key(&tenant));
        let turns = if mine == AHEAD_COUNTED {
            own.len()
        } else {
            mine * (others + 1) + others
        };
        higher + turns.min(own.len())
    }

    /// [`offer_as`](Self::offer_as) for the anonymous tenant (tests).
    #[cfg(test)]
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
        let who = Who::anonymous();
        self.offer_as(&who, id, lane, work, now_us, draw, drain_per_s, payload)
    }

    /// Offer request `id` of `who` to `lane`. `work` is its expected size
    /// if known, `now_us` the current time, `draw` a uniform random number
    /// in [0, 1), `drain_per_s` the measured completion rate if known. A
    /// grant (now or later) charges its prompt to its tenant; the slot's
    /// release names the tenant ([`release_for`](Self::release_for)).
    #[allow(clippy::too_many_arguments)]
    pub fn offer_as(
        &mut self,
        who: &Who,
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
            let fair = &mut self.waiting[lane].fair;
            fair.arrive(&who.tenant);
            fair.start(who.tenant.id, who.prompt);
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
        let ahead = self.ahead_of_tenant(lane, who.tenant.id, key);
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
                    .order
                    .iter()
                    .max_by_key(|(k, _)| k.1)
                    .map(|(_, w)| w.0)
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
        let (t, at) = (who.tenant.id, (key, self.seq));
        let w = &mut self.waiting[lane];
        w.order.insert(at, (id, t));
        let waiter = Waiter {
            id,
            prompt: who.prompt,
            payload,
        };
        w.by_tenant.entry(t).or_default().insert(at, waiter);
        w.fair.arrive(&who.tenant);
        self.index.insert(id, (lane, t, key, self.seq));
        match evicted {
            Some(evicted) => Offer::QueuedEvicting { ahead, evicted },
            None => Offer::Queued { ahead },
        }
    }

    /// Remove waiter `id` (gave up, disconnected, evicted). Returns its
    /// payload, or None if it is not waiting (already granted or gone).
    pub fn cancel(&mut self, id: u64) -> Option<T> {
        let (lane, tenant, key, seq) = self.index.remove(&id)?;
        let w = &mut self.waiting[lane];
        let waiter = w.remove(tenant, (key, seq))?;
        w.fair.withdraw(tenant);
        Some(waiter.payload)
    }

    /// [`release_for`](Self::release_for) the anonymous tenant (tests).
    #[cfg(test)]
    pub fn release(&mut self, lane: usize) -> Vec<(u64, usize, T)> {
        self.release_for(lane, Tenant::anonymous().id)
    }

    /// A slot of `lane` held for `tenant` was released. Returns the
    /// waiters granted a slot now (id, lane and payload), in grant order.
    pub fn release_for(&mut self, lane: usize, tenant: u64) -> Vec<(u64, usize, T)> {
        self.in_use = self.in_use.saturating_sub(1);
        self.in_use_lane[lane] = self.in_use_lane[lane].saturating_sub(1);
        self.waiting[lane].fair.finish(tenant);
        self.grant()
    }

    /// Give free slots to waiters, best lane first, inside a lane by fair
    /// share: (id, lane, payload).
    pub fn grant(&mut self) -> Vec<(u64, usize, T)> {
        let mut out = Vec::new();
        'outer: loop {
            for l in 0..self.lanes.len() {
                if self.waiting[l].is_empty() || !self.can_take(l) {
                    continue;
                }
                if let Some((_, w)) = self.waiting[l].pop() {
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
    use std::time::Duration;

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
    fn a_tenant_with_ten_times_the_queue_gets_no_more_slots_while_both_wait() {
        let mut ls = lanes();
        ls[0].queue_len = 100; // standard
        let mut q: LaneQueue<u64> = LaneQueue::new(ls, 1, 100);
        let s = q.lane("standard").unwrap();
        let (a, b) = (Tenant::named("a", 1.0), Tenant::named("b", 1.0));
        let who = |t: &Tenant| Who {
            tenant: t.clone(),
            prompt: 100,
        };
        assert_eq!(
            q.offer_as(&who(&a), 0, s, None, 0, 0.0, None, 0),
            Offer::Granted
        );
        for id in 1..=10 {
            q.offer_as(&who(&a), id, s, None, id, 0.0, None, id);
        }
        // Counted ahead: a's next waits for its ten; b's first for one of
        // a's (fair shares alternate), not for all ten.
        assert_eq!(q.ahead_of_tenant(s, a.id, 11), 10);
        assert_eq!(q.ahead_of_tenant(s, b.id, 11), 1);
        for id in 11..=12 {
            q.offer_as(&who(&b), id, s, None, id, 0.0, None, id);
        }
        // With b backlogged too, a's next waits for its ten and b's turns.
        assert_eq!(q.ahead_of_tenant(s, a.id, 13), 12);
        let mut holder = a.id;
        let mut order = Vec::new();
        for _ in 0..12 {
            let (id, _, p) = q.release_for(s, holder).pop().unwrap();
            q.produced(s, if id <= 10 { a.id } else { b.id }, 10);
            holder = if p <= 10 { a.id } else { b.id };
            order.push(id);
        }
        // b (lifted to a's counter on arrival) alternates with a: both of
        // its requests are among the first four grants, not the last two.
        let b_early = order[..4].iter().filter(|&&id| id > 10).count();
        assert_eq!(b_early, 2, "{order:?}");
        // a's own requests keep their order.
        let a_order: Vec<u64> = order.iter().copied().filter(|&id| id <= 10).collect();
        assert_eq!(a_order, (1..=10).collect::<Vec<_>>());
        assert!(q.counter(s, a.id) > q.counter(s, b.id));
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
        Arrive {
            ultra: bool,
            work: u64,
            draw: f64,
            tenant: usize,
        },
        Complete(usize),
        Cancel(usize),
        Tick(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (any::<bool>(), 0u64..5000, 0.0f64..1.0, 0usize..3).prop_map(|(ultra, work, draw, tenant)| Op::Arrive { ultra, work, draw, tenant }),
            3 => (0usize..64).prop_map(Op::Complete),
            1 => (0usize..64).prop_map(Op::Cancel),
            1 => (1u64..1_000_000).prop_map(Op::Tick),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

        /// Under any interleaving: nothing lost, nothing served twice, bounds
        /// hold, and grants follow lane priority, then inside a lane the
        /// tenant with the smallest counter, then key order among its own.
        #[test]
        fn queue_invariants(ops in proptest::collection::vec(op(), 1..200), capacity in 1usize..6, max_queued in 1usize..10) {
            let mut ls = lanes();
            ls[0].high_watermark = 0.75;
            let mut q: LaneQueue<u64> = LaneQueue::new(ls, capacity, max_queued);
            let lane_ids = [q.lane("ultra").unwrap(), q.lane("standard").unwrap()];
            let mut now = 0u64;
            let mut next = 0u64;
            let tenants: Vec<Tenant> = (0..3).map(|i| Tenant::named(&format!("t{i}"), 1.0 + i as f64)).collect();
            // id -> (lane, tenant)
            let mut in_flight: Map<u64, (usize, usize)> = Map::new();
            // id -> (lane, key, tenant)
            let mut waiting: Map<u64, (usize, u64, usize)> = Map::new();
            let mut done: HashSet<u64> = HashSet::new();
            // Counters as they were before each grant (a grant charges).
            let check_grants = |q: &LaneQueue<u64>, before: &[Vec<Option<f64>>], granted: Vec<(u64, usize, u64)>, waiting: &mut Map<u64, (usize, u64, usize)>, in_flight: &mut Map<u64, (usize, usize)>| -> Result<(), TestCaseError> {
                let _ = q;
                for (id, granted_lane, payload) in granted {
                    prop_assert_eq!(id, payload);
                    let (lane, key, t) = waiting.remove(&id).ok_or_else(|| TestCaseError::fail("granted a request that was not waiting"))?;
                    prop_assert_eq!(granted_lane, lane, "grant names the waiter's own lane");
                    for (_, (l, k, u)) in waiting.iter() {
                        prop_assert!(*l >= lane, "a higher lane was still waiting");
                        if *l == lane && *u == t { prop_assert!(*k >= key, "a tenant's own order broken"); }
                        if *l == lane && *u != t && before.len() == 1 {
                            prop_assert!(before[0][*u] >= before[0][t], "not the smallest counter");
                        }
                    }
                    prop_assert!(in_flight.insert(id, (lane, t)).is_none());
                }
                Ok(())
            };
            for op in ops {
                match op {
                    Op::Arrive { ultra, work, draw, tenant } => {
                        let lane = lane_ids[ultra as usize];
                        let id = next; next += 1;
                        let key = now + work * q.lanes()[lane].sjf_us_per_unit;
                        let who = Who { tenant: tenants[tenant].clone(), prompt: work as usize };
                        match q.offer_as(&who, id, lane, Some(work), now, draw, None, id) {
                            Offer::Granted => { in_flight.insert(id, (lane, tenant)); }
                            Offer::Queued { .. } => { waiting.insert(id, (lane, key, tenant)); }
                            Offer::QueuedEvicting { evicted, .. } => {
                                let (el, _, _) = waiting.remove(&evicted).ok_or_else(|| TestCaseError::fail("evicted a non-waiter"))?;
                                prop_assert!(el > lane, "evicted an equal or higher lane");
                                waiting.insert(id, (lane, key, tenant));
                            }
                            Offer::Refused(_) => {}
                        }
                    }
                    Op::Complete(k) => {
                        if let Some((&id, &(lane, t))) = in_flight.iter().nth(k % in_flight.len().max(1)) {
                            in_flight.remove(&id);
                            prop_assert!(done.insert(id), "served twice");
                            // Counters before the release's grants, when
                            // at most one grant can follow (one slot).
                            let before: Vec<Vec<Option<f64>>> = if capacity == 1 {
                                q.produced(lane, tenants[t].id, 3);
                                let l = waiting.values().map(|w| w.0).min().unwrap_or(lane);
                                vec![tenants.iter().map(|x| q.counter(l, x.id)).collect()]
                            } else {
                                Vec::new()
                            };
                            let g = q.release_for(lane, tenants[t].id);
                            check_grants(&q, &before, g, &mut waiting, &mut in_flight)?;
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
