//! The seam between the proxy and the engine: requests in, a stream of
//! events out. A request is already tokenized and validated; the engine
//! thread owns all scheduling state; dropping the event receiver cancels the
//! request and frees its KV blocks.

use crate::sampling::SamplingParams;
use std::time::Duration;

/// A validated generation request.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// Stop sequences (matched on text, not emitted).
    pub stop: Vec<String>,
    /// Lane rank: lower runs first and may preempt higher ranks.
    pub lane_rank: u32,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop sequence.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl FinishReason {
    /// The OpenAI spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
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
}
