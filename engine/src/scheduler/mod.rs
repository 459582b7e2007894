//! Continuous batching on one engine thread.
//!
//! The thread owns every piece of scheduling state (queue, running batch,
//! KV blocks); callers talk to it through a command channel and get events
//! on their own channel. Each step: running sequences first, in lane order
//! (one decode token each, or the next prefill chunk), then new sequences
//! from the queue (best lane first, then shortest prompt with aging), all
//! under `max_batched_tokens` and `max_num_seqs`. Long prompts are split into
//! chunks, so they never stall the decodes that share the step. When blocks
//! run out, the lowest-priority running sequence is preempted by recompute
//! (its blocks are freed and it re-enters the queue), so an ultra request is
//! never stuck behind standard ones. A closed event channel cancels the
//! sequence at the next step and frees its blocks.

mod seq;

use crate::api::{Event, GenerateRequest};
use crate::error::{EngineError, Result};
use crate::generate::Loaded;
use crate::kv::{BlockPool, PoolStats};
use crate::model::paged::{PagedKv, SeqStep};
use seq::{Outcome, Seq};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// Engine sizing.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// KV blocks.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Sequences per step at most.
    pub max_num_seqs: usize,
    /// Tokens per step at most (decodes plus prefill chunks).
    pub max_batched_tokens: usize,
    /// Queue aging: a waiting request's effective length shrinks by one
    /// token per this many ms, so long prompts are not starved.
    pub aging_ms_per_token: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            num_blocks: 1024,
            block_size: 16,
            max_num_seqs: 32,
            max_batched_tokens: 512,
            aging_ms_per_token: 10,
        }
    }
}

/// Counters the engine exports.
#[derive(Debug, Default)]
pub struct EngineStats {
    /// Steps run.
    pub steps: AtomicU64,
    /// Sequences preempted (recomputed later).
    pub preemptions: AtomicU64,
    /// Sequences running now.
    pub running: AtomicUsize,
    /// Sequences waiting now.
    pub waiting: AtomicUsize,
    /// Tokens in the last step.
    pub last_step_tokens: AtomicUsize,
    /// Sequences in the last step.
    pub last_step_seqs: AtomicUsize,
    /// Waiting sequences by lane rank (ranks above 3 count as 3).
    pub waiting_by_rank: [AtomicUsize; 4],
}

/// Told about every step (for metrics); runs on the engine thread, so it
/// must be cheap.
pub trait StepObserver: Send + Sync {
    /// A step ran `seqs` sequences and `tokens` tokens in `elapsed`.
    fn step(&self, elapsed: Duration, seqs: usize, tokens: usize);
}

enum Cmd {
    Submit(Box<Seq>),
}

/// A running engine: submit requests, read stats.
pub struct Engine {
    tx: Sender<Cmd>,
    loaded: Arc<Loaded>,
    pool: BlockPool,
    stats: Arc<EngineStats>,
    cfg: EngineConfig,
}

impl Engine {
    /// Start the engine thread over a loaded model.
    pub fn start(loaded: Arc<Loaded>, cfg: EngineConfig) -> Result<Engine> {
        Self::start_observed(loaded, cfg, None)
    }

    /// Start the engine thread, reporting every step to `observer`.
    pub fn start_observed(
        loaded: Arc<Loaded>,
        cfg: EngineConfig,
        observer: Option<Arc<dyn StepObserver>>,
    ) -> Result<Engine> {
        let pool = BlockPool::new(cfg.num_blocks, cfg.block_size);
        let (tx, rx) = channel();
        let stats = Arc::new(EngineStats::default());
        let worker = Worker {
            rx,
            kv: PagedKv::new(&loaded.model, cfg.num_blocks, cfg.block_size),
            loaded: loaded.clone(),
            pool: pool.clone(),
            cfg: cfg.clone(),
            stats: stats.clone(),
            waiting: Vec::new(),
            running: Vec::new(),
            observer,
        };
        std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || worker.run())
            .map_err(|e| EngineError::Invalid(format!("cannot start the engine thread: {e}")))?;
        Ok(Engine {
            tx,
            loaded,
            pool,
            stats,
            cfg,
        })
    }

    /// The model and tokenizer (for tokenizing off the engine thread).
    pub fn loaded(&self) -> &Arc<Loaded> {
        &self.loaded
    }

    /// Queue a request; events arrive on the returned channel. A request that
    /// can never fit (context or KV pool) is refused here.
    pub fn submit(&self, req: GenerateRequest) -> Result<UnboundedReceiver<Event>> {
        let total = req.prompt.len() + req.max_tokens;
        let ctx = self.loaded.model.max_positions();
        if req.prompt.is_empty() {
            return Err(EngineError::Invalid("empty prompt".into()));
        }
        if total > ctx {
            return Err(EngineError::Invalid(format!(
                "context_length_exceeded: {} prompt + {} max tokens > {ctx}",
                req.prompt.len(),
                req.max_tokens
            )));
        }
        if self.pool.blocks_for(total) > self.cfg.num_blocks {
            return Err(EngineError::Invalid(format!(
                "request needs more KV blocks than the pool has ({total} tokens)"
            )));
        }
        let (etx, erx) = unbounded_channel();
        let seq = Seq::new(req, etx);
        self.tx
            .send(Cmd::Submit(Box::new(seq)))
            .map_err(|_| EngineError::Invalid("engine stopped".into()))?;
        Ok(erx)
    }

    /// Block pool counts.
    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Scheduler counters.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }
}

struct Worker {
    rx: Receiver<Cmd>,
    kv: PagedKv,
    loaded: Arc<Loaded>,
    pool: BlockPool,
    cfg: EngineConfig,
    stats: Arc<EngineStats>,
    waiting: Vec<Seq>,
    running: Vec<Seq>,
    observer: Option<Arc<dyn StepObserver>>,
}

impl Worker {
    fn run(mut self) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                match self.rx.recv() {
                    Ok(Cmd::Submit(s)) => self.waiting.push(*s),
                    Err(_) => return,
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(Cmd::Submit(s)) => self.waiting.push(*s),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        if self.running.is_empty() && self.waiting.is_empty() {
                            return;
                        }
                        break;
                    }
                }
            }
            self.running.retain(|s| !s.cancelled());
            self.waiting.retain(|s| !s.cancelled());
            let plan = self.plan();
            self.stats
                .running
                .store(self.running.len(), Ordering::Relaxed);
            self.stats
                .waiting
                .store(self.waiting.len(), Ordering::Relaxed);
            let mut by_rank = [0usize; 4];
            for s in &self.waiting {
                by_rank[(s.req.lane_rank as usize).min(3)] += 1;
            }
            for (slot, n) in self.stats.waiting_by_rank.iter().zip(by_rank) {
                slot.store(n, Ordering::Relaxed);
            }
            if plan.is_empty() {
                // Nothing runnable (waiting for blocks that only frees on
                // cancellation): do not spin.
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            self.step(plan);
        }
    }

    /// Pick this step's work: (index into `running`, tokens to compute).
    fn plan(&mut self) -> Vec<(usize, usize)> {
        let mut budget = self.cfg.max_batched_tokens;
        self.running.sort_by_key(|s| (s.req.lane_rank, s.arrived));
        let mut plan: Vec<(usize, usize)> = Vec::new();
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = &self.running[i];
            let need = s.tokens.len() - s.computed;
            let chunk = need.min(budget);
            if !self.ensure_blocks(i, s.computed + chunk) {
                i += 1;
                continue;
            }
            // ensure_blocks may have preempted sequences after i.
            plan.push((i, chunk));
            budget -= chunk;
            i += 1;
        }
        let aging = self.cfg.aging_ms_per_token.max(1) as u128;
        let now = Instant::now();
        self.waiting.sort_by_key(|s| {
            let age = now.duration_since(s.arrived).as_millis() / aging;
            (
                s.req.lane_rank,
                (s.tokens.len() as u128).saturating_sub(age),
            )
        });
        while budget > 0 && self.running.len() < self.cfg.max_num_seqs && !self.waiting.is_empty() {
            let rank = self.waiting[0].req.lane_rank;
            let blocks = match self.pool.allocate(&self.waiting[0].tokens) {
                Some(b) => b,
                None => {
                    // Preempt a running sequence of a worse lane, if any.
                    if !self.preempt_worse_than(rank, &mut plan) {
                        break;
                    }
                    continue;
                }
            };
            let mut s = self.waiting.remove(0);
            s.computed = blocks.cached_tokens;
            s.cached_tokens = blocks.cached_tokens;
            s.blocks = Some(blocks);
            let chunk = (s.tokens.len() - s.computed).min(budget);
            budget -= chunk;
            self.running.push(s);
            plan.push((self.running.len() - 1, chunk));
        }
        plan
    }

    /// Make running[i] hold `len` tokens, preempting the lowest-priority
    /// other running sequence when blocks run out.
    fn ensure_blocks(&mut self, i: usize, len: usize) -> bool {
        loop {
            let ok = match self.running[i].blocks.as_mut() {
                Some(b) => self.pool.grow(b, len),
                None => false,
            };
            if ok {
                return true;
            }
            // The last running sequence has the lowest priority (sorted).
            if self.running.len() - 1 <= i {
                return false;
            }
            let victim = self.running.pop();
            if let Some(v) = victim {
                self.requeue(v);
            }
        }
    }

    fn preempt_worse_than(&mut self, rank: u32, plan: &mut [(usize, usize)]) -> bool {
        let Some(pos) = self.running.iter().rposition(|s| s.req.lane_rank > rank) else {
            return false;
        };
        // A sequence already planned this step keeps its slot.
        if plan.iter().any(|(i, _)| *i == pos) {
            return false;
        }
        let v = self.running.remove(pos);
        for p in plan.iter_mut() {
            if p.0 > pos {
                p.0 -= 1;
            }
        }
        self.requeue(v);
        true
    }

    fn requeue(&mut self, mut s: Seq) {
        s.blocks = None; // frees the blocks
        s.computed = 0; // recompute prompt + generated tokens on return
        self.stats.preemptions.fetch_add(1, Ordering::Relaxed);
        self.waiting.push(s);
    }

    fn step(&mut self, plan: Vec<(usize, usize)>) {
        let started = Instant::now();
        let chunks: Vec<(usize, usize, Vec<u32>)> = plan
            .iter()
            .map(|&(i, n)| {
                let s = &self.running[i];
                (i, s.computed, s.tokens[s.computed..s.computed + n].to_vec())
            })
            .collect();
        let steps: Vec<SeqStep> = chunks
            .iter()
            .filter_map(|(i, start, toks)| {
                let blocks = self.running[*i].blocks.as_ref()?.blocks();
                Some(SeqStep {
                    tokens: toks,
                    start: *start,
                    blocks,
                })
            })
            .collect();
        self.stats
            .last_step_seqs
            .store(steps.len(), Ordering::Relaxed);
        self.stats.last_step_tokens.store(
            steps.iter().map(|s| s.tokens.len()).sum(),
            Ordering::Relaxed,
        );
        let result = self.loaded.model.forward_paged(&mut self.kv, &steps);
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        let elapsed = started.elapsed();
        if let Some(o) = &self.observer {
            o.step(
                elapsed,
                steps.len(),
                steps.iter().map(|s| s.tokens.len()).sum(),
            );
        }
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                for (i, _, _) in &chunks {
                    self.running[*i].fail(&e.to_string());
                }
                self.running.retain(|s| !s.finished);
                return;
            }
        };
        for ((i, start, toks), logits) in chunks.iter().zip(logits) {
            let s = &mut self.running[*i];
            s.first_step.get_or_insert(started);
            s.compute += elapsed;
            s.computed = start + toks.len();
            if let Some(b) = s.blocks.as_mut() {
                self.pool.seal(b, &s.tokens[..s.computed]);
            }
            if s.computed == s.tokens.len() {
                if let Outcome::Finished = s.advance(&logits, &self.loaded.codec) {
                    s.finished = true;
                }
            }
        }
        self.running.retain(|s| !s.finished);
    }
}
