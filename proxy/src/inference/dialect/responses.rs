//! OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE
//! /v1/responses/{id}`): the request into the pipeline's form, the answer
//! as output items (`message`, `function_call`) and `response.*` events.
//!
//! A response is stored (`store`, default true) in the async store, under
//! the same random id as an async request (`resp_` in place of `req_`), with
//! the conversation that led to it, so `previous_response_id` continues it
//! for the same tenant while the store keeps it; past that it is a clear
//! 404. `background: true` is the async mode: the 202 of the pipeline's
//! async store, read back with `GET /v1/responses/{id}`.

use super::{Ev, Writer};
use crate::inference::delivery::Finished;
use crate::inference::openai::{
    bad, body_object, boolean, num, opt, priority, response_format, string, structure_of_tools,
    tool, tool_choice, uint, wrong_type, Endpoint, Parsed,
};
use crate::inference::shape::{Collected, Piece};
use bytes::Bytes;
use serde_json::{json, Map, Value};
use ultrafast_engine::api::{BackendError, FinishReason, Prompt, TokenLogprob};
use ultrafast_engine::sampling::SamplingParams;
use ultrafast_engine::tokenizer::ChatMessage;

pub use crate::inference::request::ResponsesOpts as Opts;

/// The key under which a stored response keeps its conversation (never
/// shown: `view` removes it).
pub const CONVERSATION: &str = "ultrafast_conversation";

/// The job id of a response id (and back).
pub fn job_id(response_id: &str) -> String {
    match response_id.strip_prefix("resp_") {
        Some(rest) => format!("req_{rest}"),
        None => response_id.to_string(),
    }
}

/// The response id of a job id.
pub fn response_id(job_id: &str) -> String {
    format!("resp_{}", job_id.trim_start_matches("req_"))
}

fn content_text(v: &Value) -> Result<String, BackendError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut s = String::new();
            for p in parts {
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => {
                        s.push_str(p["text"].as_str().unwrap_or_default())
                    }
                    Some(t @ ("input_image" | "input_file" | "input_audio")) => {
                        return Err(bad(
                            "input",
                            format!(
                                "content type '{t}' cannot be used: this model reads text only."
                            ),
                        ))
                    }
                    Some(t) => {
                        return Err(bad(
                            "input",
                            format!("content type '{t}' is not supported."),
                        ))
                    }
                    None => return Err(bad("input", "every content part needs a 'type'.".into())),
                }
            }
            Ok(s)
        }
        other => Err(wrong_type(
            "input",
            "a string or an array of content parts",
            other,
        )),
    }
}

/// `input` as chat messages.
fn input(v: &Value) -> Result<Vec<ChatMessage>, BackendError> {
    let items = match v {
        Value::String(s) => return Ok(vec![ChatMessage::new("user", s.clone())]),
        Value::Array(items) => items,
        other => {
            return Err(wrong_type(
                "input",
                "a string or an array of input items",
                other,
            ))
        }
    };
    let mut out: Vec<ChatMessage> = Vec::new();
    for it in items {
        match it.get("type").and_then(Value::as_str) {
            None | Some("message") => {
                let role = match it.get("role").and_then(Value::as_str) {
                    Some("developer") | Some("system") => "system",
                    Some(r @ ("user" | "assistant")) => r,
                    Some(r) => return Err(bad("input", format!("unknown role '{r}'."))),
                    None => return Err(bad("input", "every message needs a 'role'.".into())),
                };
                out.push(ChatMessage::new(
                    role,
                    content_text(it.get("content").unwrap_or(&Value::Null))?,
                ));
            }
            Some("function_call") => {
                let call = json!({"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}});
                // Calls of one turn go on one assistant message.
                match out.last_mut() {
                    Some(m) if m.role == "assistant" => {
                        match m.tool_calls.as_mut().and_then(Value::as_array_mut) {
                            Some(a) => a.push(call),
                            None => m.tool_calls = Some(json!([call])),
                        }
                    }
                    _ => out.push(ChatMessage {
                        role: "assistant".into(),
                        tool_calls: Some(json!([call])),
                        ..Default::default()
                    }),
                }
            }
            Some("function_call_output") => out.push(ChatMessage {
                role: "tool".into(),
                content: match &it["output"] {
                    Value::String(s) => s.clone(),
                    o => o.to_string(),
                },
                tool_call_id: it["call_id"].as_str().map(str::to_string),
                ..Default::default()
            }),
            Some(t) => {
                return Err(bad(
                    "input",
                    format!("input item type '{t}' is not supported."),
                ))
            }
        }
    }
    if out.is_empty() {
        return Err(bad("input", "'input' must not be empty.".into()));
    }
    Ok(out)
}

/// Parse a Responses request (the conversation of `previous_response_id`
/// is added by the pipeline, which has the store).
pub fn parse(body: &[u8]) -> Result<Parsed, BackendError> {
    let o = &body_object(body)?;
    crate::inference::fields::check(o, crate::inference::fields::RESPONSES)?;
    let model = string(o, "model")?
        .ok_or_else(|| bad("model", "Missing required parameter: 'model'.".into()))?;
    let mut msgs = Vec::new();
    let instructions = string(o, "instructions")?;
    if let Some(i) = &instructions {
        msgs.push(ChatMessage::new("system", i.clone()));
    }
    let inp = opt(o, "input")
        .ok_or_else(|| bad("input", "Missing required parameter: 'input'.".into()))?;
    msgs.extend(input(inp)?);
    let max_tokens = uint(o, "max_output_tokens")?;
    if max_tokens == Some(0) {
        return Err(bad(
            "max_output_tokens",
            "'max_output_tokens' must be at least 1.".into(),
        ));
    }
    let mut passthrough = Map::new();
    let mut structure = None;
    if let Some(list) = opt(o, "tools") {
        let list = list
            .as_array()
            .ok_or_else(|| wrong_type("tools", "an array", list))?;
        let mut tools = Vec::with_capacity(list.len());
        for t in list {
            match t.get("type").and_then(Value::as_str) {
                Some("function") => tools.push(tool(
                    t.get("name"),
                    t.get("description"),
                    t.get("parameters"),
                )?),
                Some(other) => {
                    return Err(bad(
                        "tools",
                        format!("tool type '{other}' is not supported; only 'function'."),
                    ))
                }
                None => return Err(bad("tools", "every tool needs a 'type'.".into())),
            }
        }
        let choice = tool_choice(opt(o, "tool_choice"))?;
        let parallel = match opt(o, "parallel_tool_calls") {
            None => true,
            Some(Value::Bool(b)) => *b,
            Some(v) => return Err(wrong_type("parallel_tool_calls", "a boolean", v)),
        };
        let chat_tools: Vec<Value> = tools
            .iter()
            .map(|t| json!({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}))
            .collect();
        passthrough.insert("tools".into(), Value::Array(chat_tools));
        if let Some(tc) = opt(o, "tool_choice") {
            let tc = match tc.get("name") {
                Some(n) => json!({"type": "function", "function": {"name": n}}),
                None => tc.clone(),
            };
            passthrough.insert("tool_choice".into(), tc);
        }
        if !parallel {
            passthrough.insert("parallel_tool_calls".into(), json!(false));
        }
        structure = structure_of_tools(tools, choice, parallel)?;
    }
    let format = opt(o, "text")
        .and_then(|t| t.get("format"))
        .filter(|f| !f.is_null());
    if let Some(f) = format {
        let s = response_format(f, "text.format")?;
        if s.is_some() {
            // Chat's spelling for upstream servers.
            let rf = match f["type"].as_str() {
                Some("json_schema") => json!({"type": "json_schema", "json_schema": {
                    "name": f.get("name").cloned().unwrap_or(json!("response")), "schema": f["schema"], "strict": f.get("strict").cloned().unwrap_or(Value::Null)}}),
                _ => f.clone(),
            };
            passthrough.insert("response_format".into(), rf);
        }
        if structure.is_none() {
            structure = s;
        }
    }
    let store = match opt(o, "store") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(wrong_type("store", "a boolean", v)),
    };
    let previous = string(o, "previous_response_id")?;
    let background = boolean(o, "background")?;
    if background && !store {
        return Err(bad(
            "background",
            "a background response must be stored ('store' cannot be false).".into(),
        ));
    }
    crate::inference::openai::metadata(o)?;
    let logprobs = logprobs(o)?;
    let mut echo = Map::new();
    for k in [
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "tool_choice",
        "tools",
        "parallel_tool_calls",
        "text",
        "metadata",
        "previous_response_id",
        "top_logprobs",
    ] {
        if let Some(v) = opt(o, k) {
            echo.insert(k.into(), v.clone());
        }
    }
    echo.insert("store".into(), json!(store));
    echo.insert("background".into(), json!(background));
    Ok(Parsed {
        endpoint: Endpoint::Chat,
        model,
        prompt: Prompt::Chat(msgs),
        max_tokens: max_tokens.map(|m| m.min(u32::MAX as u64) as usize),
        n: 1,
        sampling: SamplingParams {
            temperature: num(o, "temperature", 0.0, 2.0)?.unwrap_or(1.0) as f32,
            top_k: 0,
            top_p: num(o, "top_p", 0.0, 1.0)?.unwrap_or(1.0) as f32,
            seed: None,
            logprobs,
            ..SamplingParams::default()
        },
        stop: Vec::new(),
        stream: boolean(o, "stream")?,
        include_usage: false,
        user: string(o, "user")?,
        background,
        priority: priority(o)?,
        structure,
        passthrough,
        dialect: super::Dialect::Responses(Opts {
            store,
            previous,
            echo,
        }),
        // A sampling field the dialect lacks was refused by its table.
        given: crate::inference::request::Given::of(o),
    })
}

/// What the Responses API names for log-probabilities: `include` may ask
/// for `message.output_text.logprobs` (any other value is refused by
/// name: there are no other extra outputs here), with `top_logprobs`
/// alternatives (0 to 20). Some(k) when they are asked for.
fn logprobs(o: &Map<String, Value>) -> Result<Option<usize>, BackendError> {
    const LOGPROBS: &str = "message.output_text.logprobs";
    let mut asked = false;
    if let Some(inc) = opt(o, "include") {
        let list = inc
            .as_array()
            .ok_or_else(|| wrong_type("include", "an array", inc))?;
        for v in list {
            match v.as_str() {
                Some(LOGPROBS) => asked = true,
                Some(other) => {
                    let shown: String = other.chars().take(64).collect();
                    return Err(bad(
                        "include",
                        format!("'{shown}' is not available here; only '{LOGPROBS}'."),
                    ));
                }
                None => return Err(wrong_type("include", "an array of strings", v)),
            }
        }
    }
    let top = uint(o, "top_logprobs")?;
    if top.is_some_and(|k| k > ultrafast_engine::api::MAX_LOGPROBS as u64) {
        return Err(bad(
            "top_logprobs",
            format!(
                "'top_logprobs' must be at most {}.",
                ultrafast_engine::api::MAX_LOGPROBS
            ),
        ));
    }
    // `top_logprobs` alone asks for the alternatives, hence the scores.
    Ok((asked || top.is_some_and(|k| k > 0)).then(|| top.unwrap_or(0) as usize))
}

/// Writes a Responses response.
pub struct ResponsesWriter {
    id: String,
    created: u64,
    model: String,
    echo: Map<String, Value>,
    seq: u64,
    /// The output item being streamed.
    open: Option<Item>,
    items: usize,
    /// The conversation before this answer (stored with it).
    conversation: Vec<ChatMessage>,
    /// The request asked for log-probabilities.
    scored: bool,
    /// Reports of the tokens whose text comes next.
    pending: Vec<TokenLogprob>,
    /// The message's reports so far, as its `output_text` lists them.
    reports: Vec<Value>,
}

/// An output item while it streams.
struct Item {
    index: usize,
    /// Its item id (`msg_...` or `fc_...`).
    id: String,
    /// Its text, or its call's arguments, so far.
    acc: String,
    /// The call's id and function name; None for a message.
    call: Option<(String, String)>,
    /// Where its reports start in the writer's list (a message's).
    from: usize,
}

/// The id of the message item of response `resp_id`.
fn message_id(resp_id: &str) -> String {
    format!("msg_{}", resp_id.trim_start_matches("resp_"))
}

/// The id of the function-call item of call `call_id`.
fn call_item_id(call_id: &str) -> String {
    format!("fc_{}", call_id.trim_start_matches("call_"))
}

impl ResponsesWriter {
    /// A writer for the response `id`.
    pub fn new(id: String, p: &Parsed) -> Self {
        let (echo, conversation) = match (&p.dialect, &p.prompt) {
            (super::Dialect::Responses(o), Prompt::Chat(m)) => (o.echo.clone(), m.clone()),
            _ => (Map::new(), Vec::new()),
        };
        ResponsesWriter {
            id,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            model: p.model.clone(),
            echo,
            seq: 0,
            open: None,
            items: 0,
            conversation,
            scored: p.sampling.logprobs.is_some(),
            pending: Vec::new(),
            reports: Vec::new(),
        }
    }

    fn ev(&mut self, name: &'static str, mut data: Value) -> Ev {
        data["type"] = json!(name);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        Ev { name, data }
    }

    /// The response object with `status`, `output` and `usage`.
    fn object(&self, status: &str, output: Vec<Value>, usage: Value) -> Value {
        let mut r = json!({"id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "usage": usage, "error": null, "incomplete_details": null,
            "parallel_tool_calls": true, "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}},
            "instructions": null, "max_output_tokens": null, "previous_response_id": null, "metadata": {},
            "temperature": 1.0, "top_p": 1.0});
        for (k, v) in &self.echo {
            r[k] = v.clone();
        }
        r
    }

    fn close_item(&mut self, evs: &mut Vec<Ev>) {
        let Some(Item {
            index,
            id,
            acc,
            call: None,
            from,
        }) = self.open.take()
        else {
            return;
        };
        let mut part = json!({"type": "output_text", "text": acc, "annotations": []});
        let mut done =
            json!({"item_id": id, "output_index": index, "content_index": 0, "text": acc});
        if self.scored {
            let lps = json!(self.reports.get(from..).unwrap_or_default());
            part["logprobs"] = lps.clone();
            done["logprobs"] = lps;
        }
        let e = self.ev("response.output_text.done", done);
        evs.push(e);
        let e = self.ev(
            "response.content_part.done",
            json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
        );
        evs.push(e);
        let item = json!({"type": "message", "id": id, "status": "completed", "role": "assistant", "content": [part]});
        let e = self.ev(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
        evs.push(e);
    }
}

/// A token's report as a delta event lists it (no `bytes`).
fn without_bytes(v: &Value) -> Value {
    let mut v = v.clone();
    if let Some(o) = v.as_object_mut() {
        o.remove("bytes");
    }
    if let Some(top) = v["top_logprobs"].as_array_mut() {
        for t in top.iter_mut().filter_map(Value::as_object_mut) {
            t.remove("bytes");
        }
    }
    v
}

/// The output items; the message's text with its tokens' `reports` when
/// the request asked for them.
fn items(id: &str, out: &Collected, reports: Option<&[Value]>) -> Vec<Value> {
    let mut v = Vec::new();
    if !out.text.is_empty() {
        let mut part = json!({"type": "output_text", "text": out.text, "annotations": []});
        if let Some(r) = reports {
            part["logprobs"] = json!(r);
        }
        v.push(json!({"type": "message", "id": message_id(id), "status": "completed", "role": "assistant",
            "content": [part]}));
    }
    for c in &out.calls {
        v.push(
            json!({"type": "function_call", "id": call_item_id(&c.id), "call_id": c.id,
            "name": c.name, "arguments": c.arguments, "status": "completed"}),
        );
    }
    v
}

impl Writer for ResponsesWriter {
    fn open(&mut self) -> Vec<Ev> {
        let r = self.object("in_progress", Vec::new(), Value::Null);
        vec![
            self.ev("response.created", json!({"response": r})),
            self.ev("response.in_progress", json!({"response": r})),
        ]
    }

    fn piece(&mut self, p: &Piece) -> Vec<Ev> {
        let mut evs = Vec::new();
        match p {
            Piece::Text(t) => {
                if !matches!(self.open, Some(Item { call: None, .. })) {
                    self.close_item(&mut evs);
                    let index = self.items;
                    self.items += 1;
                    let id = message_id(&self.id);
                    let item = json!({"type": "message", "id": id, "status": "in_progress", "role": "assistant", "content": []});
                    let e = self.ev(
                        "response.output_item.added",
                        json!({"output_index": index, "item": item}),
                    );
                    evs.push(e);
                    let e = self.ev(
                        "response.content_part.added",
                        json!({"item_id": id, "output_index": index, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": []}}),
                    );
                    evs.push(e);
                    self.open = Some(Item {
                        index,
                        id,
                        acc: String::new(),
                        call: None,
                        from: self.reports.len(),
                    });
                }
                // The delta's tokens: without `bytes` in the event, with
                // them in the finished text (as OpenAI writes both).
                let full = match self.scored {
                    true => crate::inference::logprobs::chat(&std::mem::take(&mut self.pending))
                        ["content"]
                        .take(),
                    false => json!([]),
                };
                let delta_lps: Vec<Value> = full
                    .as_array()
                    .map(|a| a.iter().map(without_bytes).collect())
                    .unwrap_or_default();
                if let Some(a) = full.as_array() {
                    self.reports.extend(a.iter().cloned());
                }
                if let Some(it) = self.open.as_mut() {
                    it.acc.push_str(t);
                    let (index, id) = (it.index, it.id.clone());
                    let e = self.ev("response.output_text.delta", json!({"item_id": id, "output_index": index, "content_index": 0, "delta": t, "logprobs": delta_lps}));
                    evs.push(e);
                }
            }
            Piece::CallStart { id, name, .. } => {
                self.close_item(&mut evs);
                let index = self.items;
                self.items += 1;
                let item_id = call_item_id(id);
                let item = json!({"type": "function_call", "id": item_id, "call_id": id, "name": name, "arguments": "", "status": "in_progress"});
                let e = self.ev(
                    "response.output_item.added",
                    json!({"output_index": index, "item": item}),
                );
                evs.push(e);
                self.open = Some(Item {
                    index,
                    id: item_id,
                    acc: String::new(),
                    call: Some((id.clone(), name.clone())),
                    from: self.reports.len(),
                });
            }
            Piece::CallArgs { delta, .. } => {
                if let Some(it) = self.open.as_mut().filter(|it| it.call.is_some()) {
                    it.acc.push_str(delta);
                    let (index, id) = (it.index, it.id.clone());
                    let e = self.ev(
                        "response.function_call_arguments.delta",
                        json!({"item_id": id, "output_index": index, "delta": delta}),
                    );
                    evs.push(e);
                }
            }
            Piece::CallEnd { .. } => {
                if let Some(Item {
                    index,
                    id,
                    acc,
                    call: Some((call_id, name)),
                    ..
                }) = self.open.take()
                {
                    let e = self.ev(
                        "response.function_call_arguments.done",
                        json!({"item_id": id, "output_index": index, "arguments": acc}),
                    );
                    evs.push(e);
                    let item = json!({"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": acc, "status": "completed"});
                    let e = self.ev(
                        "response.output_item.done",
                        json!({"output_index": index, "item": item}),
                    );
                    evs.push(e);
                }
            }
        }
        evs
    }

    fn close(&mut self, out: &Collected, end: &Finished) -> Vec<Ev> {
        let mut evs = Vec::new();
        self.close_item(&mut evs);
        let r = self.whole(out, end);
        let name = if end.finish == FinishReason::Length {
            "response.incomplete"
        } else {
            "response.completed"
        };
        evs.push(self.ev(name, json!({"response": r})));
        evs
    }

    fn whole(&self, out: &Collected, end: &Finished) -> Value {
        let u = &end.usage;
        let usage = json!({"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens});
        let status = if end.finish == FinishReason::Length {
            "incomplete"
        } else {
            "completed"
        };
        let mut r = self.object(
            status,
            items(&self.id, out, self.scored.then_some(&self.reports[..])),
            usage,
        );
        if end.finish == FinishReason::Length {
            r["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        r
    }

    fn stored(&self, out: &Collected, end: &Finished) -> Value {
        let mut r = self.whole(out, end);
        // The conversation so far, for `previous_response_id`.
        let mut conv = self.conversation.clone();
        let calls: Vec<Value> = out
            .calls
            .iter()
            .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
            .collect();
        conv.push(ChatMessage {
            role: "assistant".into(),
            content: out.text.clone(),
            tool_calls: (!calls.is_empty()).then_some(Value::Array(calls)),
            ..Default::default()
        });
        r[CONVERSATION] = json!(conv);
        r
    }

    fn error(&mut self, body: &Value) -> Ev {
        let e = &body["error"];
        self.ev(
            "error",
            json!({"code": e["code"], "message": e["message"], "param": e["param"]}),
        )
    }

    fn logprobs(&mut self, mut tokens: Vec<TokenLogprob>) {
        if self.scored {
            self.pending.append(&mut tokens);
        }
    }

    fn ping(&mut self) -> Bytes {
        crate::inference::sse::comment("waiting")
    }

    fn failed(&self, error: &Value) -> Option<Value> {
        let mut r = self.object("failed", Vec::new(), Value::Null);
        r["error"] = json!({"code": error["error"]["code"], "message": error["error"]["message"]});
        Some(r)
    }
}

/// The conversation a stored response keeps, with its answer last (its
/// system messages left out: instructions are not carried over, as
/// OpenAI does).
pub fn conversation(result: &Value) -> Option<Vec<ChatMessage>> {
    let list = result.get(CONVERSATION)?.as_array()?;
    Some(
        list.iter()
            .filter(|m| m["role"] != "system")
            .map(|m| ChatMessage {
                role: m["role"].as_str().unwrap_or("user").to_string(),
                content: m["content"].as_str().unwrap_or_default().to_string(),
                tool_calls: m.get("tool_calls").filter(|c| c.is_array()).cloned(),
                tool_call_id: m["tool_call_id"].as_str().map(str::to_string),
            })
            .collect(),
    )
}

/// A stored response as `GET /v1/responses/{id}` shows it: the result if
/// finished, else the response in its current status.
pub fn view(job: &Value, model: &str) -> Value {
    let id = response_id(job["id"].as_str().unwrap_or_default());
    let mut r = match job.get("result") {
        Some(r) if r.is_object() => r.clone(),
        _ => json!({"id": id, "object": "response", "created_at": job["created"], "model": model,
            "output": [], "usage": null, "error": job.get("error").cloned().unwrap_or(Value::Null)}),
    };
    if let Value::Object(o) = &mut r {
        o.remove(CONVERSATION);
    }
    let status = match job["status"].as_str() {
        Some("completed") => r["status"].as_str().unwrap_or("completed").to_string(),
        Some(s) => s.to_string(),
        None => "failed".into(),
    };
    r["status"] = json!(status);
    r
}
