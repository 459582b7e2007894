//! Property tests of the scheduler on the real model: random mixes of
//! prompt lengths, token budgets, lanes and cancellations on a KV pool small
//! enough to force preemption. Invariants: every step stays within
//! `max_batched_tokens` and `max_num_seqs`; a step with a prefill chunk of
//! lane `r` has no work of a worse lane unless it is a guard step (the
//! `MAX_HELD_STEPS` steps before it all had a prefill); every request not
//! cancelled finishes with exactly its token count or a stop; nothing is
//! leaked (the pool is back to full, no block still used) when the engine
//! is idle.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use ultrafast_engine::api::{Event, FinishReason};
use ultrafast_engine::sampling::SamplingParams;
use ultrafast_engine::scheduler::GenerateRequest;
use ultrafast_engine::scheduler::{Engine, EngineConfig, StepObserver, StepWork, MAX_HELD_STEPS};

mod common;
use common::loaded;

#[derive(Default)]
struct Budget {
    max_tokens: AtomicUsize,
    max_seqs: AtomicUsize,
    steps: AtomicUsize,
    /// Steps in a row (up to the last) that had a prefill chunk.
    prefill_run: Mutex<u32>,
    /// Steps mixing a prefill with worse-lane work outside a guard step.
    unheld: AtomicUsize,
}

impl StepObserver for Budget {
    fn step(&self, _: Duration, seqs: usize, tokens: usize) {
        self.max_tokens.fetch_max(tokens, Ordering::Relaxed);
        self.max_seqs.fetch_max(seqs, Ordering::Relaxed);
        self.steps.fetch_add(1, Ordering::Relaxed);
    }

    fn step_work(&self, _: Duration, work: &[StepWork]) {
        let best_prefill = work.iter().filter(|w| w.prefill).map(|w| w.lane_rank).min();
        let mut run = self.prefill_run.lock().unwrap();
        if let Some(r) = best_prefill {
            if work.iter().any(|w| w.lane_rank > r) && *run < MAX_HELD_STEPS {
                self.unheld.fetch_add(1, Ordering::Relaxed);
            }
            *run += 1;
        } else {
            *run = 0;
        }
    }
}

#[derive(Debug, Clone)]
struct Req {
    prompt_len: usize,
    max_tokens: usize,
    lane: u32,
    cancel: bool,
}

fn reqs() -> impl Strategy<Value = Vec<Req>> {
    prop::collection::vec(
        (2usize..40, 1usize..5, 0u32..3, prop::bool::weighted(0.2)).prop_map(
            |(prompt_len, max_tokens, lane, cancel)| Req {
                prompt_len,
                max_tokens,
                lane,
                cancel,
            },
        ),
        1..7,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4, ..ProptestConfig::default() })]

    #[test]
    fn budgets_hold_requests_finish_and_no_block_leaks(rs in reqs(), batched in 8usize..48, seqs in 1usize..5) {
        let budget = Arc::new(Budget::default());
        let cfg = EngineConfig {
            num_blocks: 16,
            block_size: 4,
            max_num_seqs: seqs,
            max_batched_tokens: batched,
            aging_ms_per_token: 10,
            ..EngineConfig::default()
        };
        let e = Engine::start_observed(loaded(), cfg, Some(budget.clone() as Arc<dyn StepObserver>)).unwrap();
        let mut rxs = Vec::new();
        for (i, r) in rs.iter().enumerate() {
            let prompt: Vec<u32> = (0..r.prompt_len as u32).map(|t| 100 + (t * 31 + i as u32 * 7) % 5000).collect();
            let req = GenerateRequest {
                prompt,
                max_tokens: r.max_tokens,
                sampling: SamplingParams { temperature: 0.0, ..SamplingParams::default() },
                stop: Vec::new(),
                lane_rank: r.lane,
                tenant: None,
                guide: None,
            };
            // 40 prompt tokens + 4 fit in 16 blocks of 4: never refused.
            rxs.push(Some(e.submit(req).unwrap()));
        }
        for (r, rx) in rs.iter().zip(rxs.iter_mut()) {
            if r.cancel {
                *rx = None;
            }
        }
        for (r, rx) in rs.iter().zip(rxs.iter_mut()) {
            let Some(rx) = rx else { continue };
            let mut tokens = 0;
            loop {
                match rx.blocking_recv() {
                    Some(Event::Token { .. }) => tokens += 1,
                    Some(Event::Done { finish, usage, .. }) => {
                        prop_assert_eq!(usage.completion_tokens, tokens);
                        match finish {
                            FinishReason::Length => prop_assert_eq!(tokens, r.max_tokens),
                            _ => prop_assert!(tokens <= r.max_tokens),
                        }
                        break;
                    }
                    Some(Event::Error(m)) => prop_assert!(false, "request failed: {}", m),
                    Some(Event::Raw { .. }) => prop_assert!(false, "the engine sent a raw event"),
                    Some(Event::Prompt(_) | Event::Logprob(_) | Event::Indexed(..)) => {
                        prop_assert!(false, "nothing asked for reports or choices")
                    }
                    None => prop_assert!(false, "stream ended without Done"),
                }
            }
        }
        prop_assert!(budget.max_tokens.load(Ordering::Relaxed) <= batched);
        prop_assert!(budget.max_seqs.load(Ordering::Relaxed) <= seqs);
        prop_assert_eq!(budget.unheld.load(Ordering::Relaxed), 0);
        let end = Instant::now() + Duration::from_secs(10);
        while (e.stats().running.load(Ordering::Relaxed) + e.stats().waiting.load(Ordering::Relaxed) > 0
            || e.pool_stats().used > 0) && Instant::now() < end
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        let p = e.pool_stats();
        prop_assert_eq!(p.used, 0, "blocks leaked: {:?}", p);
        prop_assert_eq!(p.free + p.cached, 16);
    }
}
