//! Continuous batching on one engine thread.
//!
//! The thread owns every piece of scheduling state (queue, running batch,
//! KV blocks); callers talk to it through a command channel and get events
//! on their own channel. Each step is planned best lane first (`plan`):
//! running sequences and waiting ones that may start, each getting one
//! decode token or its next prefill chunk, under `max_batched_tokens` and
//! `max_num_seqs`. A better lane starts at once even when worse lanes fill
//! the engine (they pause, keeping their KV blocks), and its prompt runs in
//! steps of its own. Long prompts are split into chunks. When blocks run
//! out, the lowest-priority running sequence is preempted by recompute (its
//! blocks are freed and it re-enters the queue). A closed event channel
//! cancels the sequence at the next step and frees its blocks.
//!
//! Steps run on the model runner (`backend`) whose threads sit at a lower
//! OS priority than the proxy (`threads`), and every step feeds the online step-cost model
//! (`cost`) that the proxy reads to predict time to first token.

mod cost;
mod fairq;
pub use fairq::Charge;
mod plan;
mod request;
mod seq;
mod spread;
mod threads;

use crate::api::{Event, MAX_CHOICES};
use crate::backend::loaded::Loaded;
use crate::backend::logits::{Need, StepLogits, MAX_TOP};
use crate::backend::{self, ModelRunner};
use crate::error::{EngineError, Result};
use crate::fair::{self, Share, Vtc};
use crate::kv::{BlockPool, PoolStats};
use crate::model::paged::SeqStep;
use plan::Planned;
pub use request::GenerateRequest;
use seq::{Outcome, Seq};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

pub use cost::StepCost;
pub use plan::MAX_HELD_STEPS;
pub use threads::NICE_INCREMENT;

/// Engine sizing.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// KV blocks.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Sequences per step at most. A waiting sequence starts while fewer
    /// than this many sequences of its lane rank or better are running, so
    /// more may be running (worse lanes paused) when better lanes arrive.
    pub max_num_seqs: usize,
    /// Tokens per step at most (decodes plus prefill chunks).
    pub max_batched_tokens: usize,
    /// Queue aging: a waiting request's effective length shrinks by one
    /// token per this many ms, so long prompts are not starved.
    pub aging_ms_per_token: u64,
    /// Precision of the KV cache.
    pub kv_dtype: backend::KvDtype,
    /// Where the model runs.
    pub device: backend::Device,
    /// What prompt and output tokens cost a tenant (fair shares inside a
    /// lane; see [`crate::fair`]).
    pub fair: fair::Costs,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            num_blocks: 1024,
            block_size: 16,
            max_num_seqs: 32,
            max_batched_tokens: 512,
            aging_ms_per_token: 10,
            kv_dtype: backend::KvDtype::default(),
            device: backend::Device::default(),
            fair: fair::Costs::default(),
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
    /// Running sequences that sat out the last step (worse lanes held back
    /// by better ones, or waiting for KV blocks).
    pub paused: AtomicUsize,
    /// Waiting sequences by lane rank (ranks above 3 count as 3).
    pub waiting_by_rank: [AtomicUsize; 4],
    /// Steps given up part way to start a better lane's request at once
    /// (their work is run again in a later step).
    pub interrupted: AtomicU64,
}

/// Lane ranks told apart by step interruption; worse ones count as the
/// last.
const RANKS: usize = 8;

/// Requests submitted so far, by lane rank: a step in flight compares them
/// with what it saw at its start to notice a better lane's arrival.
type Arrivals = [AtomicU64; RANKS];

/// One sequence's part of a step, as observers see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepWork {
    /// The sequence's lane rank.
    pub lane_rank: u32,
    /// Tokens it computed in the step.
    pub tokens: usize,
    /// Whether this was a prefill chunk (prompt, or recompute after
    /// preemption) rather than one decode token.
    pub prefill: bool,
}

/// Told about every step (for metrics); runs on the engine thread, so it
/// must be cheap.
pub trait StepObserver: Send + Sync {
    /// A step ran `seqs` sequences and `tokens` tokens in `elapsed`.
    fn step(&self, elapsed: Duration, seqs: usize, tokens: usize);

    /// The same step sequence by sequence, in plan order (best lane
    /// first); called after `step`. Does nothing unless implemented.
    fn step_work(&self, _elapsed: Duration, _work: &[StepWork]) {}
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
    cost: Arc<cost::SharedCost>,
    cfg: EngineConfig,
    arrivals: Arc<Arrivals>,
    device: backend::Device,
    runner_desc: String,
    /// The runner computes every position's logits (prompt scoring).
    scores_prompts: bool,
    shares: Arc<fairq::Published>,
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
        let device = backend::choose_device(cfg.device)?;
        // Built here, so its threads take this thread's priority before
        // lowering their own.
        let runner = backend::runner_for(
            device,
            &loaded,
            cfg.num_blocks,
            cfg.block_size,
            cfg.kv_dtype,
            threads::lower_this_thread,
            cfg.device == backend::Device::Auto,
        )?;
        Self::start_with(loaded, cfg, runner, observer)
    }

    /// Start the engine thread on a given runner (one built for
    /// `cfg.num_blocks` blocks of `cfg.block_size`), e.g. the reference
    /// runner of the CUDA path's host side.
    pub fn start_with(
        loaded: Arc<Loaded>,
        cfg: EngineConfig,
        runner: Box<dyn backend::ModelRunner>,
        observer: Option<Arc<dyn StepObserver>>,
    ) -> Result<Engine> {
        let pool = BlockPool::new(cfg.num_blocks, cfg.block_size);
        let (tx, rx) = channel();
        let stats = Arc::new(EngineStats::default());
        let shared_cost = Arc::new(cost::SharedCost::default());
        let (device, runner_desc) = (runner.device(), runner.describe());
        let scores_prompts = runner.every_row();
        let arrivals: Arc<Arrivals> = Arc::new(Default::default());
        let shares = Arc::new(fairq::Published::default());
        let worker = Worker {
            fair: (0..RANKS).map(|_| Vtc::new(cfg.fair)).collect(),
            shares: shares.clone(),
            arrivals: arrivals.clone(),
            guard_step: false,
            gave_way: 0,
            rx,
            runner,
            logits: StepLogits::default(),
            loaded: loaded.clone(),
            pool: pool.clone(),
            cfg: cfg.clone(),
            stats: stats.clone(),
            waiting: Vec::new(),
            running: Vec::new(),
            observer,
            held_steps: 0,
            fit: cost::CostFit::default(),
            shared_cost: shared_cost.clone(),
        };
        std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || {
                threads::lower_this_thread();
                worker.run()
            })
            .map_err(|e| EngineError::Invalid(format!("cannot start the engine thread: {e}")))?;
        Ok(Engine {
            tx,
            loaded,
            pool,
            stats,
            cost: shared_cost,
            cfg,
            arrivals,
            device,
            runner_desc,
            scores_prompts,
            shares,
        })
    }

    /// The device the model runs on.
    pub fn device(&self) -> backend::Device {
        self.device
    }

    /// The runner's description (`cpu/avx2 x2 kv F16`).
    pub fn runner(&self) -> &str {
        &self.runner_desc
    }

    /// Whether its runner can score a prompt (`echo` with `logprobs`).
    pub fn scores_prompts(&self) -> bool {
        self.scores_prompts
    }

    /// The sizing it runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Sequences per step at most (and running sequences per lane rank and
    /// better).
    pub fn max_num_seqs(&self) -> usize {
        self.cfg.max_num_seqs
    }

    /// The current estimate of a step's duration on this machine (see
    /// [`StepCost`]); for any thread (a short lock).
    pub fn step_cost(&self) -> StepCost {
        self.cost.load()
    }

    /// The model and tokenizer (for tokenizing off the engine thread).
    pub fn loaded(&self) -> &Arc<Loaded> {
        &self.loaded
    }

    /// Queue a request; events arrive on the returned channel. A request that
    /// can never fit (context or KV pool) is refused here.
    pub fn submit(&self, req: GenerateRequest) -> Result<UnboundedReceiver<Event>> {
        self.submit_n(req, 1)
    }

    /// Queue a request for `n` choices (1 to [`MAX_CHOICES`]): the prompt
    /// is computed once and its cached blocks shared by the others; for
    /// n > 1 every event comes as [`Event::Indexed`].
    pub fn submit_n(&self, req: GenerateRequest, n: usize) -> Result<UnboundedReceiver<Event>> {
        if n == 0 || n > MAX_CHOICES {
            return Err(EngineError::Invalid(format!(
                "n must be from 1 to {MAX_CHOICES}, got {n}"
            )));
        }
        // Refused here, not in the step: a step that cannot serve one
        // sequence fails every sequence in it.
        if req.sampling.echo && req.sampling.prompt_logprobs.is_some() && !self.scores_prompts {
            return Err(EngineError::Invalid(format!(
                "runner {} does not score prompts",
                self.runner_desc
            )));
        }
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
        let rank = (req.lane_rank as usize).min(RANKS - 1);
        let seq = Seq::choices(req, n, etx);
        self.tx
            .send(Cmd::Submit(Box::new(seq)))
            .map_err(|_| EngineError::Invalid("engine stopped".into()))?;
        // After the send: a step that sees the count finds the request
        // queued when it stops.
        self.arrivals[rank].fetch_add(1, Ordering::Release);
        Ok(erx)
    }

    /// Block pool counts.
    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Token slots per KV block.
    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    /// Scheduler counters.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// The tenants of each lane rank served most, with their virtual
    /// counters (as of the last publication, at most a second old).
    pub fn fair_shares(&self) -> Vec<(u32, Share)> {
        self.shares.get()
    }

    /// Shared counters across instances: hand in what other instances
    /// charged (rank, tenant id, counter units; applied at the next
    /// publication), take what was charged here since the last exchange.
    /// Until the first call nothing is collected.
    pub fn fair_exchange(&self, remote: Vec<(u32, u64, f64)>) -> Vec<Charge> {
        self.shares.exchange(remote)
    }
}

struct Worker {
    rx: Receiver<Cmd>,
    /// The model on its device, with the KV storage.
    runner: Box<dyn ModelRunner>,
    /// The last step's logits (reused).
    logits: StepLogits,
    loaded: Arc<Loaded>,
    pool: BlockPool,
    cfg: EngineConfig,
    stats: Arc<EngineStats>,
    waiting: Vec<Seq>,
    running: Vec<Seq>,
    observer: Option<Arc<dyn StepObserver>>,
    /// Steps in a row in which a better lane's prefill held worse ones back.
    held_steps: u32,
    fit: cost::CostFit,
    shared_cost: Arc<cost::SharedCost>,
    arrivals: Arc<Arrivals>,
    /// The planned step is a guard step (never stopped for a better lane).
    guard_step: bool,
    /// Virtual token counters per lane rank (fair shares inside a lane).
    fair: Vec<Vtc>,
    /// Where the counters are published for metrics.
    shares: Arc<fairq::Published>,
    /// Steps with worse-lane work given up in a row: at
    /// [`MAX_HELD_STEPS`] the next one runs to its end, so a stream of
    /// better-lane arrivals cannot stall the worse lanes.
    gave_way: u32,
}

impl Worker {
    /// The running and waiting counts the metrics read.
    fn publish_counts(&self) {
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
    }

    fn run(mut self) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                // Idle: say so before blocking, or the last step's counts
                // would stand until the next request.
                self.publish_counts();
                match self.rx.recv() {
                    Ok(Cmd::Submit(s)) => self.enqueue(*s),
                    Err(_) => return,
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(Cmd::Submit(s)) => self.enqueue(*s),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        if self.running.is_empty() && self.waiting.is_empty() {
                            return;
                        }
                        break;
                    }
                }
            }
            self.drop_cancelled();
            let plan = self.plan();
            self.publish_counts();
            if plan.is_empty() {
                // Nothing runnable (waiting for blocks that only frees on
                // cancellation): do not spin.
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            self.step(plan);
        }
    }

    fn step(&mut self, plan: Vec<Planned>) {
        let started = Instant::now();
        let chunks: Vec<(usize, usize, Vec<u32>)> = plan
            .iter()
            .map(|p| {
                let s = &self.running[p.seq];
                let end = s.computed + p.tokens;
                (p.seq, s.computed, s.tokens[s.computed..end].to_vec())
            })
            .collect();
        // The guides of sequences that sample this step, taken out so that
        // their masks can be computed beside the forward pass.
        let mut guides: Vec<(usize, crate::guide::Guide)> = Vec::new();
        for (i, start, toks) in &chunks {
            let s = &mut self.running[*i];
            if start + toks.len() == s.tokens.len() {
                if let Some(g) = s.guide.take() {
                    guides.push((*i, g));
                }
            }
        }
        // Each step's rows, and what its sampler needs: a device runner
        // copies back only that.
        let (steps, needs): (Vec<SeqStep>, Vec<Need>) = chunks
            .iter()
            .filter_map(|(i, start, toks)| {
                let s = &self.running[*i];
                let need = if s.scoring_prompt() {
                    Need::Every
                } else if start + toks.len() < s.tokens.len() {
                    Need::Nothing
                } else if guides.iter().any(|(j, _)| j == i) {
                    Need::Full
                } else {
                    // A sequence that reports scores and samples from
                    // candidates gets enough of them for both, and its
                    // row's normaliser; else its whole row.
                    let top = s.sampler_needs_top(MAX_TOP);
                    match (top, s.req.sampling.logprobs) {
                        (Some(k), Some(r)) => Need::Scored(k.max(r)),
                        (None, _) => Need::Full,
                        (Some(k), None) => Need::Top(k),
                    }
                };
                let step = SeqStep {
                    tokens: toks,
                    start: *start,
                    blocks: s.blocks.as_ref()?.blocks(),
                };
                Some((step, need))
            })
            .unzip();
        let tokens: usize = steps.iter().map(|s| s.tokens.len()).sum();
        self.stats
            .last_step_seqs
            .store(steps.len(), Ordering::Relaxed);
        self.stats.last_step_tokens.store(tokens, Ordering::Relaxed);
        let stop = self.stop_rule(&chunks);
        let (runner, logits) = (&mut self.runner, &mut self.logits);
        let mut forward = || runner.step_for(&steps, &needs, &stop, logits);
        // Constrained sequences that sample this step get their masks on a
        // thread of their own while the forward pass runs: the grammar's
        // work is off the step's critical path for the whole batch.
        let (result, mut masks) = if guides.is_empty() {
            (forward(), Vec::new())
        } else {
            std::thread::scope(|sc| {
                // Spread over the machine's threads: with many constrained
                // sequences, one after another could outlast the pass.
                let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
                let guides = &mut guides[..];
                let masking =
                    sc.spawn(move || spread::map_spread(guides, threads, |(i, g)| (*i, g.mask())));
                let r = forward();
                (r, masking.join().unwrap_or_default())
            })
        };
        drop(steps);
        for (i, g) in guides {
            self.running[i].guide = Some(g);
        }
        if let Ok(false) = result {
            // A better lane arrived: plan again with it, at once.
            self.stats.interrupted.fetch_add(1, Ordering::Relaxed);
            self.gave_way += 1;
            return;
        }
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        self.gave_way = 0;
        let elapsed = started.elapsed();
        self.record(elapsed, &chunks, result.is_ok());
        if let Err(e) = result {
            for (i, _, _) in &chunks {
                self.running[*i].fail(&e.to_string());
            }
            self.drop_finished();
            return;
        }
        let vocab = self.loaded.model.cfg.vocab.max(1);
        let mut released: Vec<Seq> = Vec::new();
        for (k, (i, start, toks)) in chunks.iter().enumerate() {
            let s = &mut self.running[*i];
            s.first_step.get_or_insert(started);
            s.compute += elapsed;
            s.computed = start + toks.len();
            if let Some(b) = s.blocks.as_mut() {
                self.pool.seal(b, &s.tokens[..s.computed]);
            }
            if s.scoring_prompt() {
                if let Some(rows) = self.logits.every(k, vocab) {
                    s.score_prompt(*start, rows, vocab, &self.loaded.codec);
                }
            }
            if s.computed >= s.req.prompt.len() && !s.followers.is_empty() {
                // The prompt's full blocks are sealed: the other choices
                // start on them.
                released.append(&mut s.followers);
            }
            if s.computed == s.tokens.len() {
                let mask = match masks.iter().position(|(j, _)| j == i) {
                    Some(k) => masks.swap_remove(k).1.ok(),
                    None => None,
                };
                let Some(row) = self.logits.row(k, vocab) else {
                    s.fail("the step returned no logits for this sequence");
                    continue;
                };
                self.fair[s.rank()].produced(s.tenant, 1);
                if let Outcome::Finished = s.advance(row, &self.loaded.codec, mask) {
                    s.finished = true;
                }
            }
        }
        for f in released {
            self.enqueue(f);
        }
        // A scored prompt's step grew the buffer to many rows: give the
        // memory back rather than hold it for every later step.
        let keep = vocab * self.cfg.max_num_seqs.max(1);
        if self.logits.full.capacity() > 2 * keep {
            self.logits.full = Vec::with_capacity(keep);
        }
        self.drop_finished();
    }

    /// When the step about to run gives way: a request of a lane better than
    /// the worst one in it arrived since planning. At any layer: stopping
    /// late throws more work away, but an ultra request waiting out the
    /// last third of a 200 ms step was most of its tail; the waste is at
    /// most one partial step per better-lane arrival. A guard step, or one of the best lane alone, never
    /// gives way, nor one after [`MAX_HELD_STEPS`] given up in a row: the
    /// worse lanes' progress depends on them.
    fn stop_rule(&self, chunks: &[(usize, usize, Vec<u32>)]) -> impl Fn(usize) -> bool + Sync {
        let worst = chunks
            .iter()
            .map(|(i, _, _)| (self.running[*i].req.lane_rank as usize).min(RANKS - 1))
            .max()
            .unwrap_or(0);
        let better = match self.guard_step || self.gave_way >= MAX_HELD_STEPS {
            true => 0,
            false => worst,
        };
        let arrivals = self.arrivals.clone();
        let seen = move |a: &Arrivals| -> u64 {
            a[..better].iter().map(|c| c.load(Ordering::Acquire)).sum()
        };
        let at_start = seen(&arrivals);
        move |_layer| better > 0 && seen(&arrivals) != at_start
    }

    /// Feed a finished step to the cost model and the observer.
    fn record(&mut self, elapsed: Duration, chunks: &[(usize, usize, Vec<u32>)], ok: bool) {
        let tokens = chunks.iter().map(|c| c.2.len()).sum();
        // A decode is the last token of its sequence; anything else is a
        // chunk of a prompt (or of a recompute).
        let work: Vec<StepWork> = chunks
            .iter()
            .map(|(i, start, toks)| {
                let s = &self.running[*i];
                StepWork {
                    lane_rank: s.req.lane_rank,
                    tokens: toks.len(),
                    prefill: s.tokens.len() - start > 1,
                }
            })
            .collect();
        if ok {
            let decodes = work.iter().filter(|w| !w.prefill).count();
            self.fit.observe(decodes, tokens - decodes, elapsed);
            self.shared_cost.publish(self.fit.cost());
        }
        let Some(o) = &self.observer else { return };
        o.step(elapsed, chunks.len(), tokens);
        o.step_work(elapsed, &work);
    }
}
