//! The async side of a pool's lane queue: requests wait here for a slot.
//!
//! One short `parking_lot` lock guards the `LaneQueue`; waiting happens on a
//! oneshot channel outside it. A grant sends the `Permit` itself through the
//! channel, so a slot is owned by a value at every instant: a waiter whose
//! future is dropped after the grant but before it polls drops the channel,
//! the channel drops the permit, and the permit frees the slot. A waiter
//! leaves on grant, on max wait, on eviction (its sender is dropped) or when
//! its client disconnects; a guard removes it from the queue however its
//! future ends, so a dropped request never leaves a ghost behind. The drain
//! rate (completions per second while requests are queued) feeds the
//! expected-wait refusal and `Retry-After`.

use super::queue::{LaneQueue, LaneSpec, Offer, Reason, Who};
use crate::hash::mix64;
use parking_lot::Mutex;
use prometheus::{Histogram, IntCounter, IntGauge};
use std::future::Future;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use ultrafast_engine::fair::{Costs, Share};

/// Output tokens a permit counts before charging them to its tenant (one
/// lock per this many tokens; the counters lag by at most this many).
const CHARGE_EVERY: u32 = 8;

/// Metric handles of one gate, one entry per lane (by rank).
#[derive(Clone)]
pub struct GateMetrics {
    /// Queue depth per lane.
    pub depth: Vec<IntGauge>,
    /// Queue wait per lane.
    pub wait: Vec<Histogram>,
    /// Admitted per lane.
    pub admitted: Vec<IntCounter>,
    /// Slots in use.
    pub in_use: IntGauge,
}

struct Inner {
    /// Each waiter's channel and tenant.
    q: LaneQueue<(oneshot::Sender<Permit>, u64)>,
    last_release: Option<Instant>,
    avg_gap_s: f64,
}

/// A pool's admission gate.
pub struct Gate {
    inner: Mutex<Inner>,
    ids: AtomicU64,
    rng: AtomicU64,
    epoch: Instant,
    metrics: GateMetrics,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Gate")
    }
}

/// Why a request did not get a slot.
#[derive(Debug, Clone, PartialEq)]
pub enum Denied {
    /// Refused, with an estimate of when to retry.
    Shed(Reason, Duration),
    /// The client went away while waiting.
    Gone,
}

/// A held slot; released on drop.
pub struct Permit {
    gate: Arc<Gate>,
    lane: usize,
    /// The tenant it was granted to.
    tenant: u64,
    /// Output tokens not yet charged to the tenant.
    pending: AtomicU32,
}

impl Permit {
    fn new(gate: Arc<Gate>, lane: usize, tenant: u64) -> Self {
        Permit {
            gate,
            lane,
            tenant,
            pending: AtomicU32::new(0),
        }
    }

    /// The request produced an output token: charged to its tenant's
    /// counter (in batches of [`CHARGE_EVERY`]).
    pub fn produced(&self) {
        let n = self.pending.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= CHARGE_EVERY {
            self.flush();
        }
    }

    fn flush(&self) {
        let n = self.pending.swap(0, Ordering::Relaxed);
        if n > 0 {
            let mut g = self.gate.inner.lock();
            g.q.produced(self.lane, self.tenant, n as usize);
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.flush();
        let gate = self.gate.clone();
        gate.release(self.lane, self.tenant);
    }
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Permit(lane {})", self.lane)
    }
}

struct CancelOnDrop<'a> {
    gate: &'a Gate,
    id: u64,
    armed: bool,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            let mut g = self.gate.inner.lock();
            g.q.cancel(self.id);
            self.gate.update_depths(&g.q);
        }
    }
}

impl Gate {
    /// A gate with `capacity` slots over `lanes`.
    pub fn new(
        lanes: Vec<LaneSpec>,
        capacity: usize,
        max_queued: usize,
        metrics: GateMetrics,
    ) -> Self {
        Self::with_costs(lanes, capacity, max_queued, metrics, Costs::default())
    }

    /// A gate whose fair shares between tenants charge `costs`.
    pub fn with_costs(
        lanes: Vec<LaneSpec>,
        capacity: usize,
        max_queued: usize,
        metrics: GateMetrics,
        costs: Costs,
    ) -> Self {
        Gate {
            inner: Mutex::new(Inner {
                q: LaneQueue::with_costs(lanes, capacity, max_queued, costs),
                last_release: None,
                avg_gap_s: 0.0,
            }),
            ids: AtomicU64::new(1),
            rng: AtomicU64::new(0x1234_5678),
            epoch: Instant::now(),
            metrics,
        }
    }

    /// Lane index by name.
    pub fn lane(&self, name: &str) -> Option<usize> {
        self.inner.lock().q.lane(name)
    }

    fn draw(&self) -> f64 {
        let r = mix64(self.rng.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed));
        (r >> 11) as f64 / (1u64 << 53) as f64
    }

    fn drain(inner: &Inner) -> Option<f64> {
        (inner.avg_gap_s > 0.0).then(|| 1.0 / inner.avg_gap_s)
    }

    fn retry_after(inner: &Inner, lane: usize) -> Duration {
        let ahead = inner.q.waiting_through(lane) + 1;
        match Self::drain(inner) {
            Some(rate) => Duration::from_secs_f64((ahead as f64 / rate).clamp(0.001, 3600.0)),
            None => Duration::from_secs(1),
        }
    }

    fn update_depths(&self, q: &LaneQueue<(oneshot::Sender<Permit>, u64)>) {
        for (l, g) in self.metrics.depth.iter().enumerate() {
            g.set(q.depth(l) as i64);
        }
        self.metrics.in_use.set(q.in_use() as i64);
    }

    /// Per lane (name), up to `n` tenants served most, with their
    /// virtual counters.
    pub fn shares(&self, n: usize) -> Vec<(String, Vec<Share>)> {
        let g = self.inner.lock();
        let lanes = g.q.lanes();
        (0..lanes.len())
            .map(|l| (lanes[l].name.clone(), g.q.shares(l, n)))
            .collect()
    }

    /// Shared counters across instances: apply what others charged
    /// (lane rank, tenant id, amount) and take what was charged here
    /// since the last call, at most `max` tenants per lane: (lane rank,
    /// id, name, amount).
    pub fn fair_exchange(
        &self,
        remote: &[(u32, u64, f64)],
        max: usize,
    ) -> Vec<(u32, u64, Arc<str>, f64)> {
        let mut g = self.inner.lock();
        let ranks: Vec<u32> = g.q.lanes().iter().map(|l| l.rank).collect();
        for &(rank, id, amount) in remote {
            if let Some(lane) = ranks.iter().position(|r| *r == rank) {
                g.q.absorb(lane, id, amount);
            }
        }
        let mut out = Vec::new();
        for (lane, rank) in ranks.iter().enumerate() {
            for (id, name, amount) in g.q.drain_unsynced(lane, max) {
                out.push((*rank, id, name, amount));
            }
        }
        out
    }

    fn release(self: &Arc<Self>, lane: usize, tenant: u64) {
        // Permits that found no receiver are dropped after the lock is let
        // go: their own drop releases (and re-locks).
        let mut orphans: Vec<Permit> = Vec::new();
        {
            let mut g = self.inner.lock();
            let now = Instant::now();
            if g.q.queued() > 0 {
                if let Some(last) = g.last_release {
                    let gap = now.duration_since(last).as_secs_f64();
                    g.avg_gap_s = if g.avg_gap_s == 0.0 {
                        gap
                    } else {
                        0.8 * g.avg_gap_s + 0.2 * gap
                    };
                }
            }
            g.last_release = Some(now);
            for (_, granted_lane, (tx, t)) in g.q.release_for(lane, tenant) {
                let permit = Permit::new(self.clone(), granted_lane, t);
                if let Err(p) = tx.send(permit) {
                    orphans.push(p);
                }
            }
            self.update_depths(&g.q);
        }
        drop(orphans);
    }

    /// Requests waiting now, per lane (by rank).
    pub fn depths(&self) -> Vec<i64> {
        self.metrics.depth.iter().map(|g| g.get()).collect()
    }

    /// Free slots now (capacity minus slots held), for tests and metrics.
    pub fn free(&self) -> usize {
        let g = self.inner.lock();
        g.q.capacity() - g.q.in_use()
    }

    /// Wait for a slot in `lane`. `work` is the expected size if known;
    /// `gone` resolves if the client disconnects.
    pub async fn acquire(
        self: &Arc<Self>,
        lane: usize,
        work: Option<u64>,
        gone: impl Future<Output = ()>,
    ) -> Result<(Permit, Duration), Denied> {
        self.acquire_as(&Who::anonymous(), lane, work, gone).await
    }

    /// [`acquire`](Self::acquire) for `who`: inside its lane, slots go by
    /// fair share between tenants; the permit charges the tenant's output.
    pub async fn acquire_as(
        self: &Arc<Self>,
        who: &Who,
        lane: usize,
        work: Option<u64>,
        gone: impl Future<Output = ()>,
    ) -> Result<(Permit, Duration), Denied> {
        let start = Instant::now();
        let id = self.ids.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let tenant = who.tenant.id;
        let (offer, max_wait) = {
            let mut g = self.inner.lock();
            let now_us = self.epoch.elapsed().as_micros() as u64;
            let drain = Self::drain(&g);
            let draw = self.draw();
            let offer =
                g.q.offer_as(who, id, lane, work, now_us, draw, drain, (tx, tenant));
            let max_wait = g.q.lanes()[lane].max_wait;
            if let Offer::Refused(r) = offer {
                return Err(Denied::Shed(r, Self::retry_after(&g, lane)));
            }
            self.update_depths(&g.q);
            (offer, max_wait)
        };
        if offer == Offer::Granted {
            self.metrics.admitted[lane].inc();
            self.metrics.wait[lane].observe(0.0);
            return Ok((Permit::new(self.clone(), lane, tenant), Duration::ZERO));
        }
        let mut rx = rx;
        let mut guard = CancelOnDrop {
            gate: self,
            id,
            armed: true,
        };
        let wake = tokio::select! {
            r = &mut rx => match r {
                Ok(p) => Wake::Granted(p),
                Err(_) => Wake::Evicted,
            },
            _ = tokio::time::sleep(max_wait) => Wake::TimedOut,
            _ = gone => Wake::Gone,
        };
        guard.armed = false;
        let (permit, wake) = match wake {
            Wake::Granted(p) => (Some(p), Wake::Evicted),
            Wake::Evicted => (None, Wake::Evicted),
            w @ (Wake::TimedOut | Wake::Gone) => {
                {
                    let mut g = self.inner.lock();
                    g.q.cancel(id);
                    self.update_depths(&g.q);
                }
                // Not queued any more: granted in the same instant (the
                // permit is in the channel) or evicted (sender dropped).
                (rx.try_recv().ok(), w)
            }
        };
        match (permit, wake) {
            (Some(_), Wake::Gone) | (None, Wake::Gone) => Err(Denied::Gone),
            (Some(permit), _) => {
                let waited = start.elapsed();
                self.metrics.admitted[lane].inc();
                self.metrics.wait[lane].observe(waited.as_secs_f64());
                Ok((permit, waited))
            }
            (None, w) => {
                let reason = if matches!(w, Wake::Evicted) {
                    Reason::Preempted
                } else {
                    Reason::MaxWait
                };
                Err(Denied::Shed(
                    reason,
                    Self::retry_after(&self.inner.lock(), lane),
                ))
            }
        }
    }
}

enum Wake {
    Granted(Permit),
    Evicted,
    TimedOut,
    Gone,
}

/// A gate shares its fair-share counters with the cluster.
impl crate::cluster::fair::FairSource for Gate {
    fn exchange(&self, remote: &[(u32, u64, f64)]) -> Vec<(u32, u64, Arc<str>, f64)> {
        self.fair_exchange(remote, crate::cluster::fair::PER_LANE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::default_lanes;
    use prometheus::{Histogram, HistogramOpts, IntCounter, IntGauge};

    fn metrics(lanes: usize) -> GateMetrics {
        let g = || IntGauge::new("g", "g").unwrap();
        GateMetrics {
            depth: (0..lanes).map(|_| g()).collect(),
            wait: (0..lanes)
                .map(|_| Histogram::with_opts(HistogramOpts::new("h", "h")).unwrap())
                .collect(),
            admitted: (0..lanes)
                .map(|_| IntCounter::new("c", "c").unwrap())
                .collect(),
            in_use: g(),
        }
    }

    /// Waiters aborted at random moments, also right after their grant was
    /// sent and before they polled it, never strand a slot.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cancelled_waiters_never_strand_a_slot() {
        let lanes = default_lanes();
        let n = lanes.len();
        for round in 0..20u64 {
            let capacity = 3;
            let gate = Arc::new(Gate::new(lanes.clone(), capacity, 10_000, metrics(n)));
            let mut tasks = Vec::new();
            for i in 0..200u64 {
                let g = gate.clone();
                let lane = (mix64(i ^ round) % n as u64) as usize;
                let hold = Duration::from_micros(mix64(i * 7 + round) % 300);
                tasks.push(tokio::spawn(async move {
                    if let Ok((permit, _)) = g.acquire(lane, None, std::future::pending()).await {
                        tokio::time::sleep(hold).await;
                        drop(permit);
                    }
                }));
            }
            // Abort a third of them at staggered moments, while grants fly.
            for (i, t) in tasks.iter().enumerate() {
                if mix64(i as u64 + round * 1000).is_multiple_of(3) {
                    tokio::time::sleep(Duration::from_micros(mix64(i as u64) % 50)).await;
                    t.abort();
                }
            }
            for t in tasks {
                let _ = t.await;
            }
            assert_eq!(gate.free(), capacity, "round {round}: a slot was lost");
            assert_eq!(gate.inner.lock().q.queued(), 0);
        }
    }

    /// A grant sent to a waiter that is dropped before it polls frees the
    /// slot at once (the exact case of the old `()` grant).
    #[tokio::test]
    async fn grant_to_a_dropped_waiter_frees_the_slot() {
        let gate = Arc::new(Gate::new(default_lanes(), 1, 10, metrics(3)));
        let (held, _) = gate.acquire(1, None, std::future::pending()).await.unwrap();
        let g = gate.clone();
        let mut waiter = Box::pin(async move { g.acquire(1, None, std::future::pending()).await });
        // Poll once so it queues, then grant by releasing, then drop unpolled.
        assert!(futures_poll_once(&mut waiter).await.is_none());
        drop(held);
        drop(waiter);
        assert_eq!(gate.free(), 1);
    }

    async fn futures_poll_once<F: Future + Unpin>(f: &mut F) -> Option<F::Output> {
        use std::task::Poll;
        std::future::poll_fn(|cx| match std::pin::Pin::new(&mut *f).poll(cx) {
            Poll::Ready(v) => Poll::Ready(Some(v)),
            Poll::Pending => Poll::Ready(None),
        })
        .await
    }
}
