//! Fair shares between tenants inside one lane: virtual token counters
//! (VTC; Sheng et al., "Fairness in Serving Large Language Models", OSDI
//! 2024).
//!
//! Every tenant has a counter of the service it received, in weighted
//! tokens: a request's prompt is charged when it is granted a slot
//! (`input` per token), its output as it is produced (`output` per token),
//! both divided by the tenant's weight. The next slot goes to the
//! backlogged tenant (one with a request waiting) whose counter is the
//! smallest; a tenant that comes back from idle is lifted to the smallest
//! counter of the tenants still active, so idling earns no credit. The
//! queue stays work-conserving: a slot is never left free while anyone
//! waits, whoever it is. Between two tenants that stay backlogged, the
//! counters differ by at most one request's charge plus what is produced
//! while it runs (the paper's service-gap bound).
//!
//! The engine's waiting queue and the proxy's lane gates both keep one
//! [`Vtc`] per lane. Every change is O(log n) in the tenants active; a
//! pick is O(log n). Idle tenants' counters are kept up to
//! [`MAX_IDLE`]; past it the idle ones whose counter a lift would raise
//! anyway are forgotten first (no information lost), then the oldest
//! (they come back lifted to the smallest active counter instead of
//! their own: at most the service they had above it is forgiven).
//!
//! Several instances share counters through a store (the proxy's
//! `[cluster]`): each hands over what it charged since the last exchange
//! ([`Vtc::drain_unsynced`]) and takes in what the others charged
//! ([`Vtc::absorb`]), which raises counters only, so every rule above
//! holds on each instance.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

/// Idle tenants whose counters are kept.
pub const MAX_IDLE: usize = 4096;

/// Who a request is for: its tenant and the tenant's weight.
#[derive(Debug, Clone, PartialEq)]
pub struct Tenant {
    /// A stable id of the name (the key the counters are kept under).
    pub id: u64,
    /// The name, for metrics.
    pub name: Arc<str>,
    /// Its share relative to others (1 by default; 3 receives three times
    /// the tokens of a tenant of weight 1 when both are backlogged).
    pub weight: f64,
}

impl Tenant {
    /// A tenant by name; a weight that is not a positive number counts as 1.
    pub fn named(name: &str, weight: f64) -> Tenant {
        let weight = if weight.is_finite() && weight > 0.0 {
            weight
        } else {
            1.0
        };
        Tenant {
            id: id_of(name),
            name: name.into(),
            weight,
        }
    }

    /// The tenant of requests that name none (one shared value: no
    /// allocation or hashing per request).
    pub fn anonymous() -> Tenant {
        static ANONYMOUS: std::sync::LazyLock<Tenant> =
            std::sync::LazyLock::new(|| Tenant::named("", 1.0));
        ANONYMOUS.clone()
    }
}

/// A tenant's id: SipHash-1-3 of its name under a key drawn at random once
/// per process, so that a client choosing tenant names (`tenant = "user"`)
/// cannot search for two names that share an id, and with it a share.
/// Ids are this process's own: instances share counters by name.
pub fn id_of(name: &str) -> u64 {
    use std::hash::BuildHasher;
    static KEY: std::sync::LazyLock<std::hash::RandomState> =
        std::sync::LazyLock::new(std::hash::RandomState::new);
    KEY.hash_one(name)
}

/// What a token costs, before the tenant's weight divides it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Costs {
    /// Per prompt token (charged when the request is granted a slot).
    pub input: f64,
    /// Per output token (charged as produced).
    pub output: f64,
}

impl Default for Costs {
    /// 1 and 2: an output token costs a step of its own, a prompt token a
    /// share of a batched prefill.
    fn default() -> Self {
        Costs {
            input: 1.0,
            output: 2.0,
        }
    }
}

#[derive(Debug, Clone)]
struct Acct {
    name: Arc<str>,
    counter: f64,
    weight: f64,
    waiting: u32,
    running: u32,
    /// Prompt plus output tokens served (unweighted).
    served: u64,
    /// When it last became idle (a change count), for eviction.
    idle_since: u64,
    /// Counter charged here and not yet handed to other instances.
    unsynced: f64,
}

impl Acct {
    fn active(&self) -> bool {
        self.waiting > 0 || self.running > 0
    }
}

/// A counter as an ordered key: non-negative floats order as their bits.
fn key(c: f64) -> u64 {
    c.max(0.0).to_bits()
}

/// One tenant's state, as metrics show it.
#[derive(Debug, Clone, PartialEq)]
pub struct Share {
    /// Its name.
    pub name: Arc<str>,
    /// Its virtual counter.
    pub counter: f64,
    /// Tokens served (prompt and output, unweighted).
    pub served: u64,
    /// Requests waiting.
    pub waiting: u32,
    /// Requests holding a slot.
    pub running: u32,
}

/// The counters of one lane.
#[derive(Debug, Clone)]
pub struct Vtc {
    costs: Costs,
    accts: HashMap<u64, Acct>,
    /// Tenants with a request waiting, by (counter, id).
    backlogged: BTreeSet<(u64, u64)>,
    /// Tenants with a request waiting or holding a slot, by (counter, id).
    active: BTreeSet<(u64, u64)>,
    changes: u64,
}

impl Default for Vtc {
    fn default() -> Self {
        Vtc::new(Costs::default())
    }
}

impl Vtc {
    /// Counters charging `costs`.
    pub fn new(costs: Costs) -> Self {
        Vtc {
            costs,
            accts: HashMap::new(),
            backlogged: BTreeSet::new(),
            active: BTreeSet::new(),
            changes: 0,
        }
    }

    /// The costs it charges.
    pub fn costs(&self) -> Costs {
        self.costs
    }

    /// Change one tenant, keeping the ordered sets in step.
    fn change(&mut self, id: u64, f: impl FnOnce(&mut Acct)) {
        let Some(a) = self.accts.get_mut(&id) else {
            return;
        };
        let k = (key(a.counter), id);
        let (was_backlogged, was_active) = (a.waiting > 0, a.active());
        f(a);
        let nk = (key(a.counter), id);
        let (backlogged, active) = (a.waiting > 0, a.active());
        self.changes += 1;
        if was_active && !active {
            a.idle_since = self.changes;
        }
        if was_backlogged && (!backlogged || nk != k) {
            self.backlogged.remove(&k);
        }
        if backlogged && (!was_backlogged || nk != k) {
            self.backlogged.insert(nk);
        }
        if was_active && (!active || nk != k) {
            self.active.remove(&k);
        }
        if active && (!was_active || nk != k) {
            self.active.insert(nk);
        }
    }

    /// The smallest counter among active tenants.
    pub fn floor(&self) -> Option<f64> {
        self.active.first().map(|(k, _)| f64::from_bits(*k))
    }

    /// A request of `t` joins the queue. A tenant coming back from idle
    /// (nothing waiting, nothing running) is lifted to the smallest active
    /// counter.
    pub fn arrive(&mut self, t: &Tenant) {
        let floor = self.floor();
        if !self.accts.contains_key(&t.id) {
            self.evict_idle();
            self.accts.insert(
                t.id,
                Acct {
                    name: t.name.clone(),
                    counter: floor.unwrap_or(0.0),
                    weight: t.weight,
                    waiting: 0,
                    running: 0,
                    served: 0,
                    idle_since: 0,
                    unsynced: 0.0,
                },
            );
        }
        let weight = t.weight;
        self.change(t.id, |a| {
            if !a.active() {
                if let Some(f) = floor {
                    a.counter = a.counter.max(f);
                }
            }
            a.weight = weight;
            a.waiting += 1;
        });
    }

    /// The backlogged tenant served next: the smallest counter (ties: the
    /// smaller id).
    pub fn next(&self) -> Option<u64> {
        self.backlogged.first().map(|&(_, id)| id)
    }

    /// Whether `id` has a request waiting.
    pub fn backlogged(&self, id: u64) -> bool {
        self.accts.get(&id).is_some_and(|a| a.waiting > 0)
    }

    /// A request of `id` was granted a slot: charge its prompt.
    pub fn start(&mut self, id: u64, prompt_tokens: usize) {
        let cost = self.costs.input;
        self.change(id, |a| {
            a.waiting = a.waiting.saturating_sub(1);
            a.running += 1;
            let c = prompt_tokens as f64 * cost / a.weight;
            a.counter += c;
            a.unsynced += c;
            a.served += prompt_tokens as u64;
        });
    }

    /// A request of `id` that was granted and preempted starts again: it
    /// takes a slot without a second charge.
    pub fn resume(&mut self, id: u64) {
        self.change(id, |a| {
            a.waiting = a.waiting.saturating_sub(1);
            a.running += 1;
        });
    }

    /// A request of `id` left the queue without a slot.
    pub fn withdraw(&mut self, id: u64) {
        self.change(id, |a| a.waiting = a.waiting.saturating_sub(1));
    }

    /// A running request of `id` went back to the queue (preempted), its
    /// prompt already charged: no lift, no charge.
    pub fn requeue(&mut self, id: u64) {
        self.change(id, |a| {
            a.running = a.running.saturating_sub(1);
            a.waiting += 1;
        });
    }

    /// A running request of `id` produced `n` tokens.
    pub fn produced(&mut self, id: u64, n: usize) {
        let cost = self.costs.output;
        self.change(id, |a| {
            let c = n as f64 * cost / a.weight;
            a.counter += c;
            a.unsynced += c;
            a.served += n as u64;
        });
    }

    /// A running request of `id` ended.
    pub fn finish(&mut self, id: u64) {
        self.change(id, |a| a.running = a.running.saturating_sub(1));
    }

    /// What was charged here since the last call, for at most `max`
    /// tenants (those charged, then the other active ones with 0, so that
    /// their counters learn what others charged): (id, name, amount).
    pub fn drain_unsynced(&mut self, max: usize) -> Vec<(u64, Arc<str>, f64)> {
        let mut out: Vec<(u64, Arc<str>, f64)> = Vec::new();
        for (id, a) in self.accts.iter_mut() {
            if out.len() >= max {
                break;
            }
            if a.unsynced > 0.0 || a.active() {
                out.push((*id, a.name.clone(), a.unsynced));
                a.unsynced = 0.0;
            }
        }
        out
    }

    /// Other instances charged `id` by `amount` (counter units): its
    /// counter rises by it (never falls). Unknown tenants are ignored: they
    /// are lifted when they come.
    pub fn absorb(&mut self, id: u64, amount: f64) {
        if amount.is_finite() && amount > 0.0 {
            self.change(id, |a| a.counter += amount);
        }
    }

    /// The counter of `id`.
    pub fn counter(&self, id: u64) -> Option<f64> {
        self.accts.get(&id).map(|a| a.counter)
    }

    /// Tenants known (active and idle).
    pub fn len(&self) -> usize {
        self.accts.len()
    }

    /// Whether no tenant is known.
    pub fn is_empty(&self) -> bool {
        self.accts.is_empty()
    }

    /// Up to `n` tenants, those served most first.
    pub fn top(&self, n: usize) -> Vec<Share> {
        let mut all: Vec<&Acct> = self.accts.values().collect();
        all.sort_by(|a, b| b.served.cmp(&a.served).then(a.name.cmp(&b.name)));
        all.into_iter()
            .take(n)
            .map(|a| Share {
                name: a.name.clone(),
                counter: a.counter,
                served: a.served,
                waiting: a.waiting,
                running: a.running,
            })
            .collect()
    }

    /// Forget idle tenants past [`MAX_IDLE`] (see the module doc); runs
    /// only when the map is full, and then frees half of it.
    fn evict_idle(&mut self) {
        let idle = self.accts.len() - self.active.len();
        if idle < MAX_IDLE {
            return;
        }
        let floor = self.floor().unwrap_or(f64::INFINITY);
        self.accts.retain(|_, a| a.active() || a.counter > floor);
        let idle = self.accts.len() - self.active.len();
        if idle >= MAX_IDLE / 2 {
            let mut ages: Vec<u64> = self
                .accts
                .values()
                .filter(|a| !a.active())
                .map(|a| a.idle_since)
                .collect();
            let cut = idle - MAX_IDLE / 2;
            ages.select_nth_unstable(cut);
            let oldest_kept = ages[cut];
            self.accts
                .retain(|_, a| a.active() || a.idle_since >= oldest_kept);
        }
    }
}

#[cfg(test)]
mod tests;
