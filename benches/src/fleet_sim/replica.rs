//! One simulated replica: a continuous-batching step model with its own
//! speed, slot count, token budget per step, and a prefix cache of KV
//! blocks, as vLLM schedules (decodes first, then prompt chunks within the
//! step's token budget; a request takes a slot when one frees, FIFO).
//!
//! Time is the caller's: [`Replica::step`] plans one step and says how long
//! it takes; the live server sleeps that long, the discrete-event run
//! moves its clock. So both modes run exactly this model.

use std::collections::{HashMap, VecDeque};

/// The cost model of a replica at speed 1, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepModel {
    /// Fixed cost of a step.
    pub fixed_s: f64,
    /// Added cost per decoding sequence.
    pub per_seq_s: f64,
    /// Cost per prompt token prefilled.
    pub per_prompt_token_s: f64,
    /// Sequences at once.
    pub slots: usize,
    /// Tokens per step (decodes and prompt chunks together).
    pub chunk: usize,
    /// KV capacity in tokens (bounds the prefix cache).
    pub kv_tokens: usize,
    /// Tokens per KV block.
    pub block_tokens: usize,
}

impl Default for StepModel {
    /// A GPU-like replica: 10 ms steps plus 0.5 ms a sequence, 10,000
    /// prompt tokens/s, 16 slots, 512 tokens a step, 64k tokens of KV.
    fn default() -> Self {
        StepModel {
            fixed_s: 0.010,
            per_seq_s: 0.0005,
            per_prompt_token_s: 0.0001,
            slots: 16,
            chunk: 512,
            kv_tokens: 65_536,
            block_tokens: 16,
        }
    }
}

impl StepModel {
    /// Requests per second one replica at speed 1 sustains with every slot
    /// busy, for requests of `prompt` tokens to prefill and `output`
    /// tokens: its capacity, by which loads are stated.
    pub fn capacity(&self, prompt: f64, output: f64) -> f64 {
        let step = self.fixed_s + self.per_seq_s * self.slots as f64;
        let per_request = prompt * self.per_prompt_token_s + output * step / self.slots as f64;
        1.0 / per_request
    }
}

/// A request inside a replica.
#[derive(Debug, Clone)]
pub struct Seq {
    /// The caller's id.
    pub id: u64,
    /// Prompt tokens.
    pub prompt: usize,
    /// Its prompt's chained block hashes.
    pub blocks: Vec<u64>,
    /// Output tokens to generate.
    pub output: usize,
    prefill_left: usize,
    generated: usize,
    /// Prompt tokens its prefix-cache hit saved.
    pub cached: usize,
}

impl Seq {
    /// A new request.
    pub fn new(id: u64, prompt: usize, blocks: Vec<u64>, output: usize) -> Self {
        Seq {
            id,
            prompt: prompt.max(1),
            blocks,
            output: output.max(1),
            prefill_left: 0,
            generated: 0,
            cached: 0,
        }
    }
}

/// What one step produced for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Out {
    /// A token (the first one when `first`); `last` when it was the final.
    Token {
        /// The request.
        id: u64,
        /// Its first token.
        first: bool,
        /// Its last token.
        last: bool,
    },
}

/// A replica's state.
#[derive(Debug)]
pub struct Replica {
    /// Its model at speed 1.
    pub model: StepModel,
    /// Its speed (2 = twice as fast); changed by events.
    pub speed: f64,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    cache: Lru,
    /// Requests it cancelled before finishing (the client went away).
    cancelled: Vec<u64>,
    /// Prompt tokens prefilled and saved by the cache, in all.
    pub prefilled: u64,
    /// Prompt tokens the cache saved, in all.
    pub saved: u64,
}

impl Replica {
    /// An idle replica.
    pub fn new(model: StepModel, speed: f64) -> Self {
        Replica {
            model,
            speed,
            waiting: VecDeque::new(),
            running: Vec::new(),
            cache: Lru::new(model.kv_tokens / model.block_tokens.max(1)),
            cancelled: Vec::new(),
            prefilled: 0,
            saved: 0,
        }
    }

    /// Queue a request.
    pub fn submit(&mut self, s: Seq) {
        self.waiting.push_back(s);
    }

    /// Drop a request (its client left).
    pub fn cancel(&mut self, id: u64) {
        self.waiting.retain(|s| s.id != id);
        let before = self.running.len();
        self.running.retain(|s| s.id != id);
        if self.running.len() != before {
            self.cancelled.push(id);
        }
    }

    /// Requests waiting for a slot, and holding one.
    pub fn counts(&self) -> (usize, usize) {
        (self.waiting.len(), self.running.len())
    }

    /// KV in use, 0..1 (vLLM's `kv_cache_usage_perc`).
    pub fn kv_usage(&self) -> f64 {
        let used: usize = self.running.iter().map(|s| s.prompt + s.generated).sum();
        (used as f64 / self.model.kv_tokens.max(1) as f64).min(1.0)
    }

    /// Whether a step would do anything.
    pub fn busy(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Plan and run one step: its duration (seconds) and what it produced.
    /// None when idle.
    pub fn step(&mut self) -> Option<(f64, Vec<Out>)> {
        let m = self.model;
        while self.running.len() < m.slots {
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            let hit = self.cache.hit(&s.blocks) * m.block_tokens;
            let hit = hit.min(s.prompt - 1);
            s.cached = hit;
            s.prefill_left = s.prompt - hit;
            self.saved += hit as u64;
            self.running.push(s);
        }
        if self.running.is_empty() {
            return None;
        }
        let decoders = self.running.iter().filter(|s| s.prefill_left == 0).count();
        let mut budget = m.chunk.saturating_sub(decoders);
        let mut prompt_tokens = 0usize;
        let mut out = Vec::new();
        for s in &mut self.running {
            if s.prefill_left == 0 {
                s.generated += 1;
                out.push(Out::Token {
                    id: s.id,
                    first: false,
                    last: s.generated >= s.output,
                });
            } else if budget > 0 {
                let take = s.prefill_left.min(budget);
                budget -= take;
                prompt_tokens += take;
                s.prefill_left -= take;
                if s.prefill_left == 0 {
                    // The step that ends a prompt yields its first token.
                    s.generated = 1;
                    out.push(Out::Token {
                        id: s.id,
                        first: true,
                        last: s.output <= 1,
                    });
                }
            }
        }
        self.prefilled += prompt_tokens as u64;
        let dur = (m.fixed_s
            + m.per_seq_s * decoders as f64
            + m.per_prompt_token_s * prompt_tokens as f64)
            / self.speed.max(1e-3);
        // A finished prompt is in the cache; a finished request leaves.
        let mut i = 0;
        while i < self.running.len() {
            let s = &self.running[i];
            if s.prefill_left == 0 && s.generated == 1 {
                self.cache.insert(&s.blocks);
            }
            if s.generated >= s.output {
                self.running.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Some((dur, out))
    }
}

/// The prefix cache: block hashes, least recently used evicted first.
#[derive(Debug)]
struct Lru {
    cap: usize,
    at: HashMap<u64, u64>,
    order: VecDeque<(u64, u64)>,
    tick: u64,
}

impl Lru {
    fn new(cap: usize) -> Self {
        Lru {
            cap: cap.max(1),
            at: HashMap::new(),
            order: VecDeque::new(),
            tick: 0,
        }
    }

    /// Leading blocks held (and touched).
    fn hit(&mut self, blocks: &[u64]) -> usize {
        let n = blocks
            .iter()
            .take_while(|b| self.at.contains_key(b))
            .count();
        self.insert(&blocks[..n]);
        n
    }

    fn insert(&mut self, blocks: &[u64]) {
        for &b in blocks {
            self.tick += 1;
            self.at.insert(b, self.tick);
            self.order.push_back((b, self.tick));
        }
        while self.at.len() > self.cap || self.order.len() > 2 * self.cap + 64 {
            let Some((b, t)) = self.order.pop_front() else {
                break;
            };
            if self.at.get(&b) == Some(&t) {
                self.at.remove(&b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_prefills_in_chunks_then_decodes() {
        let m = StepModel {
            chunk: 100,
            ..StepModel::default()
        };
        let mut r = Replica::new(m, 1.0);
        r.submit(Seq::new(1, 250, vec![], 3));
        let mut firsts = 0;
        let mut steps = 0;
        let mut t = 0.0;
        while let Some((d, out)) = r.step() {
            steps += 1;
            t += d;
            firsts += out
                .iter()
                .filter(|o| matches!(o, Out::Token { first: true, .. }))
                .count();
        }
        assert_eq!(firsts, 1);
        // 3 prompt steps (the third yields the first token), 2 decodes.
        assert_eq!(steps, 5);
        assert!(
            (t - (5.0 * 0.010 + 0.025 + 2.0 * 0.0005)).abs() < 1e-9,
            "{t}"
        );
    }

    #[test]
    fn a_shared_prefix_is_prefilled_once() {
        let mut r = Replica::new(StepModel::default(), 2.0);
        let blocks: Vec<u64> = (0..40).collect();
        r.submit(Seq::new(1, 700, blocks.clone(), 1));
        while r.step().is_some() {}
        r.submit(Seq::new(2, 700, blocks, 1));
        while r.step().is_some() {}
        assert_eq!(r.saved, 640);
        assert_eq!(r.prefilled, 700 + 60);
    }
}
