//! One sequence inside the engine: its tokens, blocks, sampler, stop
//! matcher and event channel, and what happens when a step produces its
//! next-token logits.

use super::GenerateRequest;
use crate::api::{Alt, Event, FinishReason, TokenLogprob, Usage};
use crate::backend::logits::Row;
use crate::guide::{Guide, Mask};
use crate::kv::SeqBlocks;
use crate::logprob::Before;
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
    /// The prompt's report (`echo`), filled as its chunks are scored.
    prompt_report: Vec<TokenLogprob>,
    /// The report went out (before the first token).
    prompt_sent: bool,
    /// Which choice it is of a request for several (its events go out
    /// wrapped in [`Event::Indexed`]).
    pub index: Option<u32>,
    /// The request's other choices, held until this one's prompt is in
    /// the cache: then they start on its cached blocks and compute only
    /// the prompt's last, partial block.
    pub followers: Vec<Seq>,
}

impl Seq {
    pub fn new(mut req: GenerateRequest, tx: UnboundedSender<Event>) -> Self {
        Seq {
            tenant: req
                .tenant
                .as_ref()
                .map_or_else(|| crate::fair::Tenant::anonymous().id, |t| t.id),
            charged: false,
            prompt_report: Vec::new(),
            prompt_sent: false,
            index: None,
            followers: Vec::new(),
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

    /// `n` sequences for one request, sharing one event channel: the
    /// first leads and holds the others (see `followers`); each choice's
    /// generator is seeded apart (seed + index when the request has one).
    pub fn choices(mut req: GenerateRequest, n: usize, tx: UnboundedSender<Event>) -> Seq {
        if n <= 1 {
            return Seq::new(req, tx);
        }
        // One base seed for all, so that no two choices can draw the same
        // seed from a coarse clock.
        let base = req.sampling.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0x5eed, |d| d.as_nanos() as u64)
        });
        req.sampling.seed = Some(base);
        let mut lead = Seq::new(req.clone(), tx.clone());
        lead.index = Some(0);
        for i in 1..n {
            let mut r = req.clone();
            r.sampling.seed = Some(base.wrapping_add(i as u64));
            // The prompt's report is the leader's (one prompt).
            r.sampling.echo = false;
            r.sampling.prompt_logprobs = None;
            let mut f = Seq::new(r, tx.clone());
            f.index = Some(i as u32);
            lead.followers.push(f);
        }
        lead
    }

    /// Send `ev`, wrapped when this is one of several choices; false when
    /// the client is gone.
    fn emit(&self, ev: Event) -> bool {
        let ev = match self.index {
            Some(i) => Event::Indexed(i, Box::new(ev)),
            None => ev,
        };
        self.tx.send(ev).is_ok()
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

    /// Its prompt is being scored and some of it is not yet: a step must
    /// hand it every position's logits.
    pub fn scoring_prompt(&self) -> bool {
        // Once sent, the report is gone from here: never again.
        self.req.sampling.echo
            && self.req.sampling.prompt_logprobs.is_some()
            && !self.prompt_sent
            && self.prompt_report.len() < self.prompt_len
    }

    /// Score the prompt tokens that the rows of a step predict: `rows` are
    /// the logits of positions `start..`, one row each, and the row of
    /// position p predicts token p + 1.
    pub fn score_prompt(&mut self, start: usize, rows: &[f32], vocab: usize, codec: &TextCodec) {
        let k = self.req.sampling.prompt_logprobs.unwrap_or(0);
        if self.prompt_report.is_empty() && self.prompt_len > 0 {
            // Nothing predicts the first token.
            self.prompt_report
                .push(report(codec, self.tokens[0], None, &[]));
        }
        for (r, row) in rows.chunks_exact(vocab.max(1)).enumerate() {
            let target = start + r + 1;
            // Rows of positions already scored (a recompute after
            // preemption) or past the prompt are not the prompt's.
            if target != self.prompt_report.len() || target >= self.prompt_len {
                continue;
            }
            let id = self.tokens[target];
            let (lp, alts) = crate::logprob::score(row, id, k);
            self.prompt_report.push(report(codec, id, Some(lp), &alts));
        }
    }

    /// Send the prompt's report once, before the first token (`echo`).
    fn send_prompt(&mut self, codec: &TextCodec) {
        if self.prompt_sent || !self.req.sampling.echo {
            return;
        }
        self.prompt_sent = true;
        let mut out = std::mem::take(&mut self.prompt_report);
        // Unscored tokens (echo alone) are listed with their bytes only.
        for &id in &self.tokens[out.len()..self.prompt_len] {
            out.push(report(codec, id, None, &[]));
        }
        let _ = self.emit(Event::Prompt(out));
    }

    pub fn fail(&mut self, why: &str) {
        let _ = self.emit(Event::Error(why.to_string()));
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
        let _ = self.emit(Event::Done {
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
        self.send_prompt(codec);
        if self.req.max_tokens == 0 {
            // Scoring only (`echo` with `max_tokens` 0).
            return self.done(FinishReason::Length);
        }
        // The report is of the row as the model produced it: a row that
        // sampling changes in place is kept whole until the token is known.
        let mut scored: Option<Before> = None;
        let mut report_of: Option<(f32, Vec<(u32, f32)>)> = None;
        let want = self.req.sampling.logprobs;
        let next = match logits {
            Row::Full(logits) => {
                if let Some(k) = want {
                    let changes = self.req.sampling.adjusts_logits() || self.guide.is_some();
                    scored = Some(Before::take(logits, k, changes));
                }
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
                let next = self.sampler.sample(logits);
                report_of = scored.map(|b| b.chosen(logits, next));
                next
            }
            // The scheduler asks for candidates only without a grammar.
            Row::Top(_) | Row::Scored(..) if self.guide.is_some() => {
                self.fail("a constrained sequence got candidates instead of its logits");
                return Outcome::Finished;
            }
            Row::Top(cands) => self.sampler.sample_top(cands),
            // Candidates (at least the sampler's and the report's k) and
            // the row's log-normaliser, from a device.
            Row::Scored(cands, norm) => {
                let next = self.sampler.sample_top(cands);
                let lp = |l: f32| {
                    if norm.is_finite() {
                        l - norm
                    } else {
                        f32::NEG_INFINITY
                    }
                };
                let k = want.unwrap_or(0);
                let mine = cands
                    .iter()
                    .find(|c| c.0 == next)
                    .map_or(f32::NEG_INFINITY, |c| lp(c.1));
                let alts = cands.iter().take(k).map(|&(t, l)| (t, lp(l))).collect();
                report_of = want.map(|_| (mine, alts));
                next
            }
        };
        if let Some((lp, alts)) = report_of {
            // Before the token's own event, end of sequence included (as
            // vLLM lists it: a scorer echoing `max_tokens` 1 drops the last
            // token's report, whichever it is).
            let r = report(codec, next, Some(lp), &alts);
            let _ = self.emit(Event::Logprob(Box::new(r)));
        }
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
                let _ = self.emit(Event::Token {
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
        if !self.emit(Event::Token {
            id: next,
            text: out.emit,
        }) {
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

/// One token's report: its bytes and those of its alternatives.
fn report(codec: &TextCodec, id: u32, logprob: Option<f32>, alts: &[(u32, f32)]) -> TokenLogprob {
    TokenLogprob {
        id,
        bytes: codec.token_bytes(id),
        logprob,
        top: alts
            .iter()
            .map(|&(id, logprob)| Alt {
                id,
                bytes: codec.token_bytes(id),
                logprob,
            })
            .collect(),
    }
}
