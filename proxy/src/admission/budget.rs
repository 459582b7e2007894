//! Token budgets: LLM tokens per minute for a key, as a keyed token bucket
//! whose grants are reservations settled against what a request really used.
//!
//! Data flow: admission reserves a request's worst case (prompt tokens plus
//! `max_tokens`) with `TokenBudget::reserve`, which takes the tokens at once
//! or refuses with the exact wait (`BudgetRefusal::Wait`), or says the
//! request can never fit (`BudgetRefusal::TooLarge`: more than the burst).
//! The grant is a `Reservation`, an RAII value that travels with the
//! request: `settle(used)` when the usage is known gives back what was not
//! used (never filling the bucket past its burst) or takes the overshoot
//! (the bucket goes into debt and the key's next request waits); dropping an
//! unsettled reservation gives everything back, since the request never ran.
//!
//! Why our own bucket and not `governor`: GCRA cannot give cells back, and a
//! budget must refund. Why a type beside `ratelimit::Limiter` rather than one
//! folded limiter: a request limit answers yes or no and forgets, a budget
//! hands out a guard that lives as long as the request, so they have
//! different APIs; `[rate_limits.NAME]` builds either or both, sharing the
//! key derivation (`KeySource::key`), and a route carries `limiters` and
//! `budgets` side by side.
//!
//! State: per key a level in tokens (`f64`, refilled at `tokens_per_min / 60`
//! per second up to `burst`, negative while in debt), its last update time and
//! the count of reservations outstanding. The map is bounded by `max_keys`:
//! at the bound, a sweep (at most once a second) evicts full buckets with
//! nothing outstanding (idle keys, whose state is the same as a fresh one);
//! if the map is still full, new keys share one overflow bucket. Time comes
//! from a `Clock` passed in (`clock`), so tests are deterministic.

use super::clock::{Clock, MonotonicClock};
use super::ratelimit::{KeyInput, KeySource};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The key that new keys share once the map is full.
const OVERFLOW_KEY: u64 = u64::MAX;
/// Sweeps for idle keys at the bound happen at most this often.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// Longest wait a refusal reports (a key deep in debt).
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 3600);

/// Why a reservation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BudgetRefusal {
    /// Not enough tokens now; the bucket holds enough after `retry_after`.
    #[error("token budget exhausted; retry after {retry_after:?}")]
    Wait {
        /// Time until the bucket holds the tokens asked for.
        retry_after: Duration,
    },
    /// More tokens than the bucket can ever hold: waiting will not help.
    #[error("a request of {tokens} tokens can never fit a budget of {burst} tokens")]
    TooLarge {
        /// Tokens asked for.
        tokens: u64,
        /// The bucket's size.
        burst: u64,
    },
    /// The shared store is unreachable and the budget fails closed.
    #[error("the shared limit store is unreachable")]
    StoreDown,
}

impl BudgetRefusal {
    /// The wait for a `Wait` refusal; None when waiting will not help.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            BudgetRefusal::Wait { retry_after } => Some(*retry_after),
            BudgetRefusal::TooLarge { .. } | BudgetRefusal::StoreDown => None,
        }
    }
}

/// Size and rate of a budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BudgetSpec {
    /// Sustained tokens per minute (> 0).
    pub tokens_per_min: f64,
    /// Bucket size in tokens (>= 1): the most one request may reserve.
    pub burst: u64,
    /// Keys tracked at most (plus one overflow bucket).
    pub max_keys: usize,
}

#[derive(Debug)]
struct Bucket {
    level: f64,
    at: Instant,
    pending: u32,
}

impl Bucket {
    fn refill(&mut self, now: Instant, per_s: f64, burst: f64) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        if self.level < burst {
            self.level = (self.level + dt * per_s).min(burst);
        }
        self.at = self.at.max(now);
    }
}

#[derive(Debug)]
struct Keys {
    map: HashMap<u64, Bucket>,
    last_sweep: Option<Instant>,
}

/// One configured token budget, keyed like a request rate limit.
pub struct TokenBudget {
    name: String,
    source: KeySource,
    spec: BudgetSpec,
    per_s: f64,
    clock: Arc<dyn Clock>,
    keys: Mutex<Keys>,
    /// What it does with `[cluster]` while the store is down.
    pub on_store_error: crate::cluster::OnStoreError,
}

impl fmt::Debug for TokenBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TokenBudget({})", self.name)
    }
}

impl TokenBudget {
    /// A budget on the monotonic clock; None when the rate or burst is not
    /// positive.
    pub fn new(name: &str, source: KeySource, spec: BudgetSpec) -> Option<Self> {
        Self::with_clock(name, source, spec, Arc::new(MonotonicClock))
    }

    /// A budget on the given clock.
    pub fn with_clock(
        name: &str,
        source: KeySource,
        spec: BudgetSpec,
        clock: Arc<dyn Clock>,
    ) -> Option<Self> {
        let per_s = spec.tokens_per_min / 60.0;
        if !(per_s.is_finite() && per_s > 0.0) || spec.burst == 0 {
            return None;
        }
        Some(TokenBudget {
            name: name.to_string(),
            source,
            spec: BudgetSpec {
                max_keys: spec.max_keys.max(1),
                ..spec
            },
            per_s,
            clock,
            keys: Mutex::new(Keys {
                map: HashMap::new(),
                last_sweep: None,
            }),
            on_store_error: crate::cluster::OnStoreError::Local,
        })
    }

    /// Refill rate in tokens per second.
    pub fn per_s(&self) -> f64 {
        self.per_s
    }

    /// Name from the config.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Size and rate.
    pub fn spec(&self) -> BudgetSpec {
        self.spec
    }

    /// Where this budget's key comes from.
    pub fn source(&self) -> &KeySource {
        &self.source
    }

    /// The key of a request (as `Limiter::check` derives it); an error is a
    /// malformed key (a 400).
    pub fn key(&self, input: &KeyInput) -> Result<u64, &'static str> {
        self.source.key(input)
    }

    /// Take `tokens` from `key`'s bucket, or say how long until they fit.
    pub fn reserve(self: &Arc<Self>, key: u64, tokens: u64) -> Result<Reservation, BudgetRefusal> {
        self.reserve_scaled(key, tokens, 1)
    }

    /// `Err(TooLarge)` when `tokens` can never fit.
    pub fn fits(&self, tokens: u64) -> Result<(), BudgetRefusal> {
        if tokens > self.spec.burst {
            return Err(BudgetRefusal::TooLarge {
                tokens,
                burst: self.spec.burst,
            });
        }
        Ok(())
    }

    /// A reservation held in the shared store under `store_key` (taken
    /// there already); settling refunds it there.
    pub fn shared(self: &Arc<Self>, store_key: String, tokens: u64) -> Reservation {
        Reservation {
            budget: Arc::clone(self),
            key: 0,
            tokens,
            scale: 1,
            shared: Some(store_key),
            settled: false,
        }
    }

    /// `reserve`, charging `share` times the tokens (capped so that a
    /// request that fits the burst still fits): with `share` instances
    /// each keeping its own bucket, each gets 1/`share` of the rate (the
    /// `local` fallback of `[cluster]`).
    pub fn reserve_scaled(
        self: &Arc<Self>,
        key: u64,
        tokens: u64,
        share: usize,
    ) -> Result<Reservation, BudgetRefusal> {
        self.fits(tokens)?;
        let scale = (share.max(1) as u64)
            .min(self.spec.burst / tokens.max(1))
            .max(1);
        let now = self.clock.now();
        let burst = self.spec.burst as f64;
        let mut keys = self.keys.lock();
        let key = self.slot(&mut keys, key, now);
        let b = keys.map.entry(key).or_insert(Bucket {
            level: burst,
            at: now,
            pending: 0,
        });
        b.refill(now, self.per_s, burst);
        let need = (tokens * scale) as f64;
        if b.level < need {
            let secs = (need - b.level) / self.per_s;
            let retry_after = Duration::try_from_secs_f64(secs)
                .unwrap_or(MAX_RETRY_AFTER)
                .min(MAX_RETRY_AFTER);
            return Err(BudgetRefusal::Wait { retry_after });
        }
        b.level -= need;
        b.pending = b.pending.saturating_add(1);
        Ok(Reservation {
            budget: Arc::clone(self),
            key,
            tokens,
            scale,
            shared: None,
            settled: false,
        })
    }

    /// The key to use: `key` itself while there is room (after a sweep for
    /// idle keys if needed), else the shared overflow bucket.
    fn slot(&self, keys: &mut Keys, key: u64, now: Instant) -> u64 {
        if keys.map.len() < self.spec.max_keys || keys.map.contains_key(&key) {
            return key;
        }
        let due = keys
            .last_sweep
            .is_none_or(|t| now.saturating_duration_since(t) >= SWEEP_EVERY);
        if due {
            keys.last_sweep = Some(now);
            let (per_s, burst) = (self.per_s, self.spec.burst as f64);
            keys.map.retain(|k, b| {
                b.refill(now, per_s, burst);
                *k == OVERFLOW_KEY || b.pending > 0 || b.level < burst
            });
            if keys.map.len() < self.spec.max_keys {
                return key;
            }
        }
        OVERFLOW_KEY
    }

    /// Settle a reservation of `reserved` tokens of which `used` were used.
    fn give_back(&self, key: u64, reserved: u64, used: u64) {
        let now = self.clock.now();
        let burst = self.spec.burst as f64;
        let mut keys = self.keys.lock();
        if let Some(b) = keys.map.get_mut(&key) {
            b.refill(now, self.per_s, burst);
            b.pending = b.pending.saturating_sub(1);
            b.level = (b.level + (reserved as f64 - used as f64)).min(burst);
        }
    }

    /// Tokens `key`'s bucket holds now (negative in debt); None if the key
    /// has no bucket (a new key starts full).
    pub fn available(&self, key: u64) -> Option<f64> {
        let now = self.clock.now();
        let mut keys = self.keys.lock();
        let b = keys.map.get_mut(&key)?;
        b.refill(now, self.per_s, self.spec.burst as f64);
        Some(b.level)
    }

    /// Keys currently tracked (the overflow bucket included).
    pub fn tracked_keys(&self) -> usize {
        self.keys.lock().map.len()
    }
}

/// Tokens taken from a budget for one request. Settle it with the tokens
/// the request used; dropped unsettled, it gives everything back.
#[must_use = "dropping a reservation refunds it at once"]
pub struct Reservation {
    budget: Arc<TokenBudget>,
    key: u64,
    tokens: u64,
    /// Tokens charged per token (the `local` fallback's share).
    scale: u64,
    /// The shared store's key, when the store holds the tokens.
    shared: Option<String>,
    settled: bool,
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Reservation({}, {} tokens)",
            self.budget.name, self.tokens
        )
    }
}

impl Reservation {
    /// Tokens reserved.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The budget this came from.
    pub fn budget(&self) -> &Arc<TokenBudget> {
        &self.budget
    }

    /// The request used `used` tokens: refund the rest, or take the overshoot.
    pub fn settle(mut self, used: u64) {
        self.settled = true;
        self.release(used);
    }

    fn release(&mut self, used: u64) {
        match self.shared.take() {
            Some(k) => {
                if let Some(c) = crate::cluster::get() {
                    let b = &self.budget;
                    let delta = self.tokens as f64 - used as f64;
                    c.refund(k, b.per_s, b.spec.burst, delta);
                }
            }
            None => {
                let s = self.scale;
                self.budget
                    .give_back(self.key, self.tokens * s, used.saturating_mul(s));
            }
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.settled {
            self.release(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::clock::ManualClock;
    use proptest::prelude::*;

    /// 600 tokens a minute = 10 a second, burst 100.
    fn budget(max_keys: usize) -> (Arc<TokenBudget>, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new());
        let spec = BudgetSpec {
            tokens_per_min: 600.0,
            burst: 100,
            max_keys,
        };
        let b = TokenBudget::with_clock("t", KeySource::Route, spec, clock.clone()).unwrap();
        (Arc::new(b), clock)
    }

    fn wait(r: Result<Reservation, BudgetRefusal>) -> Duration {
        match r {
            Err(BudgetRefusal::Wait { retry_after }) => retry_after,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn reserve_refuse_with_exact_wait_then_fit() {
        let (b, clock) = budget(10);
        let r = b.reserve(1, 80).unwrap();
        assert_eq!(wait(b.reserve(1, 50)), Duration::from_secs(3));
        clock.advance(Duration::from_secs(3));
        let r2 = b.reserve(1, 50).unwrap();
        assert!(b.available(1).unwrap().abs() < 1e-9);
        r.settle(80);
        r2.settle(50);
        // Another key has its own full bucket.
        assert!(b.reserve(2, 100).is_ok());
    }

    #[test]
    fn too_large_is_distinct_from_wait() {
        let (b, _) = budget(10);
        let e = b.reserve(1, 101).unwrap_err();
        assert_eq!(
            e,
            BudgetRefusal::TooLarge {
                tokens: 101,
                burst: 100
            }
        );
        assert_eq!(e.retry_after(), None);
    }

    #[test]
    fn settle_refunds_the_unused_part_and_drop_refunds_all() {
        let (b, _) = budget(10);
        b.reserve(1, 60).unwrap().settle(20);
        assert!((b.available(1).unwrap() - 80.0).abs() < 1e-9);
        drop(b.reserve(1, 80).unwrap());
        assert!((b.available(1).unwrap() - 80.0).abs() < 1e-9);
    }

    #[test]
    fn refund_never_fills_past_burst() {
        let (b, clock) = budget(10);
        let r = b.reserve(1, 100).unwrap();
        clock.advance(Duration::from_secs(60));
        drop(r);
        assert!((b.available(1).unwrap() - 100.0).abs() < 1e-9);
    }

    #[test]
    fn overshoot_goes_into_debt_and_the_next_request_waits() {
        let (b, clock) = budget(10);
        b.reserve(1, 50).unwrap().settle(130);
        assert!((b.available(1).unwrap() + 30.0).abs() < 1e-9);
        assert_eq!(wait(b.reserve(1, 0)), Duration::from_secs(3));
        clock.advance(Duration::from_secs(4));
        assert!(b.reserve(1, 10).is_ok());
    }

    #[test]
    fn key_state_is_bounded_and_idle_keys_are_evicted() {
        let (b, clock) = budget(100);
        let mut held = Vec::new();
        for k in 0..10_000u64 {
            if let Ok(r) = b.reserve(k, 10) {
                held.push(r);
            }
        }
        assert!(b.tracked_keys() <= 101, "{}", b.tracked_keys());
        // Keys past the bound share the overflow bucket: 10 of 10 tokens fit.
        assert_eq!(held.len(), 100 + 10);
        drop(held);
        // Once idle (full again) the keys are evicted and new keys get their
        // own bucket.
        clock.advance(Duration::from_secs(2));
        for k in 20_000..20_050u64 {
            b.reserve(k, 100).unwrap().settle(100);
        }
        assert!(b.tracked_keys() <= 101, "{}", b.tracked_keys());
        assert!(b.available(20_000).is_some());
    }

    #[test]
    fn a_bucket_with_a_reservation_outstanding_is_not_evicted() {
        let (b, clock) = budget(1);
        let r = b.reserve(1, 1).unwrap();
        clock.advance(Duration::from_secs(60));
        b.reserve(2, 1).unwrap().settle(1);
        assert!(b.available(1).is_some());
        assert!(
            b.available(2).is_none(),
            "key 2 went to the overflow bucket"
        );
        r.settle(1);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Reserve(u64, u64),
        Settle(usize, u64),
        Drop(usize),
        Advance(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..3u64, 0..120u64).prop_map(|(k, t)| Op::Reserve(k, t)),
            (0..8usize, 0..250u64).prop_map(|(i, u)| Op::Settle(i, u)),
            (0..8usize).prop_map(Op::Drop),
            (0..4000u64).prop_map(Op::Advance),
        ]
    }

    proptest! {
        /// A bucket never holds more than its burst, and never more than
        /// it started with plus what time refilled minus what was consumed
        /// (so a refund never creates tokens that were not taken).
        #[test]
        fn never_above_burst_nor_above_what_was_taken(ops in proptest::collection::vec(op(), 1..200)) {
            let (b, clock) = budget(8);
            let mut held: Vec<(u64, Reservation)> = Vec::new();
            let mut consumed = [0f64; 3];
            let mut elapsed = 0f64;
            for op in ops {
                match op {
                    Op::Reserve(k, t) => {
                        if let Ok(r) = b.reserve(k, t) {
                            consumed[k as usize] += t as f64;
                            held.push((k, r));
                        }
                    }
                    Op::Settle(i, used) if i < held.len() => {
                        let (k, r) = held.swap_remove(i);
                        consumed[k as usize] += used as f64 - r.tokens() as f64;
                        r.settle(used);
                    }
                    Op::Drop(i) if i < held.len() => {
                        let (k, r) = held.swap_remove(i);
                        consumed[k as usize] -= r.tokens() as f64;
                    }
                    Op::Advance(ms) => {
                        clock.advance(Duration::from_millis(ms));
                        elapsed += ms as f64 / 1000.0;
                    }
                    _ => {}
                }
                for k in 0..3u64 {
                    let Some(level) = b.available(k) else { continue };
                    prop_assert!(level <= 100.0 + 1e-6, "key {k}: {level}");
                    let bound = 100.0 + 10.0 * elapsed - consumed[k as usize];
                    prop_assert!(level <= bound + 1e-6, "key {k}: {level} > {bound}");
                }
            }
        }
    }
}
