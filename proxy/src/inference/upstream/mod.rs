//! Upstream inference pools: OpenAI-compatible servers (vLLM, TGI, SGLang,
//! Ollama, llama.cpp) behind the same backend seam as the engine.
//!
//! Reuses the core's pools (members, health, ejection, TLS; new
//! connections through Pingora's connector, idle HTTP/1 ones kept in
//! `idle` without a watcher task). Adds: least-outstanding or
//! prefix-affinity choice (consistent hash with bounded load on the
//! conversation prefix), retry to another member only until the first
//! token (never after one reached the client), the lane passed on as
//! vLLM's `priority`, and parsing of the
//! upstream's SSE so tokens are counted and timed here. The upstream is
//! always asked to stream, even for a non-streaming client, so time to first
//! token is known and a stall is noticed.
//!
//! Two things keep one bad member from reaching the client: first-token
//! hedging (`open`: a request without a first token after the hedge delay
//! is also sent to a second member, the first to produce a token wins and
//! the other's connection is closed) and mid-stream failover (`relay`: a
//! stream that breaks after tokens were sent continues on another member,
//! as a continuation of the text delivered so far).

mod body;
mod idle;
mod open;
mod relay;
mod stream;

use super::fleet::{Aligned, Fleet, Policy};
use crate::upstream::lb::{hash_bytes, Balancer};
use crate::upstream::retry_budget::RetryBudget;
use crate::upstream::{LbSpec, Membership, Pool};
use bytes::Bytes;
use parking_lot::Mutex;
use pingora::connectors::http::Connector;
use prometheus::IntCounter;
use serde_json::Value;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use ultrafast_engine::api::{
    Backend, BackendError, EventStream, InferenceRequest, Prepared, Prompt, Readiness,
};

/// Which priority field the upstream understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PriorityField {
    /// None: the lane stays at the edge.
    None,
    /// vLLM's `priority` (lower runs first): the lane's rank.
    Vllm,
}

/// When a request without a first token is also sent to a second member.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HedgeAfter {
    /// A fixed delay.
    Fixed(Duration),
    /// This quantile (0..1) of the model's recent times to first token.
    Quantile(f64),
}

/// First-token hedging of an upstream model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HedgeSpec {
    /// The delay before the hedge.
    pub after: HedgeAfter,
    /// Hedges at most this fraction of requests over a sliding window.
    pub max_ratio: f64,
}

/// Counters of one upstream model (hedges, failovers).
#[derive(Debug, Clone)]
pub struct Counters {
    /// Hedged requests sent.
    pub hedges_sent: IntCounter,
    /// Hedged requests that produced the first token first.
    pub hedges_won: IntCounter,
    /// Streams continued on another member after a break.
    pub failovers: IntCounter,
    /// Breaks that could not be continued.
    pub failovers_failed: IntCounter,
}

impl Default for Counters {
    /// Unregistered counters (tests).
    fn default() -> Self {
        let c = |n: &str| {
            #[allow(clippy::expect_used)]
            IntCounter::new(n, n).expect("static counter")
        };
        Counters {
            hedges_sent: c("hedges_sent"),
            hedges_won: c("hedges_won"),
            failovers: c("failovers"),
            failovers_failed: c("failovers_failed"),
        }
    }
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
    /// Members tried before the first token; also the most failovers of
    /// one stream.
    pub attempts: u32,
    /// Longest silence before the first token or between tokens.
    pub stall: Duration,
    /// First-token hedging, if on.
    pub hedge: Option<HedgeSpec>,
    /// Whether a chat stream may be continued on another member (the pool
    /// speaks vLLM's `continue_final_message`); a text completion always
    /// may.
    pub resume_chat: bool,
    /// The model's context length, when known: requests that cannot fit
    /// are refused here (None: the server decides).
    pub max_model_len: Option<usize>,
    /// Counters.
    pub counters: Counters,
    /// The fleet's per-member models, when the pool places by predicted
    /// latency or by llm-d's scores (`lb = "predicted_latency"` or
    /// `"load_prefix"`).
    pub fleet: Option<Arc<Fleet>>,
}

/// The balancer built for one member set.
type Ring = (Arc<Membership>, Arc<Balancer>);

/// An upstream-served model.
#[derive(Clone)]
pub struct UpstreamBackend {
    spec: Arc<UpstreamSpec>,
    ring: Arc<Mutex<Option<Ring>>>,
    /// Recent times to first token (for a quantile hedge delay).
    ttfts: Arc<Mutex<open::Recent>>,
    /// The hedges' own budget (`max_ratio` of requests).
    hedges: Arc<RetryBudget>,
    /// Idle HTTP/1 connections to the members.
    idle: Arc<idle::Idle>,
    /// The fleet's replicas for the member set last seen.
    aligned: Arc<Mutex<Option<(Arc<Membership>, Arc<Aligned>)>>>,
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

impl UpstreamBackend {
    /// A backend over `spec.pool`.
    pub fn new(spec: UpstreamSpec) -> Self {
        let ratio = spec.hedge.map_or(0.0, |h| h.max_ratio);
        UpstreamBackend {
            spec: Arc::new(spec),
            ring: Arc::new(Mutex::new(None)),
            ttfts: Arc::new(Mutex::new(open::Recent::default())),
            hedges: Arc::new(RetryBudget::new(ratio, 0)),
            idle: Arc::default(),
            aligned: Arc::default(),
        }
    }

    /// The fleet's replicas aligned with the pool's members now (None:
    /// the pool is not a fleet), with the membership they are for.
    pub fn fleet_now(&self) -> Option<(Arc<Fleet>, Arc<Membership>, Arc<Aligned>)> {
        let fleet = self.spec.fleet.clone()?;
        let m = self.spec.pool.members();
        let mut g = self.aligned.lock();
        if let Some((mm, a)) = &*g {
            if Arc::ptr_eq(mm, &m) {
                return Some((fleet, m, a.clone()));
            }
        }
        let addrs: Vec<std::net::SocketAddr> = m.members.iter().map(|x| x.addr).collect();
        let a = fleet.align(&addrs);
        *g = Some((m.clone(), a.clone()));
        Some((fleet, m, a))
    }

    /// How old the members' scraped figures may be (None: not read).
    pub fn stale_ms(&self) -> Option<u64> {
        self.spec.pool.lb.scrape().map(|s| s.stale_ms())
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
            // A pool that reads its members' own queues balances by them.
            None if matches!(self.spec.pool.lb, LbSpec::QueueAware(_)) => self.spec.pool.lb.clone(),
            None => LbSpec::LeastOutstanding,
        };
        let b = Arc::new(spec.build(&m.members));
        *g = Some((m.clone(), b.clone()));
        b
    }

    /// `max_tokens` within the model's context when it is known
    /// (`max_model_len`), so a request that cannot fit gets OpenAI's
    /// `context_length_exceeded` here instead of whatever the server does
    /// (some close the stream). The prompt's size is an estimate, so only
    /// a prompt that alone fills the context is refused for its length.
    fn fit(&self, req: &InferenceRequest, prompt: usize) -> Result<usize, BackendError> {
        let Some(ctx) = self.spec.max_model_len else {
            return Ok(req.max_tokens.unwrap_or(256));
        };
        let param = req.prompt.param();
        if prompt >= ctx {
            return Err(BackendError::invalid(
                "context_length_exceeded",
                Some(param),
                format!("This model's maximum context length is {ctx} tokens. However, your prompt has about {prompt} tokens."),
            ));
        }
        match req.max_tokens {
            Some(m) if m >= ctx => Err(BackendError::invalid(
                "context_length_exceeded",
                Some("max_tokens"),
                format!("This model's maximum context length is {ctx} tokens. However, you requested {m} tokens for the completion alone."),
            )),
            Some(m) => Ok(m),
            None => Ok(256.min(ctx - prompt)),
        }
    }

    /// Whether a stream of `req` that broke can continue elsewhere.
    fn resumable(&self, req: &InferenceRequest) -> bool {
        match req.prompt {
            Prompt::Text(_) | Prompt::Tokens(_) => true,
            Prompt::Chat(_) => self.spec.resume_chat,
        }
    }

    /// The upstream request: the client's, or (with `resume`) its
    /// continuation after `resume.0` was delivered as `resume.1` tokens.
    fn body(
        &self,
        req: &InferenceRequest,
        prepared: &Prepared,
        resume: Option<(&str, usize)>,
    ) -> (&'static str, Bytes) {
        use body::{Concat, IncludeUsage, Messages, UpstreamBody};
        let (sent, done) = resume.unwrap_or(("", 0));
        let (path, messages, prompt) = match &req.prompt {
            Prompt::Chat(m) => {
                let m = Messages {
                    messages: m,
                    resumed: resume.map(|_| sent),
                };
                ("/v1/chat/completions", Some(m), None)
            }
            Prompt::Text(t) => ("/v1/completions", None, Some(Concat(t, sent))),
            // Refused by `prepare`.
            Prompt::Tokens(_) => ("/v1/completions", None, Some(Concat("", sent))),
        };
        let chat = messages.is_some();
        // vLLM continues the final (assistant) message of a resumed chat
        // instead of opening a new turn.
        let resumed_chat = resume.is_some() && chat;
        // Only what this kind of server accepts (see `upstream::dialect`).
        let caps = self.spec.pool.settings.server_kind.caps();
        let s = &req.sampling;
        let b = UpstreamBody {
            model: &self.spec.upstream_model,
            continue_final_message: resumed_chat.then_some(true),
            add_generation_prompt: resumed_chat.then_some(false),
            messages,
            prompt,
            // Always the size admission reserved (less what was delivered):
            // an upstream left to its own default could generate far more.
            max_tokens: prepared.max_tokens.saturating_sub(done).max(1),
            temperature: f64::from(s.temperature),
            top_p: f64::from(s.top_p),
            top_k: (s.top_k > 0 && caps.top_k).then_some(s.top_k),
            seed: s.seed.filter(|_| caps.seed),
            frequency_penalty: (s.frequency_penalty != 0.0).then_some(s.frequency_penalty),
            presence_penalty: (s.presence_penalty != 0.0).then_some(s.presence_penalty),
            // `prepare` refused these for servers that do not take them.
            repetition_penalty: (s.repetition_penalty != 1.0).then_some(s.repetition_penalty),
            min_p: (s.min_p > 0.0).then_some(s.min_p),
            logit_bias: &s.logit_bias,
            // The dialect's own shape: the relay reads either back.
            logprobs: s.logprobs.map(|k| match chat {
                true => Value::Bool(true),
                false => Value::from(k),
            }),
            top_logprobs: s.logprobs.filter(|k| chat && *k > 0),
            stop: &req.stop,
            user: req.user.as_deref(),
            priority: (self.spec.priority == PriorityField::Vllm && caps.priority)
                .then_some(req.lane_rank),
            passthrough: &req.passthrough,
            stream: true,
            stream_options: caps.stream_options.then_some(IncludeUsage {
                include_usage: true,
            }),
        };
        // Serializing borrowed strings, numbers and `Value`s cannot fail.
        let json = serde_json::to_vec(&b).unwrap_or_default();
        (path, Bytes::from(json))
    }
}

impl UpstreamBackend {
    /// Where a new request goes first: the member the fleet placed it on,
    /// or (`load_prefix`) the one llm-d's scores pick; else the balancer's.
    fn first_choice(&self, req: &InferenceRequest, prepared: &Prepared) -> open::First {
        if let Some(a) = prepared.member {
            return open::First::Member(a);
        }
        match &self.spec.fleet {
            Some(f) if f.spec().policy == Policy::LoadPrefix => open::First::Scored(
                super::fleet::prompt_blocks(&req.prompt, f.spec().block_tokens),
            ),
            _ => open::First::Balancer,
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

    fn prompt_bound(&self) -> Option<ultrafast_engine::api::PromptBound> {
        // The context when configured; the server's vocabulary is unknown,
        // so no byte count proves a prompt too long here.
        self.spec
            .max_model_len
            .map(|context| ultrafast_engine::api::PromptBound {
                context,
                max_token_bytes: None,
            })
    }

    fn prepare(&self, req: &InferenceRequest) -> Result<Prepared, BackendError> {
        // The relay reads one choice's text and scores: an echoed prompt
        // would read as output (and break a resumed stream's count), and
        // token ids mean nothing to another server's tokenizer, so these
        // are refused by name rather than answered wrongly.
        let refused = match (&req.prompt, &req.sampling) {
            (Prompt::Tokens(_), _) => Some(("prompt", "token-id prompts")),
            (_, s) if s.echo => Some(("echo", "echo")),
            _ if req.n > 1 => Some(("n", "several choices")),
            _ => None,
        };
        if let Some((field, what)) = refused {
            return Err(BackendError::invalid(
                "invalid_request_error",
                Some(field),
                format!(
                    "{what} are served by models the engine hosts; model `{}` is an upstream's.",
                    req.model
                ),
            ));
        }
        // What this kind of server would not take is refused, not dropped.
        let (s, kind) = (&req.sampling, self.spec.pool.settings.server_kind);
        if let Some(field) = kind.refused_sampling(s.min_p, s.repetition_penalty).next() {
            return Err(BackendError::invalid(
                "invalid_request_error",
                Some(field),
                format!(
                    "'{field}' is not supported by model `{}`'s upstream (pool dialect `{}`).",
                    req.model,
                    kind.name()
                ),
            ));
        }
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
            // Refused above.
            Prompt::Tokens(_) => (0, 0),
        };
        let prompt_tokens = chars.div_ceil(4).max(1);
        Ok(Prepared {
            prompt_tokens,
            max_tokens: self.fit(req, prompt_tokens)?,
            tokens: Vec::new(),
            prefix_hash: prefix,
            guide: None,
            member: None,
        })
    }

    async fn generate(
        &self,
        req: InferenceRequest,
        prepared: Prepared,
    ) -> Result<EventStream, BackendError> {
        self.spec.pool.record_request();
        self.hedges.deposit();
        let (path, body) = self.body(&req, &prepared, None);
        let opened = self
            .first_token(
                path,
                &body,
                open::Ids::of(&req),
                prepared.prefix_hash,
                &[],
                true,
                self.first_choice(&req, &prepared),
            )
            .await?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let work = crate::drain::Work::start(crate::drain::Kind::UpstreamStream);
        let mut opened = opened;
        let keep_raw = req.raw_sse.is_some() && self.spec.attempts > 0 && self.resumable(&req);
        let sent = relay::send_leading(&mut opened, &tx, keep_raw);
        // Boxed where it is made: spawned inline, its state (some 12 KB) was
        // copied five times on the way into the task and twice more as the
        // task ended, a fifth of a streamed request's instructions.
        let relay = Box::pin(self.clone().relay(opened, req, prepared, tx, sent));
        tokio::spawn(async move {
            let _work = work;
            relay.await
        });
        Ok(rx)
    }
}
