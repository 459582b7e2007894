//! The last stage of the inference pipeline: one loop that takes a
//! backend's events, passes the text through the lane's pacer and hands it
//! to a sink (an SSE stream, a whole JSON response, or the async job
//! store), sending heartbeats while nothing is ready and watching the
//! consumer, so that a client who leaves cancels the backend at once.
//!
//! Every wake-up of the loop has its own variant: a backend event, a pacer
//! deadline, a heartbeat, the consumer gone. (An earlier version used one
//! variant for both "pacer deadline" and "client read returned"; on a paced
//! lane the first deadline switched disconnect detection off for good.)

use super::delivery::{error_json, Failure, Finished, Gone, Sink, Timing};
use super::pacer::{PaceSpec, Pacer};
use super::predict::Ticket;
use std::future::Future;
use std::time::{Duration, Instant};
use ultrafast_engine::api::{Event, EventStream, FinishReason, TokenLogprob, Usage};

/// How often an idle stream gets an SSE comment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Beats {
    /// While nothing has been written yet (queued, before the first
    /// token): the client sees that it is still waiting.
    pub waiting: Duration,
    /// Between tokens, once text flows: only a keepalive for intermediaries
    /// with an idle timeout (nginx's and most balancers' are 60 s). At the
    /// waiting rate, thousands of slow streams would cost one write each a
    /// second.
    pub flowing: Duration,
}

impl Beats {
    /// The same interval before and after the first text.
    pub fn every(d: Duration) -> Self {
        Self {
            waiting: d,
            flowing: d,
        }
    }
}

/// Wait for `fut`, sending heartbeats on a stream and watching for the
/// consumer going away.
pub async fn wait<S: Sink + ?Sized, T>(
    sink: &mut S,
    heartbeat: Duration,
    fut: impl Future<Output = T>,
) -> Result<T, Gone> {
    tokio::pin!(fut);
    let streaming = sink.streaming();
    loop {
        let beat = tokio::time::sleep(heartbeat);
        tokio::select! {
            v = &mut fut => return Ok(v),
            _ = beat, if streaming => sink.heartbeat().await?,
            _ = sink.gone() => return Err(Gone),
        }
    }
}

/// What the drive loop observed, for metrics and the ledger.
#[derive(Debug, Clone, Copy, Default)]
pub struct Delivery {
    /// First text handed to the sink.
    pub first_text: Option<Instant>,
    /// Previous text handed to the sink (for inter-token intervals).
    pub last_text: Option<Instant>,
    /// Completion tokens seen from the backend.
    pub tokens: usize,
    /// Choices the request asked for (`n`; 0 is taken as 1). With more
    /// than one the backend's events come indexed, each choice ending on
    /// its own, and the generation ends when every choice has.
    pub choices: usize,
}

/// Text released by the pacer: its choice, the text, the reports of the
/// tokens it completes (`logprobs`), and the choice's end when it is its
/// last.
type Out = (u32, String, Vec<TokenLogprob>, Option<FinishReason>);

/// The choices' ends so far, summed into one [`Finished`].
#[derive(Default)]
struct Ends {
    seen: usize,
    finish: Option<FinishReason>,
    usage: Usage,
    queue: Duration,
    compute: Duration,
}

impl Ends {
    /// Choice `i` ended: prompt counts once, completions add up (as OpenAI
    /// counts `n`), the time is the slowest choice's; the cached prompt
    /// tokens are the first choice's (the others start on the blocks it
    /// computed, which says nothing of the request's prompt).
    fn add(&mut self, i: u32, finish: FinishReason, u: Usage, queue: Duration, compute: Duration) {
        self.seen += 1;
        self.finish = Some(finish);
        self.usage.prompt_tokens = u.prompt_tokens;
        if i == 0 {
            self.usage.cached_tokens = u.cached_tokens;
        }
        self.usage.completion_tokens += u.completion_tokens;
        self.queue = self.queue.max(queue);
        self.compute = self.compute.max(compute);
    }

    fn finished(&self) -> Finished {
        Finished {
            finish: self.finish.unwrap_or(FinishReason::Stop),
            usage: self.usage,
            backend_queue: self.queue,
            compute: self.compute,
        }
    }
}

/// Called with each delivered text's time and the previous one's.
pub trait OnText: FnMut(Instant, Option<Instant>) + Send {}
impl<F: FnMut(Instant, Option<Instant>) + Send> OnText for F {}

/// A token the backend produced: the ledger's ticket and `on_token`.
fn produced(
    ticket: Option<&Ticket>,
    dispatched: Instant,
    last_token: &mut Option<Instant>,
    on_token: &mut impl OnText,
    now: Instant,
) {
    if let Some(t) = ticket {
        let alone = last_token
            .is_none()
            .then(|| now.saturating_duration_since(dispatched));
        t.token(last_token.map(|l| now.saturating_duration_since(l)), alone);
    }
    on_token(now, *last_token);
    *last_token = Some(now);
}

/// Text reached the sink: the first one is the time to first token.
fn delivered(delivery: &mut Delivery, timing: &mut Timing, on_text: &mut impl OnText) -> Instant {
    let at = Instant::now();
    if delivery.first_text.is_none() {
        delivery.first_text = Some(at);
        timing.ttft = Some(at.saturating_duration_since(timing.arrived));
    }
    on_text(at, delivery.last_text);
    delivery.last_text = Some(at);
    at
}

enum Wake {
    Event(Option<Event>),
    PaceDue,
    Heartbeat,
    ConsumerGone,
}

/// Drive one generation to its end. Ok(Some) on a finished generation,
/// Ok(None) when the backend failed (the sink was told), Err(Gone) when
/// the consumer left (the event stream is dropped, cancelling the work).
#[allow(clippy::too_many_arguments)]
pub async fn drive<S: Sink + ?Sized>(
    sink: &mut S,
    mut events: EventStream,
    pace: PaceSpec,
    beats: Beats,
    ticket: Option<&Ticket>,
    timing: &mut Timing,
    delivery: &mut Delivery,
    mut on_text: impl OnText,
    mut on_token: impl OnText,
) -> Result<Option<Finished>, Gone> {
    let dispatched = Instant::now();
    let choices = delivery.choices.max(1);
    // Several choices' texts interleave: a cadence is one stream's.
    let mut pacer: Pacer<Out> = Pacer::new(if sink.streaming() && choices == 1 {
        pace
    } else {
        PaceSpec::OFF
    });
    let mut last_token: Option<Instant> = None;
    let mut last_write = Instant::now();
    let mut end: Option<Result<Finished, String>> = None;
    // Each choice's reports of tokens whose text is not out yet (held
    // back while a character or a stop sequence is incomplete).
    let mut reports: Vec<Vec<TokenLogprob>> = vec![Vec::new(); choices];
    let mut ends = Ends::default();
    loop {
        let now = Instant::now();
        let due: Vec<Out> = if end.is_some() {
            pacer.drain().collect()
        } else {
            std::iter::from_fn(|| pacer.pop_due(now)).collect()
        };
        for (i, text, lps, last) in due {
            if choices > 1 {
                sink.choice(i);
            }
            if !lps.is_empty() {
                sink.logprobs(lps);
            }
            if !text.is_empty() || last.is_none() {
                sink.text(&text).await?;
                last_write = delivered(delivery, timing, &mut on_text);
            }
            if let (Some(f), true) = (last, choices > 1) {
                sink.choice_end(i, f).await?;
            }
        }
        if let Some(end) = end {
            return match end {
                Ok(f) => {
                    timing.compute = if f.compute.is_zero() {
                        dispatched.elapsed()
                    } else {
                        f.compute
                    };
                    timing.queue += f.backend_queue;
                    Ok(Some(f))
                }
                Err(msg) => {
                    let e = ultrafast_engine::api::BackendError::request(502, "backend_error", msg);
                    sink.fail(&Failure {
                        status: 502,
                        headers: Vec::new(),
                        body: error_json(&e),
                    })
                    .await?;
                    Ok(None)
                }
            };
        }
        let deadline = pacer.deadline(now).map(tokio::time::Instant::from_std);
        let idle = if delivery.first_text.is_some() {
            beats.flowing
        } else {
            beats.waiting
        };
        let beat_at = tokio::time::Instant::from_std(last_write + idle);
        let streaming = sink.streaming();
        let wake = tokio::select! {
            ev = events.recv() => Wake::Event(ev),
            _ = tokio::time::sleep_until(deadline.unwrap_or(beat_at)), if deadline.is_some() => Wake::PaceDue,
            _ = tokio::time::sleep_until(beat_at), if streaming && deadline.is_none() => Wake::Heartbeat,
            _ = sink.gone() => Wake::ConsumerGone,
        };
        // A choice's event, unwrapped (a single answer is choice 0).
        let (i, wake) = match wake {
            Wake::Event(Some(Event::Indexed(i, ev))) if (i as usize) < choices => {
                (i, Wake::Event(Some(*ev)))
            }
            Wake::Event(Some(Event::Indexed(i, _))) => (
                0,
                Wake::Event(Some(Event::Error(format!(
                    "the backend sent choice {i} of {choices}"
                )))),
            ),
            w => (0, w),
        };
        let pending = &mut reports[i as usize];
        match wake {
            Wake::Event(Some(Event::Token { text, .. })) => {
                let now = Instant::now();
                delivery.tokens += 1;
                produced(ticket, dispatched, &mut last_token, &mut on_token, now);
                if !text.is_empty() {
                    pacer.push((i, text, std::mem::take(pending), None), now);
                }
            }
            Wake::Event(Some(Event::Logprob(r))) => pending.push(*r),
            Wake::Event(Some(Event::Prompt(tokens))) => sink.prompt(tokens).await?,
            Wake::Event(Some(Event::Indexed(..))) => {
                end = Some(Err("the backend nested its choices".into()))
            }
            Wake::Event(Some(Event::Raw { sse, tokens, end })) => {
                // The pass-through: no pacing (it is chosen only for lanes
                // without), the events written as they came.
                let now = Instant::now();
                delivery.tokens += tokens;
                for _ in 0..tokens {
                    produced(ticket, dispatched, &mut last_token, &mut on_token, now);
                }
                sink.raw(sse, end).await?;
                last_write = if tokens > 0 {
                    delivered(delivery, timing, &mut on_text)
                } else {
                    Instant::now()
                };
            }
            Wake::Event(Some(Event::Done {
                text,
                finish,
                usage,
                queue,
                compute,
            })) => {
                let last = (choices > 1).then_some(finish);
                if !text.is_empty() || !pending.is_empty() || last.is_some() {
                    pacer.push((i, text, std::mem::take(pending), last), Instant::now());
                }
                ends.add(i, finish, usage, queue, compute);
                if ends.seen >= choices {
                    end = Some(Ok(ends.finished()));
                }
            }
            Wake::Event(Some(Event::Error(msg))) => end = Some(Err(msg)),
            Wake::Event(None) => end = Some(Err("the backend stopped".into())),
            Wake::PaceDue => {}
            Wake::Heartbeat => {
                sink.heartbeat().await?;
                last_write = Instant::now();
            }
            Wake::ConsumerGone => return Err(Gone),
        }
    }
}
