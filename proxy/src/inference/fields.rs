//! Nothing silently ignored: every request field each dialect knows is
//! honoured, accepted and ignored for a stated reason, or refused with a
//! 400 that names it; a field no dialect knows is refused as OpenAI
//! refuses it ("Unrecognized request argument supplied"). The tables here
//! are what the README lists.

use super::openai::bad;
use serde_json::{Map, Value};
use ultrafast_engine::api::BackendError;

/// What a dialect does with one request field.
#[derive(Debug, Clone, Copy)]
pub enum Field {
    /// Read and acted on.
    Honoured,
    /// Accepted and ignored, for this reason.
    Ignored(&'static str),
    /// Refused (400 naming it) unless it asks for nothing (`null`,
    /// `false`, `0`, empty, or `["text"]` for `modalities`), for this
    /// reason.
    Refused(&'static str),
}

use Field::{Honoured, Ignored, Refused};

/// Reasons shared by the dialects' tables.
const ONE_TIER: Field = Ignored("one service tier here; lanes are chosen by `priority`");
const NO_CACHE_KEY: Field = Ignored("the prefix cache matches prompts without a key");
const USER_IS_TENANT: Field = Ignored("`user` names the tenant; no safety system reads it");
const TEXT_ONLY: Field = Refused("the models here produce text only");
const NOT_REASONING: Field = Refused("the models here are not reasoning models");

/// Fields of OpenAI's chat completions and completions (both parse the
/// same body shape; `messages` or `prompt` is required by each).
pub const OPENAI: &[(&str, Field)] = &[
    ("model", Honoured),
    ("messages", Honoured),
    ("prompt", Honoured),
    ("max_tokens", Honoured),
    ("max_completion_tokens", Honoured),
    ("temperature", Honoured),
    ("top_p", Honoured),
    ("top_k", Honoured),
    ("min_p", Honoured),
    ("frequency_penalty", Honoured),
    ("presence_penalty", Honoured),
    ("repetition_penalty", Honoured),
    ("logit_bias", Honoured),
    ("seed", Honoured),
    ("stop", Honoured),
    ("stream", Honoured),
    ("stream_options", Honoured),
    ("user", Honoured),
    ("n", Honoured),
    ("response_format", Honoured),
    ("tools", Honoured),
    ("tool_choice", Honoured),
    ("parallel_tool_calls", Honoured),
    ("priority", Honoured),
    ("background", Honoured),
    ("metadata", Honoured),
    (
        "store",
        Ignored("nothing is kept for OpenAI's evals or distillation"),
    ),
    ("service_tier", ONE_TIER),
    ("prompt_cache_key", NO_CACHE_KEY),
    ("safety_identifier", USER_IS_TENANT),
    ("logprobs", Honoured),
    ("top_logprobs", Honoured),
    ("echo", Honoured),
    ("best_of", Refused("best_of is not supported; use n = 1")),
    ("suffix", Refused("insertion (suffix) is not supported")),
    ("modalities", TEXT_ONLY),
    ("audio", TEXT_ONLY),
    ("prediction", Refused("predicted outputs are not supported")),
    ("web_search_options", Refused("there is no web search here")),
    ("reasoning_effort", NOT_REASONING),
    ("functions", Refused("deprecated by OpenAI: use `tools`")),
    (
        "function_call",
        Refused("deprecated by OpenAI: use `tool_choice`"),
    ),
];

/// Fields of Anthropic's Messages API.
pub const ANTHROPIC: &[(&str, Field)] = &[
    ("model", Honoured),
    ("messages", Honoured),
    ("max_tokens", Honoured),
    ("system", Honoured),
    ("stop_sequences", Honoured),
    ("stream", Honoured),
    ("temperature", Honoured),
    ("top_p", Honoured),
    ("top_k", Honoured),
    ("tools", Honoured),
    ("tool_choice", Honoured),
    ("metadata", Honoured),
    ("priority", Honoured),
    ("service_tier", ONE_TIER),
    (
        "thinking",
        Refused("the models here have no extended thinking"),
    ),
    ("mcp_servers", Refused("there are no MCP connectors here")),
    (
        "container",
        Refused("there is no code execution container here"),
    ),
];

/// Fields of OpenAI's Responses API.
pub const RESPONSES: &[(&str, Field)] = &[
    ("model", Honoured),
    ("input", Honoured),
    ("instructions", Honoured),
    ("max_output_tokens", Honoured),
    ("temperature", Honoured),
    ("top_p", Honoured),
    ("text", Honoured),
    ("tools", Honoured),
    ("tool_choice", Honoured),
    ("parallel_tool_calls", Honoured),
    ("store", Honoured),
    ("previous_response_id", Honoured),
    ("metadata", Honoured),
    ("stream", Honoured),
    ("background", Honoured),
    ("user", Honoured),
    ("priority", Honoured),
    ("service_tier", ONE_TIER),
    (
        "truncation",
        Ignored("inputs are never truncated: one that does not fit is refused"),
    ),
    ("prompt_cache_key", NO_CACHE_KEY),
    ("safety_identifier", USER_IS_TENANT),
    ("reasoning", NOT_REASONING),
    // Only `message.output_text.logprobs` (the parser refuses the rest).
    ("include", Honoured),
    ("top_logprobs", Honoured),
    (
        "prompt",
        Refused("stored prompt templates are not supported"),
    ),
    (
        "conversation",
        Refused("conversations are continued with previous_response_id"),
    ),
    ("max_tool_calls", Refused("tool calls are not bounded here")),
];

/// OpenAI fields of chat completions only, and of completions only: a
/// body for the other endpoint that names them is refused as OpenAI does.
const CHAT_ONLY: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "top_logprobs",
    "modalities",
    "audio",
    "prediction",
    "web_search_options",
    "reasoning_effort",
    "functions",
    "function_call",
    "store",
    "prompt_cache_key",
    "safety_identifier",
];
const COMPLETIONS_ONLY: &[&str] = &["prompt", "echo", "best_of", "suffix"];

/// [`check`] against [`OPENAI`] for chat completions (`chat`) or
/// completions.
pub fn check_openai(o: &Map<String, Value>, chat: bool) -> Result<(), BackendError> {
    let other = if chat { COMPLETIONS_ONLY } else { CHAT_ONLY };
    if let Some(k) = o.keys().find(|k| other.contains(&k.as_str())) {
        return Err(unrecognized(k));
    }
    check(o, OPENAI)
}

fn unrecognized(k: &str) -> BackendError {
    let shown: String = k.chars().take(64).collect();
    BackendError::invalid(
        "invalid_request_error",
        None,
        format!("Unrecognized request argument supplied: {shown}"),
    )
}

/// Whether a refused field's value asks for nothing.
fn asks_nothing(name: &str, v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => true,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty() || (name == "modalities" && a.iter().all(|m| m == "text")),
        Value::Object(o) => o.is_empty(),
        Value::Bool(true) => false,
    }
}

/// Refuse what `table` refuses and what it does not know.
pub fn check(o: &Map<String, Value>, table: &[(&'static str, Field)]) -> Result<(), BackendError> {
    for (k, v) in o {
        match table.iter().find(|(n, _)| n == k) {
            Some((_, Honoured | Ignored(_))) => {}
            Some((name, Refused(why))) => {
                if !asks_nothing(name, v) {
                    return Err(bad(name, format!("'{name}' is not supported: {why}.")));
                }
            }
            None => return Err(unrecognized(k)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(s: &str) -> Map<String, Value> {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn known_fields_pass_refused_ones_are_named_and_unknown_ones_refused() {
        assert!(check(
            &obj(r#"{"model":"m","store":true,"logprobs":false,"modalities":["text"]}"#),
            OPENAI
        )
        .is_ok());
        assert!(check(&obj(r#"{"logprobs":true,"top_logprobs":2}"#), OPENAI).is_ok());
        let e = check(&obj(r#"{"modalities":["text","audio"]}"#), OPENAI).unwrap_err();
        assert_eq!(e.param, Some("modalities"));
        let e = check(&obj(r#"{"unknown_field":1}"#), OPENAI).unwrap_err();
        assert_eq!((e.status, e.param), (400, None));
        assert!(e.message.contains("unknown_field"));
        assert_eq!(
            check(&obj(r#"{"thinking":{"type":"enabled"}}"#), ANTHROPIC)
                .unwrap_err()
                .param,
            Some("thinking")
        );
        assert_eq!(
            check(&obj(r#"{"reasoning":{"effort":"high"}}"#), RESPONSES)
                .unwrap_err()
                .param,
            Some("reasoning")
        );
        assert!(check(&obj(r#"{"truncation":"auto","include":[]}"#), RESPONSES).is_ok());
        // Each OpenAI endpoint refuses the other's fields.
        assert!(check_openai(&obj(r#"{"prompt":"x"}"#), true).is_err());
        assert!(check_openai(&obj(r#"{"messages":[]}"#), false).is_err());
        assert!(check_openai(&obj(r#"{"tools":[]}"#), false).is_err());
        assert!(check_openai(&obj(r#"{"echo":false}"#), false).is_ok());
    }
}
