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

use super::pacer::{PaceSpec, Pacer};
use super::predict::Ticket;
use async_trait::async_trait;
use bytes::Bytes;
use std::future::Future;
use std::time::{Duration, Instant};
use ultrafast_engine::api::{Event, EventStream, FinishReason, Usage};

/// The consumer of a response went away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gone;

/// The socket side of a response, as the pipeline sees it (the Pingora
/// adapter implements it; tests use an in-memory one). An implementation
/// that reaches a client applies the edge's response policy in `head`
/// (request id, HSTS, the route's response rules), so the pipeline passes
/// only the headers that are its own.
#[async_trait]
pub trait Downstream: Send {
    /// Send the response head.
    async fn head(&mut self, status: u16, headers: &[(&str, &str)]) -> Result<(), Gone>;
    /// The next head is followed at once by body bytes (a stream's first
    /// event): it may wait for them, to leave in one write.
    fn body_follows(&mut self) {}
    /// Send body bytes; `end` finishes the response.
    async fn body(&mut self, bytes: Bytes, end: bool) -> Result<(), Gone>;
    /// Resolves when the client has gone away; pending forever when that
    /// cannot be told. Cancel-safe: polled anew on every loop turn.
    async fn gone(&mut self);
    /// Whether error bodies go out in Anthropic's shape (the request came
    /// to `/v1/messages`).
    fn anthropic(&self) -> bool {
        false
    }
}

/// Send a whole JSON response: `headers`, then its type and length.
pub async fn respond<D: Downstream + ?Sized>(
    down: &mut D,
    status: u16,
    headers: &[(&str, &str)],
    body: Bytes,
) -> Result<(), Gone> {
    // One place for every refusal and error: each dialect's clients read
    // their own error shape.
    let body = if status >= 400 && down.anthropic() {
        super::dialect::anthropic::error_body(status, &body)
    } else {
        body
    };
    let len = body.len().to_string();
    let mut h = headers.to_vec();
    h.extend([
        ("content-type", "application/json"),
        ("content-length", len.as_str()),
    ]);
    down.head(status, &h).await?;
    down.body(body, true).await
}

/// A refusal or an error, ready to send: status, extra headers and an
/// OpenAI-style JSON error body.
#[derive(Debug, Clone)]
pub struct Failure {
    /// HTTP status (when the head is not sent yet).
    pub status: u16,
    /// Extra headers (`retry-after`, `x-ultrafast-shed`, ...).
    pub headers: Vec<(&'static str, String)>,
    /// The JSON body.
    pub body: Bytes,
}

/// How a generation ended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Finished {
    /// Why.
    pub finish: FinishReason,
    /// Token counts.
    pub usage: Usage,
    /// Time in the backend's own queue.
    pub backend_queue: Duration,
    /// Compute time.
    pub compute: Duration,
}

/// Where a completion's output goes.
#[async_trait]
pub trait Sink: Send {
    /// Streams get heartbeats and pacing; whole responses and jobs do not.
    fn streaming(&self) -> bool;
    /// Resolves when the consumer went away (pending when it cannot).
    async fn gone(&mut self);
    /// The request left the admission queue (a job turns `in_progress`).
    fn admitted(&mut self) {}
    /// Nothing to send yet (queued, or before the first token).
    async fn heartbeat(&mut self) -> Result<(), Gone>;
    /// A piece of text, as the pacer releases it.
    async fn text(&mut self, text: &str) -> Result<(), Gone>;
    /// An upstream's SSE events, to write as they are. Only a sink that
    /// asked for the pass-through (`InferenceRequest::raw_sse`: the SSE
    /// sink) receives them; any other drops them, saying so in the log.
    /// `end`: the stream's last events, to write at `done`.
    async fn raw(&mut self, sse: String, end: bool) -> Result<(), Gone> {
        let _ = end;
        log::error!(
            "pass-through events reached a sink that did not ask for them: {} bytes dropped",
            sse.len()
        );
        Ok(())
    }
    /// The end of a generation; `timing` is the latency breakdown so far.
    async fn done(&mut self, end: &Finished, timing: &mut Timing) -> Result<(), Gone>;
    /// A refusal or an error, before or during generation.
    async fn fail(&mut self, f: &Failure) -> Result<(), Gone>;
}

/// Where the time of one request went.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// When the request arrived (its head was parsed).
    pub arrived: Instant,
    /// Reading the body.
    pub network: Duration,
    /// Admission queue plus the backend's own queue.
    pub queue: Duration,
    /// Arrival to the first token delivered.
    pub ttft: Option<Duration>,
    /// What admission predicted for `ttft`.
    pub predicted: Option<Duration>,
    /// Generation time in the backend.
    pub compute: Duration,
    /// Arrival to the end.
    pub total: Duration,
}

impl Timing {
    /// A breakdown starting at `arrived`.
    pub fn new(arrived: Instant, network: Duration) -> Self {
        Timing {
            arrived,
            network,
            queue: Duration::ZERO,
            ttft: None,
            predicted: None,
            compute: Duration::ZERO,
            total: Duration::ZERO,
        }
    }

    /// Time not spent reading, queued or computing: writing the output.
    pub fn output(&self) -> Duration {
        self.total
            .saturating_sub(self.network + self.queue + self.compute)
    }

    /// Set `total` to now.
    pub fn stamp(&mut self) {
        self.total = self.arrived.elapsed();
    }

    /// The `Server-Timing` value.
    pub fn header(&self) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        format!(
            "network;dur={:.3}, queue;dur={:.3}, ttft;dur={:.3}, compute;dur={:.3}, output;dur={:.3}, total;dur={:.3}",
            ms(self.network),
            ms(self.queue),
            ms(self.ttft.unwrap_or_default()),
            ms(self.compute),
            ms(self.output()),
            ms(self.total)
        )
    }

    /// The `ultrafast_timing` object of a stream's last chunk.
    pub fn json(&self) -> serde_json::Value {
        let ms = |d: Duration| (d.as_secs_f64() * 1e6).round() / 1000.0;
        let mut v = serde_json::json!({"network_ms": ms(self.network), "queue_ms": ms(self.queue),
            "ttft_ms": ms(self.ttft.unwrap_or_default()), "compute_ms": ms(self.compute),
            "output_ms": ms(self.output()), "total_ms": ms(self.total)});
        if let Some(p) = self.predicted {
            v["predicted_ttft_ms"] = serde_json::json!(ms(p));
        }
        v
    }
}

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
    let mut pacer: Pacer<String> = Pacer::new(if sink.streaming() {
        pace
    } else {
        PaceSpec::OFF
    });
    let mut last_token: Option<Instant> = None;
    let mut last_write = Instant::now();
    let mut end: Option<Result<Finished, String>> = None;
    loop {
        let now = Instant::now();
        let due: Vec<String> = if end.is_some() {
            pacer.drain().collect()
        } else {
            std::iter::from_fn(|| pacer.pop_due(now)).collect()
        };
        for text in due {
            sink.text(&text).await?;
            last_write = delivered(delivery, timing, &mut on_text);
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
                        body: super::openai::error_json(&e),
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
        match wake {
            Wake::Event(Some(Event::Token { text, .. })) => {
                let now = Instant::now();
                delivery.tokens += 1;
                produced(ticket, dispatched, &mut last_token, &mut on_token, now);
                if !text.is_empty() {
                    pacer.push(text, now);
                }
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
                if !text.is_empty() {
                    pacer.push(text, Instant::now());
                }
                end = Some(Ok(Finished {
                    finish,
                    usage,
                    backend_queue: queue,
                    compute,
                }));
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
