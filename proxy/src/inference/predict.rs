//! Time-to-first-token prediction: a live throughput model per backend and a
//! ledger of the work admitted to it, so admission can tell on arrival
//! whether a request can meet its lane's target, and refuse at once if not.
//!
//! The cost model is a step model, the shape continuous batching has on any
//! device: a step with `d` decoding sequences costs `step_fixed +
//! step_per_seq * d`, and each prompt token in it `prefill_per_token` more;
//! prompts go in chunks of what the decodes leave of `chunk` tokens. For
//! the in-process engine all three come from the engine's own online
//! least-squares fit of step time (seeded by warm-up, so the first request
//! is predicted); an upstream starts from configured priors and learns
//! online from its own streams (inter-token gaps at the current
//! concurrency, time to first token when nothing was ahead).
//!
//! The ledger holds every request admitted and not finished: lane rank,
//! prompt, expected output (its `max_tokens` times the learned share of
//! `max_tokens` that requests really generate), tokens generated so far,
//! and whether the backend has started it, kept in books (`predict_book`)
//! where every change is O(1) and the view of the work ahead is bounded
//! whatever the number of requests (decoders grouped by output left, at
//! most 64 waiting requests listed; the module states the error). A
//! prediction replays the backend's batching over that view
//! (`predict_sim`). Lower lanes are not counted: the engine pauses them
//! while a better lane prefills, and the gate serves better lanes first.
//! The view is taken under the lock, the replay runs outside it, and the
//! request enters the ledger under the lock only if no other request
//! entered meanwhile (else it views and replays again), so concurrent
//! arrivals see each other while the lock is held for microseconds; a
//! request claims its place before it is tokenized, so arrivals meanwhile
//! see it too. The replay is monotone in the work ahead up to one step
//! (property-tested; see `predict_tests::grain`).
//!
//! Admission decides on the calibrated prediction: the raw replay times
//! the lane's correction factor, the p99 of how late recent first tokens
//! came against their raw predictions (`calibrate`), so the target holds
//! on a machine slower (or faster) than the fit believes.

use crate::admission::clock::{Clock, MonotonicClock};
use book::{rank_index, Books, Entry, Viewer, RANKS};
use calibrate::Calibration;
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, Instant};
use ultrafast_engine::fair::Tenant;

/// The step model of a backend, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cost {
    /// Fixed cost of one step.
    pub step_fixed_s: f64,
    /// Added cost per decoding sequence in a step.
    pub step_per_seq_s: f64,
    /// Cost per prompt token.
    pub prefill_per_token_s: f64,
    /// Most tokens per step, decodes and prompt chunks together (None: no
    /// budget, every queued prompt goes whole into the next step).
    pub chunk: Option<usize>,
}

impl Cost {
    /// Time of a step decoding `b` sequences (its prompt tokens apart).
    pub fn step(&self, b: usize) -> f64 {
        self.step_fixed_s + self.step_per_seq_s * b as f64
    }
}

/// A member's score (see [`Latency::score`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Score {
    /// Calibrated TTFT prediction, floored as admission compares it.
    pub ttft: Duration,
    /// The same without the floor, seconds.
    pub rank_s: f64,
    /// Inter-token gap of a stream joining now.
    pub tpot: Duration,
    /// Requests in the ledger.
    pub in_ledger: usize,
}

/// One request in the ledger.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Work {
    /// Lane rank (lower is served first).
    pub rank: u32,
    /// Prompt tokens still to prefill.
    pub prefill: usize,
    /// Output tokens still expected.
    pub output: f64,
    /// Holds a backend slot (dispatched).
    pub running: bool,
    /// Requests alike it stands for (the ledger groups decoders; see
    /// `predict_book`): decoders hold a slot each, prompts replay as one
    /// prompt of all their tokens.
    pub count: usize,
}

/// An exponentially weighted least-squares fit of `y = a + c x`.
#[derive(Debug, Clone, Copy)]
pub struct Fit {
    w: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
}

impl Fit {
    const KEEP: f64 = 0.98;

    /// A fit seeded with `weight` pseudo-samples of the line `a + c x` at
    /// `x0` and `x1`.
    pub fn seeded(a: f64, c: f64, x0: f64, x1: f64, weight: f64) -> Self {
        let mut f = Fit {
            w: 0.0,
            sx: 0.0,
            sy: 0.0,
            sxx: 0.0,
            sxy: 0.0,
        };
        for x in [x0, x1] {
            f.add(x, a + c * x, weight / 2.0);
        }
        f
    }

    fn add(&mut self, x: f64, y: f64, w: f64) {
        self.w += w;
        self.sx += w * x;
        self.sy += w * y;
        self.sxx += w * x * x;
        self.sxy += w * x * y;
    }

    /// Add one sample, forgetting old ones slowly.
    pub fn observe(&mut self, x: f64, y: f64) {
        if !(x.is_finite() && y.is_finite()) || y < 0.0 {
            return;
        }
        self.w *= Self::KEEP;
        self.sx *= Self::KEEP;
        self.sy *= Self::KEEP;
        self.sxx *= Self::KEEP;
        self.sxy *= Self::KEEP;
        self.add(x, y, 1.0);
    }

    /// The fitted (a, c), with a >= 0 and c >= 0.
    pub fn line(&self) -> (f64, f64) {
        if self.w <= 0.0 {
            return (0.0, 0.0);
        }
        let var = self.w * self.sxx - self.sx * self.sx;
        let c = if var.abs() < 1e-12 {
            0.0
        } else {
            (self.w * self.sxy - self.sx * self.sy) / var
        };
        let a = (self.sy - c * self.sx) / self.w;
        // Costs are never negative: on a boundary, refit the other term.
        if c < 0.0 {
            return ((self.sy / self.w).max(0.0), 0.0);
        }
        if a < 0.0 {
            let c0 = if self.sxx > 0.0 {
                self.sxy / self.sxx
            } else {
                0.0
            };
            return (0.0, c0.max(0.0));
        }
        (a, c)
    }
}

#[derive(Debug)]
struct Ledger {
    books: Books,
    next: u64,
    /// Share of `max_tokens` that requests really generate.
    output_share: f64,
    /// Upstream step fit: inter-token gap over concurrency.
    decode: Fit,
    /// Upstream prefill seconds per prompt token, as last measured.
    prefill_per_token_s: f64,
    /// The fitted step time of one stream when it was measured: the
    /// prefill cost moves with the step time between measurements (a
    /// member that decodes 3x slower prefills 3x slower too).
    prefill_anchor_s: f64,
    /// When each lane rank (0..8) last sent a request.
    last_seen: [Option<Instant>; RANKS],
}

/// How long a better lane counts as active after its last request: while
/// it is, the slots it reserves are not counted for worse lanes.
const ACTIVE_FOR: Duration = Duration::from_secs(10);

/// How often a decision replays again because another request arrived
/// while it replayed outside the lock; after that it decides on what it
/// has (at most that many concurrent arrivals then miss each other).
const RETRIES: usize = 3;

/// What admission learns from a prediction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// Within the target (or no target): the ticket holds the place.
    Admit(Duration),
    /// Beyond the target now; it would fit on an idle backend.
    Busy(Duration),
}

/// A backend's latency model and ledger.
#[derive(Debug)]
pub struct Latency {
    /// Learn costs from streams (backends without a live cost model).
    learn: bool,
    slots: usize,
    chunk: Option<usize>,
    ledger: Mutex<Ledger>,
    calibration: Calibration,
    /// Time as the ledger and the calibration see it (a manual clock in
    /// the fleet's discrete-event simulation).
    clock: Arc<dyn Clock>,
}

/// What one decision asks of the ledger.
struct Ask<'a> {
    live: Option<Cost>,
    rank: u32,
    /// Prompt tokens the prediction is for.
    prompt: usize,
    target: Option<Duration>,
    reserved: &'a [(u32, f64)],
    /// The entry to enter when admitted (its id: the claim's, or new).
    entry: Entry,
    claim: Option<Ticket>,
    /// Whether its first token is a calibration sample (an admission; a
    /// claim predicts for a one-token stand-in, nothing to learn from).
    learns: bool,
}

impl Latency {
    /// A model for a backend running `slots` sequences at once (prompt
    /// chunks of `chunk` tokens). `learn`: the backend has no cost model of
    /// its own, so learn one from its streams, starting from priors in
    /// tokens per second.
    pub fn new(
        learn: bool,
        slots: usize,
        chunk: Option<usize>,
        prior_prefill_tps: f64,
        prior_decode_tps: f64,
    ) -> Self {
        let a = 1.0 / prior_decode_tps.max(1e-3);
        Latency {
            learn,
            slots: slots.max(1),
            chunk,
            ledger: Mutex::new(Ledger {
                books: Books::default(),
                next: 0,
                output_share: 1.0,
                last_seen: [None; RANKS],
                decode: Fit::seeded(a, 0.0, 1.0, slots.max(2) as f64, 4.0),
                prefill_per_token_s: 1.0 / prior_prefill_tps.max(1e-3),
                prefill_anchor_s: a,
            }),
            calibration: Calibration::default(),
            clock: Arc::new(MonotonicClock),
        }
    }

    /// The same model on `clock` (simulations in virtual time).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.calibration = Calibration::with_clock(self.calibration.window(), clock.clone());
        self.clock = clock;
        self
    }

    /// The cost model now: the backend's own (`live`) if it has one, else
    /// the learned one.
    pub fn cost(&self, live: Option<Cost>) -> Cost {
        if let Some(mut c) = live {
            c.chunk = c.chunk.or(self.chunk);
            return c;
        }
        let l = self.ledger.lock();
        let (a, c) = l.decode.line();
        let scale = ((a + c) / l.prefill_anchor_s.max(1e-9)).clamp(0.1, 10.0);
        Cost {
            step_fixed_s: a,
            step_per_seq_s: c,
            prefill_per_token_s: l.prefill_per_token_s * scale,
            chunk: self.chunk,
        }
    }

    /// The same model calibrated over samples of the last `window`
    /// (default one minute; see `calibrate`).
    pub fn calibrated_over(mut self, window: Duration) -> Self {
        self.calibration = Calibration::with_clock(window, self.clock.clone());
        self
    }

    /// Concurrent sequences of the backend.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The correction factor admission multiplies lane `rank`'s raw
    /// predictions by (see `calibrate`).
    pub fn correction(&self, rank: u32) -> f64 {
        self.calibration.factor(rank)
    }

    /// Predicted TTFT on an idle backend, raw: what the step model says
    /// the prompt alone costs. Not calibrated: it decides the hard 422
    /// (`slo_unattainable`), and a conservative factor there would refuse
    /// for good what is only refused for now under load.
    pub fn idle(&self, live: Option<Cost>, prompt: usize) -> Duration {
        secs(predict(&self.cost(live), self.slots, &[], 0, prompt))
    }

    /// Predict (calibrated), and take a place in the ledger when the
    /// prediction is within `target` (always, without a target). Atomic
    /// with respect to other arrivals (see [`RETRIES`]).
    /// `reserved` lists the better lanes' (rank, `reserved_share`): while
    /// such a lane is active (a request in the last ten seconds), the
    /// share of the slots it keeps for itself is not counted for this one,
    /// since its next request will take it.
    /// `claim`, the request's place taken by [`claim`](Self::claim) before
    /// tokenizing, keeps its arrival order and gives way to the real entry
    /// (or leaves the ledger on a refusal).
    #[allow(clippy::too_many_arguments)]
    pub fn admit(
        self: &Arc<Self>,
        live: Option<Cost>,
        rank: u32,
        prompt: usize,
        max_out: usize,
        target: Option<Duration>,
        reserved: &[(u32, f64)],
        claim: Option<Ticket>,
        tenant: &Tenant,
    ) -> (Verdict, Option<Ticket>) {
        let ask = Ask {
            live,
            rank,
            prompt,
            target,
            reserved,
            entry: entry(rank, prompt, max_out, target).of(tenant),
            claim,
            learns: true,
        };
        match self.decide(ask) {
            Ok((p, t)) => (Verdict::Admit(p), Some(t)),
            Err(p) => (Verdict::Busy(p), None),
        }
    }

    /// Before the prompt is tokenized: the prediction for the smallest
    /// possible prompt, which is a lower bound (the prediction grows with
    /// the prompt). Beyond `target`: `Err(prediction)`, the request can be
    /// refused before any work that grows with it. Within: the request
    /// takes a place in the ledger at once, sized by `estimate` (its
    /// prompt's likely token count, which the caller bounds by what the
    /// request can really cost), so that requests arriving while it is
    /// tokenized count it ahead of them, as they would had it been
    /// tokenized in no time; [`admit`](Self::admit) settles it. Without
    /// the place, a flood's first hundred requests all passed this check
    /// before the first was tokenized, and each waited its turn in the
    /// tokenizer to be refused. Marks the lane active.
    #[allow(clippy::too_many_arguments)]
    pub fn claim(
        self: &Arc<Self>,
        live: Option<Cost>,
        rank: u32,
        estimate: usize,
        max_out: usize,
        target: Duration,
        reserved: &[(u32, f64)],
        tenant: &Tenant,
    ) -> Result<Ticket, Duration> {
        let e = entry(rank, estimate.max(1), max_out, Some(target)).of(tenant);
        let ask = Ask {
            live,
            rank,
            prompt: 1,
            target: Some(target),
            reserved,
            entry: e,
            claim: None,
            learns: false,
        };
        self.decide(ask).map(|(_, t)| t)
    }

    /// One decision: view the work ahead under the lock, replay it outside
    /// the lock, and enter the request under the lock if no other arrival
    /// came meanwhile (else again, up to [`RETRIES`] times).
    fn decide(self: &Arc<Self>, ask: Ask<'_>) -> Result<(Duration, Ticket), Duration> {
        let cost = self.cost(ask.live);
        let mut tries = 0;
        loop {
            let (ahead, seen, slots) = {
                let mut l = self.ledger.lock();
                let place = ask.claim.as_ref().map_or(l.next, |t| t.id);
                let slots = self.slots_for(&mut l, ask.rank, ask.reserved);
                let viewer = Viewer {
                    rank: ask.rank,
                    place,
                    share: l.output_share,
                    tenant: ask.entry.tenant,
                    weight: ask.entry.weight,
                    prompt: ask.prompt,
                };
                (l.books.view(viewer), l.books.arrivals, slots)
            };
            let raw = predict(&cost, slots, &ahead, ask.rank, ask.prompt);
            // Calibrated (see `calibrate`): the floor counts on both sides.
            let factor = self.calibration.factor_for(ask.rank, ahead.is_empty());
            let p = secs(raw.max(ask.entry.floor_s) * factor);
            let mut l = self.ledger.lock();
            if l.books.arrivals != seen && tries < RETRIES {
                tries += 1;
                continue;
            }
            if ask.target.is_some_and(|t| p > t) {
                // The claim (if any) leaves the ledger when dropped, after
                // the lock.
                drop(l);
                return Err(p);
            }
            let ticket = ask.claim.unwrap_or_else(|| {
                l.next += 1;
                Ticket {
                    model: self.clone(),
                    id: l.next - 1,
                }
            });
            let mut e = ask.entry;
            e.admitted = self.clock.now();
            if ask.learns {
                e.predicted_s = Some(raw);
            }
            l.books.insert(ticket.id, e);
            return Ok((p, ticket));
        }
    }

    /// What the fleet's policy scores a member by before it admits the
    /// request on the best one (the admission there views and replays
    /// again, atomically with other arrivals): the calibrated prediction
    /// for a request of `prompt` tokens in lane `rank` as admission
    /// compares it with the target, the same without the floor (which
    /// ranks members the floor would make equal), the inter-token gap of a
    /// stream joining now, and the ledger's load. One view under the lock.
    pub fn score(
        &self,
        live: Option<Cost>,
        rank: u32,
        prompt: usize,
        target: Option<Duration>,
        tenant: &Tenant,
    ) -> Score {
        let cost = self.cost(live);
        let floor_s = target.map_or(0.05, |t| t.as_secs_f64() / 20.0);
        let (ahead, in_ledger, running) = {
            let l = self.ledger.lock();
            let viewer = Viewer {
                rank,
                place: l.next,
                share: l.output_share,
                tenant: tenant.id,
                weight: tenant.weight,
                prompt,
            };
            (l.books.view(viewer), l.books.len(), l.books.running())
        };
        let raw = predict(&cost, self.slots, &ahead, rank, prompt);
        let factor = self.calibration.factor_for(rank, ahead.is_empty());
        Score {
            ttft: secs(raw.max(floor_s) * factor),
            rank_s: raw * factor,
            tpot: secs(cost.step(self.joined(live, running))),
            in_ledger,
        }
    }

    /// The predicted gap between tokens of a stream that joins now: one
    /// step with every running sequence and this one decoding. Raw: the
    /// decode fit follows a member's speed within a few hundred tokens.
    pub fn tpot(&self, live: Option<Cost>) -> Duration {
        let cost = self.cost(live);
        let running = self.ledger.lock().books.running();
        secs(cost.step(self.joined(live, running)))
    }

    /// The concurrency a stream joining now decodes at: with a learned
    /// fit, the streams this edge has dispatched (queued at the member or
    /// not, as the fit was learned); else at most the slots.
    fn joined(&self, live: Option<Cost>, running: usize) -> usize {
        if live.is_none() && self.learn {
            running + 1
        } else {
            (running + 1).min(self.slots)
        }
    }

    /// Requests in the ledger and how many of them hold a slot.
    pub fn load(&self) -> (usize, usize) {
        let l = self.ledger.lock();
        (l.books.len(), l.books.running())
    }

    /// The slots this lane may count on, leaving out those of active
    /// better lanes' reserves; marks the lane active.
    fn slots_for(&self, l: &mut Ledger, rank: u32, reserved: &[(u32, f64)]) -> usize {
        let now = self.clock.now();
        let last = l.last_seen;
        let active = |r: u32| {
            last[rank_index(r)].is_some_and(|t| now.saturating_duration_since(t) < ACTIVE_FOR)
        };
        let held_share: f64 = reserved
            .iter()
            .filter(|(r, _)| *r < rank && active(*r))
            .map(|(_, s)| s)
            .sum();
        let held = (held_share.clamp(0.0, 1.0) * self.slots as f64).ceil() as usize;
        l.last_seen[rank_index(rank)] = Some(now);
        self.slots.saturating_sub(held).max(1)
    }

    /// Requests in the ledger (admitted, not finished).
    pub fn in_ledger(&self) -> usize {
        self.ledger.lock().books.len()
    }
}

/// A new ledger entry (its raw prediction is filled in when admitted).
fn entry(rank: u32, prompt: usize, max_out: usize, target: Option<Duration>) -> Entry {
    // Times under 1/20 of the target count as that floor (see `calibrate`).
    let floor_s = target.map_or(0.05, |t| t.as_secs_f64() / 20.0);
    Entry::new(rank, prompt, max_out, floor_s)
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.clamp(0.0, 86_400.0))
}

/// A request's place in the ledger; leaves it on drop.
#[derive(Debug)]
pub struct Ticket {
    model: Arc<Latency>,
    id: u64,
}

impl Ticket {
    /// The backend took the request (it holds a slot now).
    pub fn dispatched(&self) {
        self.model.ledger.lock().books.dispatched(self.id);
    }

    /// A token arrived; `gap` is the time since the previous one (None for
    /// the first, with `ttft` the time from dispatch when nothing was
    /// ahead, for upstream learning). O(1): the running count is kept, not
    /// recounted. The first token is a calibration sample.
    pub fn token(&self, gap: Option<Duration>, ttft_alone: Option<Duration>) {
        let m = &self.model;
        let mut l = m.ledger.lock();
        let running = l.books.running();
        let Some(before) = l.books.token(self.id) else {
            return;
        };
        if m.learn {
            if let Some(g) = gap {
                l.decode.observe(running as f64, g.as_secs_f64());
            }
            // A first token with no other stream running measures the
            // prefill alone; with others, the time also holds their steps
            // and the queue, which the replay counts already.
            if let Some(t) = ttft_alone.filter(|_| running <= 1) {
                let (a, c) = l.decode.line();
                let step = a + c;
                let per = ((t.as_secs_f64() - step) / before.prompt.max(1) as f64).max(0.0);
                let scale = (step / l.prefill_anchor_s.max(1e-9)).clamp(0.1, 10.0);
                l.prefill_per_token_s = 0.8 * l.prefill_per_token_s * scale + 0.2 * per;
                l.prefill_anchor_s = step.max(1e-9);
            }
        }
        drop(l);
        if let Some(predicted) = before.predicted_s.filter(|_| !before.decoding) {
            let now = m.clock.now();
            let actual = now.saturating_duration_since(before.admitted).as_secs_f64();
            m.calibration
                .sample(before.rank, predicted, before.floor_s, actual, now);
        }
    }

    /// The request finished having generated `completion` tokens.
    pub fn finish(self, completion: usize) {
        let mut l = self.model.ledger.lock();
        if let Some(max_out) = l.books.get(self.id).map(|e| e.max_out) {
            let share = (completion as f64 / max_out.max(1) as f64).clamp(0.05, 1.0);
            l.output_share = 0.9 * l.output_share + 0.1 * share;
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let gone = self.model.ledger.lock().books.remove(self.id);
        // A request that leaves before its first token, already later than
        // predicted (its client gave up, the gate timed it out), is a
        // sample too: its time so far is a lower bound of its TTFT, and
        // leaving these out would bias the factor low where it matters.
        let Some(e) = gone.filter(|e| !e.decoding) else {
            return;
        };
        if let Some(predicted) = e.predicted_s {
            let now = self.model.clock.now();
            let waited = now.saturating_duration_since(e.admitted).as_secs_f64();
            if waited > predicted.max(e.floor_s) * self.model.calibration.factor(e.rank) {
                self.model
                    .calibration
                    .sample(e.rank, predicted, e.floor_s, waited, now);
            }
        }
    }
}

#[path = "predict_book.rs"]
mod book;
#[path = "calibrate.rs"]
mod calibrate;
#[path = "predict_sim.rs"]
mod sim;
pub use sim::predict;

#[cfg(test)]
#[path = "predict_tests.rs"]
pub(crate) mod tests;
