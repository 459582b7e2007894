//! One thread team per step: the engine thread plus one worker per extra
//! core run the whole step as one job, meeting at spin barriers between its
//! phases, and park only between steps.
//!
//! rayon dispatched about 240 separate jobs per decode step; each one woke
//! the pool's threads and parked the caller (the engine thread is not a
//! rayon worker), and candle ran a second pool of its own. Here a step is
//! one wake-up: the workers spin briefly after each step (a decode step
//! follows the last one within microseconds) and park on a condition
//! variable after [`IDLE_SPINS`]. Barriers spin a bounded number of times
//! and then yield, since the machine is shared and the other thread may be
//! off its core.
//!
//! The job is a borrowed closure handed to threads that outlive it, which
//! safe Rust cannot express: `run` erases its lifetime and does not return
//! until every worker has finished with it (also when the job panics).
//! [`Shared`] is the other piece of `unsafe`: a buffer the team writes at
//! disjoint indices in one phase and reads after the barrier.

#![allow(unsafe_code)]

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Spins of a worker waiting for the next step before it parks (about
/// 100-300 us): long enough to span the sampling between decode steps.
const IDLE_SPINS: u32 = 20_000;
/// Spins at a barrier before each `yield_now`.
const BARRIER_SPINS: u32 = 2_000;

type Job = dyn Fn(&Ctx) + Sync;

/// The erased job pointer; valid while `run` waits.
#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: the pointee is `Sync` and outlives every use (see `Team::run`).
unsafe impl Send for JobPtr {}

struct State {
    n: usize,
    /// Bumped for every job (and once at shutdown).
    generation: AtomicU64,
    job: UnsafeCell<Option<JobPtr>>,
    /// Workers still inside the current job.
    pending: AtomicUsize,
    stop: AtomicBool,
    /// A thread's part of the job panicked: barriers stop waiting.
    poisoned: AtomicBool,
    bar_count: AtomicUsize,
    bar_gen: AtomicUsize,
    park: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by `run` while no worker reads it (between
// jobs, ordered by `generation`'s release/acquire), read by workers only
// during a job.
unsafe impl Sync for State {}

/// A running team of `n` threads (the caller of [`Team::run`] is thread 0).
pub struct Team {
    state: Arc<State>,
    workers: Vec<JoinHandle<()>>,
}

/// What a thread of the team sees of it during a job.
pub struct Ctx<'a> {
    /// This thread's index (0 is the caller of `run`).
    pub tid: usize,
    /// Threads in the team.
    pub n: usize,
    state: &'a State,
}

impl Ctx<'_> {
    /// Wait until every thread of the team has arrived.
    pub fn barrier(&self) {
        let s = self.state;
        if s.n == 1 {
            return;
        }
        poisoned_exit(s);
        let gen = s.bar_gen.load(Ordering::Acquire);
        if s.bar_count.fetch_add(1, Ordering::AcqRel) + 1 == s.n {
            s.bar_count.store(0, Ordering::Relaxed);
            s.bar_gen.store(gen.wrapping_add(1), Ordering::Release);
            return;
        }
        let mut spins = 0;
        while s.bar_gen.load(Ordering::Acquire) == gen {
            poisoned_exit(s);
            spins += 1;
            if spins < BARRIER_SPINS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Claim the next `chunk` units of `total` from `counter` (shared by the
    /// team for one phase); `None` when all are taken. Work is handed out
    /// as threads ask, so a thread that lost its core does not hold the
    /// others back.
    pub fn claim(
        &self,
        counter: &AtomicUsize,
        total: usize,
        chunk: usize,
    ) -> Option<std::ops::Range<usize>> {
        let start = counter.fetch_add(chunk, Ordering::Relaxed);
        (start < total).then(|| start..(start + chunk).min(total))
    }
}

/// After a thread's part panicked, the others leave the job at their next
/// barrier (by unwinding, which `run` and the workers catch) rather than
/// run on into phases whose inputs were never finished.
fn poisoned_exit(s: &State) {
    if s.poisoned.load(Ordering::Acquire) {
        std::panic::resume_unwind(Box::new("the step was abandoned: another thread panicked"));
    }
}

impl Team {
    /// Start a team of `n` threads (`n - 1` workers); each worker runs
    /// `init` first (to lower its priority).
    pub fn new(n: usize, init: fn()) -> std::io::Result<Team> {
        let n = n.max(1);
        let state = Arc::new(State {
            n,
            generation: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            pending: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            poisoned: AtomicBool::new(false),
            bar_count: AtomicUsize::new(0),
            bar_gen: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
        });
        // The team exists before its workers, so that a failed spawn drops
        // it and stops the ones already started.
        let mut team = Team {
            state,
            workers: Vec::with_capacity(n - 1),
        };
        for tid in 1..n {
            let s = team.state.clone();
            let h = std::thread::Builder::new()
                .name(format!("engine-team-{tid}"))
                .spawn(move || {
                    // A panicking `init` must not leave a worker that
                    // never takes part (every job would wait for it).
                    let _ = catch_unwind(init);
                    worker(&s, tid)
                })?;
            team.workers.push(h);
        }
        Ok(team)
    }

    /// Threads in the team.
    pub fn threads(&self) -> usize {
        self.state.n
    }

    /// Run `job` on every thread of the team (this one as thread 0) and
    /// return when all are done; `Err` if any part of it panicked. `&mut`:
    /// one job at a time (the erased job pointer and the worker count are
    /// the team's only slot).
    pub fn run(&mut self, job: &(dyn Fn(&Ctx) + Sync)) -> Result<(), String> {
        let s = &*self.state;
        s.poisoned.store(false, Ordering::Relaxed);
        s.bar_count.store(0, Ordering::Relaxed);
        if s.n > 1 {
            // SAFETY: erases the borrow's lifetime. The pointer is used
            // only by workers inside this job, and this function does not
            // return (nor unwind: thread 0's part is caught) before
            // `pending` says every worker has left the job.
            let ptr: *const Job = unsafe { std::mem::transmute(job as *const _) };
            // SAFETY: no worker reads `job` between jobs (they wait for
            // `generation` to move, which happens below, with release).
            unsafe { *s.job.get() = Some(JobPtr(ptr)) };
            s.pending.store(s.n - 1, Ordering::Relaxed);
            {
                let _g = s.park.lock().unwrap_or_else(|e| e.into_inner());
                s.generation.fetch_add(1, Ordering::Release);
            }
            s.wake.notify_all();
        }
        let ctx = Ctx {
            tid: 0,
            n: s.n,
            state: s,
        };
        if catch_unwind(AssertUnwindSafe(|| job(&ctx))).is_err() {
            s.poisoned.store(true, Ordering::Release);
        }
        let mut spins = 0u32;
        while s.pending.load(Ordering::Acquire) != 0 {
            spins = spins.saturating_add(1);
            if spins < BARRIER_SPINS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        if s.poisoned.load(Ordering::Relaxed) {
            return Err("a compute thread panicked during the step".into());
        }
        Ok(())
    }
}

fn worker(s: &State, tid: usize) {
    let mut seen = 0u64;
    loop {
        let mut spins = 0;
        loop {
            let g = s.generation.load(Ordering::Acquire);
            if g != seen {
                seen = g;
                break;
            }
            spins += 1;
            if spins < IDLE_SPINS {
                std::hint::spin_loop();
                continue;
            }
            let guard = s.park.lock().unwrap_or_else(|e| e.into_inner());
            let _guard = s
                .wake
                .wait_while(guard, |_| s.generation.load(Ordering::Acquire) == seen)
                .unwrap_or_else(|e| e.into_inner());
        }
        if s.stop.load(Ordering::Acquire) {
            return;
        }
        // SAFETY: written by `run` before the generation moved (acquired
        // above); `run` keeps the pointee alive until `pending` reaches 0.
        let job = unsafe { *s.job.get() };
        if let Some(JobPtr(p)) = job {
            let ctx = Ctx {
                tid,
                n: s.n,
                state: s,
            };
            // SAFETY: see above; the closure is `Sync`.
            let f = unsafe { &*p };
            if catch_unwind(AssertUnwindSafe(|| f(&ctx))).is_err() {
                s.poisoned.store(true, Ordering::Release);
            }
        }
        s.pending.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        let s = &*self.state;
        s.stop.store(true, Ordering::Release);
        {
            let _g = s.park.lock().unwrap_or_else(|e| e.into_inner());
            s.generation.fetch_add(1, Ordering::Release);
        }
        s.wake.notify_all();
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

/// A buffer the team writes at disjoint indices during a phase and reads
/// after the barrier that ends it.
pub struct Shared<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: access goes through the unsafe methods below, whose callers
// promise the disjointness that makes concurrent use sound; `slice` hands
// out shared references to several threads, hence `Sync`.
unsafe impl<T: Send + Sync> Sync for Shared<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Send> Send for Shared<'_, T> {}

impl<'a, T> Shared<'a, T> {
    /// Share `v` with the team for the length of its borrow.
    pub fn new(v: &'a mut [T]) -> Self {
        Shared {
            ptr: v.as_mut_ptr(),
            len: v.len(),
            _borrow: std::marker::PhantomData,
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `start..start + n` for writing. Panics when out of bounds.
    ///
    /// # Safety
    /// No other thread may touch these elements until the next barrier,
    /// and none may hold a slice over them from an earlier phase.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, start: usize, n: usize) -> &mut [T] {
        assert!(
            start <= self.len && n <= self.len - start,
            "Shared out of bounds"
        );
        // SAFETY: in bounds (checked); exclusive per the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), n) }
    }

    /// Write `v` at `i`. Panics when out of bounds.
    ///
    /// # Safety
    /// As [`slice_mut`](Self::slice_mut), for element `i`.
    pub unsafe fn set(&self, i: usize, v: T) {
        assert!(i < self.len, "Shared out of bounds");
        // SAFETY: in bounds; exclusive per the caller's promise.
        unsafe { *self.ptr.add(i) = v }
    }

    /// `start..start + n` for reading. Panics when out of bounds.
    ///
    /// # Safety
    /// No thread may write these elements until the next barrier.
    pub unsafe fn slice(&self, start: usize, n: usize) -> &[T] {
        assert!(
            start <= self.len && n <= self.len - start,
            "Shared out of bounds"
        );
        // SAFETY: in bounds (checked); not written per the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr.add(start), n) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_thread_runs_each_job_and_barriers_order_phases() {
        let mut team = Team::new(3, || {}).expect("team");
        for round in 0..50 {
            let mut buf = vec![0usize; 3 * 64];
            let sh = Shared::new(&mut buf);
            let counter = AtomicUsize::new(0);
            team.run(&|c: &Ctx| {
                // Phase 1: claimed indices get their value.
                while let Some(r) = c.claim(&counter, 64, 5) {
                    for i in r {
                        // SAFETY: claims are disjoint.
                        unsafe { sh.slice_mut(i, 1)[0] = i + round };
                    }
                }
                c.barrier();
                // Phase 2: each thread copies all of phase 1 into its third.
                // SAFETY: nothing writes 0..64 now; thirds are disjoint.
                let src = unsafe { sh.slice(0, 64) }.to_vec();
                if c.tid > 0 {
                    // SAFETY: this thread's own third.
                    unsafe { sh.slice_mut(c.tid * 64, 64) }.copy_from_slice(&src);
                }
            })
            .expect("run");
            for t in 1..3 {
                for i in 0..64 {
                    assert_eq!(buf[t * 64 + i], i + round);
                }
            }
        }
    }

    #[test]
    fn a_panicking_part_is_an_error_and_the_team_still_works() {
        let mut team = Team::new(2, || {}).expect("team");
        let after = AtomicUsize::new(0);
        let r = team.run(&|c: &Ctx| {
            if c.tid == 1 {
                panic!("boom");
            }
            c.barrier();
            // Never reached: the barrier ends the job for thread 0.
            after.fetch_add(1, Ordering::Relaxed);
        });
        assert!(r.is_err());
        assert_eq!(after.load(Ordering::Relaxed), 0);
        let hits = AtomicUsize::new(0);
        team.run(&|_c: &Ctx| {
            hits.fetch_add(1, Ordering::Relaxed);
        })
        .expect("run");
        assert_eq!(hits.load(Ordering::Relaxed), 2);
    }
}
