//! The async side of a pool's lane queue: requests wait here for a slot.
//!
//! One short `parking_lot` lock guards the `LaneQueue`; waiting happens on a
//! oneshot channel outside it. A waiter leaves on grant, on max wait, on
//! eviction (its sender is dropped) or when its client disconnects; a guard
//! removes it from the queue however its future ends, so a dropped request
//! never leaves a ghost behind. The drain rate (completions per second while
//! requests are queued) feeds the expected-wait refusal and `Retry-After`.

use super::queue::{LaneQueue, LaneSpec, Offer, Reason};
use crate::upstream::lb::mix64;
use parking_lot::Mutex;
use prometheus::{Histogram, IntCounter, IntGauge};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

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
    q: LaneQueue<oneshot::Sender<()>>,
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
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.gate.release(self.lane);
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
        Gate {
            inner: Mutex::new(Inner {
                q: LaneQueue::new(lanes, capacity, max_queued),
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
        let ahead = inner.q.ahead_of(lane, u64::MAX) + 1;
        match Self::drain(inner) {
            Some(rate) => Duration::from_secs_f64((ahead as f64 / rate).clamp(0.001, 3600.0)),
            None => Duration::from_secs(1),
        }
    }

    fn update_depths(&self, q: &LaneQueue<oneshot::Sender<()>>) {
        for (l, g) in self.metrics.depth.iter().enumerate() {
            g.set(q.depth(l) as i64);
        }
        self.metrics.in_use.set(q.in_use() as i64);
    }

    fn release(&self, lane: usize) {
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
        let mut granted = g.q.release(lane);
        while let Some((_, tx)) = granted.pop() {
            // Send fails only if the waiter vanished without cancelling:
            // hand its slot on. The slot's lane is unknown here, so free
            // it from the lane that just released (capacity accounting is
            // what matters; lanes re-balance on the next grant).
            if tx.send(()).is_err() {
                granted.extend(g.q.release(lane));
            }
        }
        self.update_depths(&g.q);
    }

    /// Wait for a slot in `lane`. `work` is the expected size if known;
    /// `gone` resolves if the client disconnects.
    pub async fn acquire(
        self: &Arc<Self>,
        lane: usize,
        work: Option<u64>,
        gone: impl Future<Output = ()>,
    ) -> Result<(Permit, Duration), Denied> {
        let start = Instant::now();
        let id = self.ids.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let (offer, max_wait) = {
            let mut g = self.inner.lock();
            let now_us = self.epoch.elapsed().as_micros() as u64;
            let drain = Self::drain(&g);
            let offer = g.q.offer(id, lane, work, now_us, self.draw(), drain, tx);
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
            return Ok((
                Permit {
                    gate: self.clone(),
                    lane,
                },
                Duration::ZERO,
            ));
        }
        let mut rx = rx;
        let mut guard = CancelOnDrop {
            gate: self,
            id,
            armed: true,
        };
        let wake = tokio::select! {
            r = &mut rx => if r.is_ok() { Wake::Granted } else { Wake::Evicted },
            _ = tokio::time::sleep(max_wait) => Wake::TimedOut,
            _ = gone => Wake::Gone,
        };
        guard.armed = false;
        let holds_slot = match wake {
            Wake::Granted => true,
            Wake::Evicted => false,
            Wake::TimedOut | Wake::Gone => {
                let mut g = self.inner.lock();
                let was_queued = g.q.cancel(id).is_some();
                self.update_depths(&g.q);
                // Not queued any more: granted (a sent value) or evicted
                // (a dropped sender) in the same instant; the lock makes
                // the two states exact.
                !was_queued && rx.try_recv().is_ok()
            }
        };
        if holds_slot {
            let permit = Permit {
                gate: self.clone(),
                lane,
            };
            if wake == Wake::Gone {
                return Err(Denied::Gone);
            }
            let waited = start.elapsed();
            self.metrics.admitted[lane].inc();
            self.metrics.wait[lane].observe(waited.as_secs_f64());
            return Ok((permit, waited));
        }
        let reason = match wake {
            Wake::Gone => return Err(Denied::Gone),
            Wake::Evicted => Reason::Preempted,
            _ => Reason::MaxWait,
        };
        Err(Denied::Shed(
            reason,
            Self::retry_after(&self.inner.lock(), lane),
        ))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    Granted,
    Evicted,
    TimedOut,
    Gone,
}
