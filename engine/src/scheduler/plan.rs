//! Choosing each step's work, best lane first.
//!
//! Running and waiting sequences are walked as one list ordered by lane
//! rank (running before waiting within a rank, running by arrival, waiting
//! by prompt length with aging), and each is planned while the step has
//! tokens (`max_batched_tokens`) and sequence slots (`max_num_seqs`) left:
//! a running sequence gets its next prefill chunk or one decode token, a
//! waiting one is admitted (given KV blocks) and gets its first chunk.
//!
//! - Admission counts only the running sequences of the candidate's rank
//!   or better against `max_num_seqs`, so a better-lane request starts at
//!   once even when worse lanes fill the engine. Running worse-lane
//!   sequences that no longer fit in a step are paused: they keep their
//!   blocks and skip steps until a slot frees. Only a real shortage of KV
//!   blocks preempts (frees and later recomputes) the worst running
//!   sequence.
//! - A prefill chunk of a rank-`r` sequence ends the walk after rank `r`:
//!   worse lanes sit that step out, so the better lane's prompt runs at the
//!   speed of an idle engine (same-rank and better-rank work still shares
//!   the step). They come back as soon as that prefill is done. A long
//!   prompt or an unbroken stream of better-lane prompts holds them back
//!   for at most [`MAX_HELD_STEPS`] steps in a row: the next step is a
//!   guard step, with no cut and the token budget reserved first for the
//!   decodes of every running sequence that has a slot, prefill chunks
//!   sharing what is left.
//!
//! Slots are strict priority across lanes: a worse lane waits while better
//! lanes fill every slot, as it always did for KV blocks. Inside a lane the
//! next to start is the request of the backlogged tenant with the smallest
//! virtual counter (`fairq`), in the order above among that tenant's.

use super::seq::Seq;
use super::Worker;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// How many steps in a row a better lane's prefill may hold worse lanes
/// back; the next step runs their decodes alongside it.
pub const MAX_HELD_STEPS: u32 = 4;

/// Most tokens of scored prompts in one step, all together (each holds a
/// row of logits: 256 rows of SmolLM2's 49,152 are 50 MB, of a 152k
/// vocabulary 156 MB).
const SCORED_ROWS: usize = 256;

/// One planned piece of a step: `running[seq]` computes its next `tokens`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Planned {
    pub seq: usize,
    pub tokens: usize,
}

impl Worker {
    /// Pick this step's work, in plan order.
    pub(super) fn plan(&mut self) -> Vec<Planned> {
        self.sort_queues();
        self.fair_front();
        let max_seqs = self.cfg.max_num_seqs.max(1);
        let mut budget = self.cfg.max_batched_tokens.max(1);
        let guard = self.held_steps >= MAX_HELD_STEPS;
        self.guard_step = guard;
        // Tokens kept for decodes that have a slot (guard steps only).
        let mut reserve = match guard {
            true => self.decodes_in(max_seqs).min(budget),
            false => 0,
        };
        let mut plan: Vec<Planned> = Vec::new();
        // Rows of logits the step's scored prompts may still add.
        let mut scored_rows = SCORED_ROWS;
        // Ranks above this one sit the step out (a better prefill is in it).
        let mut cut: Option<u32> = None;
        let mut admitting = true;
        // running[..i] have been considered: they are exactly the running
        // sequences of the current rank or better.
        let mut i = 0;
        while budget > 0 && plan.len() < max_seqs {
            let run = self.running.get(i).map(|s| s.req.lane_rank);
            let wait = match admitting {
                true => self.waiting.first().map(|s| s.req.lane_rank),
                false => None,
            };
            let (rank, from_queue) = match (run, wait) {
                (None, None) => break,
                (Some(r), None) => (r, false),
                (None, Some(w)) => (w, true),
                (Some(r), Some(w)) => (r.min(w), w < r),
            };
            if cut.is_some_and(|c| rank > c) {
                break;
            }
            if from_queue && (i >= max_seqs || !self.admit(i, rank)) {
                // Later waiting sequences rank no better: none can start.
                admitting = false;
                continue;
            }
            let s = &self.running[i];
            let need = s.tokens.len() - s.computed;
            let tokens = match need {
                1 if !from_queue => {
                    reserve = reserve.saturating_sub(1);
                    1
                }
                // A scored prompt's step holds a row of logits per token.
                _ if s.scoring_prompt() => need.min(budget - reserve).min(scored_rows),
                _ => need.min(budget - reserve),
            };
            // May preempt sequences after i (never a planned one).
            if tokens == 0 || !self.ensure_blocks(i, s.computed + tokens) {
                i += 1;
                continue;
            }
            if self.running[i].scoring_prompt() {
                scored_rows = scored_rows.saturating_sub(tokens);
            }
            plan.push(Planned { seq: i, tokens });
            budget -= tokens;
            i += 1;
            if need > 1 && !guard {
                cut.get_or_insert(rank);
            }
        }
        let held = cut.is_some_and(|c| self.worse_left(i, c));
        self.held_steps = if held { self.held_steps + 1 } else { 0 };
        self.stats
            .paused
            .store(self.running.len() - plan.len(), Ordering::Relaxed);
        plan
    }

    /// Decoding sequences among the first `n` running ones.
    fn decodes_in(&self, n: usize) -> usize {
        let decoding = |s: &&Seq| s.tokens.len() - s.computed == 1;
        self.running.iter().take(n).filter(decoding).count()
    }

    /// Whether work of a lane worse than `rank` is left after running[..i]
    /// (held back by the cut, or by the budget a better prefill took).
    fn worse_left(&self, i: usize, rank: u32) -> bool {
        let left = &self.running[i.min(self.running.len())..];
        left.iter()
            .chain(&self.waiting)
            .any(|s| s.req.lane_rank > rank)
    }

    /// Running by (lane, arrival); waiting by (lane, prompt length less
    /// its age in aging units).
    fn sort_queues(&mut self) {
        self.running.sort_by_key(|s| (s.req.lane_rank, s.arrived));
        let aging = self.cfg.aging_ms_per_token.max(1) as u128;
        let now = Instant::now();
        self.waiting.sort_by_key(|s| {
            let age = now.duration_since(s.arrived).as_millis() / aging;
            (
                s.req.lane_rank,
                (s.tokens.len() as u128).saturating_sub(age),
            )
        });
    }

    /// Give `waiting[0]` (of lane `rank`) its blocks and move it to
    /// `running[at]`, preempting running sequences of worse lanes while the
    /// pool is short. False when it cannot start now.
    fn admit(&mut self, at: usize, rank: u32) -> bool {
        loop {
            // A scored prompt computes every position: no cached prefix.
            let w = &self.waiting[0];
            if let Some(blocks) = self.pool.allocate_reusing(&w.tokens, !w.scoring_prompt()) {
                let mut s = self.waiting.remove(0);
                s.computed = blocks.cached_tokens;
                s.cached_tokens = blocks.cached_tokens;
                s.blocks = Some(blocks);
                self.started(&mut s);
                self.running.insert(at, s);
                self.fair_front();
                return true;
            }
            // The last running sequence is the worst; one of a worse lane
            // sits at or after `at`, so it is not planned.
            let worse = self.running.last().is_some_and(|v| v.req.lane_rank > rank);
            if !worse {
                return false;
            }
            if let Some(v) = self.running.pop() {
                self.requeue(v);
            }
        }
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
            if let Some(v) = self.running.pop() {
                self.requeue(v);
            }
        }
    }

    /// Preempt by recompute: free the blocks, queue the sequence again.
    fn requeue(&mut self, mut s: Seq) {
        s.blocks = None; // frees the blocks
        s.computed = 0; // recompute prompt + generated tokens on return
        self.stats.preemptions.fetch_add(1, Ordering::Relaxed);
        self.fair[s.rank()].requeue(s.tenant);
        self.waiting.push(s);
    }
}
