//! Fair-share counters shared by the instances of a cluster: a tenant
//! served on one instance counts on every other, so a tenant cannot take
//! more than its share by spreading its load.
//!
//! Every counter lives in memory where it is used (the engine's waiting
//! queue, a model's gate): decisions never wait on the store. Four times
//! a second each instance hands what it charged to each tenant since the
//! last exchange to Redis (`INCRBYFLOAT` on
//! `{prefix}fair:{model}:{rank}:{tenant}`, one key per tenant so that an
//! idle tenant's counter expires by itself `KEEP_S` after its last charge,
//! as the local tables forget idle tenants: client-chosen tenant names
//! cannot grow the store for ever; one pipeline per source) and reads back
//! the total; what the total grew by beyond
//! its own charge is what the others charged, and raises the local
//! counter (`Vtc::absorb`: counters only ever rise, so fairness rules hold
//! on each instance). A tenant's first exchange only learns the total: a
//! history from before this instance knew the tenant is not charged.
//!
//! While the store is down, charges stay local (each instance is fair on
//! its own, the `local` rule of the limits) unless `[cluster]
//! fair_on_store_error = "closed"`, which refuses inference requests with
//! 503 `store_unavailable` until it returns (`open` behaves as `local`:
//! fair shares never refuse anything by themselves). Charges made while
//! it is down are not sent later.

use super::Cluster;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// How often charges are exchanged.
const EVERY: Duration = Duration::from_millis(250);
/// Tenants per lane one exchange sends at most.
pub const PER_LANE: usize = 256;
/// Totals remembered (tenant, lane, source); past it they are forgotten
/// and relearned (one exchange without remote charges each).
const SEEN_MAX: usize = 65_536;
/// Seconds a tenant's counter is kept after its last charge.
const KEEP_S: u64 = 300;

/// A place that keeps counters: a gate or an engine.
pub trait FairSource: Send + Sync {
    /// Apply what others charged, (lane rank, tenant id, amount); take
    /// what was charged here since the last call, (lane rank, tenant id,
    /// tenant name, amount).
    fn exchange(&self, remote: &[(u32, u64, f64)]) -> Vec<(u32, u64, Arc<str>, f64)>;
}

impl FairSource for ultrafast_engine::service::EngineService {
    fn exchange(&self, remote: &[(u32, u64, f64)]) -> Vec<(u32, u64, Arc<str>, f64)> {
        match self.engine() {
            Some(e) => e.fair_exchange(remote.to_vec()),
            None => Vec::new(),
        }
    }
}

type Sources = Vec<(String, Weak<dyn FairSource>)>;

static SOURCES: Mutex<Sources> = Mutex::new(Vec::new());

/// Share the counters of `source`, serving `model`, while it lives.
pub fn register<S: FairSource + 'static>(model: &str, source: Weak<S>) {
    let source: Weak<dyn FairSource> = source;
    let mut s = SOURCES.lock();
    s.retain(|(_, w)| w.strong_count() > 0);
    s.push((model.to_string(), source));
}

/// The exchange loop (on the cluster runtime).
pub(super) async fn sync(c: Arc<Cluster>) {
    let mut x = Exchange::default();
    loop {
        tokio::time::sleep(EVERY).await;
        let live: Vec<(String, Arc<dyn FairSource>)> = SOURCES
            .lock()
            .iter()
            .filter_map(|(m, w)| w.upgrade().map(|s| (m.clone(), s)))
            .collect();
        // Others' charges held for a source that is gone are dropped.
        let at: Vec<usize> = live.iter().map(|(_, s)| address(s)).collect();
        x.pending.retain(|k, _| at.contains(k));
        for (model, source) in live {
            x.round(&c, &model, source).await;
        }
    }
}

/// A source's identity while it lives (its allocation's address).
fn address(s: &Arc<dyn FairSource>) -> usize {
    Arc::as_ptr(s) as *const () as usize
}

/// What the loop remembers between rounds.
#[derive(Default)]
struct Exchange {
    /// Last total seen per (hash key, tenant id).
    seen: HashMap<(String, u64), f64>,
    /// Others' charges to hand in at a source's next round, by source.
    pending: HashMap<usize, Vec<(u32, u64, f64)>>,
}

impl Exchange {
    async fn round(&mut self, c: &Arc<Cluster>, model: &str, source: Arc<dyn FairSource>) {
        let at = address(&source);
        let remote = self.pending.remove(&at).unwrap_or_default();
        let ours = source.exchange(&remote);
        if ours.is_empty() || !c.is_up() {
            return;
        }
        let keys: Vec<String> = ours
            .iter()
            .map(|(rank, _, name, _)| c.key(format_args!("fair:{model}:{rank}:{name}")))
            .collect();
        let mut pipe = redis::pipe();
        for (key, (_, _, _, amount)) in keys.iter().zip(&ours) {
            pipe.cmd("INCRBYFLOAT").arg(key).arg(amount);
            pipe.cmd("EXPIRE").arg(key).arg(KEEP_S).ignore();
        }
        let mut conn = c.conn();
        let totals = c
            .call(async move { pipe.query_async::<Vec<String>>(&mut conn).await })
            .await;
        let Ok(totals) = totals else { return };
        if self.seen.len() > SEEN_MAX {
            self.seen.clear();
        }
        let mut theirs = Vec::new();
        for ((key, (rank, id, _, amount)), total) in keys.into_iter().zip(ours).zip(totals) {
            let Ok(total) = total.parse::<f64>() else {
                continue;
            };
            if let Some(before) = self.seen.insert((key, id), total) {
                let others = total - before - amount;
                if others > 1e-9 {
                    theirs.push((rank, id, others));
                }
            }
        }
        if !theirs.is_empty() {
            self.pending.insert(at, theirs);
        }
    }
}
