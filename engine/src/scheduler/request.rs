//! The scheduler's input: a request already tokenized, validated and,
//! where its output has a shape, given its grammar.

use crate::api::SamplingParams;
use crate::guide::Guide;

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
    /// Whose request it is: fair shares inside a lane go by tenant (None:
    /// the anonymous tenant).
    pub tenant: Option<crate::fair::Tenant>,
    /// The grammar its output must follow (structured outputs, tool calls).
    pub guide: Option<Guide>,
}
