//! Fair shares inside a lane on the engine thread: each lane rank's
//! virtual token counters ([`crate::fair::Vtc`]) kept in step with the
//! queue, and the choice of which waiting request starts next.
//!
//! Bookkeeping follows a sequence's life: queued (`arrive`, lifting a
//! tenant back from idle), started (`start`, charging the prompt once),
//! each sampled token (`produced`, charged in `step`), preempted back to
//! the queue (`requeue`: no lift, no second charge), cancelled or finished
//! (`withdraw` or `finish`). The front of the queue is chosen after every
//! sort and every start: among the waiting requests of the best waiting
//! rank, a preempted one first (it was granted already), else the first
//! (in the queue's own order) of the backlogged tenant with the smallest
//! counter. One tenant alone leaves the order exactly as it was.

use super::seq::Seq;
use super::Worker;
use crate::fair::{Share, Tenant};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Tenants per rank published for metrics.
const PUBLISHED: usize = 32;
/// How often the counters are published.
const EVERY: Duration = Duration::from_millis(500);

/// Tenants per rank whose charges one exchange hands over.
const EXCHANGED: usize = 256;

/// A charge of one tenant in one lane rank: (rank, tenant id, name,
/// counter units).
pub type Charge = (u32, u64, Arc<str>, f64);

/// When the counters were last published, and what: (rank, share).
type Snapshot = (Option<Instant>, Vec<(u32, Share)>);

/// What the engine thread and the rest of the process exchange: the
/// counters for metrics, and charges to and from other instances.
#[derive(Debug, Default)]
pub(super) struct Published {
    shares: Mutex<Snapshot>,
    /// Charged here, for other instances (filled only once someone
    /// exchanges, so that it never grows unread).
    outbox: Mutex<(bool, Vec<Charge>)>,
    /// Charged by other instances, for the counters here.
    inbox: Mutex<Vec<(u32, u64, f64)>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Published {
    pub(super) fn get(&self) -> Vec<(u32, Share)> {
        lock(&self.shares).1.clone()
    }

    /// Hand in others' charges, take this engine's (see
    /// `Engine::fair_exchange`).
    pub(super) fn exchange(&self, remote: Vec<(u32, u64, f64)>) -> Vec<Charge> {
        lock(&self.inbox).extend(remote);
        let mut out = lock(&self.outbox);
        out.0 = true;
        std::mem::take(&mut out.1)
    }
}

impl Worker {
    /// A request joins the queue.
    pub(super) fn enqueue(&mut self, s: Seq) {
        let tenant = s.req.tenant.clone().unwrap_or_else(Tenant::anonymous);
        self.fair[s.rank()].arrive(&tenant);
        self.waiting.push(s);
    }

    /// A waiting request got its blocks and starts: charge its prompt once.
    pub(super) fn started(&mut self, s: &mut Seq) {
        let v = &mut self.fair[s.rank()];
        if s.charged {
            v.resume(s.tenant);
        } else {
            v.start(s.tenant, s.req.prompt.len());
            s.charged = true;
        }
    }

    /// Drop the sequences whose clients left, from both lists.
    pub(super) fn drop_cancelled(&mut self) {
        let fair = &mut self.fair;
        self.waiting.retain(|s| {
            let keep = !s.cancelled();
            if !keep {
                fair[s.rank()].withdraw(s.tenant);
            }
            keep
        });
        self.running.retain(|s| {
            let keep = !s.cancelled();
            if !keep {
                fair[s.rank()].finish(s.tenant);
            }
            keep
        });
        self.publish_shares();
    }

    /// Drop the running sequences that finished.
    pub(super) fn drop_finished(&mut self) {
        let fair = &mut self.fair;
        self.running.retain(|s| {
            if s.finished {
                fair[s.rank()].finish(s.tenant);
            }
            !s.finished
        });
    }

    /// Put the request that starts next at the front of the queue (the
    /// queue is sorted by rank first; see the module doc).
    pub(super) fn fair_front(&mut self) {
        let Some(first) = self.waiting.first() else {
            return;
        };
        let rank = first.req.lane_rank;
        let same = self
            .waiting
            .iter()
            .take_while(|s| s.req.lane_rank == rank)
            .count();
        let lane = &self.waiting[..same];
        let pick = match lane.iter().position(|s| s.charged) {
            Some(i) => i,
            None => {
                let Some(tenant) = self.fair[first.rank()].next() else {
                    return;
                };
                match lane.iter().position(|s| s.tenant == tenant) {
                    Some(i) => i,
                    None => return,
                }
            }
        };
        if pick > 0 {
            let s = self.waiting.remove(pick);
            self.waiting.insert(0, s);
        }
    }

    /// Publish the counters for metrics, at most every [`EVERY`].
    fn publish_shares(&mut self) {
        let shares = self.shares.clone();
        let mut p = lock(&shares.shares);
        if p.0.is_some_and(|t| t.elapsed() < EVERY) {
            return;
        }
        p.0 = Some(Instant::now());
        for (rank, id, amount) in std::mem::take(&mut *lock(&shares.inbox)) {
            if let Some(v) = self.fair.get_mut(rank as usize) {
                v.absorb(id, amount);
            }
        }
        let mut out = lock(&shares.outbox);
        if out.0 {
            // Unread charges pile up to a bound, then are dropped (they
            // stay in the counters here; only other instances miss them).
            if out.1.len() > 4 * EXCHANGED {
                out.1.clear();
            }
            for (rank, v) in self.fair.iter_mut().enumerate() {
                for (id, name, amount) in v.drain_unsynced(EXCHANGED) {
                    out.1.push((rank as u32, id, name, amount));
                }
            }
        }
        drop(out);
        p.1.clear();
        for (rank, v) in self.fair.iter().enumerate() {
            for share in v.top(PUBLISHED) {
                p.1.push((rank as u32, share));
            }
        }
    }
}
