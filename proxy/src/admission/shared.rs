//! The admission decisions that several instances share: request rates
//! (the route's limiters and the API key's own rate) and token
//! reservations (the route's budgets and the key's). Without `[cluster]`
//! both run in memory as before; with it each decision is one round trip
//! to the store (`cluster::limits`), and while the store is down each
//! limit's `on_store_error` decides: `local` runs the in-memory limit with
//! each request counted as many times as there are live instances (so the
//! instances together stay near the configured total), `open` allows,
//! `closed` refuses with 503.
//!
//! Store keys: `rl:NAME:KEY` and `tb:NAME:KEY` for `[rate_limits.NAME]`
//! (KEY the request key's 64-bit hash in hex), `ak:NAME:r` and `ak:NAME:t`
//! for API key NAME.

use super::budget::{BudgetRefusal, Reservation, TokenBudget};
use super::keys::KeyEntry;
use super::ratelimit::{KeyInput, Limiter, Verdict};
use crate::cluster::limits::Check;
use crate::cluster::{Cluster, OnStoreError};
use std::sync::Arc;

/// The API key of a decision and its `on_store_error`.
pub type KeyRef<'a> = Option<(&'a KeyEntry, OnStoreError)>;

/// The route's request rates, then the key's, as one decision. Err is the
/// first refusal (nothing is counted against the others in the store).
pub async fn check_rates(
    limiters: &[Arc<Limiter>],
    key: KeyRef<'_>,
    input: &KeyInput<'_>,
) -> Result<(), Verdict> {
    let Some(c) = crate::cluster::get() else {
        super::check_limits(limiters, input)?;
        return match key.map(|(k, _)| k.check_rate()) {
            Some(Err(wait)) => Err(Verdict::Limited(wait)),
            _ => Ok(()),
        };
    };
    let mut checks = Vec::with_capacity(limiters.len() + 1);
    for l in limiters {
        let k = l.source().key(input).map_err(Verdict::BadKey)?;
        let (per_s, burst) = l.rate();
        checks.push(Check::Rate {
            key: c.key(format_args!("rl:{}:{k:016x}", l.name)),
            per_s,
            burst,
        });
    }
    let key_rate = key.and_then(|(k, _)| k.limits.rate);
    if let (Some((k, _)), Some((per_s, burst))) = (key, key_rate) {
        checks.push(Check::Rate {
            key: c.key(format_args!("ak:{}:r", k.name)),
            per_s,
            burst,
        });
    }
    match c.decide(&checks).await {
        Ok(None) => Ok(()),
        Ok(Some((_, wait))) => Err(Verdict::Limited(wait)),
        Err(_) => rates_without_store(c, limiters, key, input),
    }
}

fn rates_without_store(
    c: &Cluster,
    limiters: &[Arc<Limiter>],
    key: KeyRef<'_>,
    input: &KeyInput<'_>,
) -> Result<(), Verdict> {
    let share = c.live();
    for l in limiters {
        count(c, l.on_store_error);
        match l.on_store_error {
            OnStoreError::Local => match l.check_scaled(input, share) {
                Verdict::Allow => {}
                v => return Err(v),
            },
            OnStoreError::Open => {}
            OnStoreError::Closed => return Err(Verdict::StoreDown),
        }
    }
    if let Some((k, mode)) = key.filter(|(k, _)| k.limiter.is_some()) {
        count(c, mode);
        match mode {
            OnStoreError::Local => k.check_rate_scaled(share).map_err(Verdict::Limited)?,
            OnStoreError::Open => {}
            OnStoreError::Closed => return Err(Verdict::StoreDown),
        }
    }
    Ok(())
}

fn count(c: &Cluster, mode: OnStoreError) {
    c.metrics()
        .fallbacks
        .with_label_values(&[mode.as_str()])
        .inc();
}

/// One budget of a reservation: the budget, the request's key in it, and
/// its `on_store_error`.
pub struct Want<'a> {
    /// The budget.
    pub budget: &'a Arc<TokenBudget>,
    /// The request's key in it (0 for an API key's own budget).
    pub key: u64,
    /// The API key whose own budget this is; None for a route's budget.
    pub api_key: Option<&'a str>,
    /// What it does while the store is down.
    pub mode: OnStoreError,
}

impl Want<'_> {
    /// Its key in the store: `ak:NAME:t` or `tb:NAME:KEY`.
    fn store_key(&self, c: &Cluster) -> String {
        match self.api_key {
            Some(name) => c.key(format_args!("ak:{name}:t")),
            None => c.key(format_args!("tb:{}:{:016x}", self.budget.name(), self.key)),
        }
    }
}

/// Reserve `tokens` from every budget in `wants`, all or nothing.
pub async fn reserve(wants: &[Want<'_>], tokens: u64) -> Result<Vec<Reservation>, BudgetRefusal> {
    let Some(c) = crate::cluster::get() else {
        return wants
            .iter()
            .map(|w| w.budget.reserve(w.key, tokens))
            .collect();
    };
    for w in wants {
        w.budget.fits(tokens)?;
    }
    let checks: Vec<Check> = wants
        .iter()
        .map(|w| Check::Tokens {
            key: w.store_key(c),
            per_s: w.budget.per_s(),
            burst: w.budget.spec().burst,
            tokens,
        })
        .collect();
    match c.decide(&checks).await {
        // Each reservation keeps the key its check was made with.
        Ok(None) => Ok(wants
            .iter()
            .zip(checks)
            .map(|(w, check)| w.budget.shared(check.into_key(), tokens))
            .collect()),
        Ok(Some((_, retry_after))) => Err(BudgetRefusal::Wait { retry_after }),
        Err(_) => {
            let mut held = Vec::with_capacity(wants.len());
            for w in wants {
                count(c, w.mode);
                match w.mode {
                    OnStoreError::Local => {
                        held.push(w.budget.reserve_scaled(w.key, tokens, c.live())?)
                    }
                    OnStoreError::Open => {}
                    OnStoreError::Closed => return Err(BudgetRefusal::StoreDown),
                }
            }
            Ok(held)
        }
    }
}
