//! The retry budget: retries may be at most `ratio` of the requests seen in
//! the last `WINDOW_S` seconds, plus a small floor so a quiet pool can still
//! retry. This is what keeps a failing upstream from receiving (1 + retries)
//! times its normal load exactly when it is least able to take it.
//!
//! The window is a ring of one-second slots, each one atomic word packing the
//! slot's second and its count, so recording a request is a single
//! `fetch_add` in the common case and no lock is ever taken.

use std::sync::atomic::{AtomicU64, Ordering};

const WINDOW_S: u64 = 10;

/// A sliding-window retry budget.
#[derive(Debug)]
pub struct RetryBudget {
    ratio: f64,
    min_per_s: u64,
    requests: [AtomicU64; WINDOW_S as usize],
    retries: [AtomicU64; WINDOW_S as usize],
}

fn now_s() -> u64 {
    super::now_ms() / 1000 + 1
}

fn bump(slots: &[AtomicU64; WINDOW_S as usize], sec: u64) {
    let slot = &slots[(sec % WINDOW_S) as usize];
    let mut cur = slot.load(Ordering::Relaxed);
    loop {
        let next = if cur >> 32 == sec {
            cur + 1
        } else {
            (sec << 32) | 1
        };
        match slot.compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return,
            Err(actual) => cur = actual,
        }
    }
}

fn sum(slots: &[AtomicU64; WINDOW_S as usize], sec: u64) -> u64 {
    slots
        .iter()
        .map(|s| s.load(Ordering::Relaxed))
        .filter(|v| sec.saturating_sub(v >> 32) < WINDOW_S)
        .map(|v| v & 0xffff_ffff)
        .sum()
}

impl RetryBudget {
    /// A budget allowing `ratio` retries per request plus `min_per_s` per second.
    pub fn new(ratio: f64, min_per_s: u32) -> Self {
        RetryBudget {
            ratio,
            min_per_s: min_per_s as u64,
            requests: Default::default(),
            retries: Default::default(),
        }
    }

    /// Record a request.
    pub fn deposit(&self) {
        bump(&self.requests, now_s());
    }

    /// Take one retry from the budget if there is room.
    pub fn try_withdraw(&self) -> bool {
        let sec = now_s();
        let reqs = sum(&self.requests, sec) as f64;
        let done = sum(&self.retries, sec) as f64;
        let allowed = self.ratio * reqs + (self.min_per_s * WINDOW_S) as f64;
        if done + 1.0 > allowed {
            return false;
        }
        bump(&self.retries, sec);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_caps_retries() {
        let b = RetryBudget::new(0.2, 0);
        for _ in 0..100 {
            b.deposit();
        }
        let granted = (0..100).filter(|_| b.try_withdraw()).count();
        assert_eq!(granted, 20);
    }

    #[test]
    fn floor_allows_retries_without_traffic() {
        let b = RetryBudget::new(0.0, 1);
        let granted = (0..100).filter(|_| b.try_withdraw()).count();
        assert_eq!(granted, WINDOW_S as usize);
    }
}
