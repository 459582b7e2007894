//! The API dialects beside OpenAI's chat and completions: Anthropic's
//! Messages API (`/v1/messages`) and OpenAI's Responses API
//! (`/v1/responses`). Each is a thin translation at the two edges of the
//! one pipeline: its parser fills the same `openai::Parsed` (a chat prompt,
//! sampling, stops, the `Structure` of tools or a schema), and its
//! `Writer` turns the same output pieces (`shape::Piece`) into its own
//! events and whole response. Lanes, admission, pacing, the async store and
//! the latency breakdown are the pipeline's, unchanged.

pub mod anthropic;
pub mod responses;

use super::delivery::{Downstream, Failure, Finished, Gone, Sink, Timing};
use super::jobs::{self, Job};
use super::shape::{Collected, Piece, Shaper};
use super::sinks::{finish_of, send_failure, Headers};
use super::sse;
use async_trait::async_trait;
use bytes::Bytes;
use serde_json::Value;
use std::sync::Arc;
use tokio::sync::watch;

pub use super::request::Dialect;

/// One streamed event: its SSE `event:` name and its data.
#[derive(Debug, Clone)]
pub struct Ev {
    /// The event name.
    pub name: &'static str,
    /// The JSON data.
    pub data: Value,
}

impl Ev {
    /// As SSE bytes.
    pub fn sse(&self) -> Bytes {
        Bytes::from(format!("event: {}\ndata: {}\n\n", self.name, self.data))
    }
}

/// How one dialect writes a response.
pub trait Writer: Send {
    /// The events that open a stream.
    fn open(&mut self) -> Vec<Ev>;
    /// The events of one piece of output.
    fn piece(&mut self, p: &Piece) -> Vec<Ev>;
    /// The events that end a stream.
    fn close(&mut self, out: &Collected, end: &Finished) -> Vec<Ev>;
    /// The whole response, as the client gets it.
    fn whole(&self, out: &Collected, end: &Finished) -> Value;
    /// The whole response as the store keeps it (with what a later
    /// request needs of it, never shown).
    fn stored(&self, out: &Collected, end: &Finished) -> Value {
        self.whole(out, end)
    }
    /// An error after the stream began, from an OpenAI-style error body.
    fn error(&mut self, body: &Value) -> Ev;
    /// The keep-alive while nothing is ready.
    fn ping(&mut self) -> Bytes;
    /// The reports of the tokens whose text comes next (only a dialect
    /// that parses a request for them is handed any).
    fn logprobs(&mut self, tokens: Vec<ultrafast_engine::api::TokenLogprob>) {
        let _ = tokens;
    }
    /// The response as a failed one (the async store's result).
    fn failed(&self, _error: &Value) -> Option<Value> {
        None
    }
}

/// Where a dialect's response goes.
pub enum To<'a> {
    /// A stream of events.
    Sse(&'a mut dyn Downstream),
    /// One JSON body.
    Whole(&'a mut dyn Downstream),
    /// The async store (and, for the Responses API's stored responses,
    /// where `GET /v1/responses/{id}` and `previous_response_id` find it).
    Job(Arc<Job>, watch::Receiver<bool>),
}

/// A sink in any dialect: its writer formats, this sends.
pub struct DialectSink<'a> {
    to: To<'a>,
    w: Box<dyn Writer>,
    headers: Headers,
    head_sent: bool,
    /// The opening events were made (numbered before any other).
    opened: bool,
    out: Collected,
    shaper: Option<Shaper>,
    /// Also record the finished response here (a stored response).
    store: Option<Arc<Job>>,
}

impl<'a> DialectSink<'a> {
    /// A sink to `to` in `w`'s dialect; `tools` reads the output for calls.
    pub fn new(to: To<'a>, w: Box<dyn Writer>, headers: Headers, tools: bool) -> Self {
        DialectSink {
            to,
            w,
            headers,
            head_sent: false,
            opened: false,
            out: Collected::default(),
            shaper: tools.then(Shaper::default),
            store: None,
        }
    }

    /// Record the finished response in `job` as well.
    pub fn storing(mut self, job: Option<Arc<Job>>) -> Self {
        self.store = job;
        self
    }

    /// The opening events, once, before the first others are made.
    fn opening(&mut self) -> Vec<Ev> {
        if std::mem::replace(&mut self.opened, true) {
            return Vec::new();
        }
        self.w.open()
    }

    async fn send(&mut self, evs: Vec<Ev>) -> Result<(), Gone> {
        match &mut self.to {
            To::Sse(down) => {
                if !self.head_sent {
                    let mut h: Vec<(&str, &str)> =
                        self.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
                    h.extend([
                        ("content-type", "text/event-stream"),
                        ("cache-control", "no-cache"),
                        ("x-accel-buffering", "no"),
                    ]);
                    down.body_follows();
                    down.head(200, &h).await?;
                    self.head_sent = true;
                }
                for e in evs {
                    down.body(e.sse(), false).await?;
                }
                Ok(())
            }
            To::Whole(_) => Ok(()),
            To::Job(job, _) => {
                self.head_sent = true;
                for e in evs {
                    if !job.push(e.data.to_string()) {
                        return Err(Gone);
                    }
                }
                Ok(())
            }
        }
    }

    async fn pieces(&mut self, pieces: Vec<Piece>) -> Result<(), Gone> {
        let mut evs = self.opening();
        for p in &pieces {
            self.out.add(p);
            evs.extend(self.w.piece(p));
        }
        self.send(evs).await
    }
}

#[async_trait]
impl Sink for DialectSink<'_> {
    fn streaming(&self) -> bool {
        matches!(self.to, To::Sse(_))
    }

    async fn gone(&mut self) {
        match &mut self.to {
            To::Sse(d) | To::Whole(d) => d.gone().await,
            To::Job(_, cancelled) => {
                if cancelled.wait_for(|c| *c).await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        }
    }

    fn admitted(&mut self) {
        if let To::Job(job, _) = &self.to {
            job.start();
        }
        if let Some(j) = &self.store {
            j.start();
        }
    }

    async fn heartbeat(&mut self) -> Result<(), Gone> {
        if let To::Sse(_) = self.to {
            let open = self.opening();
            self.send(open).await?;
            let ping = self.w.ping();
            if let To::Sse(down) = &mut self.to {
                down.body(ping, false).await?;
            }
        }
        Ok(())
    }

    fn logprobs(&mut self, tokens: Vec<ultrafast_engine::api::TokenLogprob>) {
        self.w.logprobs(tokens);
    }

    async fn text(&mut self, text: &str) -> Result<(), Gone> {
        let pieces = match self.shaper.as_mut() {
            Some(sh) => sh.push(text),
            None => vec![Piece::Text(text.to_string())],
        };
        self.pieces(pieces).await
    }

    async fn done(&mut self, end: &Finished, t: &mut Timing) -> Result<(), Gone> {
        if let Some(sh) = self.shaper.as_mut() {
            let pieces = sh.finish();
            self.pieces(pieces).await?;
        }
        let end = Finished {
            finish: finish_of(&self.shaper, end.finish),
            ..*end
        };
        t.stamp();
        let whole = self.w.whole(&self.out, &end);
        if let Some(j) = &self.store {
            j.finish(
                jobs::Status::Completed,
                Some(self.w.stored(&self.out, &end)),
                None,
            );
        }
        let mut close = self.opening();
        close.extend(self.w.close(&self.out, &end));
        match &mut self.to {
            To::Sse(_) => {
                self.send(close).await?;
                if let To::Sse(down) = &mut self.to {
                    let st = sse::comment(&format!("server-timing {}", t.header()));
                    down.body(st, false).await?;
                    down.body(Bytes::new(), true).await?;
                }
                Ok(())
            }
            To::Whole(down) => {
                let body = whole.to_string();
                let st = t.header();
                let len = body.len().to_string();
                let mut h: Vec<(&str, &str)> =
                    self.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
                h.extend([
                    ("content-type", "application/json"),
                    ("content-length", len.as_str()),
                    ("server-timing", st.as_str()),
                ]);
                down.head(200, &h).await?;
                down.body(Bytes::from(body), true).await
            }
            To::Job(..) => {
                self.send(close).await?;
                if let To::Job(job, _) = &self.to {
                    job.finish(
                        jobs::Status::Completed,
                        Some(self.w.stored(&self.out, &end)),
                        None,
                    );
                }
                Ok(())
            }
        }
    }

    async fn fail(&mut self, f: &Failure) -> Result<(), Gone> {
        let err: Value = serde_json::from_slice(&f.body).unwrap_or(Value::Null);
        if let Some(j) = &self.store {
            j.finish(
                jobs::Status::Failed,
                self.w.failed(&err),
                Some(err["error"].clone()),
            );
        }
        match &mut self.to {
            To::Sse(down) if !self.head_sent => send_failure(*down, &self.headers, f).await,
            To::Whole(down) => send_failure(*down, &self.headers, f).await,
            To::Sse(_) => {
                let mut evs = self.opening();
                evs.push(self.w.error(&err));
                self.send(evs).await?;
                if let To::Sse(down) = &mut self.to {
                    down.body(Bytes::new(), true).await?;
                }
                Ok(())
            }
            To::Job(job, _) => {
                let e = self.w.error(&err);
                let _ = job.push(e.data.to_string());
                job.finish(
                    jobs::Status::Failed,
                    self.w.failed(&err),
                    Some(err["error"].clone()),
                );
                Ok(())
            }
        }
    }
}
