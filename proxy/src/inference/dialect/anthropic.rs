//! Anthropic's Messages API (`POST /v1/messages`): the request into the
//! pipeline's form, the answer as Anthropic writes it (content blocks,
//! `stop_reason`, its event sequence when streamed) and errors in its shape.

use super::{Ev, Writer};
use crate::inference::delivery::Finished;
use crate::inference::openai::{
    self, bad, body_object, boolean, num, opt, priority, string, structure_of_tools, uint,
    wrong_type, Endpoint, Parsed,
};
use crate::inference::shape::{Collected, Piece};
use bytes::Bytes;
use serde_json::{json, Map, Value};
use ultrafast_engine::api::{BackendError, FinishReason, Prompt, ToolChoice, Usage};
use ultrafast_engine::sampling::SamplingParams;
use ultrafast_engine::tokenizer::ChatMessage;

/// The text of a `text` block list, or a string.
fn text_of(v: &Value, param: &'static str) -> Result<String, BackendError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut s = String::new();
            for b in blocks {
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => s.push_str(b["text"].as_str().unwrap_or_default()),
                    Some(t) => return Err(unsupported(param, t)),
                    None => return Err(bad(param, "every content block needs a 'type'.".into())),
                }
            }
            Ok(s)
        }
        other => Err(wrong_type(
            param,
            "a string or an array of content blocks",
            other,
        )),
    }
}

fn unsupported(param: &'static str, t: &str) -> BackendError {
    let why = match t {
        "image" | "document" => "this model reads text only",
        _ => "it is not supported here",
    };
    bad(
        param,
        format!("content block type '{t}' cannot be used: {why}."),
    )
}

/// One Anthropic message as chat messages: its text, its `tool_use`
/// blocks as an assistant's tool calls, each `tool_result` as a `tool`
/// message.
fn message(m: &Value, out: &mut Vec<ChatMessage>) -> Result<(), BackendError> {
    let role = match m.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        Some(r) => {
            return Err(bad(
                "messages",
                format!("unknown role '{r}'; expected user or assistant."),
            ))
        }
        None => return Err(bad("messages", "every message needs a 'role'.".into())),
    };
    let blocks = match m.get("content") {
        Some(Value::String(s)) => {
            out.push(ChatMessage::new(role, s.clone()));
            return Ok(());
        }
        Some(Value::Array(b)) => b,
        Some(v) => {
            return Err(wrong_type(
                "messages",
                "a string or an array of content blocks",
                v,
            ))
        }
        None => return Err(bad("messages", "every message needs 'content'.".into())),
    };
    let mut text = String::new();
    let mut calls = Vec::new();
    for b in blocks {
        match b.get("type").and_then(Value::as_str) {
            Some("text") => text.push_str(b["text"].as_str().unwrap_or_default()),
            Some("tool_use") if role == "assistant" => calls.push(json!({
                "id": b["id"], "type": "function",
                "function": {"name": b["name"], "arguments": b["input"].to_string()}})),
            Some("tool_result") if role == "user" => {
                let content = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(c) => text_of(c, "messages")?,
                };
                out.push(ChatMessage {
                    role: "tool".into(),
                    content,
                    tool_call_id: b["tool_use_id"].as_str().map(str::to_string),
                    ..Default::default()
                });
            }
            Some(t) => return Err(unsupported("messages", t)),
            None => {
                return Err(bad(
                    "messages",
                    "every content block needs a 'type'.".into(),
                ))
            }
        }
    }
    if !text.is_empty() || !calls.is_empty() {
        out.push(ChatMessage {
            role: role.into(),
            content: text,
            tool_calls: (!calls.is_empty()).then_some(Value::Array(calls)),
            ..Default::default()
        });
    }
    Ok(())
}

/// `tools` and `tool_choice` into the pipeline's structure, and the same
/// tools in OpenAI's shape for upstream servers.
fn tools(
    o: &Map<String, Value>,
    pass: &mut Map<String, Value>,
) -> Result<Option<ultrafast_engine::api::Structure>, BackendError> {
    let Some(list) = opt(o, "tools") else {
        return Ok(None);
    };
    let list = list
        .as_array()
        .ok_or_else(|| wrong_type("tools", "an array", list))?;
    let mut out = Vec::with_capacity(list.len());
    for t in list {
        if let Some(ty) = t
            .get("type")
            .and_then(Value::as_str)
            .filter(|t| *t != "custom")
        {
            return Err(bad(
                "tools",
                format!("tool type '{ty}' is not supported here; only client tools."),
            ));
        }
        out.push(openai::tool(
            t.get("name"),
            t.get("description"),
            t.get("input_schema"),
        )?);
    }
    let tc = opt(o, "tool_choice");
    let (choice, parallel) = match tc {
        None => (Some(ToolChoice::Auto), true),
        Some(c) => {
            let parallel = !c["disable_parallel_tool_use"].as_bool().unwrap_or(false);
            let choice = match c.get("type").and_then(Value::as_str) {
                Some("auto") => Some(ToolChoice::Auto),
                Some("any") => Some(ToolChoice::Required),
                Some("none") => None,
                Some("tool") => match c["name"].as_str() {
                    Some(n) => Some(ToolChoice::Named(n.to_string())),
                    None => {
                        return Err(bad(
                            "tool_choice",
                            "tool_choice of type 'tool' needs a 'name'.".into(),
                        ))
                    }
                },
                _ => {
                    return Err(bad(
                        "tool_choice",
                        "tool_choice type must be auto, any, tool or none.".into(),
                    ))
                }
            };
            (choice, parallel)
        }
    };
    let oa: Vec<Value> = out
        .iter()
        .map(|t| json!({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}))
        .collect();
    pass.insert("tools".into(), Value::Array(oa));
    pass.insert(
        "tool_choice".into(),
        match &choice {
            None => json!("none"),
            Some(ToolChoice::Auto) => json!("auto"),
            Some(ToolChoice::Required) => json!("required"),
            Some(ToolChoice::Named(n)) => json!({"type": "function", "function": {"name": n}}),
        },
    );
    if !parallel {
        pass.insert("parallel_tool_calls".into(), json!(false));
    }
    structure_of_tools(out, choice, parallel)
}

/// Stop sequences of one request, at most.
pub const MAX_STOP_SEQUENCES: usize = 16;

/// Parse a Messages request.
pub fn parse(body: &[u8]) -> Result<Parsed, BackendError> {
    let o = &body_object(body)?;
    crate::inference::fields::check(o, crate::inference::fields::ANTHROPIC)?;
    let model = string(o, "model")?.ok_or_else(|| bad("model", "model: Field required".into()))?;
    let max_tokens = uint(o, "max_tokens")?
        .ok_or_else(|| bad("max_tokens", "max_tokens: Field required".into()))?;
    if max_tokens == 0 {
        return Err(bad("max_tokens", "max_tokens: must be at least 1".into()));
    }
    let mut msgs = Vec::new();
    if let Some(s) = opt(o, "system") {
        let s = text_of(s, "system")?;
        if !s.is_empty() {
            msgs.push(ChatMessage::new("system", s));
        }
    }
    let list =
        opt(o, "messages").ok_or_else(|| bad("messages", "messages: Field required".into()))?;
    let list = list
        .as_array()
        .ok_or_else(|| wrong_type("messages", "an array", list))?;
    if list.is_empty() {
        return Err(bad(
            "messages",
            "messages: at least one message is required".into(),
        ));
    }
    for m in list {
        message(m, &mut msgs)?;
    }
    let stop = match opt(o, "stop_sequences") {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| {
                s.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| wrong_type("stop_sequences", "an array of strings", s))
            })
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect(),
        Some(v) => return Err(wrong_type("stop_sequences", "an array of strings", v)),
    };
    // Bounded as OpenAI's `stop` is (its count is 4; here 16, since
    // Anthropic's clients send a few more), each within MAX_STOP_BYTES;
    // counted as sent, empty ones too.
    let sent = opt(o, "stop_sequences")
        .and_then(Value::as_array)
        .map_or(0, Vec::len);
    if sent > MAX_STOP_SEQUENCES {
        return Err(bad(
            "stop_sequences",
            format!("stop_sequences: at most {MAX_STOP_SEQUENCES} stop sequences are allowed."),
        ));
    }
    crate::inference::openai::stop_lengths("stop_sequences", &stop)?;
    let mut passthrough = Map::new();
    let structure = tools(o, &mut passthrough)?;
    let user = opt(o, "metadata")
        .and_then(|m| m["user_id"].as_str())
        .map(str::to_string);
    let priority = priority(o)?;
    Ok(Parsed {
        endpoint: Endpoint::Chat,
        model,
        prompt: Prompt::Chat(msgs),
        max_tokens: Some(max_tokens.min(u32::MAX as u64) as usize),
        n: 1,
        sampling: SamplingParams {
            // Anthropic's temperature runs 0 to 1, default 1.
            temperature: num(o, "temperature", 0.0, 1.0)?.unwrap_or(1.0) as f32,
            top_k: uint(o, "top_k")?.unwrap_or(0) as usize,
            top_p: num(o, "top_p", 0.0, 1.0)?.unwrap_or(1.0) as f32,
            seed: None,
            ..SamplingParams::default()
        },
        stop,
        stream: boolean(o, "stream")?,
        include_usage: false,
        user,
        background: false,
        priority,
        structure,
        passthrough,
        dialect: super::Dialect::Anthropic,
        // A sampling field the dialect lacks was refused by its table.
        given: crate::inference::request::Given::of(o),
    })
}

pub use crate::inference::delivery::anthropic_error_body as error_body;
use crate::inference::delivery::anthropic_error_type as error_type;

/// Writes a Messages response.
pub struct MessagesWriter {
    id: String,
    model: String,
    stops: Vec<String>,
    /// The open content block: its index and whether it is text.
    block: Option<(usize, bool)>,
    blocks: usize,
    prompt_tokens: usize,
}

impl MessagesWriter {
    /// A writer for one response.
    pub fn new(request_id: &str, p: &Parsed, prompt_tokens: usize) -> Self {
        MessagesWriter {
            id: format!("msg_{request_id}"),
            model: p.model.clone(),
            stops: p.stop.clone(),
            block: None,
            blocks: 0,
            prompt_tokens,
        }
    }

    fn stop(&self, f: FinishReason) -> (&'static str, Value) {
        match f {
            FinishReason::Length => ("max_tokens", Value::Null),
            FinishReason::ToolCalls => ("tool_use", Value::Null),
            FinishReason::StopSequence(i) => (
                "stop_sequence",
                self.stops.get(i).map_or(Value::Null, |s| json!(s)),
            ),
            FinishReason::Stop => ("end_turn", Value::Null),
        }
    }

    fn usage(u: &Usage) -> Value {
        json!({"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens})
    }

    fn close_block(&mut self, evs: &mut Vec<Ev>) {
        if let Some((index, _)) = self.block.take() {
            evs.push(Ev {
                name: "content_block_stop",
                data: json!({"type": "content_block_stop", "index": index}),
            });
        }
    }
}

impl Writer for MessagesWriter {
    fn open(&mut self) -> Vec<Ev> {
        let msg = json!({"id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}});
        vec![
            Ev {
                name: "message_start",
                data: json!({"type": "message_start", "message": msg}),
            },
            Ev {
                name: "ping",
                data: json!({"type": "ping"}),
            },
        ]
    }

    fn piece(&mut self, p: &Piece) -> Vec<Ev> {
        let mut evs = Vec::new();
        match p {
            Piece::Text(t) => {
                if !matches!(self.block, Some((_, true))) {
                    self.close_block(&mut evs);
                    let index = self.blocks;
                    self.blocks += 1;
                    self.block = Some((index, true));
                    evs.push(Ev {
                        name: "content_block_start",
                        data: json!({"type": "content_block_start", "index": index,
                        "content_block": {"type": "text", "text": ""}}),
                    });
                }
                let index = self.block.map_or(0, |b| b.0);
                evs.push(Ev {
                    name: "content_block_delta",
                    data: json!({"type": "content_block_delta", "index": index,
                    "delta": {"type": "text_delta", "text": t}}),
                });
            }
            Piece::CallStart { id, name, .. } => {
                self.close_block(&mut evs);
                let index = self.blocks;
                self.blocks += 1;
                self.block = Some((index, false));
                evs.push(Ev { name: "content_block_start", data: json!({"type": "content_block_start", "index": index,
                    "content_block": {"type": "tool_use", "id": tool_id(id), "name": name, "input": {}}}) });
            }
            Piece::CallArgs { delta, .. } => {
                let index = self.block.map_or(0, |b| b.0);
                evs.push(Ev {
                    name: "content_block_delta",
                    data: json!({"type": "content_block_delta", "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": delta}}),
                });
            }
            Piece::CallEnd { .. } => self.close_block(&mut evs),
        }
        evs
    }

    fn close(&mut self, _out: &Collected, end: &Finished) -> Vec<Ev> {
        let mut evs = Vec::new();
        self.close_block(&mut evs);
        let (reason, seq) = self.stop(end.finish);
        evs.push(Ev {
            name: "message_delta",
            data: json!({"type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": seq},
            "usage": {"output_tokens": end.usage.completion_tokens}}),
        });
        evs.push(Ev {
            name: "message_stop",
            data: json!({"type": "message_stop"}),
        });
        evs
    }

    fn whole(&self, out: &Collected, end: &Finished) -> Value {
        let mut content = Vec::new();
        if !out.text.is_empty() {
            content.push(json!({"type": "text", "text": out.text}));
        }
        for c in &out.calls {
            let input: Value = serde_json::from_str(&c.arguments).unwrap_or_else(|_| json!({}));
            content.push(
                json!({"type": "tool_use", "id": tool_id(&c.id), "name": c.name, "input": input}),
            );
        }
        let (reason, seq) = self.stop(end.finish);
        json!({"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
            "stop_reason": reason, "stop_sequence": seq, "usage": Self::usage(&end.usage)})
    }

    fn error(&mut self, body: &Value) -> Ev {
        let message = body["error"]["message"].as_str().unwrap_or("error");
        let status = match body["error"]["type"].as_str() {
            Some("server_error") => 503,
            _ => 500,
        };
        Ev {
            name: "error",
            data: json!({"type": "error", "error": {"type": error_type(status), "message": message}}),
        }
    }

    fn ping(&mut self) -> Bytes {
        Ev {
            name: "ping",
            data: json!({"type": "ping"}),
        }
        .sse()
    }
}

/// Anthropic's tool-use ids start `toolu_`.
fn tool_id(call_id: &str) -> String {
    format!("toolu_{}", call_id.trim_start_matches("call_"))
}
