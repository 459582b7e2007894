//! The engine's compute threads run below the proxy's.
//!
//! The engine thread and the rayon pool that runs the model kernels (its
//! own pool, not rayon's global one: every step runs inside it) each move
//! to Linux's `SCHED_IDLE` policy when they start, and raise their nice
//! value by [`NICE_INCREMENT`] (what counts where `SCHED_IDLE` is refused).
//! The proxy's network threads keep theirs, so a network thread that wakes
//! takes the CPU from a compute thread at once, and a busy engine slows its
//! own steps rather than every request the proxy relays. A nice value
//! alone was not enough: with both cores in a step, 200 requests arriving
//! together waited 100-170 ms for their refusals (20 ms without the
//! engine's work), since a thread only a few nice levels better does not
//! always preempt at wake-up. `SCHED_IDLE` threads still get a sliver of
//! CPU when the proxy is saturated, so the engine never stops outright.
//! Threads take their creator's nice value and all of these are created by
//! the thread that starts the engine, so each ends at the creator's value
//! plus the increment.
//!
//! Failure (a sandbox forbidding it, a platform without per-thread nice
//! values) is logged once and otherwise ignored: priorities are a
//! preference, not a requirement.

use std::sync::atomic::{AtomicBool, Ordering};

/// How much nicer than the thread that starts it the engine's threads run.
pub const NICE_INCREMENT: i32 = 5;

/// A thread pool for the model kernels whose threads run at the lowered
/// priority.
#[cfg(test)]
pub(super) fn compute_pool() -> crate::error::Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .thread_name(|i| format!("engine-compute-{i}"))
        .start_handler(|_| lower_this_thread())
        .build()
        .map_err(|e| {
            crate::error::EngineError::Invalid(format!("cannot start the engine's threads: {e}"))
        })
}

/// Move the calling thread to `SCHED_IDLE` and lower its priority by
/// [`NICE_INCREMENT`]; on failure, warn the first time.
pub(super) fn lower_this_thread() {
    static WARNED: AtomicBool = AtomicBool::new(false);
    let r = renice_this_thread(NICE_INCREMENT).and(idle_policy_this_thread());
    if let Err(e) = r {
        if !WARNED.swap(true, Ordering::Relaxed) {
            log::warn!("engine: cannot lower the compute threads' priority: {e}");
        }
    }
}

/// Put the calling thread under `SCHED_IDLE`.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn idle_policy_this_thread() -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid sched_param that outlives the call; on
    // Linux pid 0 names the calling thread only.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// No such policy elsewhere.
#[cfg(not(target_os = "linux"))]
fn idle_policy_this_thread() -> std::io::Result<()> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "SCHED_IDLE is Linux-only",
    ))
}

/// Add `by` to the calling thread's nice value.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn renice_this_thread(by: i32) -> std::io::Result<()> {
    // SAFETY: getpriority and setpriority take integers only and touch no
    // memory of ours. On Linux the nice value is per thread and `who = 0`
    // with PRIO_PROCESS names the calling thread only. getpriority cannot
    // fail for the calling thread, so its -1 is a real nice value.
    let rc = unsafe {
        let now = libc::getpriority(libc::PRIO_PROCESS, 0);
        libc::setpriority(libc::PRIO_PROCESS, 0, now + by)
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Elsewhere `setpriority` may act on the whole process (the proxy too).
#[cfg(not(target_os = "linux"))]
fn renice_this_thread(_by: i32) -> std::io::Result<()> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "per-thread nice values are Linux-only",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calling thread's nice value, from procfs.
    fn nice() -> i32 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
        // Field 19, the 17th after the parenthesised command name.
        let rest = stat.rsplit(')').next().unwrap_or_default();
        rest.split_whitespace()
            .nth(16)
            .and_then(|v| v.parse().ok())
            .unwrap_or(i32::MIN)
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn pool_threads_run_nicer_than_their_creator() {
        let before = nice();
        let pool = compute_pool().expect("pool");
        let inside = pool.install(nice);
        assert_eq!(inside, (before + NICE_INCREMENT).min(19));
        assert_eq!(nice(), before, "the creating thread was reniced");
        #[allow(unsafe_code)]
        // SAFETY: no arguments but the calling thread's id (0).
        let policy = || unsafe { libc::sched_getscheduler(0) };
        assert_eq!(pool.install(policy), libc::SCHED_IDLE);
        assert_eq!(policy(), libc::SCHED_OTHER, "the creating thread moved");
    }
}
