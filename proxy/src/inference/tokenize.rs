//! Tokenization, bounded: what a prompt costs before the engine sees it.
//!
//! Tokenizing and rendering a chat template is work that grows with the
//! body and happens before the latency model knows the prompt's size, so
//! a client sending long prompts could otherwise make it the bottleneck of
//! every request, and starve the engine: the engine's threads run under
//! `SCHED_IDLE` (so that the proxy's work always goes first), and any
//! number of tokenizations at normal priority would take every core from
//! them. Two bounds:
//!
//! - **Bytes**: the prompt bytes being tokenized at once are capped
//!   (`[inference] tokenize_max_bytes`); a request that would go over is
//!   refused at once with 503 `tokenizer_overloaded` and `Retry-After`,
//!   before any work. Each request's bytes are already bounded by its
//!   model's context (a prompt whose byte count alone proves it cannot fit
//!   is refused before this; see `slo::prove_too_long`).
//! - **Threads**: at most half the cores (at least one) tokenize at once;
//!   the rest wait their turn (their bytes already counted), so the engine
//!   keeps the other half whatever the load.
//!
//! Both are held by the blocking task itself, not by the request's future:
//! a client that leaves while its prompt is tokenized frees neither bytes
//! nor thread until the tokenizer is really done.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use ultrafast_engine::api::{Backend, BackendError, InferenceRequest, Prepared};

/// The tokenization gate of the process.
#[derive(Debug)]
pub struct Tokenizing {
    bytes: Arc<AtomicUsize>,
    threads: Arc<Semaphore>,
}

impl Default for Tokenizing {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::new((cores / 2).max(1))
    }
}

/// Bytes counted while a request is tokenized; uncounted on drop.
#[derive(Debug)]
pub struct Held {
    counted: Arc<AtomicUsize>,
    bytes: usize,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.counted.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// The refusal of a request over the byte cap.
pub fn overloaded() -> BackendError {
    BackendError {
        status: 503,
        kind: "server_error",
        code: "tokenizer_overloaded",
        param: None,
        message: "too many prompt bytes are being tokenized right now; retry shortly".into(),
    }
}

impl Tokenizing {
    /// A gate letting `threads` tokenizations run at once.
    pub fn new(threads: usize) -> Self {
        Tokenizing {
            bytes: Arc::new(AtomicUsize::new(0)),
            threads: Arc::new(Semaphore::new(threads.max(1))),
        }
    }

    /// Count `bytes` if that keeps the total within `cap` (a request alone
    /// larger than the cap passes when nothing else is counted, so a cap
    /// below one prompt still serves one at a time).
    pub fn hold(&self, bytes: usize, cap: usize) -> Option<Held> {
        let mut now = self.bytes.load(Ordering::Acquire);
        loop {
            if now > 0 && now.saturating_add(bytes) > cap {
                return None;
            }
            match self.bytes.compare_exchange_weak(
                now,
                now + bytes,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    return Some(Held {
                        counted: self.bytes.clone(),
                        bytes,
                    })
                }
                Err(seen) => now = seen,
            }
        }
    }

    /// Bytes counted now.
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Acquire)
    }

    /// Tokenize `req` (`bytes` of prompt) on a blocking thread once a
    /// tokenizer thread is free; [`overloaded`] at once when its bytes
    /// would go over `cap`.
    pub async fn prepare(
        &self,
        backend: Arc<dyn Backend>,
        req: InferenceRequest,
        bytes: usize,
        cap: usize,
    ) -> Result<Prepared, BackendError> {
        let held = self.hold(bytes, cap).ok_or_else(overloaded)?;
        let turn: OwnedSemaphorePermit = self
            .threads
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| BackendError::unavailable("tokenization failed".into()))?;
        let work = move || {
            let _held = (held, turn);
            backend.prepare(&req)
        };
        match tokio::task::spawn_blocking(work).await {
            Ok(p) => p,
            Err(_) => Err(BackendError::unavailable("tokenization failed".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_capped_and_given_back() {
        let g = Tokenizing::new(1);
        let a = g.hold(600, 1000).unwrap();
        assert!(g.hold(500, 1000).is_none());
        let b = g.hold(400, 1000).unwrap();
        assert_eq!(g.bytes(), 1000);
        drop(a);
        drop(b);
        assert_eq!(g.bytes(), 0);
        // Alone, a prompt larger than the cap still passes.
        let c = g.hold(5000, 1000).unwrap();
        assert!(g.hold(1, 1000).is_none());
        drop(c);
        assert_eq!(overloaded().status, 503);
    }
}
