//! One sequence inside the engine: its tokens, blocks, sampler, stop
//! matcher and event channel, and what happens when a step produces its
//! next-token logits.

use super::GenerateRequest;
use crate::api::{Event, FinishReason, Usage};
use crate::backend::logits::Row;
use crate::guide::{Guide, Mask};
use crate::kv::SeqBlocks;
use crate::sampling::{Sampler, StopMatcher};
use crate::tokenizer::{DecodeOffsets, TextCodec};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// Whether the sequence goes on.
pub(super) enum Outcome {
    Continue,
    Finished,
}

pub(super) struct Seq {
    pub req: GenerateRequest,
    tx: UnboundedSender<Event>,
    /// Prompt then generated tokens.
    pub tokens: Vec<u32>,
    /// Tokens whose keys and values are in the cache.
    pub computed: usize,
    pub cached_tokens: usize,
    pub blocks: Option<SeqBlocks>,
    pub arrived: Instant,
    pub first_step: Option<Instant>,
    pub compute: Duration,
    pub finished: bool,
    sampler: Sampler,
    stop: StopMatcher,
    offsets: DecodeOffsets,
    prompt_len: usize,
    /// The output's grammar, if constrained (taken out by the scheduler
    /// while it computes the mask beside the forward pass).
    pub guide: Option<Guide>,
    /// Its tenant's id (the anonymous tenant's when the request names none).
    pub tenant: u64,
    /// Its prompt was charged to the tenant (it was granted a slot once;
    /// a preempted sequence back in the queue is not charged again).
    pub charged: bool,
}

impl Seq {
    pub fn new(mut req: GenerateRequest, tx: UnboundedSender<Event>) -> Self {
        Seq {
            tenant: req
                .tenant
                .as_ref()
                .map_or_else(|| crate::fair::Tenant::anonymous().id, |t| t.id),
            charged: false,
            guide: req.guide.take(),
            tokens: req.prompt.clone(),
            prompt_len: req.prompt.len(),
            computed: 0,
            cached_tokens: 0,
            blocks: None,
            arrived: Instant::now(),
            first_step: None,
            compute: Duration::ZERO,
            finished: false,
            sampler: Sampler::new(req.sampling.clone()),
            stop: StopMatcher::new(&req.stop),
            offsets: DecodeOffsets::default(),
            req,
            tx,
        }
    }

    /// Its lane rank as an index of the per-rank state.
    pub fn rank(&self) -> usize {
        (self.req.lane_rank as usize).min(super::RANKS - 1)
    }

    /// The client is gone (its receiver was dropped).
    pub fn cancelled(&self) -> bool {
        self.tx.is_closed()
    }

    /// See [`Sampler::needs_top`].
    pub fn sampler_needs_top(&self, max: usize) -> Option<usize> {
        self.sampler.needs_top(max)
    }

    pub fn fail(&mut self, why: &str) {
        let _ = self.tx.send(Event::Error(why.to_string()));
        self.finished = true;
    }

    fn done(&mut self, finish: FinishReason) -> Outcome {
        let usage = Usage {
            prompt_tokens: self.prompt_len,
            completion_tokens: self.tokens.len() - self.prompt_len,
            cached_tokens: self.cached_tokens,
        };
        let queue = self
            .first_step
            .map(|f| f.duration_since(self.arrived))
            .unwrap_or_default();
        let text = self.stop.finish();
        let _ = self.tx.send(Event::Done {
            text,
            finish,
            usage,
            queue,
            compute: self.compute,
        });
        Outcome::Finished
    }

    /// Sample the next token from `logits` and report it. A constrained
    /// sequence samples only what its grammar allows (`mask`, computed
    /// during the step; here if it was not).
    pub fn advance(&mut self, logits: Row<'_>, codec: &TextCodec, mask: Option<Mask>) -> Outcome {
        let next = match logits {
            Row::Full(logits) => {
                self.sampler.adjust(logits, &self.tokens);
                if let Some(g) = self.guide.as_mut() {
                    let mask = match mask.map(Ok).unwrap_or_else(|| g.mask()) {
                        Ok(m) => m,
                        Err(e) => {
                            self.fail(&e);
                            return Outcome::Finished;
                        }
                    };
                    mask.apply(logits);
                }
                self.sampler.cut(logits);
                self.sampler.sample(logits)
            }
            // The scheduler asks for candidates only without a grammar.
            Row::Top(_) if self.guide.is_some() => {
                self.fail("a constrained sequence got candidates instead of its logits");
                return Outcome::Finished;
            }
            Row::Top(cands) => self.sampler.sample_top(cands),
        };
        if codec.eos.contains(&next) {
            return self.done(FinishReason::Stop);
        }
        if let Some(g) = self.guide.as_mut() {
            if let Err(e) = g.commit(next) {
                self.fail(&e);
                return Outcome::Finished;
            }
        }
        self.tokens.push(next);
        self.sampler.accepted(next);
        let generated = &self.tokens[self.prompt_len..];
        let piece = match codec.decode_step(generated, &mut self.offsets) {
            Ok(p) => p,
            Err(e) => {
                self.fail(&e.to_string());
                return Outcome::Finished;
            }
        };
        let out = self.stop.push(&piece);
        if out.stopped {
            if !out.emit.is_empty() {
                let _ = self.tx.send(Event::Token {
                    id: next,
                    text: out.emit,
                });
            }
            // The stop text is not part of the completion.
            return self.done(
                out.which
                    .map_or(FinishReason::Stop, FinishReason::StopSequence),
            );
        }
        if self
            .tx
            .send(Event::Token {
                id: next,
                text: out.emit,
            })
            .is_err()
        {
            self.finished = true;
            return Outcome::Finished;
        }
        if self.guide.as_ref().is_some_and(Guide::finished) {
            // The grammar is complete: only end-of-sequence could follow.
            return self.done(FinishReason::Stop);
        }
        if self.tokens.len() - self.prompt_len >= self.req.max_tokens {
            return self.done(FinishReason::Length);
        }
        Outcome::Continue
    }
}
