//! The seam between the proxy and the engine: requests in, a stream of
//! events out. A request is already tokenized and validated; the engine
//! thread owns all scheduling state; dropping the event receiver cancels the
//! request and frees its KV blocks.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

/// Opens one tool call in the model's output (the wire format the
/// engine's grammar and the front's tool-call reader share).
pub const CALL_OPEN: &str = "<tool_call>";
/// Closes one tool call.
pub const CALL_CLOSE: &str = "</tool_call>";

/// What a backend compiled for one request's output (the engine's grammar
/// state): opaque to the front, which only hands it back, inside
/// [`Prepared`], to the backend that made it.
#[derive(Clone)]
pub struct Compiled(Arc<dyn Any + Send + Sync>);

impl Compiled {
    /// Wrap a backend's compiled value.
    pub fn new<T: Any + Send + Sync>(value: T) -> Self {
        Compiled(Arc::new(value))
    }

    /// The value, if it is a `T`: taken whole where this is its only
    /// holder, cloned where a copy of the `Prepared` still holds it.
    pub fn take<T: Any + Send + Sync + Clone>(self) -> Option<T> {
        let v = self.0.downcast::<T>().ok()?;
        Some(Arc::try_unwrap(v).unwrap_or_else(|v| (*v).clone()))
    }
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Compiled")
    }
}

/// What a request's output must be, as every API dialect asks for it (the
/// front translates `response_format`, `tools` and their Anthropic and
/// Responses spellings into this one form).
#[derive(Debug, Clone, PartialEq)]
pub enum Structure {
    /// JSON that validates against this schema (`{"type": "object"}` for
    /// OpenAI's `json_object`).
    Json(serde_json::Value),
    /// Calls of these tools, as `tool_choice` says.
    Tools {
        /// The callable functions.
        tools: Vec<Tool>,
        /// Whether and which to call.
        choice: ToolChoice,
        /// Whether more than one call may be made in one answer.
        parallel: bool,
    },
}

/// A function the model may call.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Tool {
    /// Its name.
    pub name: String,
    /// What it does (shown to the model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON schema of its arguments (an object).
    pub parameters: serde_json::Value,
}

/// OpenAI's `tool_choice` (`none` is no structure at all).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Text or calls, as the model chooses.
    Auto,
    /// At least one call.
    Required,
    /// Exactly one call of this function.
    Named(String),
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop sequence.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The answer is tool calls.
    ToolCalls,
    /// This stop sequence (its index among the request's non-empty stop
    /// strings) ended it; OpenAI says `stop`, Anthropic names it.
    StopSequence(usize),
}

impl FinishReason {
    /// The OpenAI spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop | FinishReason::StopSequence(_) => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

/// What the engine reports for a request, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// One generated token and the text it completes (may be empty while a
    /// character or a possible stop sequence is incomplete).
    Token {
        /// Token id.
        id: u32,
        /// Text to send.
        text: String,
    },
    /// The end: trailing text, why, counts, and where the time went.
    Done {
        /// Text held back until the end.
        text: String,
        /// Why it ended.
        finish: FinishReason,
        /// Counts.
        usage: Usage,
        /// Time from submission to the first scheduled step.
        queue: Duration,
        /// Time spent in steps that included this request.
        compute: Duration,
    },
    /// The request failed (it can never fit, or the model failed).
    Error(String),
    /// The prompt's tokens, scored when asked (`echo`); before any
    /// [`Event::Token`].
    Prompt(Vec<TokenLogprob>),
    /// The log-probabilities of the [`Event::Token`] that follows
    /// (`logprobs`).
    Logprob(Box<TokenLogprob>),
    /// An event of choice `.0` of a request for several (`n` > 1: every
    /// event of such a request comes wrapped, each choice ending with its
    /// own [`Event::Done`]).
    Indexed(u32, Box<Event>),
    /// An upstream's SSE events, to go to the client as they are (the
    /// pass-through of `InferenceRequest::raw_sse`): whole `data:` events,
    /// ending in a blank line. The engine never sends these.
    Raw {
        /// The events' bytes.
        sse: String,
        /// Tokens they carry.
        tokens: usize,
        /// These are the stream's last events, from its finish chunk on:
        /// the consumer writes them at the end, the finish chunk with its
        /// own timing added.
        end: bool,
    },
}

/// What a client of the SSE pass-through takes as it is from an upstream
/// server: its events, and (when it asked for it) its usage chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawSse {
    /// The client asked for the usage chunk (`stream_options`).
    pub usage: bool,
}

/// A prompt before tokenization.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Chat messages, rendered with the model's template.
    Chat(Vec<ChatMessage>),
    /// Raw text (completions).
    Text(String),
    /// Token ids (completions' `prompt` as an array of integers).
    Tokens(Vec<u32>),
}

impl Prompt {
    /// The request field it came in (`messages` or `prompt`), for errors.
    pub fn param(&self) -> &'static str {
        match self {
            Prompt::Chat(_) => "messages",
            Prompt::Text(_) | Prompt::Tokens(_) => "prompt",
        }
    }

    /// Bytes of its text: the messages' contents, or the prompt.
    pub fn text_bytes(&self) -> usize {
        match self {
            Prompt::Chat(m) => m.iter().map(|m| m.content.len()).sum(),
            Prompt::Text(t) => t.len(),
            // What they would take as text, at the bound a token has.
            Prompt::Tokens(t) => t.len() * 4,
        }
    }
}

/// A validated inference request as the front hands it to a backend.
#[derive(Debug, Clone)]
pub struct InferenceRequest {
    /// Model name the client asked for.
    pub model: String,
    /// What to continue.
    pub prompt: Prompt,
    /// Most tokens to generate (None: as many as fit).
    pub max_tokens: Option<usize>,
    /// Choices to generate from the one prompt (1 to [`MAX_CHOICES`]).
    pub n: usize,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// Stop sequences.
    pub stop: Vec<String>,
    /// Lane name (`ultra`, `standard`, ...).
    pub lane: String,
    /// Lane rank: lower is more urgent.
    pub lane_rank: u32,
    /// The tenant it is served for (fair shares inside its lane).
    pub tenant: Option<crate::fair::Tenant>,
    /// Request id, passed on to upstreams.
    pub request_id: String,
    /// W3C `traceparent` to send an upstream server (its parent span).
    pub traceparent: Option<String>,
    /// End-user id (OpenAI's `user`), passed on.
    pub user: Option<String>,
    /// What the output must be (the engine enforces it while decoding).
    pub structure: Option<Structure>,
    /// The client's own fields for an upstream server (`response_format`,
    /// `tools`, `tool_choice`, ...), sent to it unchanged.
    pub passthrough: serde_json::Map<String, serde_json::Value>,
    /// Set when the client takes an upstream server's SSE events as they
    /// are (nothing to pace or rewrite): an upstream backend then sends
    /// `Event::Raw`; the engine ignores it.
    pub raw_sse: Option<RawSse>,
}

/// What a backend learned while preparing a request: its size (for
/// admission) and backend-private data needed to run it.
#[derive(Debug, Clone, Default)]
pub struct Prepared {
    /// Prompt tokens (exact for the engine, estimated for upstreams).
    pub prompt_tokens: usize,
    /// Tokens the request may generate.
    pub max_tokens: usize,
    /// Token ids (engine only).
    pub tokens: Vec<u32>,
    /// Hash of the conversation prefix (for prefix affinity).
    pub prefix_hash: u64,
    /// The compiled grammar of the output (engine only; opaque here).
    pub guide: Option<Compiled>,
    /// The member of an upstream pool the edge placed the request on
    /// (a fleet routed on predicted latency); tried first.
    pub member: Option<std::net::SocketAddr>,
}

/// A request a backend cannot take, in OpenAI's error vocabulary.
#[derive(Debug, Clone, PartialEq)]
pub struct BackendError {
    /// HTTP status.
    pub status: u16,
    /// OpenAI error `type`.
    pub kind: &'static str,
    /// OpenAI error `code`.
    pub code: &'static str,
    /// The request field at fault.
    pub param: Option<&'static str>,
    /// Human-readable reason.
    pub message: String,
}

impl BackendError {
    /// A 400 about one field.
    pub fn invalid(code: &'static str, param: Option<&'static str>, message: String) -> Self {
        BackendError {
            status: 400,
            kind: "invalid_request_error",
            code,
            param,
            message,
        }
    }

    /// An error of the request as a whole (no single field at fault).
    pub fn request(status: u16, code: &'static str, message: String) -> Self {
        BackendError {
            status,
            kind: if status >= 500 {
                "server_error"
            } else {
                "invalid_request_error"
            },
            code,
            param: None,
            message,
        }
    }

    /// A 503: the backend cannot serve now.
    pub fn unavailable(message: String) -> Self {
        BackendError {
            status: 503,
            kind: "server_error",
            code: "backend_unavailable",
            param: None,
            message,
        }
    }
}

/// Whether a backend can take requests, and if not why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// Serving.
    Ready,
    /// Starting (fetching, loading, warming up): the phase.
    Starting(String),
    /// Failed for good: the reason (names the file and the problem).
    Failed(String),
}

/// What a backend knows of a prompt's size before tokenizing it, so that
/// a prompt whose byte count alone proves it cannot fit is refused before
/// any work grows with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptBound {
    /// The model's context in tokens.
    pub context: usize,
    /// The most bytes of text one token covers (the longest token of the
    /// vocabulary), when the vocabulary is known: a prompt of `n` bytes is
    /// then at least `n / max_token_bytes` tokens.
    pub max_token_bytes: Option<usize>,
}

/// The events of one running request. Dropping it cancels the work.
pub type EventStream = tokio::sync::mpsc::UnboundedReceiver<Event>;

/// The seam between the inference front and whatever generates tokens: the
/// in-process engine or a pool of OpenAI-compatible upstream servers. Both
/// get the same lanes, pacing, async mode and metrics from the front.
#[async_trait::async_trait]
pub trait Backend: Send + Sync {
    /// `engine` or `upstream`, for metrics labels.
    fn kind(&self) -> &'static str;
    /// Whether it can serve now.
    fn readiness(&self) -> Readiness;
    /// Where it computes once serving: the in-process engine's device and
    /// runner (`cpu`, `cpu/avx2 x2 kv F16`); `None` for upstream pools.
    fn device(&self) -> Option<(String, String)> {
        None
    }
    /// Tokenize (or estimate) and check that the request can ever fit.
    fn prepare(&self, req: &InferenceRequest) -> Result<Prepared, BackendError>;
    /// What bounds a prompt's token count before it is tokenized (None:
    /// nothing known, e.g. before the model is loaded).
    fn prompt_bound(&self) -> Option<PromptBound> {
        None
    }
    /// The backend's own measured step cost, if it measures one (the
    /// engine does; upstreams are modelled by the front from their streams).
    fn step_cost(&self) -> Option<StepCost> {
        None
    }
    /// Start generating. Events arrive in order and end with `Done` or
    /// `Error`; dropping the stream cancels the request.
    async fn generate(
        &self,
        req: InferenceRequest,
        prepared: Prepared,
    ) -> Result<EventStream, BackendError>;
}

// The seam's plain data, used on both sides of it: how to sample, a chat
// message, the step-cost estimate. (Their old paths re-export them.)

/// How to pick tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p (1.0 = off).
    pub top_p: f32,
    /// Seed of the generator (None: a fresh one per request).
    pub seed: Option<u64>,
    /// Subtracted from a token's logit once per time it was generated
    /// (OpenAI's `frequency_penalty`, -2 to 2; 0 = off).
    pub frequency_penalty: f32,
    /// Subtracted once from the logit of every token generated so far
    /// (OpenAI's `presence_penalty`, -2 to 2; 0 = off).
    pub presence_penalty: f32,
    /// vLLM's `repetition_penalty`: the logits of tokens in the prompt or
    /// the output are divided by it where positive and multiplied by it
    /// where negative (1 = off).
    pub repetition_penalty: f32,
    /// Drop tokens less likely than `min_p` times the likeliest, after
    /// temperature (0 = off).
    pub min_p: f32,
    /// Added to the logits of these tokens (OpenAI's `logit_bias`, -100
    /// to 100 each).
    pub logit_bias: Vec<(u32, f32)>,
    /// Report each generated token's log-probability and this many of the
    /// likeliest alternatives (at most [`MAX_LOGPROBS`]; None: nothing).
    pub logprobs: Option<usize>,
    /// Report the prompt's tokens ([`Event::Prompt`]: OpenAI's `echo`).
    pub echo: bool,
    /// With `echo`: score the prompt too, each token's log-probability and
    /// this many alternatives (every position's logits are computed, and
    /// the prefix cache is not used for this prompt).
    pub prompt_logprobs: Option<usize>,
}

/// Most choices one request may ask for (`n`).
pub const MAX_CHOICES: usize = 8;

/// Most alternatives a token's report may list (OpenAI's `top_logprobs`
/// bound).
pub const MAX_LOGPROBS: usize = 20;

/// One token as a report lists it: its id and bytes (a token may end
/// inside a character), and its log-probability under the distribution
/// the model produced, before temperature, penalties, bias or a grammar
/// mask (as OpenAI and vLLM report by default).
#[derive(Debug, Clone, PartialEq)]
pub struct Alt {
    /// Token id.
    pub id: u32,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// Natural log of its probability.
    pub logprob: f32,
}

/// A reported token: itself (its log-probability is None for the first
/// prompt token, which nothing predicts) and the likeliest alternatives
/// at its position, likeliest first.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// Token id.
    pub id: u32,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// Natural log of its probability (None: not scored).
    pub logprob: Option<f32>,
    /// The likeliest tokens at its position.
    pub top: Vec<Alt>,
}

impl SamplingParams {
    /// Whether the logits are changed before sampling (penalties, bias,
    /// `min_p`): such a sequence needs its whole row of logits.
    pub fn adjusts_logits(&self) -> bool {
        self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
            || self.repetition_penalty != 1.0
            || self.min_p > 0.0
            || !self.logit_bias.is_empty()
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repetition_penalty: 1.0,
            min_p: 0.0,
            logit_bias: Vec::new(),
            logprobs: None,
            echo: false,
            prompt_logprobs: None,
        }
    }
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Text.
    pub content: String,
    /// An assistant turn's tool calls, in OpenAI's shape (sent to upstream
    /// servers as they are; rendered as `<tool_call>` blocks for the engine).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// The call a `tool` message answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message of plain text.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            ..Default::default()
        }
    }

    /// The text the model sees: the content, then each tool call as a
    /// `<tool_call>` block (the format the engine's grammar produces).
    pub fn model_text(&self) -> String {
        let Some(calls) = self.tool_calls.as_ref().and_then(|c| c.as_array()) else {
            return self.content.clone();
        };
        let mut s = self.content.clone();
        for c in calls {
            let f = &c["function"];
            // OpenAI sends arguments as a JSON string; the model saw an object.
            let args = match &f["arguments"] {
                serde_json::Value::String(a) => {
                    serde_json::from_str(a).unwrap_or(serde_json::Value::String(a.clone()))
                }
                other => other.clone(),
            };
            let call = serde_json::json!({"name": f["name"], "arguments": args});
            if !s.is_empty() {
                s.push('\n');
            }
            s.push_str(CALL_OPEN);
            s.push_str(&call.to_string());
            s.push_str(CALL_CLOSE);
        }
        s
    }
}

/// The engine's estimate of its step duration: a step of `decodes`
/// decoding sequences and `prompt_tokens` prompt tokens (chunks of prompts,
/// or of recomputed sequences) takes about `fixed_s + per_decode_s *
/// decodes + per_prompt_token_s * prompt_tokens` seconds on this machine,
/// now.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepCost {
    /// Seconds a step costs whatever its size (dispatch, synchronisation).
    pub fixed_s: f64,
    /// Seconds each decoding sequence adds (one token, its logits, its
    /// attention over its context).
    pub per_decode_s: f64,
    /// Seconds each prompt token adds.
    pub per_prompt_token_s: f64,
    /// Steps the estimate has seen (0: no estimate yet, all are 0).
    pub samples: u64,
}

impl StepCost {
    /// Predicted duration of a step of `decodes` decoding sequences and
    /// `prompt_tokens` prompt tokens.
    pub fn predict(&self, decodes: usize, prompt_tokens: usize) -> Duration {
        let s = self.fixed_s
            + self.per_decode_s * decodes as f64
            + self.per_prompt_token_s * prompt_tokens as f64;
        Duration::from_secs_f64(s.max(0.0))
    }
}
