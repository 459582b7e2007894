//! Handing memory freed after a burst back to the OS.
//!
//! The binary allocates through glibc's malloc (mimalloc is a build
//! option, `--features mimalloc`). glibc keeps freed memory for reuse and
//! gives back only what lies at the top of a heap, so the memory a burst
//! took (an overload shed, a flood of connections) stayed mapped for ever.
//! `malloc_trim` hands back every free page, wherever it is, at 4 KiB
//! granularity. It is asked for once the process is quiet again after
//! activity (no request, async job or upstream stream in flight), checked
//! once a second: a busy server never pays for it, and an idle one is back
//! to its idle memory within a second or two of the last request.
//!
//! mimalloc was the allocator before: its 64 KiB pages stay mapped while
//! any block in them lives, so a few long-lived blocks allocated mid-burst
//! kept 1-3 MiB after a 60 s overload soak (benches/RESULTS.md section 10);
//! glibc with the trim comes back within 1 MiB, from an idle RSS 7 MiB
//! lower.

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Something allocated since the last release.
static BUSY: AtomicBool = AtomicBool::new(false);

/// How often the quiet check runs.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);

/// Note activity (a request started). Written only when it changes, so
/// the per-request cost is one shared load.
pub fn note_busy() {
    if !BUSY.load(Ordering::Relaxed) {
        BUSY.store(true, Ordering::Relaxed);
    }
}

/// Hand back what the allocator holds free. A no-op where there is no
/// such call (mimalloc builds, which purge on their own, or non-glibc).
#[allow(unsafe_code)]
pub fn release() {
    // SAFETY: `malloc_trim` takes glibc's arena locks itself and may be
    // called at any time from any thread.
    #[cfg(all(not(feature = "mimalloc"), target_env = "gnu"))]
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The background service that releases memory once quiet after activity.
pub struct Releaser<F> {
    /// Whether nothing is in flight now.
    pub quiet: F,
}

impl<F: Fn() -> bool> Releaser<F> {
    /// One check: release if there was activity since the last release and
    /// there is none now. Returns whether it released.
    pub fn tick(&self) -> bool {
        if BUSY.load(Ordering::Relaxed) && (self.quiet)() {
            BUSY.store(false, Ordering::Relaxed);
            release();
            return true;
        }
        false
    }
}

#[async_trait]
impl<F: Fn() -> bool + Send + Sync> BackgroundService for Releaser<F> {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tokio::time::sleep(CHECK_EVERY) => {
                    self.tick();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn releases_once_per_quiet_period_after_activity() {
        let inflight = AtomicUsize::new(0);
        let r = Releaser {
            quiet: || inflight.load(Ordering::Relaxed) == 0,
        };
        BUSY.store(false, Ordering::Relaxed);
        assert!(!r.tick(), "no activity yet");
        note_busy();
        inflight.store(1, Ordering::Relaxed);
        assert!(!r.tick(), "busy now");
        inflight.store(0, Ordering::Relaxed);
        assert!(r.tick(), "quiet after activity");
        assert!(!r.tick(), "once per quiet period");
    }
}
