//! Relaying an opened upstream stream to the front, and mid-stream
//! failover: when the stream breaks after tokens went out (a reset, a stall
//! past `stall_timeout_ms`, malformed SSE, an error object, a close before
//! `[DONE]`), the request continues on another member as a continuation of
//! the text delivered so far (`UpstreamBackend::body` with `resume`), so
//! the client sees one stream and `usage` counts what it received. A chat
//! stream continues only on a pool that declares `resume = "vllm"`; others
//! end with the error event as before.

use super::open::Opened;
use super::{connector, UpstreamBackend};
use pingora::protocols::http::client::HttpSession;
use pingora::upstreams::peer::Peer;
use std::time::Duration;
use tokio::sync::mpsc::UnboundedSender;
use ultrafast_engine::api::{Event, InferenceRequest, Prepared, Usage};

/// How one upstream stream ended.
enum End {
    /// `[DONE]`, with the final event to send.
    Done(Event),
    /// The consumer left.
    Gone,
    /// Broken, with why.
    Broken(String),
}

/// What went out to the consumer so far.
#[derive(Default)]
pub(super) struct Sent {
    text: String,
    tokens: usize,
    /// Forwarded events, kept (when the stream may be continued) to be
    /// read only if it breaks.
    raw: Option<String>,
}

impl Sent {
    /// Nothing yet; `keep_raw` keeps forwarded events for a continuation.
    fn new(keep_raw: bool) -> Self {
        Sent {
            raw: keep_raw.then(String::new),
            ..Sent::default()
        }
    }

    fn add(&mut self, text: &str) {
        self.text.push_str(text);
        self.tokens += 1;
    }

    fn add_event(&mut self, e: &Event) {
        match e {
            Event::Token { text, .. } => self.add(text),
            Event::Raw { sse, tokens, .. } => {
                self.tokens += tokens;
                if let Some(r) = self.raw.as_mut() {
                    r.push_str(sse);
                }
            }
            Event::Done { .. }
            | Event::Error(_)
            | Event::Prompt(_)
            | Event::Logprob(_)
            | Event::Indexed(..) => {}
        }
    }

    /// The text of the forwarded events, read now that the stream broke
    /// and is to be continued: each event on its own, so one the upstream
    /// garbled loses only itself.
    fn read_raw(&mut self) {
        let Some(raw) = self.raw.take() else { return };
        for ev in raw.split_inclusive("\n\n") {
            let mut st = super::stream::StreamState::default();
            let mut evs = Vec::new();
            st.feed(ev.as_bytes(), &mut evs);
            for e in evs {
                if let Event::Token { text, .. } = e {
                    self.text.push_str(&text);
                }
            }
        }
    }
}

/// Send the tokens `o` opened with now, from the request's own task: the
/// client's first chunk then does not wait for the relay task to be
/// scheduled (a hand-over measured at about 45 us of time to first token).
/// What follows them (more tokens, the end) is the relay's.
pub(super) fn send_leading(o: &mut Opened, tx: &UnboundedSender<Event>, keep_raw: bool) -> Sent {
    let mut sent = Sent::new(keep_raw);
    let n = o
        .first
        .iter()
        .take_while(|e| {
            matches!(
                e,
                Event::Token { .. } | Event::Raw { .. } | Event::Logprob(_)
            )
        })
        .count();
    for e in o.first.drain(..n) {
        sent.add_event(&e);
        // The receiver is not handed out yet: this cannot fail.
        let _ = tx.send(e);
    }
    sent
}

impl UpstreamBackend {
    /// Forward `o` and, when it breaks, its continuations; dropping out of
    /// here (consumer gone, error) closes the upstream connection, which
    /// cancels the work there.
    pub(super) async fn relay(
        self,
        mut o: Opened,
        req: InferenceRequest,
        prepared: Prepared,
        tx: UnboundedSender<Event>,
        mut sent: Sent,
    ) {
        // Tokens delivered before the current upstream stream began.
        let mut before = 0usize;
        let mut failovers = 0u32;
        loop {
            let end = self.pump(&mut o, &tx, &mut sent).await;
            let why = match end {
                End::Gone => return,
                End::Done(ev) => {
                    let _ = tx.send(resumed_usage(ev, before));
                    // Boxed: the pool's state would size the relay task.
                    Box::pin(self.release(o)).await;
                    return;
                }
                End::Broken(why) => why,
            };
            self.spec.pool.record_failure(&o.member);
            let left = prepared.max_tokens.saturating_sub(sent.tokens);
            let can = self.resumable(&req)
                && failovers < self.spec.attempts
                && left > 0
                && self.spec.pool.budget.try_withdraw();
            if !can {
                self.spec.counters.failovers_failed.inc();
                let _ = tx.send(Event::Error(why));
                return;
            }
            let broken = o.member.addr;
            drop(o);
            sent.read_raw();
            failovers += 1;
            log::warn!(
                "inference pool {}: {why}; continuing on another member after {} token(s)",
                self.spec.pool.name,
                sent.tokens
            );
            let (path, body) = self.body(&req, &prepared, Some((&sent.text, sent.tokens)));
            // The continuation is read, not forwarded: its chunks are the
            // edge's own, numbered on from what the client received.
            let ids = super::open::Ids {
                raw: None,
                ..super::open::Ids::of(&req)
            };
            // Boxed: inline, the opening's state would be part of every
            // relay task, copied whole when the task is spawned.
            let next = Box::pin(self.first_token(
                path,
                &body,
                ids,
                prepared.prefix_hash,
                &[broken],
                false,
                super::open::First::Balancer,
            ))
            .await;
            match next {
                Ok(n) => {
                    self.spec.counters.failovers.inc();
                    before = sent.tokens;
                    o = n;
                }
                Err(e) => {
                    self.spec.counters.failovers_failed.inc();
                    let _ = tx.send(Event::Error(format!("{why}; {}", e.message)));
                    return;
                }
            }
        }
    }

    /// Forward one upstream stream until it ends.
    async fn pump(&self, o: &mut Opened, tx: &UnboundedSender<Event>, sent: &mut Sent) -> End {
        let stall = self.spec.stall;
        let mut evs = std::mem::take(&mut o.first);
        loop {
            for e in evs.drain(..) {
                match e {
                    Event::Error(why) => return End::Broken(why),
                    Event::Done { .. } => return End::Done(e),
                    Event::Token { .. }
                    | Event::Raw { .. }
                    | Event::Prompt(_)
                    | Event::Logprob(_)
                    | Event::Indexed(..) => {
                        sent.add_event(&e);
                        if tx.send(e).is_err() {
                            return End::Gone;
                        }
                    }
                }
            }
            let read = tokio::select! {
                r = tokio::time::timeout(stall, o.session.read_response_body()) => r,
                _ = tx.closed() => return End::Gone,
            };
            let label = &o.member.label;
            match read {
                // The session's own read timeout is the same stall limit:
                // whichever fires first, it is a stall.
                Err(_) => return End::Broken(stalled(label, stall)),
                Ok(Err(e)) if matches!(e.etype(), pingora::ErrorType::ReadTimedout) => {
                    return End::Broken(stalled(label, stall))
                }
                Ok(Err(e)) => return End::Broken(format!("upstream {label}: stream broke: {e}")),
                Ok(Ok(None)) => {
                    return End::Broken(format!("upstream {label} closed the stream before [DONE]"))
                }
                Ok(Ok(Some(b))) => o.state.feed(&b, &mut evs),
            }
        }
    }

    /// Drain the (empty) rest of a finished stream so its connection can be
    /// reused.
    async fn release(&self, mut o: Opened) {
        let ok = matches!(
            tokio::time::timeout(Duration::from_millis(50), o.session.read_response_body()).await,
            Ok(Ok(None))
        ) || o.session.response_done();
        let Some(idle) = self.spec.pool.settings.keepalive_idle.filter(|_| ok) else {
            return;
        };
        match o.session {
            HttpSession::H1(mut h1) => {
                h1.respect_keepalive();
                if let Some(stream) = h1.reuse().await {
                    self.idle.put(o.peer.reuse_hash(), stream, idle);
                }
            }
            h2 => {
                connector()
                    .release_http_session(h2, &*o.peer, Some(idle))
                    .await
            }
        }
    }
}

fn stalled(label: &str, stall: Duration) -> String {
    format!("upstream {label} stalled: no data for {stall:?}")
}

/// The final event of a continued stream: the client received `before`
/// tokens from the broken stream(s) plus this one's, and this one's prompt
/// counted those tokens as prompt.
fn resumed_usage(ev: Event, before: usize) -> Event {
    match ev {
        Event::Done {
            text,
            finish,
            usage,
            queue,
            compute,
        } if before > 0 => Event::Done {
            text,
            finish,
            usage: Usage {
                prompt_tokens: usage.prompt_tokens.saturating_sub(before),
                completion_tokens: usage.completion_tokens + before,
                cached_tokens: usage.cached_tokens,
            },
            queue,
            compute,
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ultrafast_engine::api::FinishReason;

    #[test]
    fn a_continued_stream_counts_what_the_client_received() {
        let done = Event::Done {
            text: String::new(),
            finish: FinishReason::Stop,
            usage: Usage {
                prompt_tokens: 20,
                completion_tokens: 11,
                cached_tokens: 0,
            },
            queue: Duration::ZERO,
            compute: Duration::ZERO,
        };
        match resumed_usage(done, 5) {
            Event::Done { usage, .. } => {
                assert_eq!(usage.completion_tokens, 16);
                assert_eq!(usage.prompt_tokens, 15);
            }
            e => panic!("{e:?}"),
        }
    }
}
