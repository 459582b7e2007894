//! The prediction itself: the backend's continuous batching replayed step
//! by step, in bulk between events.
//!
//! The replay follows what the engine's planner does with a step's token
//! budget (`chunk`): every sequence holding a slot that has finished its
//! prompt decodes one token, and what is left of the budget goes to prompt
//! chunks in slot order, a finished prompt handing the rest of the step to
//! the next one. So while prompts are queued each step is full, and every
//! prompt that finishes turns into a decoder that takes one token of every
//! later step: a dozen prompts arriving together prefill ever more slowly,
//! which a sum of idle prefill times misses (it predicted the twelfth of
//! twelve at half its real time to first token). Between two events (a
//! prompt finishing, a decoder finishing and freeing its slot for the next
//! queued request) every step is the same, so the replay jumps from event
//! to event: its cost grows with the number of requests, not of steps.
//!
//! A [`Work`] may stand for several requests alike (`count`): the ledger
//! groups decoding requests by how much output they have left, so the
//! replay's cost is bounded by the number of groups, not of streams (see
//! `predict_book`). A group of decoders holds `count` slots and adds
//! `count` sequences to each step; it is split where only part of it finds
//! free slots.

use super::{Cost, Work};

/// One request in the replay: prompt tokens still to prefill and output
/// tokens still to decode.
#[derive(Debug, Clone, Copy)]
struct Seq {
    prefill: f64,
    output: f64,
    /// Requests it stands for (slots it holds, decoders it adds).
    n: usize,
}

/// Float slack so that `ceil` of an exact quotient is not one step more.
const EPS: f64 = 1e-9;

/// Predicted TTFT of a request of `rank` with `prompt` tokens, behind
/// `ahead` (in arrival order; entries of worse lanes are skipped: the
/// engine pauses them while a better lane prefills), on a backend with
/// `slots` concurrent sequences. Pure: the property tests drive it
/// directly.
///
/// Running work holds the slots first (in arrival order; beyond the slots
/// it waits in the backend's own queue), then queued work, better lanes
/// first, then this request; each takes a slot as one frees. The request
/// also waits out the step in flight when it arrives. More work anywhere in
/// the list never makes the result earlier (property-tested).
pub fn predict(cost: &Cost, slots: usize, ahead: &[Work], rank: u32, prompt: usize) -> f64 {
    let slots = slots.max(1);
    let counted = |w: &&Work| w.rank <= rank;
    let mut queued: Vec<&Work> = ahead
        .iter()
        .filter(counted)
        .filter(|w| !w.running)
        .collect();
    // Better lanes first, then arrival order (the sort is stable).
    queued.sort_by_key(|w| w.rank);
    let seqs: Vec<Seq> = ahead
        .iter()
        .filter(counted)
        .filter(|w| w.running)
        .chain(queued)
        .map(|w| match w.prefill {
            // Alike decoders hold a slot each.
            0 => Seq {
                prefill: 0.0,
                output: w.output,
                n: w.count.max(1),
            },
            // Alike prompts replay as one prompt of all their tokens.
            p => Seq {
                prefill: (p * w.count.max(1)) as f64,
                output: w.output,
                n: 1,
            },
        })
        .chain(std::iter::once(Seq {
            prefill: prompt.max(1) as f64,
            output: 1.0,
            n: 1,
        }))
        .collect();
    in_flight(cost, slots, ahead) + replay(cost, slots, seqs)
}

/// The step in flight when the request arrives (idle: none): all running
/// sequences, or a whole budget if a prompt is being prefilled.
fn in_flight(cost: &Cost, slots: usize, ahead: &[Work]) -> f64 {
    let running: usize = ahead
        .iter()
        .filter(|w| w.running)
        .map(|w| w.count.max(1))
        .sum();
    if running == 0 {
        return 0.0;
    }
    let seqs = cost.step(running.min(slots));
    match cost.chunk {
        Some(c) if ahead.iter().any(|w| w.running && w.prefill > 0) => seqs.max(cost.step(c)),
        _ => seqs,
    }
}

/// Seconds until the last of `seqs` has its prompt prefilled (its first
/// token), replaying `slots` slots from an idle start.
fn replay(cost: &Cost, slots: usize, mut seqs: Vec<Seq>) -> f64 {
    let me = seqs.len() - 1;
    // Slot holders as (index, state), in slot order; `next` is the first
    // request still queued.
    // At most every sequence holds a slot: an unlimited backend has a
    // million slots, and reserving them all was a 24 MiB allocation (and
    // 80 us) per prediction.
    let mut active: Vec<(usize, Seq)> = Vec::with_capacity(slots.min(seqs.len()));
    let mut next = 0;
    let mut used = 0;
    let mut t = 0.0;
    // Each round ends at least one prompt or one group of decoders, and a
    // group split for want of slots adds one more, so three rounds per
    // request stood for end everything; the bound only guards against a
    // float surprise.
    let members: usize = seqs.iter().map(|s| s.n).sum();
    for _ in 0..3 * members + 2 {
        while used < slots && next < seqs.len() {
            let free = slots - used;
            let s = &mut seqs[next];
            if s.n > free {
                // Part of a group of alike requests takes the free slots;
                // the rest waits in its place.
                s.n -= free;
                active.push((next, Seq { n: free, ..*s }));
                used += free;
                break;
            }
            used += s.n;
            active.push((next, *s));
            next += 1;
        }
        let decoders: usize = active
            .iter()
            .filter(|(_, s)| s.prefill <= 0.0)
            .map(|(_, s)| s.n)
            .sum();
        let pending: f64 = active.iter().map(|(_, s)| s.prefill.max(0.0)).sum();
        // Prompt tokens per step: what the decodes leave of the budget (at
        // least one: the planner always moves a prompt), all of it without
        // a budget.
        let rate = match cost.chunk {
            Some(c) => (c as f64 - decoders as f64).max(1.0).min(pending),
            None => pending,
        };
        let per_step = cost.step(decoders);
        // Cost of n steps: the prompt tokens they really take (the last
        // step of a span may be part empty).
        let span = |n: f64| n * per_step + cost.prefill_per_token_s * (n * rate).min(pending);
        // Steps until an event: the first prompt in slot order ends, or the
        // shortest decoder does; the step mix is the same until then.
        let mut k = f64::INFINITY;
        let mut mine = None;
        let mut upto = 0.0;
        for (i, s) in active.iter().filter(|(_, s)| s.prefill > 0.0) {
            upto += s.prefill;
            let done = (upto / rate - EPS).ceil().max(1.0);
            if *i == me {
                mine = Some(done);
                break;
            }
            k = k.min(done);
        }
        for (_, s) in active.iter().filter(|(_, s)| s.prefill <= 0.0) {
            k = k.min((s.output - EPS).ceil().max(1.0));
        }
        // This request's prompt ends before or with the next event.
        if let Some(done) = mine.filter(|d| *d <= k) {
            // Its last step may be part empty when it is the last prompt.
            let last = rate.min(pending - (done - 1.0) * rate);
            return t + span(done - 1.0) + per_step + cost.prefill_per_token_s * last;
        }
        if !k.is_finite() {
            break;
        }
        t += span(k);
        // Decoders advance k tokens; prompts take k * rate tokens in order.
        let mut budget = k * rate;
        for (_, s) in active.iter_mut() {
            if s.prefill <= 0.0 {
                s.output -= k;
            } else if budget > 0.0 {
                let take = s.prefill.min(budget);
                s.prefill -= take;
                budget -= take;
                if s.prefill <= EPS {
                    s.prefill = 0.0;
                    // Decoding starts after this span: whatever it decodes
                    // in the span's last steps is not counted (conservative).
                    s.output = s.output.max(1.0);
                }
            }
        }
        active.retain(|(_, s)| {
            let keep = s.prefill > 0.0 || s.output > EPS;
            if !keep {
                used -= s.n;
            }
            keep
        });
    }
    t
}
