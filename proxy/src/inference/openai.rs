//! OpenAI request parsing and response shapes.
//!
//! Parsing walks a `serde_json::Value` instead of deriving, so a wrong type
//! is a 400 that names the field (as OpenAI does); what each field gets
//! (honoured, ignored for a reason, refused) is `fields`' table, and an
//! unknown field is refused as OpenAI refuses it.

use super::shape::{Collected, Piece};
use serde_json::{json, Map, Value};
use ultrafast_engine::api::{
    BackendError, FinishReason, Prompt, Structure, Tool, ToolChoice, Usage, MAX_CHOICES,
};
use ultrafast_engine::sampling::SamplingParams;
use ultrafast_engine::tokenizer::ChatMessage;

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
}

/// A parsed, type-checked request.
#[derive(Debug, Clone)]
pub struct Parsed {
    /// Endpoint.
    pub endpoint: Endpoint,
    /// Model name.
    pub model: String,
    /// Prompt.
    pub prompt: Prompt,
    /// `max_completion_tokens` or `max_tokens`.
    pub max_tokens: Option<usize>,
    /// Choices asked for (`n`, 1 to 8).
    pub n: usize,
    /// Sampling.
    pub sampling: SamplingParams,
    /// Stop sequences.
    pub stop: Vec<String>,
    /// Stream the answer as SSE.
    pub stream: bool,
    /// Send a usage chunk at the end of a stream.
    pub include_usage: bool,
    /// End-user id.
    pub user: Option<String>,
    /// Async mode asked in the body.
    pub background: bool,
    /// Lane asked in the body.
    pub priority: Option<String>,
    /// What the output must be (`response_format`, `tools`).
    pub structure: Option<Structure>,
    /// The client's structured-output fields as sent, for upstream servers.
    pub passthrough: Map<String, Value>,
    /// The API it came in, which shapes the answer.
    pub dialect: super::request::Dialect,
    /// The sampling fields it set (the others take the model's defaults).
    pub given: super::request::Given,
}

impl Parsed {
    /// Whether the output is read for tool calls.
    pub fn tools(&self) -> bool {
        matches!(self.structure, Some(Structure::Tools { .. }))
    }
}

/// The fields an upstream server gets exactly as the client sent them.
const PASSTHROUGH: [&str; 4] = [
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
];

pub(super) fn bad(param: &'static str, message: String) -> BackendError {
    BackendError::invalid("invalid_request_error", Some(param), message)
}

pub(super) fn wrong_type(param: &'static str, want: &str, v: &Value) -> BackendError {
    let got = match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    };
    BackendError::invalid(
        "invalid_type",
        Some(param),
        format!("Invalid type for '{param}': expected {want}, but got {got}."),
    )
}

pub(super) fn opt<'a>(o: &'a Map<String, Value>, k: &str) -> Option<&'a Value> {
    o.get(k).filter(|v| !v.is_null())
}

pub(super) fn num(
    o: &Map<String, Value>,
    k: &'static str,
    lo: f64,
    hi: f64,
) -> Result<Option<f64>, BackendError> {
    let Some(v) = opt(o, k) else { return Ok(None) };
    let x = v.as_f64().ok_or_else(|| wrong_type(k, "a number", v))?;
    if !(lo..=hi).contains(&x) {
        return Err(bad(
            k,
            format!("'{k}' must be between {lo} and {hi}, got {x}."),
        ));
    }
    Ok(Some(x))
}

/// Most `logit_bias` entries (OpenAI's bound).
pub const MAX_LOGIT_BIAS: usize = 300;

/// `logit_bias`: token ids (as the object's keys) to biases, -100 to 100
/// each, at most [`MAX_LOGIT_BIAS`] (checked before anything is built from
/// them; the ids are checked against the vocabulary by the engine).
fn logit_bias(o: &Map<String, Value>) -> Result<Vec<(u32, f32)>, BackendError> {
    let m = match opt(o, "logit_bias") {
        None => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(v) => {
            return Err(wrong_type(
                "logit_bias",
                "an object of token ids to numbers",
                v,
            ))
        }
    };
    if m.len() > MAX_LOGIT_BIAS {
        return Err(bad(
            "logit_bias",
            format!(
                "'logit_bias' may have at most {MAX_LOGIT_BIAS} entries, got {}.",
                m.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(m.len());
    for (k, v) in m {
        let Ok(t) = k.parse::<u32>() else {
            return Err(bad(
                "logit_bias",
                format!(
                    "'logit_bias' keys must be token ids, got `{}`.",
                    k.chars().take(32).collect::<String>()
                ),
            ));
        };
        let b = v
            .as_f64()
            .filter(|b| (-100.0..=100.0).contains(b))
            .ok_or_else(|| {
                bad(
                    "logit_bias",
                    format!("the bias of token {t} must be a number between -100 and 100."),
                )
            })?;
        out.push((t, b as f32));
    }
    Ok(out)
}

/// vLLM's `repetition_penalty`: above 0, at most 10; 1 = off.
fn repetition_penalty(o: &Map<String, Value>) -> Result<f32, BackendError> {
    match num(o, "repetition_penalty", 0.0, 10.0)? {
        None => Ok(1.0),
        Some(r) if r > 0.0 => Ok(r as f32),
        Some(_) => Err(bad(
            "repetition_penalty",
            "'repetition_penalty' must be above 0 (1 = off).".into(),
        )),
    }
}

pub(super) fn uint(o: &Map<String, Value>, k: &'static str) -> Result<Option<u64>, BackendError> {
    let Some(v) = opt(o, k) else { return Ok(None) };
    match v.as_u64() {
        Some(x) => Ok(Some(x)),
        None if v.as_i64().is_some() => {
            Err(bad(k, format!("'{k}' must be a non-negative integer.")))
        }
        None => Err(wrong_type(k, "an integer", v)),
    }
}

pub(super) fn boolean(o: &Map<String, Value>, k: &'static str) -> Result<bool, BackendError> {
    match opt(o, k) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(wrong_type(k, "a boolean", v)),
    }
}

pub(super) fn string(
    o: &Map<String, Value>,
    k: &'static str,
) -> Result<Option<String>, BackendError> {
    match opt(o, k) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(wrong_type(k, "a string", v)),
    }
}

/// Message content: a string, or a list of `{"type": "text", "text"}` parts.
fn content(v: &Value) -> Result<String, BackendError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut out = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => out.push_str(t),
                    (Some(t), _) if t != "text" => {
                        return Err(bad(
                            "messages",
                            format!(
                            "content part type '{t}' is not supported by this model; only 'text'."
                        ),
                        ))
                    }
                    _ => return Err(wrong_type("messages", "text content parts", p)),
                }
            }
            Ok(out)
        }
        other => Err(wrong_type(
            "messages",
            "a string or an array of content parts",
            other,
        )),
    }
}

fn messages(o: &Map<String, Value>) -> Result<Vec<ChatMessage>, BackendError> {
    let v = opt(o, "messages")
        .ok_or_else(|| bad("messages", "Missing required parameter: 'messages'.".into()))?;
    let arr = v
        .as_array()
        .ok_or_else(|| wrong_type("messages", "an array", v))?;
    if arr.is_empty() {
        return Err(bad(
            "messages",
            "'messages' must contain at least one message.".into(),
        ));
    }
    let mut out = Vec::with_capacity(arr.len());
    for m in arr {
        let mo = m
            .as_object()
            .ok_or_else(|| wrong_type("messages", "an array of objects", m))?;
        let role = match mo.get("role") {
            Some(Value::String(r)) => r.clone(),
            Some(v) => return Err(wrong_type("messages", "a string role", v)),
            None => return Err(bad("messages", "every message needs a 'role'.".into())),
        };
        if !matches!(
            role.as_str(),
            "system" | "user" | "assistant" | "developer" | "tool"
        ) {
            return Err(bad("messages", format!("unknown role '{role}'.")));
        }
        // `developer` is OpenAI's newer name for `system`.
        let role = if role == "developer" {
            "system".to_string()
        } else {
            role
        };
        let tool_calls = match opt(mo, "tool_calls") {
            None => None,
            Some(v @ Value::Array(_)) if role == "assistant" => Some(v.clone()),
            Some(v) => {
                return Err(wrong_type(
                    "messages",
                    "an array of tool calls on an assistant message",
                    v,
                ))
            }
        };
        let tool_call_id = match opt(mo, "tool_call_id") {
            None => None,
            Some(Value::String(id)) => Some(id.clone()),
            Some(v) => return Err(wrong_type("messages", "a string tool_call_id", v)),
        };
        out.push(ChatMessage {
            role,
            content: content(mo.get("content").unwrap_or(&Value::Null))?,
            tool_calls,
            tool_call_id,
        });
    }
    Ok(out)
}

/// Completions' `prompt`: a string, token ids, or a one-element list of
/// either (what batching clients send one at a time).
fn completion_prompt(o: &Map<String, Value>) -> Result<Prompt, BackendError> {
    let ids = |a: &[Value]| -> Option<Vec<u32>> {
        a.iter()
            .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect()
    };
    match opt(o, "prompt") {
        None => Err(bad(
            "prompt",
            "Missing required parameter: 'prompt'.".into(),
        )),
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => Ok(Prompt::Text(
            a[0].as_str().unwrap_or_default().to_string(),
        )),
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_number) => ids(a)
            .map(Prompt::Tokens)
            .ok_or_else(|| bad("prompt", "token ids must be integers from 0 to 2^32-1.".into())),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_array() => {
            match a[0].as_array().and_then(|t| ids(t)) {
                Some(t) if !t.is_empty() => Ok(Prompt::Tokens(t)),
                _ => Err(bad(
                    "prompt",
                    "token ids must be a non-empty list of integers from 0 to 2^32-1.".into(),
                )),
            }
        }
        Some(Value::Array(_)) => Err(bad(
            "prompt",
            "only one prompt per request is supported (a string, a list of token ids, or a one-element list of either).".into(),
        )),
        Some(v) => Err(wrong_type("prompt", "a string", v)),
    }
}

/// What a request asks to see besides the text (see [`scores`]).
struct Scores {
    logprobs: Option<usize>,
    echo: bool,
    prompt_logprobs: Option<usize>,
}

/// Chat: `logprobs` (bool) and `top_logprobs` (0-20, only with
/// `logprobs`). Completions: `logprobs` (0-5 alternatives) and `echo`
/// (the prompt first, scored when `logprobs` is set).
fn scores(endpoint: Endpoint, o: &Map<String, Value>) -> Result<Scores, BackendError> {
    match endpoint {
        Endpoint::Chat => {
            let on = boolean(o, "logprobs")?;
            let top = uint(o, "top_logprobs")?;
            if let Some(k) = top {
                if k > ultrafast_engine::api::MAX_LOGPROBS as u64 {
                    return Err(bad(
                        "top_logprobs",
                        format!(
                            "'top_logprobs' must be at most {}.",
                            ultrafast_engine::api::MAX_LOGPROBS
                        ),
                    ));
                }
                if !on {
                    return Err(bad(
                        "top_logprobs",
                        "'logprobs' must be true when 'top_logprobs' is set.".into(),
                    ));
                }
            }
            Ok(Scores {
                logprobs: on.then_some(top.unwrap_or(0) as usize),
                echo: false,
                prompt_logprobs: None,
            })
        }
        Endpoint::Completions => {
            let k = match opt(o, "logprobs") {
                None => None,
                Some(v) => match v.as_u64() {
                    Some(k) if k <= 5 => Some(k as usize),
                    _ => {
                        return Err(bad(
                            "logprobs",
                            "'logprobs' must be an integer from 0 to 5.".into(),
                        ))
                    }
                },
            };
            let echo = boolean(o, "echo")?;
            Ok(Scores {
                logprobs: k,
                echo,
                prompt_logprobs: k.filter(|_| echo),
            })
        }
    }
}

pub(super) fn stop(o: &Map<String, Value>) -> Result<Vec<String>, BackendError> {
    let out = match opt(o, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            let mut v = Vec::new();
            for s in a {
                v.push(
                    s.as_str()
                        .ok_or_else(|| wrong_type("stop", "a string or an array of strings", s))?
                        .to_string(),
                );
            }
            v
        }
        Some(v) => return Err(wrong_type("stop", "a string or an array of strings", v)),
    };
    if out.len() > 4 {
        return Err(bad("stop", "at most 4 stop sequences are allowed.".into()));
    }
    stop_lengths("stop", &out)?;
    Ok(out.into_iter().filter(|s| !s.is_empty()).collect())
}

/// Bytes of one stop sequence, at most. The engine checks every stop
/// against every new piece of text on the thread that steps the whole
/// batch: its work must not grow with what a client sends. Real stops are
/// a few characters (`"\n\n"`, `"</answer>"`, `"Human:"`).
pub const MAX_STOP_BYTES: usize = 256;

/// Each stop sequence within `MAX_STOP_BYTES`, or a 400 naming `param`.
pub(super) fn stop_lengths(param: &'static str, stops: &[String]) -> Result<(), BackendError> {
    match stops.iter().position(|s| s.len() > MAX_STOP_BYTES) {
        Some(i) => Err(bad(
            param,
            format!("'{param}[{i}]' is longer than the maximum of {MAX_STOP_BYTES} bytes."),
        )),
        None => Ok(()),
    }
}

/// Pairs of `metadata`, at most, as OpenAI limits it.
pub const MAX_METADATA_PAIRS: usize = 16;
/// Characters of a `metadata` key, at most (OpenAI's limit).
pub const MAX_METADATA_KEY: usize = 64;
/// Characters of a `metadata` value, at most (OpenAI's limit).
pub const MAX_METADATA_VALUE: usize = 512;

/// `metadata`, when present: an object of at most 16 string pairs, keys
/// of at most 64 characters, values of at most 512, as OpenAI's API takes
/// it; a stored response keeps it, so it is bounded before it is kept.
pub(super) fn metadata(o: &Map<String, Value>) -> Result<(), BackendError> {
    let Some(v) = opt(o, "metadata") else {
        return Ok(());
    };
    let m = v
        .as_object()
        .ok_or_else(|| wrong_type("metadata", "an object of strings", v))?;
    if m.len() > MAX_METADATA_PAIRS {
        return Err(bad(
            "metadata",
            format!(
                "'metadata' has {} pairs; at most {MAX_METADATA_PAIRS} are allowed.",
                m.len()
            ),
        ));
    }
    for (k, val) in m {
        if k.chars().count() > MAX_METADATA_KEY {
            return Err(bad(
                "metadata",
                format!("a 'metadata' key is longer than {MAX_METADATA_KEY} characters."),
            ));
        }
        let Some(text) = val.as_str() else {
            return Err(wrong_type("metadata", "an object of strings", val));
        };
        if text.chars().count() > MAX_METADATA_VALUE {
            return Err(bad(
                "metadata",
                format!("'metadata.{k}' is longer than {MAX_METADATA_VALUE} characters."),
            ));
        }
    }
    Ok(())
}

/// `response_format`: none for `text`, else the JSON its output must be.
pub fn response_format(v: &Value, param: &'static str) -> Result<Option<Structure>, BackendError> {
    let o = v
        .as_object()
        .ok_or_else(|| wrong_type(param, "an object", v))?;
    match o.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Structure::Json(serde_json::json!({"type": "object"})))),
        Some("json_schema") => {
            // Chat's `json_schema.schema`; the Responses API's flat `schema`.
            let spec = o.get("json_schema").unwrap_or(v);
            match spec.get("schema") {
                Some(s @ (Value::Object(_) | Value::Bool(_))) => {
                    Ok(Some(Structure::Json(s.clone())))
                }
                Some(other) => Err(wrong_type(param, "a JSON schema object", other)),
                None => Err(bad(
                    param,
                    format!("'{param}' of type json_schema needs a 'schema'."),
                )),
            }
        }
        Some(t) => Err(bad(
            param,
            format!("unknown {param} type '{t}'; expected text, json_object or json_schema."),
        )),
        None => Err(bad(param, format!("'{param}' needs a 'type'."))),
    }
}

/// A function's name as OpenAI allows it.
fn tool_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// One tool from its parts (`name`, `description`, `parameters`), as each
/// dialect nests them.
pub fn tool(
    name: Option<&Value>,
    description: Option<&Value>,
    parameters: Option<&Value>,
) -> Result<Tool, BackendError> {
    let name = match name {
        Some(Value::String(n)) if tool_name(n) => n.clone(),
        Some(Value::String(n)) => {
            return Err(bad(
                "tools",
                format!("tool name '{n}' must be 1-64 letters, digits, '_' or '-'."),
            ))
        }
        Some(v) => return Err(wrong_type("tools", "a string function name", v)),
        None => return Err(bad("tools", "every tool needs a function 'name'.".into())),
    };
    let parameters = match parameters.filter(|p| !p.is_null()) {
        None => serde_json::json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(v) => return Err(wrong_type("tools", "a JSON schema object of parameters", v)),
    };
    Ok(Tool {
        name,
        description: description.and_then(Value::as_str).map(str::to_string),
        parameters,
    })
}

/// Chat's `tools`, `tool_choice` and `parallel_tool_calls`.
fn tools(o: &Map<String, Value>) -> Result<Option<Structure>, BackendError> {
    let Some(list) = opt(o, "tools") else {
        if opt(o, "tool_choice").is_some_and(|c| *c != "none" && *c != "auto") {
            return Err(bad(
                "tool_choice",
                "'tool_choice' is only allowed when 'tools' are given.".into(),
            ));
        }
        return Ok(None);
    };
    let list = list
        .as_array()
        .ok_or_else(|| wrong_type("tools", "an array", list))?;
    let mut out = Vec::with_capacity(list.len());
    for t in list {
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(other) => {
                return Err(bad(
                    "tools",
                    format!("tool type '{other}' is not supported; only 'function'."),
                ))
            }
            None => return Err(bad("tools", "every tool needs 'type': 'function'.".into())),
        }
        let f = t
            .get("function")
            .ok_or_else(|| bad("tools", "every tool needs a 'function'.".into()))?;
        out.push(tool(
            f.get("name"),
            f.get("description"),
            f.get("parameters"),
        )?);
    }
    let choice = tool_choice(opt(o, "tool_choice"))?;
    let parallel = match opt(o, "parallel_tool_calls") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(wrong_type("parallel_tool_calls", "a boolean", v)),
    };
    structure_of_tools(out, choice, parallel)
}

/// `tool_choice`: `none` (None), `auto`, `required`, or one function
/// (`{"type": "function", "function": {"name"}}` or the Responses API's
/// `{"type": "function", "name"}`).
pub fn tool_choice(v: Option<&Value>) -> Result<Option<ToolChoice>, BackendError> {
    match v {
        None => Ok(Some(ToolChoice::Auto)),
        Some(Value::String(s)) => match s.as_str() {
            "none" => Ok(None),
            "auto" => Ok(Some(ToolChoice::Auto)),
            "required" => Ok(Some(ToolChoice::Required)),
            other => Err(bad(
                "tool_choice",
                format!(
                    "unknown tool_choice '{other}'; expected none, auto, required or a function."
                ),
            )),
        },
        Some(c @ Value::Object(_)) => {
            let name = c["function"]["name"]
                .as_str()
                .or_else(|| c["name"].as_str());
            match name {
                Some(n) => Ok(Some(ToolChoice::Named(n.to_string()))),
                None => Err(bad(
                    "tool_choice",
                    "a function tool_choice needs the function's 'name'.".into(),
                )),
            }
        }
        Some(v) => Err(wrong_type("tool_choice", "a string or an object", v)),
    }
}

/// The structure of a tool request, checking a named choice.
pub fn structure_of_tools(
    tools: Vec<Tool>,
    choice: Option<ToolChoice>,
    parallel: bool,
) -> Result<Option<Structure>, BackendError> {
    let Some(choice) = choice else {
        return Ok(None);
    };
    if tools.is_empty() {
        return Ok(None);
    }
    if let ToolChoice::Named(n) = &choice {
        if !tools.iter().any(|t| &t.name == n) {
            return Err(bad(
                "tool_choice",
                format!("tool_choice names '{n}', which is not among the tools."),
            ));
        }
    }
    Ok(Some(Structure::Tools {
        tools,
        choice,
        parallel,
    }))
}

/// A request body as a JSON object (every dialect's first step).
pub(super) fn body_object(body: &[u8]) -> Result<Map<String, Value>, BackendError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        BackendError::invalid(
            "invalid_json",
            None,
            format!("We could not parse the JSON body of your request: {e}"),
        )
    })?;
    match v {
        Value::Object(o) => Ok(o),
        _ => Err(BackendError::invalid(
            "invalid_json",
            None,
            "the request body must be a JSON object".into(),
        )),
    }
}

/// The lane asked in the body (`priority`).
pub(super) fn priority(o: &Map<String, Value>) -> Result<Option<String>, BackendError> {
    match opt(o, "priority") {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(wrong_type("priority", "a lane name", v)),
    }
}

/// Parse a request body for `endpoint`.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Parsed, BackendError> {
    let o = &body_object(body)?;
    super::fields::check_openai(o, endpoint == Endpoint::Chat)?;
    let model = string(o, "model")?
        .ok_or_else(|| bad("model", "Missing required parameter: 'model'.".into()))?;
    let prompt = match endpoint {
        Endpoint::Chat => Prompt::Chat(messages(o)?),
        Endpoint::Completions => completion_prompt(o)?,
    };
    metadata(o)?;
    let scores = scores(endpoint, o)?;
    let max_tokens = match uint(o, "max_completion_tokens")? {
        Some(m) => Some(m),
        None => uint(o, "max_tokens")?,
    };
    // Zero asks for scoring only, which needs the prompt echoed.
    if max_tokens == Some(0) && !scores.echo {
        let p = if opt(o, "max_completion_tokens").is_some() {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        return Err(bad(p, format!("'{p}' must be at least 1.")));
    }
    // OpenAI's legacy completions default to 16 tokens.
    let max_tokens = max_tokens
        .map(|m| m.min(u32::MAX as u64) as usize)
        .or((endpoint == Endpoint::Completions).then_some(16));
    let n = uint(o, "n")?.unwrap_or(1);
    if n == 0 || n > MAX_CHOICES as u64 {
        return Err(bad(
            "n",
            format!("'n' must be from 1 to {MAX_CHOICES}, got {n}."),
        ));
    }
    let n = n as usize;
    let temperature = num(o, "temperature", 0.0, 2.0)?.unwrap_or(1.0) as f32;
    let top_p = num(o, "top_p", 0.0, 1.0)?.unwrap_or(1.0) as f32;
    let top_k = uint(o, "top_k")?.unwrap_or(0) as usize;
    let seed = match opt(o, "seed") {
        None => None,
        Some(v) => Some(
            v.as_i64()
                .map(|s| s as u64)
                .or_else(|| v.as_u64())
                .ok_or_else(|| wrong_type("seed", "an integer", v))?,
        ),
    };
    let stream = boolean(o, "stream")?;
    let include_usage = match opt(o, "stream_options") {
        None => false,
        Some(Value::Object(so)) => boolean(so, "include_usage")?,
        Some(v) => return Err(wrong_type("stream_options", "an object", v)),
    };
    // Tools first: a request with both calls tools (as vLLM does).
    let mut structure = match endpoint {
        Endpoint::Chat => tools(o)?,
        Endpoint::Completions => None,
    };
    if structure.is_none() {
        if let Some(rf) = opt(o, "response_format") {
            structure = response_format(rf, "response_format")?;
        }
    }
    if n > 1 && matches!(structure, Some(Structure::Tools { .. })) {
        return Err(bad(
            "n",
            "'n' above 1 is not supported with tools (one choice reads the calls).".into(),
        ));
    }
    let passthrough: Map<String, Value> = PASSTHROUGH
        .iter()
        .filter_map(|k| opt(o, k).map(|v| (k.to_string(), v.clone())))
        .collect();
    let priority = priority(o)?;
    Ok(Parsed {
        endpoint,
        model,
        prompt,
        max_tokens,
        n,
        sampling: SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
            frequency_penalty: num(o, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
            presence_penalty: num(o, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
            repetition_penalty: repetition_penalty(o)?,
            min_p: num(o, "min_p", 0.0, 1.0)?.unwrap_or(0.0) as f32,
            logit_bias: logit_bias(o)?,
            logprobs: scores.logprobs,
            echo: scores.echo,
            prompt_logprobs: scores.prompt_logprobs,
        },
        stop: stop(o)?,
        stream,
        include_usage,
        user: string(o, "user")?,
        background: boolean(o, "background")?,
        priority,
        structure,
        passthrough,
        dialect: super::request::Dialect::OpenAi,
        given: super::request::Given::of(o),
    })
}

pub use super::delivery::error_json;

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// Identity of one response, shared by all its chunks.
#[derive(Debug, Clone)]
pub struct Ident {
    /// `chatcmpl-...` or `cmpl-...`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// Model name as asked.
    pub model: String,
    /// Endpoint.
    pub endpoint: Endpoint,
}

impl Ident {
    /// A fresh identity.
    pub fn new(endpoint: Endpoint, model: &str, request_id: &str) -> Self {
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl-",
            Endpoint::Completions => "cmpl-",
        };
        Ident {
            id: format!("{prefix}{request_id}"),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            model: model.to_string(),
            endpoint,
        }
    }

    /// The endpoint it answers.
    pub fn endpoint(&self) -> Endpoint {
        self.endpoint
    }

    /// One streamed chunk: text (or the role on the first chunk of a chat),
    /// and the finish reason on the last.
    pub fn chunk(&self, text: &str, first: bool, finish: Option<FinishReason>) -> Value {
        let finish = finish.map(FinishReason::as_str);
        match self.endpoint {
            Endpoint::Chat => {
                let delta = if first {
                    json!({"role": "assistant", "content": text})
                } else if finish.is_some() && text.is_empty() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model, "system_fingerprint": "ultrafast",
                    "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]})
            }
            Endpoint::Completions => json!({"id": self.id, "object": "text_completion",
                "created": self.created, "model": self.model, "system_fingerprint": "ultrafast",
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}]}),
        }
    }

    /// `chunk(text, first, None)` as an SSE `data:` line, written
    /// directly: a stream writes one per token, and building it through a
    /// `serde_json::Value` (a map per object, a `String` per key) was most
    /// of the CPU a streamed token cost. Same keys, same order (OpenAI's,
    /// which serde_json keeps: `preserve_order` is on for llguidance),
    /// byte-equal (tested).
    pub fn chunk_line(&self, text: &str, first: bool) -> bytes::Bytes {
        use crate::accesslog::json_str;
        let mut s = String::with_capacity(160 + self.id.len() + self.model.len() + text.len());
        let object = match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        };
        s.push_str("data: {\"id\":");
        json_str(&mut s, &self.id);
        s.push_str(",\"object\":\"");
        s.push_str(object);
        s.push_str("\",\"created\":");
        s.push_str(&self.created.to_string());
        s.push_str(",\"model\":");
        json_str(&mut s, &self.model);
        s.push_str(",\"system_fingerprint\":\"ultrafast\",\"choices\":[{\"index\":0,");
        match self.endpoint {
            Endpoint::Chat => {
                s.push_str("\"delta\":{");
                if first {
                    s.push_str("\"role\":\"assistant\",");
                }
                s.push_str("\"content\":");
                json_str(&mut s, text);
                s.push_str("},\"logprobs\":null,\"finish_reason\":null}]}\n\n");
            }
            Endpoint::Completions => {
                s.push_str("\"text\":");
                json_str(&mut s, text);
                s.push_str(",\"logprobs\":null,\"finish_reason\":null}]}\n\n");
            }
        }
        bytes::Bytes::from(s)
    }

    /// The chunk of a tool-call piece (chat only; a call's end has none).
    pub fn tool_chunk(&self, p: &Piece, first: bool) -> Option<Value> {
        let call = match p {
            Piece::CallStart { index, id, name } => {
                json!({"index": index, "id": id, "type": "function",
                "function": {"name": name, "arguments": ""}})
            }
            Piece::CallArgs { index, delta } => {
                json!({"index": index, "function": {"arguments": delta}})
            }
            Piece::Text(_) | Piece::CallEnd { .. } => return None,
        };
        let mut delta = json!({"tool_calls": [call]});
        if first {
            delta["role"] = json!("assistant");
            delta["content"] = Value::Null;
        }
        Some(
            json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model, "system_fingerprint": "ultrafast",
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": null}]}),
        )
    }

    /// A whole response with its tool calls.
    pub fn full_calls(&self, c: &Collected, finish: FinishReason, u: &Usage) -> Value {
        let mut v = self.full(&c.text, finish, u);
        if self.endpoint == Endpoint::Chat && !c.calls.is_empty() {
            let calls: Vec<Value> = c
                .calls
                .iter()
                .map(|k| json!({"id": k.id, "type": "function", "function": {"name": k.name, "arguments": k.arguments}}))
                .collect();
            let m = &mut v["choices"][0]["message"];
            m["tool_calls"] = Value::Array(calls);
            if c.text.is_empty() {
                m["content"] = Value::Null;
            }
        }
        v
    }

    /// The usage chunk that ends a stream with `include_usage`.
    pub fn usage_chunk(&self, u: &Usage) -> Value {
        let object = match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
            "system_fingerprint": "ultrafast", "choices": [], "usage": usage_json(u)})
    }

    /// A whole (non-streamed) response.
    pub fn full(&self, text: &str, finish: FinishReason, u: &Usage) -> Value {
        match self.endpoint {
            Endpoint::Chat => {
                json!({"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "system_fingerprint": "ultrafast",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": null},
                    "logprobs": null, "finish_reason": finish.as_str()}],
                "usage": usage_json(u)})
            }
            Endpoint::Completions => json!({"id": self.id, "object": "text_completion",
                "created": self.created, "model": self.model, "system_fingerprint": "ultrafast",
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish.as_str()}],
                "usage": usage_json(u)}),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(
        r: Result<impl std::fmt::Debug, BackendError>,
    ) -> (u16, Option<&'static str>, String) {
        let e = r.expect_err("refused");
        (e.status, e.param, e.message)
    }

    #[test]
    fn penalties_bias_and_min_p_are_read_and_bounded() {
        let p = parse(
            Endpoint::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":"x"}],"frequency_penalty":0.5,
                "presence_penalty":-1,"repetition_penalty":1.2,"min_p":0.05,"logit_bias":{"42":-100,"7":3.5}}"#,
        )
        .unwrap();
        let s = &p.sampling;
        assert_eq!((s.frequency_penalty, s.presence_penalty), (0.5, -1.0));
        assert_eq!((s.repetition_penalty, s.min_p), (1.2, 0.05));
        let mut bias = s.logit_bias.clone();
        bias.sort_by_key(|b| b.0);
        assert_eq!(bias, vec![(7, 3.5), (42, -100.0)]);
        let defaults = parse(Endpoint::Completions, br#"{"model":"m","prompt":"x"}"#).unwrap();
        assert!(!defaults.sampling.adjusts_logits());
        let many: String = (0..301)
            .map(|i| format!("\"{i}\":1"))
            .collect::<Vec<_>>()
            .join(",");
        for (body, param) in [
            (
                r#""frequency_penalty":2.5"#.to_string(),
                "frequency_penalty",
            ),
            (r#""presence_penalty":"a""#.to_string(), "presence_penalty"),
            (
                r#""repetition_penalty":0"#.to_string(),
                "repetition_penalty",
            ),
            (
                r#""repetition_penalty":11"#.to_string(),
                "repetition_penalty",
            ),
            (r#""min_p":1.5"#.to_string(), "min_p"),
            (r#""logit_bias":{"x":1}"#.to_string(), "logit_bias"),
            (r#""logit_bias":{"1":101}"#.to_string(), "logit_bias"),
            (r#""logit_bias":[1]"#.to_string(), "logit_bias"),
            (format!(r#""logit_bias":{{{many}}}"#), "logit_bias"),
        ] {
            let b =
                format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],{body}}}"#);
            let e = parse(Endpoint::Chat, b.as_bytes()).unwrap_err();
            assert_eq!(e.param, Some(param), "{body}: {}", e.message);
            assert_eq!(e.status, 400);
        }
    }

    #[test]
    fn stop_sequences_are_bounded_in_count_and_length_in_both_dialects() {
        let long = "x".repeat(MAX_STOP_BYTES + 1);
        let chat = |stop: serde_json::Value| {
            let b = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": stop});
            parse(Endpoint::Chat, b.to_string().as_bytes())
        };
        assert_eq!(
            refusal(chat(serde_json::json!(["a", "b", "c", "d", "e"]))).1,
            Some("stop")
        );
        let (status, param, msg) = refusal(chat(serde_json::json!([long.clone()])));
        assert_eq!((status, param), (400, Some("stop")));
        assert!(msg.contains("256 bytes"), "{msg}");
        assert!(chat(serde_json::json!(["x".repeat(MAX_STOP_BYTES)])).is_ok());
        let messages = |stops: serde_json::Value| {
            let b = serde_json::json!({"model": "m", "max_tokens": 5,
                "messages": [{"role": "user", "content": "hi"}], "stop_sequences": stops});
            crate::inference::dialect::anthropic::parse(b.to_string().as_bytes())
        };
        // The audit's 5,000, empty ones counted too.
        let many: Vec<String> = (0..5000).map(|i| format!("s{i}")).collect();
        assert_eq!(
            refusal(messages(serde_json::json!(many))).1,
            Some("stop_sequences")
        );
        assert_eq!(
            refusal(messages(serde_json::json!(vec![""; 17]))).1,
            Some("stop_sequences")
        );
        assert_eq!(
            refusal(messages(serde_json::json!([long]))).1,
            Some("stop_sequences")
        );
        assert!(messages(serde_json::json!(vec!["s"; 16])).is_ok());
    }

    #[test]
    fn responses_metadata_is_bounded_as_openai_bounds_it() {
        let req = |metadata: serde_json::Value| {
            let b = serde_json::json!({"model": "m", "input": "hi", "metadata": metadata});
            crate::inference::dialect::responses::parse(b.to_string().as_bytes())
        };
        let pairs = |n: usize| -> serde_json::Map<String, serde_json::Value> {
            (0..n)
                .map(|i| (format!("k{i}"), serde_json::json!("v")))
                .collect()
        };
        assert!(req(serde_json::Value::Object(pairs(16))).is_ok());
        // The audit's 2,000 pairs.
        assert_eq!(
            refusal(req(serde_json::Value::Object(pairs(2000)))).1,
            Some("metadata")
        );
        assert_eq!(
            refusal(req(serde_json::json!({"k".repeat(65): "v"}))).1,
            Some("metadata")
        );
        assert!(req(serde_json::json!({"k".repeat(64): "é".repeat(512)})).is_ok());
        assert_eq!(
            refusal(req(serde_json::json!({"k": "v".repeat(513)}))).1,
            Some("metadata")
        );
        assert_eq!(
            refusal(req(serde_json::json!({"k": 1}))).1,
            Some("metadata")
        );
        assert_eq!(refusal(req(serde_json::json!(["k"]))).1, Some("metadata"));
        // Chat's the same.
        let chat = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "metadata": serde_json::Value::Object(pairs(17))});
        assert_eq!(
            refusal(parse(Endpoint::Chat, chat.to_string().as_bytes())).1,
            Some("metadata")
        );
    }

    #[test]
    fn a_chunk_line_is_the_chunk_value_byte_for_byte() {
        for ep in [Endpoint::Chat, Endpoint::Completions] {
            let id = Ident::new(ep, "m\"odel", "req-1");
            for text in [
                "",
                "plain",
                "q\"uote \\ back",
                "new\nline\ttab\r",
                "\u{1}\u{1f}\u{7f}",
                "héllo ✓ 🦀",
            ] {
                for first in [true, false] {
                    let line = id.chunk_line(text, first);
                    let want = super::super::sse::data(&id.chunk(text, first, None).to_string());
                    let got: Value = serde_json::from_slice(&line[6..line.len() - 2]).unwrap();
                    assert_eq!(got, id.chunk(text, first, None), "{ep:?} {text:?} {first}");
                    if !text.contains(['\u{1}', '\u{1f}']) {
                        assert_eq!(line, want, "{ep:?} {text:?} {first}");
                    }
                }
            }
        }
    }

    #[test]
    fn chat_request_fields() {
        let p = parse(
            Endpoint::Chat,
            br#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
                "max_completion_tokens":7,"temperature":0,"stop":"x","seed":3,"stream":true,
                "stream_options":{"include_usage":true},"user":"u","n":1,"store":false}"#,
        )
        .unwrap();
        assert_eq!(p.model, "m");
        assert_eq!(p.max_tokens, Some(7));
        assert_eq!(p.stop, vec!["x"]);
        assert_eq!(p.sampling.seed, Some(3));
        assert_eq!(p.sampling.temperature, 0.0);
        assert!(p.stream && p.include_usage);
        match p.prompt {
            Prompt::Chat(m) => assert_eq!(m[1].content, "ab"),
            _ => panic!("chat prompt expected"),
        }
    }

    #[test]
    fn errors_name_the_field() {
        let e = parse(
            Endpoint::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":"hot"}"#,
        )
        .unwrap_err();
        assert_eq!((e.status, e.param), (400, Some("temperature")));
        let e = parse(
            Endpoint::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":9}"#,
        )
        .unwrap_err();
        assert_eq!(e.param, Some("n"));
        let ok = br#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":8}"#;
        assert_eq!(parse(Endpoint::Chat, ok).unwrap().n, 8);
        let e = parse(Endpoint::Chat, br#"{"model":"m","messages":"hi"}"#).unwrap_err();
        assert_eq!(e.param, Some("messages"));
        let e = parse(Endpoint::Chat, b"{not json").unwrap_err();
        assert_eq!(e.code, "invalid_json");
        let e = parse(Endpoint::Completions, br#"{"model":"m"}"#).unwrap_err();
        assert_eq!(e.param, Some("prompt"));
        let e = parse(
            Endpoint::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":-1}"#,
        )
        .unwrap_err();
        assert_eq!(e.param, Some("max_tokens"));
    }

    #[test]
    fn completions_default_to_16_tokens() {
        let p = parse(Endpoint::Completions, br#"{"model":"m","prompt":["hi"]}"#).unwrap();
        assert_eq!(p.max_tokens, Some(16));
    }
}
