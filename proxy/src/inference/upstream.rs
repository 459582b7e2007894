//! Upstream inference pools: OpenAI-compatible servers (vLLM, TGI, SGLang,
//! Ollama, llama.cpp) behind the same backend seam as the engine.
//!
//! Reuses the core's pools (members, health, ejection, TLS, keepalive via
//! Pingora's connector). Adds: least-outstanding or prefix-affinity choice
//! (consistent hash with bounded load on the conversation prefix), retry to
//! another member only until the first token (never after one reached the
//! client), the lane passed on as vLLM's `priority`, and parsing of the
//! upstream's SSE so tokens are counted and timed here. The upstream is
//! always asked to stream, even for a non-streaming client, so time to first
//! token is known and a stall is noticed.

use super::sse::Parser;
use crate::upstream::lb::{hash_bytes, Balancer};
use crate::upstream::{LbSpec, Member, Membership, Outstanding, Pool};
use bytes::Bytes;
use parking_lot::Mutex;
use pingora::connectors::http::Connector;
use pingora::http::RequestHeader;
use pingora::protocols::http::client::HttpSession;
use pingora::upstreams::peer::HttpPeer;
use serde_json::{json, Value};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use ultrafast_engine::api::{
    Backend, BackendError, Event, EventStream, FinishReason, InferenceRequest, Prepared, Prompt,
    Readiness, Usage,
};

/// Which priority field the upstream understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PriorityField {
    /// None: the lane stays at the edge.
    None,
    /// vLLM's `priority` (lower runs first): the lane's rank.
    Vllm,
}

/// Settings of an upstream-served model.
#[derive(Debug, Clone)]
pub struct UpstreamSpec {
    /// The pool.
    pub pool: Arc<Pool>,
    /// Model name sent upstream.
    pub upstream_model: String,
    /// Prefix affinity's bounded-load factor (None: least outstanding).
    pub affinity: Option<f64>,
    /// Priority field.
    pub priority: PriorityField,
    /// Members tried before the first token.
    pub attempts: u32,
    /// Longest silence before the first token or between tokens.
    pub stall: Duration,
}

/// The balancer built for one member set.
type Ring = (Arc<Membership>, Arc<Balancer>);

/// An upstream-served model.
#[derive(Clone)]
pub struct UpstreamBackend {
    spec: Arc<UpstreamSpec>,
    ring: Arc<Mutex<Option<Ring>>>,
}

impl std::fmt::Debug for UpstreamBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UpstreamBackend({})", self.spec.pool.name)
    }
}

fn connector() -> &'static Connector {
    static C: OnceLock<Connector> = OnceLock::new();
    C.get_or_init(|| Connector::new(None))
}

/// How one try ended before any token.
enum TryError {
    /// Worth another member (connect failure, 5xx, reset, stall).
    Retry(String),
    /// The upstream refused the request itself (4xx): pass it on.
    Final(BackendError),
}

impl UpstreamBackend {
    /// A backend over `spec.pool`.
    pub fn new(spec: UpstreamSpec) -> Self {
        UpstreamBackend {
            spec: Arc::new(spec),
            ring: Arc::new(Mutex::new(None)),
        }
    }

    /// The spec.
    pub fn spec(&self) -> &UpstreamSpec {
        &self.spec
    }

    /// The balancer for this membership (a ring for prefix affinity is
    /// built once per member set, not per request).
    fn balancer(&self, m: &Arc<Membership>) -> Arc<Balancer> {
        let mut g = self.ring.lock();
        if let Some((mm, b)) = &*g {
            if Arc::ptr_eq(mm, m) {
                return b.clone();
            }
        }
        let spec = match self.spec.affinity {
            Some(f) => LbSpec::ConsistentHash(crate::upstream::lb::HashKey::ClientIp, f),
            None => LbSpec::LeastOutstanding,
        };
        let b = Arc::new(spec.build(&m.members));
        *g = Some((m.clone(), b.clone()));
        b
    }

    fn body(&self, req: &InferenceRequest, prepared: &Prepared) -> (String, Bytes) {
        let mut o = serde_json::Map::new();
        o.insert("model".into(), json!(self.spec.upstream_model));
        let path = match &req.prompt {
            Prompt::Chat(m) => {
                o.insert("messages".into(), json!(m));
                "/v1/chat/completions"
            }
            Prompt::Text(t) => {
                o.insert("prompt".into(), json!(t));
                "/v1/completions"
            }
        };
        // Always the size admission reserved: an upstream left to its own
        // default could generate far more than was admitted.
        o.insert("max_tokens".into(), json!(prepared.max_tokens));
        let s = &req.sampling;
        o.insert("temperature".into(), json!(s.temperature));
        o.insert("top_p".into(), json!(s.top_p));
        if s.top_k > 0 {
            o.insert("top_k".into(), json!(s.top_k));
        }
        if let Some(seed) = s.seed {
            o.insert("seed".into(), json!(seed));
        }
        if !req.stop.is_empty() {
            o.insert("stop".into(), json!(req.stop));
        }
        if let Some(u) = &req.user {
            o.insert("user".into(), json!(u));
        }
        if self.spec.priority == PriorityField::Vllm {
            o.insert("priority".into(), json!(req.lane_rank));
        }
        o.insert("stream".into(), json!(true));
        o.insert("stream_options".into(), json!({"include_usage": true}));
        (path.to_string(), Bytes::from(Value::Object(o).to_string()))
    }

    /// Connect, send, read the head and the stream up to the first token.
    #[allow(clippy::too_many_arguments)]
    async fn try_member(
        &self,
        peer: &HttpPeer,
        m: &Member,
        path: &str,
        body: &Bytes,
        request_id: &str,
        first: &mut Vec<Event>,
        st: &mut StreamState,
    ) -> Result<HttpSession, TryError> {
        let retry = |what: &str, e: &dyn std::fmt::Display| {
            TryError::Retry(format!("{} ({}): {what}: {e}", m.label, m.addr))
        };
        let (mut s, _reused) = connector()
            .get_http_session(peer)
            .await
            .map_err(|e| retry("connect", &e))?;
        s.set_read_timeout(Some(self.spec.stall));
        let mut head = RequestHeader::build("POST", path.as_bytes(), Some(6))
            .map_err(|e| retry("request", &e))?;
        let _ = head.insert_header("host", m.label.as_str());
        let _ = head.insert_header("content-type", "application/json");
        let _ = head.insert_header("accept", "text/event-stream");
        let _ = head.insert_header("content-length", body.len());
        let _ = head.insert_header("x-request-id", request_id);
        s.write_request_header(Box::new(head))
            .await
            .map_err(|e| retry("write", &e))?;
        s.write_request_body(body.clone(), true)
            .await
            .map_err(|e| retry("write", &e))?;
        s.finish_request_body()
            .await
            .map_err(|e| retry("write", &e))?;
        s.read_response_header()
            .await
            .map_err(|e| retry("read", &e))?;
        let status = s
            .response_header()
            .map(|h| h.status.as_u16())
            .unwrap_or(502);
        if status != 200 {
            let mut text = Vec::new();
            while let Ok(Some(b)) = s.read_response_body().await {
                if text.len() < 64 << 10 {
                    text.extend_from_slice(&b);
                }
            }
            let msg = serde_json::from_slice::<Value>(&text)
                .ok()
                .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
                .unwrap_or_else(|| String::from_utf8_lossy(&text).chars().take(300).collect());
            if status >= 500 || status == 429 {
                return Err(TryError::Retry(format!(
                    "{} answered {status}: {msg}",
                    m.label
                )));
            }
            return Err(TryError::Final(BackendError {
                status,
                kind: "invalid_request_error",
                code: "upstream_rejected",
                param: None,
                message: format!("upstream answered {status}: {msg}"),
            }));
        }
        loop {
            let chunk = s
                .read_response_body()
                .await
                .map_err(|e| retry("read", &e))?;
            let Some(chunk) = chunk else {
                return Err(TryError::Retry(format!(
                    "{} closed the stream before the first token",
                    m.label
                )));
            };
            st.feed(&chunk, first);
            if !first.is_empty() {
                return Ok(s);
            }
        }
    }
}

/// What the SSE of one upstream response has said so far.
#[derive(Default)]
struct StreamState {
    parser: Parser,
    finish: Option<FinishReason>,
    usage: Option<Usage>,
    chunks: usize,
    done: bool,
    failed: bool,
}

impl StreamState {
    /// Turn bytes into events (tokens, then at most one `Done` or `Error`).
    fn feed(&mut self, bytes: &[u8], out: &mut Vec<Event>) {
        if self.done || self.failed {
            return;
        }
        let datas = match self.parser.feed(bytes) {
            Ok(d) => d,
            Err(e) => {
                self.failed = true;
                out.push(Event::Error(format!("upstream sent malformed SSE: {e}")));
                return;
            }
        };
        for d in datas {
            if d.trim() == "[DONE]" {
                self.done = true;
                out.push(self.done_event());
                return;
            }
            let v: Value = match serde_json::from_str(&d) {
                Ok(v) => v,
                Err(e) => {
                    self.failed = true;
                    out.push(Event::Error(format!("upstream sent malformed SSE: {e}")));
                    return;
                }
            };
            if let Some(err) = v.get("error") {
                self.failed = true;
                let msg = err["message"].as_str().unwrap_or("upstream error");
                out.push(Event::Error(format!("upstream error: {msg}")));
                return;
            }
            if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                let n = |k: &str| u[k].as_u64().unwrap_or(0) as usize;
                self.usage = Some(Usage {
                    prompt_tokens: n("prompt_tokens"),
                    completion_tokens: n("completion_tokens"),
                    cached_tokens: u["prompt_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .unwrap_or(0) as usize,
                });
            }
            let Some(c) = v["choices"].get(0) else {
                continue;
            };
            let text = c["delta"]["content"]
                .as_str()
                .or_else(|| c["text"].as_str())
                .unwrap_or("");
            if !text.is_empty() {
                self.chunks += 1;
                out.push(Event::Token {
                    id: 0,
                    text: text.to_string(),
                });
            }
            if let Some(f) = c["finish_reason"].as_str() {
                self.finish = Some(if f == "length" {
                    FinishReason::Length
                } else {
                    FinishReason::Stop
                });
            }
        }
    }

    fn done_event(&self) -> Event {
        let usage = self.usage.unwrap_or(Usage {
            prompt_tokens: 0,
            completion_tokens: self.chunks,
            cached_tokens: 0,
        });
        Event::Done {
            text: String::new(),
            finish: self.finish.unwrap_or(FinishReason::Stop),
            usage,
            queue: Duration::ZERO,
            compute: Duration::ZERO,
        }
    }
}

/// Forward the rest of the stream; dropping out of here (client gone,
/// error) closes the upstream connection, which cancels the work there.
async fn pump(
    mut s: HttpSession,
    mut st: StreamState,
    tx: UnboundedSender<Event>,
    peer: Box<HttpPeer>,
    idle: Option<Duration>,
    _out: Outstanding,
    stall: Duration,
) {
    let mut evs = Vec::new();
    while !st.done && !st.failed {
        let read = tokio::select! {
            r = tokio::time::timeout(stall, s.read_response_body()) => r,
            _ = tx.closed() => return,
        };
        // The session's own read timeout is the same stall limit: whichever
        // of the two fires first, it is a stall.
        let stalled = match &read {
            Err(_) => true,
            Ok(Err(e)) => matches!(e.etype(), pingora::ErrorType::ReadTimedout),
            Ok(Ok(_)) => false,
        };
        match read {
            _ if stalled => {
                let _ = tx.send(Event::Error(format!(
                    "upstream stalled: no data for {stall:?}"
                )));
                return;
            }
            Err(_) => return,
            Ok(Err(e)) => {
                let _ = tx.send(Event::Error(format!("upstream stream broke: {e}")));
                return;
            }
            Ok(Ok(None)) => {
                let _ = tx.send(Event::Error(
                    "upstream closed the stream before [DONE]".into(),
                ));
                return;
            }
            Ok(Ok(Some(b))) => {
                st.feed(&b, &mut evs);
                for e in evs.drain(..) {
                    if tx.send(e).is_err() {
                        return;
                    }
                }
            }
        }
    }
    if st.done {
        // Drain the (empty) rest so the connection can be reused.
        let ok = matches!(
            tokio::time::timeout(Duration::from_millis(50), s.read_response_body()).await,
            Ok(Ok(None))
        ) || s.response_done();
        if ok && idle.is_some() {
            connector().release_http_session(s, &*peer, idle).await;
        }
    }
}

#[async_trait::async_trait]
impl Backend for UpstreamBackend {
    fn kind(&self) -> &'static str {
        "upstream"
    }

    fn readiness(&self) -> Readiness {
        let m = self.spec.pool.members();
        let now = crate::upstream::now_ms();
        if m.members.iter().any(|x| x.available(now)) {
            Readiness::Ready
        } else {
            Readiness::Starting(format!(
                "pool `{}` has no healthy member",
                self.spec.pool.name
            ))
        }
    }

    fn prepare(&self, req: &InferenceRequest) -> Result<Prepared, BackendError> {
        // Token counts are estimated (about 4 bytes per token): they only
        // size the request for admission; the upstream reports real usage.
        let (chars, prefix) = match &req.prompt {
            Prompt::Chat(m) => {
                let chars: usize = m.iter().map(|x| x.content.len() + 16).sum();
                // The conversation before the last message (a shared system
                // prompt, earlier turns) is what an upstream KV cache holds.
                let mut p = Vec::new();
                let head = if m.len() > 1 {
                    &m[..m.len() - 1]
                } else {
                    &m[..]
                };
                for x in head {
                    p.extend_from_slice(x.role.as_bytes());
                    p.push(0);
                    p.extend_from_slice(x.content.as_bytes());
                    p.push(0);
                }
                p.truncate(4096);
                (chars, hash_bytes(&p))
            }
            Prompt::Text(t) => (t.len(), hash_bytes(&t.as_bytes()[..t.len().min(1024)])),
        };
        Ok(Prepared {
            prompt_tokens: chars.div_ceil(4).max(1),
            max_tokens: req.max_tokens.unwrap_or(256),
            tokens: Vec::new(),
            prefix_hash: prefix,
        })
    }

    async fn generate(
        &self,
        req: InferenceRequest,
        prepared: Prepared,
    ) -> Result<EventStream, BackendError> {
        let pool = &self.spec.pool;
        pool.record_request();
        let membership = pool.members();
        let balancer = self.balancer(&membership);
        let (path, body) = self.body(&req, &prepared);
        let mut tried: Vec<usize> = Vec::new();
        let mut last = String::from("no upstream member available");
        let attempts = self.spec.attempts.max(1) as usize;
        while tried.len() < attempts.min(membership.members.len()) {
            let now = crate::upstream::now_ms();
            let Some(i) = balancer.select(&membership.members, prepared.prefix_hash, &tried, now)
            else {
                break;
            };
            if !tried.is_empty() {
                if !pool.budget.try_withdraw() {
                    pool.metrics.retries_denied.inc();
                    break;
                }
                pool.metrics.retries.inc();
            }
            tried.push(i);
            let m = &membership.members[i];
            let out = Outstanding::acquire(m);
            let peer = pool.peer(m);
            let started = Instant::now();
            let mut first = Vec::new();
            let mut st = StreamState::default();
            match self
                .try_member(&peer, m, &path, &body, &req.request_id, &mut first, &mut st)
                .await
            {
                Ok(s) => {
                    pool.record_success(m, started.elapsed());
                    let (tx, rx) = unbounded_channel();
                    for e in first {
                        let _ = tx.send(e);
                    }
                    let idle = pool.settings.keepalive_idle;
                    let stall = self.spec.stall;
                    tokio::spawn(pump(s, st, tx, peer, idle, out, stall));
                    return Ok(rx);
                }
                Err(TryError::Final(e)) => return Err(e),
                Err(TryError::Retry(why)) => {
                    log::warn!("inference pool {}: {why}", pool.name);
                    pool.record_failure(m);
                    last = why;
                }
            }
        }
        Err(BackendError {
            status: 502,
            kind: "server_error",
            code: "upstream_unavailable",
            param: None,
            message: format!("no upstream could serve the request: {last}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_state_counts_tokens_and_finishes() {
        let mut st = StreamState::default();
        let mut out = Vec::new();
        st.feed(
            b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
            &mut out,
        );
        assert!(out.is_empty());
        st.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\ndata: {\"choices\":[{\"delta\":{},\"finish_reason\":\"length\"}]}\n\n", &mut out);
        st.feed(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n", &mut out);
        assert_eq!(out.len(), 2);
        match &out[1] {
            Event::Done { finish, usage, .. } => {
                assert_eq!(*finish, FinishReason::Length);
                assert_eq!(usage.prompt_tokens, 5);
            }
            e => panic!("{e:?}"),
        }
    }

    #[test]
    fn malformed_sse_is_an_error_event() {
        let mut st = StreamState::default();
        let mut out = Vec::new();
        st.feed(b"data: {not json\n\n", &mut out);
        assert!(matches!(&out[0], Event::Error(m) if m.contains("malformed")));
    }
}
