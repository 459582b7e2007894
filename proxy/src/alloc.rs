//! Handing memory freed after a burst back to the OS.
//!
//! An allocator keeps freed memory for reuse and gives it back on its own
//! schedule, so the memory a burst took (an overload shed, a flood of
//! connections) stayed mapped well after it. Once the process is quiet
//! again after activity (no request started for a whole second, and no
//! request, async job or upstream stream in flight) every arena is asked
//! to purge its free pages: a busy server never pays for it, and an idle
//! one is back to its idle memory within two seconds of the last request.
//!
//! Why jemalloc is the default (benches/RESULTS.md section 10, round 3):
//! - mimalloc keeps a 64 KiB page mapped while any block in it lives, so a
//!   few long-lived blocks allocated mid-burst kept 1-3 MiB after a 60 s
//!   overload soak, even when collected every second;
//! - glibc's malloc with `malloc_trim` came back within 1 MiB, but cost a
//!   fifth of the proxy's throughput with two workers (blocks freed on
//!   another thread than the one that allocated them take that arena's
//!   lock);
//! - jemalloc purges free pages at page granularity (`arena.<all>.purge`)
//!   and frees across threads without a shared lock.

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A request started since the last check.
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

/// Hand back what the allocator holds free. A no-op for mimalloc, whose
/// purge is per thread (the worker's own, set to purge at once in `main`).
#[allow(unsafe_code)]
pub fn release() {
    #[cfg(all(feature = "jemalloc", not(feature = "mimalloc")))]
    {
        // `MALLCTL_ARENAS_ALL` (4096): every arena, not just this thread's.
        const PURGE_ALL: &[u8] = b"arena.4096.purge\0";
        // SAFETY: a "void" mallctl (no old or new value: null pointers and
        // length 0, as jemalloc documents for `arena.<i>.purge`), named by
        // a NUL-terminated string; jemalloc takes its own locks.
        let rc = unsafe {
            tikv_jemalloc_sys::mallctl(
                PURGE_ALL.as_ptr().cast(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if rc != 0 {
            log::debug!("jemalloc purge failed: {rc}");
        }
    }
    // SAFETY: `malloc_trim` takes glibc's arena locks itself and may be
    // called at any time from any thread.
    #[cfg(all(
        not(feature = "jemalloc"),
        not(feature = "mimalloc"),
        target_env = "gnu"
    ))]
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Let jemalloc's own decay (free pages back to the OS some seconds after
/// their last use) run on a thread of its own. Without it jemalloc decays
/// only while the process allocates, and the quiet-time purge above never
/// comes while light traffic goes on: after a burst of 500 slow readers,
/// with a probe every 100 ms, the burst's pages stayed mapped for the
/// whole attack (384 KiB per connection where its drains held 36).
#[allow(unsafe_code)]
pub fn background_decay() {
    #[cfg(all(feature = "jemalloc", not(feature = "mimalloc")))]
    {
        const NAME: &[u8] = b"background_thread\0";
        let mut on = true;
        // SAFETY: a bool write mallctl (`background_thread`, documented as
        // `bool rw`): a valid pointer to a bool and its size; jemalloc
        // starts its threads and takes its own locks.
        let rc = unsafe {
            tikv_jemalloc_sys::mallctl(
                NAME.as_ptr().cast(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                (&mut on as *mut bool).cast(),
                std::mem::size_of::<bool>(),
            )
        };
        if rc != 0 {
            log::debug!("jemalloc background_thread failed: {rc}");
        }
    }
}

/// The background service that releases memory once quiet after activity.
pub struct Releaser<F> {
    /// Whether nothing is in flight now.
    pub quiet: F,
    /// Activity since the last release: a release is owed.
    pub owed: AtomicBool,
}

impl<F: Fn() -> bool> Releaser<F> {
    /// A releaser with nothing owed yet.
    pub fn new(quiet: F) -> Self {
        Releaser {
            quiet,
            owed: AtomicBool::new(false),
        }
    }

    /// One check: release when a release is owed, no request started since
    /// the last check, and nothing is in flight. A purge of a large heap
    /// holds the allocator's arena locks for a while, so it waits for a
    /// whole quiet interval rather than a momentary gap between requests.
    /// Returns whether it released.
    pub fn tick(&self) -> bool {
        if BUSY.swap(false, Ordering::Relaxed) {
            self.owed.store(true, Ordering::Relaxed);
            return false;
        }
        if self.owed.load(Ordering::Relaxed) && (self.quiet)() {
            self.owed.store(false, Ordering::Relaxed);
            release();
            return true;
        }
        false
    }
}

#[async_trait]
impl<F: Fn() -> bool + Send + Sync> BackgroundService for Releaser<F> {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        // Here, in the serving process (after any fork of a daemon).
        background_decay();
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
        let r = Releaser::new(|| inflight.load(Ordering::Relaxed) == 0);
        BUSY.store(false, Ordering::Relaxed);
        assert!(!r.tick(), "no activity yet");
        note_busy();
        inflight.store(1, Ordering::Relaxed);
        assert!(!r.tick(), "a request started in this interval");
        assert!(!r.tick(), "still in flight");
        inflight.store(0, Ordering::Relaxed);
        note_busy();
        assert!(!r.tick(), "a request started in this interval");
        assert!(r.tick(), "a whole quiet interval after activity");
        assert!(!r.tick(), "once per quiet period");
    }
}
