//! What the pipeline delivers through, as types every stage shares: the
//! socket side (`Downstream`), where output goes (`Sink`), how a
//! generation ended (`Finished`), a refusal ready to send (`Failure`, with
//! its OpenAI and Anthropic error shapes) and where the time went
//! (`Timing`). A leaf: `drive`, the sinks and the dialects all name these
//! and none of each other for them.

use async_trait::async_trait;
use bytes::Bytes;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use ultrafast_engine::api::{BackendError, FinishReason, TokenLogprob, Usage};

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
        anthropic_error_body(status, &body)
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
    /// The prompt's tokens (`echo`), scored when asked, before any text.
    /// Only the sinks of OpenAI's endpoints are handed them (the other
    /// dialects refuse the fields that ask).
    async fn prompt(&mut self, tokens: Vec<TokenLogprob>) -> Result<(), Gone> {
        let _ = tokens;
        Ok(())
    }
    /// The reports of the tokens whose text comes next (`logprobs`), just
    /// before that [`text`](Sink::text). Only the sinks of OpenAI's
    /// endpoints are handed them.
    fn logprobs(&mut self, tokens: Vec<TokenLogprob>) {
        let _ = tokens;
    }
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
    /// The text, reports and end that follow are choice `index`'s (a
    /// request for several, `n` > 1; only OpenAI's sinks are handed them).
    fn choice(&mut self, index: u32) {
        let _ = index;
    }
    /// Choice `index` of several ended (before [`done`](Sink::done), which
    /// ends them all).
    async fn choice_end(&mut self, index: u32, finish: FinishReason) -> Result<(), Gone> {
        let _ = (index, finish);
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

/// An OpenAI-style error body.
pub fn error_json(e: &BackendError) -> Bytes {
    Bytes::from(
        json!({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}})
            .to_string(),
    )
}

/// An error body in Anthropic's shape, from an OpenAI-style one.
pub fn anthropic_error_body(status: u16, openai_body: &[u8]) -> Bytes {
    let v: Value = serde_json::from_slice(openai_body).unwrap_or(Value::Null);
    let message = v["error"]["message"].as_str().unwrap_or("error");
    Bytes::from(
        json!({"type": "error", "error": {"type": anthropic_error_type(status), "message": message}})
            .to_string(),
    )
}

/// The Anthropic error `type` of an HTTP status.
pub fn anthropic_error_type(status: u16) -> &'static str {
    match status {
        400 | 405 | 409 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}
