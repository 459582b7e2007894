//! The three sinks of the drive loop: an SSE stream, a whole JSON response
//! and the async job store. Each formats the same events in its own way and
//! knows whether its head is already out (a refusal after heartbeats were
//! sent becomes an error event, not a status).

use super::choices::Choices;
use super::delivery::{Downstream, Failure, Finished, Gone, Sink, Timing};
use super::jobs::{self, Job};
use super::logprobs::{Reports, Shape};
use super::openai::{self, Ident};
use super::shape::{Collected, Piece, Shaper};
use super::sse;
use async_trait::async_trait;
use bytes::Bytes;
use serde_json::Value;
use std::sync::Arc;
use tokio::sync::watch;
use ultrafast_engine::api::{FinishReason, TokenLogprob};

/// Headers every admitted response carries (request id, lane, prediction).
pub type Headers = Vec<(&'static str, String)>;

fn refs(h: &Headers) -> Vec<(&str, &str)> {
    h.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// Send a refusal or error as a whole response, with `base` headers.
pub async fn send_failure<D: Downstream + ?Sized>(
    down: &mut D,
    base: &Headers,
    f: &Failure,
) -> Result<(), Gone> {
    let mut h = refs(base);
    h.extend(f.headers.iter().map(|(k, v)| (*k, v.as_str())));
    super::delivery::respond(down, f.status, &h, f.body.clone()).await
}

/// A streamed (SSE) response.
pub struct SseSink<'a, D: Downstream + ?Sized> {
    down: &'a mut D,
    ident: Ident,
    headers: Headers,
    head_sent: bool,
    include_usage: bool,
    shaper: Option<Shaper>,
    /// The pass-through's last events (from the upstream's finish chunk
    /// on), written at the end with the edge's timing in the finish chunk.
    raw_tail: Option<String>,
    /// Per choice: first chunks and reports (`n`, `logprobs`).
    choices: Choices,
}

/// The shape of reports an endpoint writes.
fn shape_of(ident: &Ident) -> Shape {
    match ident.endpoint() {
        openai::Endpoint::Chat => Shape::Chat,
        openai::Endpoint::Completions => Shape::Legacy,
    }
}

/// The text of an echoed prompt.
fn prompt_text(tokens: &[TokenLogprob]) -> String {
    let bytes: Vec<u8> = tokens
        .iter()
        .flat_map(|t| t.bytes.iter().copied())
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The finish reason a response reports: `tool_calls` when it made any.
pub(super) fn finish_of(shaper: &Option<Shaper>, f: FinishReason) -> FinishReason {
    match shaper {
        Some(s)
            if s.calls() > 0 && matches!(f, FinishReason::Stop | FinishReason::StopSequence(_)) =>
        {
            FinishReason::ToolCalls
        }
        _ => f,
    }
}

impl<'a, D: Downstream + ?Sized> SseSink<'a, D> {
    /// A stream over `down`, with `headers` on its head.
    pub fn new(down: &'a mut D, ident: Ident, headers: Headers, include_usage: bool) -> Self {
        SseSink {
            down,
            ident,
            headers,
            head_sent: false,
            include_usage,
            shaper: None,
            raw_tail: None,
            choices: Choices::new(1, None),
        }
    }

    /// Stream `n` choices, with the tokens' reports in their chunks when
    /// `scored` (`logprobs`).
    pub fn with_choices(mut self, n: usize, scored: bool) -> Self {
        self.choices = Choices::new(n, scored.then(|| shape_of(&self.ident)));
        self
    }

    /// The current choice's chunk of `text`, with the reports waiting for
    /// it (one choice without reports: the direct writer).
    fn text_line(&mut self, text: &str) -> Bytes {
        let first = self.choices.first();
        if !self.choices.scored() && !self.choices.multi() {
            return self.ident.chunk_line(text, first);
        }
        let mut v = self.ident.chunk(text, first, None);
        self.choices.fill(&mut v);
        sse::data(&v.to_string())
    }

    /// Read the output for tool calls (the request has tools).
    pub fn with_tools(mut self, on: bool) -> Self {
        self.shaper = on.then(Shaper::default);
        self
    }

    async fn pieces(&mut self, pieces: Vec<Piece>) -> Result<(), Gone> {
        for p in pieces {
            let line = match &p {
                Piece::Text(t) => self.text_line(t),
                _ => {
                    let first = self.choices.first();
                    match self.ident.tool_chunk(&p, first) {
                        Some(mut v) => {
                            if self.choices.multi() || self.choices.waiting() {
                                self.choices.fill(&mut v);
                            }
                            sse::data(&v.to_string())
                        }
                        None => continue,
                    }
                }
            };
            self.down.body(line, false).await?;
        }
        Ok(())
    }

    async fn head(&mut self) -> Result<(), Gone> {
        if self.head_sent {
            return Ok(());
        }
        let mut h = refs(&self.headers);
        h.extend([
            ("content-type", "text/event-stream"),
            ("cache-control", "no-cache"),
            ("x-accel-buffering", "no"),
        ]);
        // Only called with the stream's first bytes ready.
        self.down.body_follows();
        self.down.head(200, &h).await?;
        self.head_sent = true;
        Ok(())
    }

    /// Add a header before the head is sent.
    pub fn set_header(&mut self, k: &'static str, v: String) {
        self.headers.retain(|(n, _)| *n != k);
        self.headers.push((k, v));
    }
}

#[async_trait]
impl<D: Downstream + ?Sized> Sink for SseSink<'_, D> {
    fn streaming(&self) -> bool {
        true
    }

    async fn gone(&mut self) {
        self.down.gone().await
    }

    async fn heartbeat(&mut self) -> Result<(), Gone> {
        self.head().await?;
        self.down.body(sse::comment("waiting"), false).await
    }

    async fn text(&mut self, text: &str) -> Result<(), Gone> {
        self.head().await?;
        if let Some(sh) = self.shaper.as_mut() {
            let pieces = sh.push(text);
            return self.pieces(pieces).await;
        }
        let line = self.text_line(text);
        self.down.body(line, false).await
    }

    async fn prompt(&mut self, tokens: Vec<TokenLogprob>) -> Result<(), Gone> {
        self.head().await?;
        let text = prompt_text(&tokens);
        // The echo goes out as each choice's first text, as OpenAI sends it.
        for i in 0..self.choices.n {
            self.choices.index = i as u32;
            self.choices.add(tokens.clone());
            let line = self.text_line(&text);
            self.down.body(line, false).await?;
        }
        self.choices.index = 0;
        Ok(())
    }

    fn logprobs(&mut self, tokens: Vec<TokenLogprob>) {
        self.choices.add(tokens);
    }

    fn choice(&mut self, index: u32) {
        self.choices.index = index;
    }

    async fn choice_end(&mut self, index: u32, finish: FinishReason) -> Result<(), Gone> {
        self.head().await?;
        self.choices.index = index;
        // A choice that ended before any text still names its role.
        let first = self.choices.first();
        let mut v = self
            .ident
            .chunk("", first, Some(finish_of(&self.shaper, finish)));
        self.choices.fill(&mut v);
        self.down.body(sse::data(&v.to_string()), false).await
    }

    async fn raw(&mut self, sse: String, end: bool) -> Result<(), Gone> {
        self.head().await?;
        self.choices.first();
        if end {
            self.raw_tail = Some(sse);
            return Ok(());
        }
        self.down.body(Bytes::from(sse), false).await
    }

    async fn done(&mut self, end: &Finished, t: &mut Timing) -> Result<(), Gone> {
        self.head().await?;
        if let Some(sh) = self.shaper.as_mut() {
            let pieces = sh.finish();
            self.pieces(pieces).await?;
        }
        t.stamp();
        match self.raw_tail.take() {
            // The pass-through's finish and usage chunks are the upstream's;
            // its finish chunk gets the edge's timing, as ours does.
            Some(tail) => {
                let tail = with_timing(&tail, &t.json());
                self.down.body(Bytes::from(tail), false).await?;
            }
            None => {
                let finish = finish_of(&self.shaper, end.finish);
                let mut last = self.ident.chunk("", false, Some(finish));
                if self.choices.multi() {
                    // Each choice had its finish chunk: this one carries
                    // the timing alone.
                    last["choices"] = Value::Array(Vec::new());
                } else if self.choices.waiting() {
                    self.choices.fill(&mut last);
                }
                last["ultrafast_timing"] = t.json();
                self.down.body(sse::data(&last.to_string()), false).await?;
                if self.include_usage {
                    let u = self.ident.usage_chunk(&end.usage);
                    self.down.body(sse::data(&u.to_string()), false).await?;
                }
                t.stamp();
            }
        }
        let st = sse::comment(&format!("server-timing {}", t.header()));
        self.down.body(st, false).await?;
        self.down.body(Bytes::from_static(sse::DONE), true).await
    }

    async fn fail(&mut self, f: &Failure) -> Result<(), Gone> {
        if !self.head_sent {
            return send_failure(self.down, &self.headers, f).await;
        }
        let text = String::from_utf8_lossy(&f.body).into_owned();
        self.down.body(sse::data(&text), false).await?;
        self.down.body(Bytes::from_static(sse::DONE), true).await
    }
}

/// The pass-through's last events with `timing` added to the first (the
/// finish chunk) as `ultrafast_timing`, inserted before the object's
/// closing brace (the pass-through reads it as an object), so nothing is
/// parsed again; one that is not a non-empty object stays as it came.
fn with_timing(tail: &str, timing: &Value) -> String {
    let (first, rest) = match tail.find("\n\n") {
        Some(i) => tail.split_at(i + 2),
        None => (tail, ""),
    };
    let body = first.trim_end();
    let Some(open) = body.strip_prefix("data: ").map(str::trim_start) else {
        return tail.to_string();
    };
    let inner = open
        .strip_prefix('{')
        .and_then(|o| o.strip_suffix('}'))
        .filter(|i| !i.trim().is_empty() && !i.contains('\n'));
    let Some(inner) = inner else {
        return tail.to_string();
    };
    let mut out = String::with_capacity(tail.len() + 160);
    out.push_str("data: {");
    out.push_str(inner);
    out.push_str(",\"ultrafast_timing\":");
    out.push_str(&timing.to_string());
    out.push_str("}\n\n");
    out.push_str(rest);
    out
}

/// A whole JSON response, written at the end.
pub struct JsonSink<'a, D: Downstream + ?Sized> {
    down: &'a mut D,
    ident: Ident,
    headers: Headers,
    /// Each choice's output, its end, and its tokens' reports.
    outs: Vec<(Collected, Option<FinishReason>, Vec<TokenLogprob>)>,
    /// The choice the next text is of.
    index: usize,
    shaper: Option<Shaper>,
    /// Reports are written in this shape (the request asked `logprobs`).
    scored: Option<Shape>,
    /// The prompt echoed (`echo`), at the head of every choice.
    echo: Option<Vec<TokenLogprob>>,
}

impl<'a, D: Downstream + ?Sized> JsonSink<'a, D> {
    /// A whole response over `down`.
    pub fn new(down: &'a mut D, ident: Ident, headers: Headers) -> Self {
        JsonSink {
            down,
            ident,
            headers,
            outs: vec![Default::default()],
            index: 0,
            shaper: None,
            scored: None,
            echo: None,
        }
    }

    /// Answer `n` choices, with the tokens' reports when `scored`
    /// (`logprobs`).
    pub fn with_choices(mut self, n: usize, scored: bool) -> Self {
        self.outs.resize_with(n.max(1), Default::default);
        self.scored = scored.then(|| shape_of(&self.ident));
        self
    }

    /// Read the output for tool calls (the request has tools; one choice).
    pub fn with_tools(mut self, on: bool) -> Self {
        self.shaper = on.then(Shaper::default);
        self
    }

    /// The response's choices: each one's text after the echo, its finish
    /// and its reports; the first with its tool calls.
    fn choices(&mut self, end: &Finished) -> Value {
        let echo = self.echo.take().unwrap_or_default();
        let head = prompt_text(&echo);
        let mut body = Value::Null;
        let mut all = Vec::with_capacity(self.outs.len());
        for (i, (out, fin, lps)) in self.outs.iter_mut().enumerate() {
            out.text.insert_str(0, &head);
            let finish = finish_of(&self.shaper, fin.unwrap_or(end.finish));
            let mut full = self.ident.full_calls(out, finish, &end.usage);
            let mut c = full["choices"][0].take();
            c["index"] = serde_json::json!(i);
            if let Some(shape) = self.scored {
                let mut r = Reports::new(shape);
                r.add(echo.clone());
                r.add(std::mem::take(lps));
                c["logprobs"] = r.take();
            }
            all.push(c);
            if i == 0 {
                body = full;
            }
        }
        body["choices"] = Value::Array(all);
        body
    }
}

#[async_trait]
impl<D: Downstream + ?Sized> Sink for JsonSink<'_, D> {
    fn streaming(&self) -> bool {
        false
    }

    async fn gone(&mut self) {
        self.down.gone().await
    }

    async fn heartbeat(&mut self) -> Result<(), Gone> {
        Ok(())
    }

    async fn text(&mut self, text: &str) -> Result<(), Gone> {
        let Some((out, _, _)) = self.outs.get_mut(self.index) else {
            return Ok(());
        };
        match self.shaper.as_mut() {
            Some(sh) => sh.push(text).iter().for_each(|p| out.add(p)),
            None => out.text.push_str(text),
        }
        Ok(())
    }

    async fn prompt(&mut self, tokens: Vec<TokenLogprob>) -> Result<(), Gone> {
        self.echo = Some(tokens);
        Ok(())
    }

    fn logprobs(&mut self, mut tokens: Vec<TokenLogprob>) {
        if let (Some(_), Some((_, _, l))) = (self.scored, self.outs.get_mut(self.index)) {
            l.append(&mut tokens);
        }
    }

    fn choice(&mut self, index: u32) {
        self.index = index as usize;
    }

    async fn choice_end(&mut self, index: u32, finish: FinishReason) -> Result<(), Gone> {
        if let Some((_, f, _)) = self.outs.get_mut(index as usize) {
            *f = Some(finish);
        }
        Ok(())
    }

    async fn done(&mut self, end: &Finished, t: &mut Timing) -> Result<(), Gone> {
        if let (Some(sh), Some((out, _, _))) = (self.shaper.as_mut(), self.outs.first_mut()) {
            sh.finish().iter().for_each(|p| out.add(p));
        }
        let body = self.choices(end).to_string();
        t.stamp();
        let st = t.header();
        let len = body.len().to_string();
        let mut h = refs(&self.headers);
        h.extend([
            ("content-type", "application/json"),
            ("content-length", len.as_str()),
            ("server-timing", st.as_str()),
        ]);
        self.down.head(200, &h).await?;
        self.down.body(Bytes::from(body), true).await
    }

    async fn fail(&mut self, f: &Failure) -> Result<(), Gone> {
        send_failure(self.down, &self.headers, f).await
    }
}

/// An async job: events go into the store, where `/v1/requests/{id}`
/// readers find them; a `DELETE` is its "consumer gone".
pub struct JobSink {
    job: Arc<Job>,
    ident: Ident,
    out: Collected,
    first: bool,
    cancelled: watch::Receiver<bool>,
    shaper: Option<Shaper>,
}

impl JobSink {
    /// A sink into `job`.
    pub fn new(job: Arc<Job>, ident: Ident) -> Self {
        let cancelled = job.cancelled();
        JobSink {
            job,
            ident,
            out: Collected::default(),
            first: true,
            cancelled,
            shaper: None,
        }
    }

    /// Read the output for tool calls (the request has tools).
    pub fn with_tools(mut self, on: bool) -> Self {
        self.shaper = on.then(Shaper::default);
        self
    }

    fn pieces(&mut self, pieces: Vec<Piece>) -> Result<(), Gone> {
        for p in pieces {
            self.out.add(&p);
            let chunk = match &p {
                Piece::Text(t) => self.ident.chunk(t, self.first, None),
                _ => match self.ident.tool_chunk(&p, self.first) {
                    Some(v) => v,
                    None => continue,
                },
            };
            self.first = false;
            self.push(chunk.to_string())?;
        }
        Ok(())
    }

    fn push(&self, payload: String) -> Result<(), Gone> {
        if self.job.push(payload) {
            Ok(())
        } else {
            Err(Gone)
        }
    }
}

#[async_trait]
impl Sink for JobSink {
    fn streaming(&self) -> bool {
        false
    }

    async fn gone(&mut self) {
        if self.cancelled.wait_for(|c| *c).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    async fn heartbeat(&mut self) -> Result<(), Gone> {
        Ok(())
    }

    fn admitted(&mut self) {
        self.job.start();
    }

    async fn text(&mut self, text: &str) -> Result<(), Gone> {
        let pieces = match self.shaper.as_mut() {
            Some(sh) => sh.push(text),
            None => vec![Piece::Text(text.to_string())],
        };
        self.pieces(pieces)
    }

    async fn done(&mut self, end: &Finished, t: &mut Timing) -> Result<(), Gone> {
        if let Some(sh) = self.shaper.as_mut() {
            let pieces = sh.finish();
            self.pieces(pieces)?;
        }
        t.stamp();
        let finish = finish_of(&self.shaper, end.finish);
        self.push(self.ident.chunk("", false, Some(finish)).to_string())?;
        self.push(self.ident.usage_chunk(&end.usage).to_string())?;
        let full = self.ident.full_calls(&self.out, finish, &end.usage);
        self.job.finish(jobs::Status::Completed, Some(full), None);
        Ok(())
    }

    async fn fail(&mut self, f: &Failure) -> Result<(), Gone> {
        let err: Value = serde_json::from_slice(&f.body).unwrap_or(Value::Null);
        let _ = self.job.push(err.to_string());
        self.job
            .finish(jobs::Status::Failed, None, Some(err["error"].clone()));
        Ok(())
    }
}

/// The error body of a failed backend call.
pub fn backend_failure(e: &ultrafast_engine::api::BackendError) -> Failure {
    Failure {
        status: e.status,
        headers: Vec::new(),
        body: openai::error_json(e),
    }
}

#[cfg(test)]
mod tests {
    //! The drive loop and the sinks over an in-memory downstream: no socket.
    use super::*;
    use crate::inference::drive::{drive, wait, Beats, Delivery};
    use crate::inference::openai::Endpoint;
    use crate::inference::pacer::{PaceMode, PaceSpec};
    use std::time::{Duration, Instant};
    use tokio::sync::mpsc::unbounded_channel;
    use ultrafast_engine::api::{Event, EventStream, FinishReason, Usage};

    #[test]
    fn the_pass_throughs_finish_chunk_gets_the_timing_and_the_rest_stays() {
        let t = serde_json::json!({"total_ms": 1.5});
        let tail = "data: {\"choices\":[{\"finish_reason\":\"stop\"}]}\n\ndata: {\"usage\":{}}\n\n";
        let out = with_timing(tail, &t);
        let (first, rest) = out.split_once("\n\n").unwrap();
        let v: Value = serde_json::from_str(first.strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(v["ultrafast_timing"]["total_ms"], 1.5);
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(rest, "data: {\"usage\":{}}\n\n");
        // What is not a non-empty object is left as it came.
        for odd in ["data: {}\n\n", "data: [1]\n\n", "event: x\n\n"] {
            assert_eq!(with_timing(odd, &t), odd);
        }
    }

    #[derive(Default)]
    struct Mem {
        status: Option<u16>,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
        ended: bool,
        gone: Option<watch::Receiver<bool>>,
    }

    #[async_trait]
    impl Downstream for Mem {
        async fn head(&mut self, status: u16, headers: &[(&str, &str)]) -> Result<(), Gone> {
            assert!(self.status.is_none(), "head sent twice");
            self.status = Some(status);
            self.headers = headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            Ok(())
        }
        async fn body(&mut self, bytes: Bytes, end: bool) -> Result<(), Gone> {
            assert!(self.status.is_some() && !self.ended);
            self.body.extend_from_slice(&bytes);
            self.ended = end;
            Ok(())
        }
        async fn gone(&mut self) {
            match &mut self.gone {
                Some(rx) => {
                    let _ = rx.wait_for(|g| *g).await;
                }
                None => std::future::pending().await,
            }
        }
    }

    fn ident() -> Ident {
        Ident::new(Endpoint::Chat, "m", "rid")
    }

    fn done(n: usize) -> Event {
        Event::Done {
            text: String::new(),
            finish: FinishReason::Length,
            usage: Usage {
                prompt_tokens: 3,
                completion_tokens: n,
                cached_tokens: 0,
            },
            queue: Duration::ZERO,
            compute: Duration::from_millis(5),
        }
    }

    fn tokens(words: &[&str]) -> EventStream {
        let (tx, rx) = unbounded_channel();
        for (i, w) in words.iter().enumerate() {
            tx.send(Event::Token {
                id: i as u32,
                text: w.to_string(),
            })
            .unwrap();
        }
        tx.send(done(words.len())).unwrap();
        rx
    }

    async fn run<S: Sink>(
        sink: &mut S,
        events: EventStream,
        pace: PaceSpec,
    ) -> (Result<Option<Finished>, Gone>, Timing) {
        let mut t = Timing::new(Instant::now(), Duration::ZERO);
        let mut d = Delivery::default();
        let r = drive(
            sink,
            events,
            pace,
            Beats::every(Duration::from_secs(5)),
            None,
            &mut t,
            &mut d,
            |_, _| {},
            |_, _| {},
        )
        .await;
        if let Ok(Some(end)) = &r {
            sink.done(end, &mut t).await.unwrap();
        }
        (r, t)
    }

    #[tokio::test]
    async fn sse_sink_streams_chunks_then_timing_then_done() {
        let mut down = Mem::default();
        let mut sink = SseSink::new(
            &mut down,
            ident(),
            vec![("x-request-id", "rid".into())],
            true,
        );
        let (r, t) = run(&mut sink, tokens(&["Hel", "lo"]), PaceSpec::OFF).await;
        assert_eq!(r.unwrap().unwrap().usage.completion_tokens, 2);
        assert!(t.ttft.is_some());
        let text = String::from_utf8(down.body).unwrap();
        assert_eq!(down.status, Some(200));
        assert!(down
            .headers
            .iter()
            .any(|(k, v)| k == "content-type" && v == "text/event-stream"));
        let datas: Vec<&str> = text.lines().filter(|l| l.starts_with("data: ")).collect();
        let chunk = |i: usize| -> Value { serde_json::from_str(&datas[i][6..]).unwrap() };
        assert_eq!(
            chunk(0)["choices"][0]["delta"]["role"],
            "assistant",
            "{text}"
        );
        assert_eq!(chunk(0)["choices"][0]["delta"]["content"], "Hel");
        assert_eq!(chunk(1)["choices"][0]["delta"]["content"], "lo");
        assert!(
            datas[2].contains("ultrafast_timing")
                && datas[2].contains(r#""finish_reason":"length""#)
        );
        assert!(datas[3].contains(r#""usage""#));
        assert_eq!(datas[4], "data: [DONE]");
        assert!(text.contains(": server-timing network;dur="));
        assert!(down.ended);
    }

    #[tokio::test]
    async fn json_sink_answers_once_with_server_timing() {
        let mut down = Mem::default();
        let mut sink = JsonSink::new(
            &mut down,
            ident(),
            vec![("x-ultrafast-lane", "standard".into())],
        );
        let (r, _) = run(&mut sink, tokens(&["a", "b", "c"]), PaceSpec::OFF).await;
        assert!(r.unwrap().is_some());
        let v: Value = serde_json::from_slice(&down.body).unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], "abc");
        assert_eq!(v["usage"]["completion_tokens"], 3);
        let h = |k: &str| {
            down.headers
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
        };
        assert!(h("server-timing").unwrap().contains("total;dur="));
        assert_eq!(h("x-ultrafast-lane").as_deref(), Some("standard"));
        assert_eq!(h("content-length").unwrap(), down.body.len().to_string());
    }

    #[tokio::test]
    async fn job_sink_fills_the_store() {
        let store = jobs::Store::new(4, 1 << 20, Duration::from_secs(60));
        let job = store.create("req_1".into()).unwrap();
        let mut sink = JobSink::new(job.clone(), ident());
        sink.admitted();
        assert_eq!(job.status(), jobs::Status::InProgress);
        let (r, _) = run(&mut sink, tokens(&["x", "y"]), PaceSpec::OFF).await;
        assert!(r.unwrap().is_some());
        assert_eq!(job.status(), jobs::Status::Completed);
        let (evs, finished) = job.events_from(0);
        assert!(finished);
        assert_eq!(
            evs.len(),
            4,
            "two chunks, the finish chunk, the usage chunk"
        );
        assert_eq!(
            job.view()["result"]["choices"][0]["message"]["content"],
            "xy"
        );
    }

    #[tokio::test]
    async fn a_backend_error_mid_stream_ends_the_stream_with_an_error_event() {
        let mut down = Mem::default();
        let mut sink = SseSink::new(&mut down, ident(), Vec::new(), false);
        let (tx, rx) = unbounded_channel();
        tx.send(Event::Token {
            id: 1,
            text: "a".into(),
        })
        .unwrap();
        tx.send(Event::Error("model failed".into())).unwrap();
        let (r, _) = run(&mut sink, rx, PaceSpec::OFF).await;
        assert!(r.unwrap().is_none());
        let text = String::from_utf8(down.body).unwrap();
        assert!(
            text.contains(r#""code":"backend_error""#) && text.ends_with("data: [DONE]\n\n"),
            "{text}"
        );
    }

    /// The regression of the shared wake-up variant: on a paced stream,
    /// after the pacer's deadlines have fired, a client that leaves still
    /// ends the drive at once, dropping (cancelling) the backend's stream.
    #[tokio::test]
    async fn a_paced_stream_notices_the_client_leaving() {
        let (gone_tx, gone_rx) = watch::channel(false);
        let mut down = Mem {
            gone: Some(gone_rx),
            ..Mem::default()
        };
        let mut sink = SseSink::new(&mut down, ident(), Vec::new(), false);
        let pace = PaceSpec {
            mode: PaceMode::Fixed(Duration::from_millis(20)),
            max_lead: 8,
        };
        let (tx, rx) = unbounded_channel();
        // A burst: the pacer holds most of it and its deadlines fire.
        for i in 0..6 {
            tx.send(Event::Token {
                id: i,
                text: format!("t{i} "),
            })
            .unwrap();
        }
        let leave = async {
            tokio::time::sleep(Duration::from_millis(150)).await;
            gone_tx.send_replace(true);
            Instant::now()
        };
        let mut t = Timing::new(Instant::now(), Duration::ZERO);
        let mut d = Delivery::default();
        let drive = drive(
            &mut sink,
            rx,
            pace,
            Beats::every(Duration::from_secs(5)),
            None,
            &mut t,
            &mut d,
            |_, _| {},
            |_, _| {},
        );
        let (r, left) = tokio::join!(drive, leave);
        assert_eq!(r.unwrap_err(), Gone);
        assert!(
            left.elapsed() < Duration::from_millis(100),
            "took {:?}",
            left.elapsed()
        );
        assert!(
            tx.is_closed(),
            "the backend's stream is dropped: the sequence is cancelled"
        );
        assert!(
            d.first_text.is_some(),
            "tokens were paced out before the client left"
        );
    }

    #[tokio::test]
    async fn waiting_streams_send_heartbeats_and_notice_the_client_leaving() {
        let (gone_tx, gone_rx) = watch::channel(false);
        let mut down = Mem {
            gone: Some(gone_rx),
            ..Mem::default()
        };
        let mut sink = SseSink::new(&mut down, ident(), Vec::new(), false);
        let slow = tokio::time::sleep(Duration::from_millis(120));
        let r = wait(&mut sink, Duration::from_millis(30), slow).await;
        assert!(r.is_ok());
        let never = std::future::pending::<()>();
        gone_tx.send_replace(true);
        assert_eq!(
            wait(&mut sink, Duration::from_millis(30), never).await,
            Err(Gone)
        );
        let text = String::from_utf8(down.body.clone()).unwrap();
        assert!(text.matches(": waiting").count() >= 2, "{text}");
        assert_eq!(down.status, Some(200));
    }

    #[tokio::test]
    async fn idle_streams_beat_at_the_waiting_rate_until_text_flows_then_at_the_keepalive() {
        // Real time (the drive loop keeps std instants): 20 ms and 400 ms.
        let mut down = Mem::default();
        let mut sink = SseSink::new(&mut down, ident(), Vec::new(), false);
        let (tx, rx) = unbounded_channel();
        let beats = Beats {
            waiting: Duration::from_millis(20),
            flowing: Duration::from_millis(400),
        };
        let backend = async {
            // 210 ms before the first token, 300 ms to the second, 500 ms
            // to the end.
            tokio::time::sleep(Duration::from_millis(210)).await;
            tx.send(Event::Token {
                id: 0,
                text: "a".into(),
            })
            .unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
            tx.send(Event::Token {
                id: 1,
                text: "b".into(),
            })
            .unwrap();
            tokio::time::sleep(Duration::from_millis(500)).await;
            tx.send(done(2)).unwrap();
        };
        let mut t = Timing::new(Instant::now(), Duration::ZERO);
        let mut d = Delivery::default();
        let (r, ()) = tokio::join!(
            drive(
                &mut sink,
                rx,
                PaceSpec::OFF,
                beats,
                None,
                &mut t,
                &mut d,
                |_, _| {},
                |_, _| {}
            ),
            backend
        );
        assert!(r.unwrap().is_some());
        let text = String::from_utf8(down.body.clone()).unwrap();
        let (before, after) = text
            .split_once("\"a\"")
            .expect("the first token was written");
        // About ten beats before the first token; after it none in the 300 ms
        // to the second, one in the 500 ms before the end (at 400 ms).
        let waiting = before.matches(": waiting").count();
        assert!((7..=10).contains(&waiting), "{waiting}: {text}");
        assert_eq!(after.matches(": waiting").count(), 1, "{text}");
    }

    #[tokio::test]
    async fn a_refusal_before_the_head_is_a_status_after_it_an_event() {
        let f = Failure {
            status: 503,
            headers: vec![("retry-after", "2".into())],
            body: Bytes::from_static(br#"{"error":{"code":"slo"}}"#),
        };
        let mut down = Mem::default();
        SseSink::new(&mut down, ident(), Vec::new(), false)
            .fail(&f)
            .await
            .unwrap();
        assert_eq!(down.status, Some(503));
        assert!(down
            .headers
            .iter()
            .any(|(k, v)| k == "retry-after" && v == "2"));
        let mut down = Mem::default();
        let mut sink = SseSink::new(&mut down, ident(), Vec::new(), false);
        sink.heartbeat().await.unwrap();
        sink.fail(&f).await.unwrap();
        assert_eq!(down.status, Some(200));
        let text = String::from_utf8(down.body).unwrap();
        assert!(
            text.contains(r#"data: {"error":{"code":"slo"}}"#)
                && text.ends_with("data: [DONE]\n\n")
        );
    }
}
