//! Time sources for admission state that tests must drive by hand: the
//! monotonic clock in production, a manual one in tests and simulations.
//! (`governor` has its own clock abstraction; this one serves our own
//! token buckets, `budget`.)

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A source of monotonic time.
pub trait Clock: Send + Sync + fmt::Debug {
    /// The current instant.
    fn now(&self) -> Instant;
}

/// `Instant::now()`.
#[derive(Debug, Default, Clone, Copy)]
pub struct MonotonicClock;

impl Clock for MonotonicClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that moves only when told to (tests and simulations).
#[derive(Debug)]
pub struct ManualClock {
    base: Instant,
    offset_ns: AtomicU64,
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl ManualClock {
    /// A clock standing at an arbitrary instant.
    pub fn new() -> Self {
        ManualClock {
            base: Instant::now(),
            offset_ns: AtomicU64::new(0),
        }
    }

    /// Move the clock forward.
    pub fn advance(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.offset_ns.fetch_add(ns, Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.base + Duration::from_nanos(self.offset_ns.load(Ordering::Relaxed))
    }
}
