//! What a graceful shutdown waits for beyond proxied requests in flight:
//! async jobs still generating after their `202`, and upstream streams
//! still relaying (a relay task outlives the request that started it while
//! it winds down). Each holds a [`Work`] guard while it runs; the drain
//! watcher in `server` waits for all of them, up to the grace period, and
//! logs what it had to abandon.
//!
//! The counters are process-wide statics: there is one drain per process,
//! and the tasks that hold them are spawned deep in the inference path,
//! where threading a handle through would touch every constructor.

use std::sync::atomic::{AtomicUsize, Ordering};

/// A kind of work the drain waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// An async request (`202 Accepted`) still running.
    AsyncJob,
    /// An upstream inference stream still relaying.
    UpstreamStream,
}

static JOBS: AtomicUsize = AtomicUsize::new(0);
static STREAMS: AtomicUsize = AtomicUsize::new(0);

fn counter(k: Kind) -> &'static AtomicUsize {
    match k {
        Kind::AsyncJob => &JOBS,
        Kind::UpstreamStream => &STREAMS,
    }
}

/// Counts one unit of `Kind` work while alive.
#[derive(Debug)]
pub struct Work(Kind);

impl Work {
    /// Start counting.
    pub fn start(k: Kind) -> Self {
        counter(k).fetch_add(1, Ordering::Relaxed);
        Work(k)
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        counter(self.0).fetch_sub(1, Ordering::Relaxed);
    }
}

/// Work of `k` running now.
pub fn running(k: Kind) -> usize {
    counter(k).load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_count_while_alive() {
        let before = running(Kind::AsyncJob);
        let a = Work::start(Kind::AsyncJob);
        let b = Work::start(Kind::AsyncJob);
        assert_eq!(running(Kind::AsyncJob), before + 2);
        drop((a, b));
        assert_eq!(running(Kind::AsyncJob), before);
    }
}
