//! The SSE of one upstream response, turned into the backend's events:
//! tokens as they come, then one `Done` (with the upstream's usage when it
//! sent one) or one `Error` (malformed SSE, an error object).
//!
//! In the pass-through (`RawSse`), events are forwarded as they are
//! (`Event::Raw`, all the events of one read together) and only scanned:
//! for their boundaries, for whether they carry text (counted as a token),
//! and for the few that need a parse (a finish, usage, an error), which
//! then go through the same reading as above.

use super::super::sse::Parser;
use serde::Deserialize;
use serde_json::Value;
use std::borrow::Cow;
use std::ops::ControlFlow;
use std::time::Duration;
use ultrafast_engine::api::{Alt, Event, FinishReason, RawSse, TokenLogprob, Usage};

/// The fields of an OpenAI stream chunk the relay reads.
#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(borrow)]
    choices: Option<Vec<Choice<'a>>>,
    usage: Option<Value>,
    error: Option<Value>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(borrow)]
    delta: Option<Delta<'a>>,
    #[serde(borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow)]
    finish_reason: Option<Cow<'a, str>>,
    /// vLLM's: the stop string (or token id) that ended the choice.
    stop_reason: Option<Value>,
    /// The chunk's tokens' scores (`logprobs`), in chat's or the legacy
    /// shape.
    logprobs: Option<Value>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(borrow)]
    content: Option<Cow<'a, str>>,
    tool_calls: Option<Value>,
}

/// An upstream chunk's scores as the engine reports them (ids unknown: 0),
/// before the chunk's text: chat's `content` list (each entry's `bytes`,
/// else its token's UTF-8) or the legacy object (`tokens`,
/// `token_logprobs`, `top_logprobs` maps). Anything else adds nothing.
fn reports(lp: &Value, out: &mut Vec<Event>) {
    let bytes = |e: &Value, token: &str| -> Vec<u8> {
        match e["bytes"].as_array() {
            Some(b) => b
                .iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as u8)
                .collect(),
            None => token.as_bytes().to_vec(),
        }
    };
    let alt = |b: Vec<u8>, l: &Value| Alt {
        id: 0,
        bytes: b,
        logprob: l.as_f64().unwrap_or(f64::NEG_INFINITY) as f32,
    };
    if let Some(content) = lp["content"].as_array() {
        for e in content {
            let token = e["token"].as_str().unwrap_or_default();
            let top = e["top_logprobs"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|x| {
                            let t = x["token"].as_str().unwrap_or_default();
                            alt(bytes(x, t), &x["logprob"])
                        })
                        .collect()
                })
                .unwrap_or_default();
            out.push(Event::Logprob(Box::new(TokenLogprob {
                id: 0,
                bytes: bytes(e, token),
                logprob: e["logprob"].as_f64().map(|l| l as f32),
                top,
            })));
        }
    } else if let Some(tokens) = lp["tokens"].as_array() {
        for (i, t) in tokens.iter().enumerate() {
            let token = t.as_str().unwrap_or_default();
            let chosen = lp["token_logprobs"][i].as_f64().map(|l| l as f32);
            let mut top: Vec<Alt> = lp["top_logprobs"][i]
                .as_object()
                .map(|m| {
                    m.iter()
                        .map(|(k, v)| alt(k.as_bytes().to_vec(), v))
                        .collect()
                })
                .unwrap_or_default();
            top.sort_by(|a, b| b.logprob.total_cmp(&a.logprob));
            out.push(Event::Logprob(Box::new(TokenLogprob {
                id: 0,
                bytes: token.as_bytes().to_vec(),
                logprob: chosen,
                top,
            })));
        }
    }
}

/// The end of a call's arguments object and of its block.
const CLOSE_CALL: &str = "}</tool_call>";

/// What the SSE of one upstream response has said so far.
#[derive(Default)]
pub(super) struct StreamState {
    pub(super) parser: Parser,
    pub(super) finish: Option<FinishReason>,
    pub(super) usage: Option<Usage>,
    pub(super) chunks: usize,
    pub(super) done: bool,
    pub(super) failed: bool,
    /// The index of the tool call being streamed, if one is open, and
    /// whether any of its arguments came.
    call: Option<(u64, bool)>,
    /// The request's stop sequences.
    stops: Vec<String>,
    /// Set for the pass-through: events go out as `Event::Raw`.
    raw: Option<RawSse>,
    /// The pass-through's events from the finish chunk on, held for the
    /// end (the finish chunk gets the edge's timing there).
    tail: Forwarded,
    /// The pass-through is holding events for the end.
    holding: bool,
}

impl StreamState {
    /// A stream of a request with these stop sequences (so that vLLM's
    /// `stop_reason` names which one ended it).
    pub(super) fn with_stops(stops: &[String]) -> Self {
        StreamState {
            stops: stops.to_vec(),
            ..StreamState::default()
        }
    }

    /// Forward the events as they are (the pass-through).
    pub(super) fn forwarding(mut self, raw: Option<RawSse>) -> Self {
        self.raw = raw;
        self
    }

    /// Turn bytes into events (tokens, then at most one `Done` or `Error`).
    pub(super) fn feed(&mut self, bytes: &[u8], out: &mut Vec<Event>) {
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
        // Sized once for what came in (what goes out is about that, plus
        // framing): a growing string reallocates, which costs more than
        // the copy.
        let mut raw = Forwarded {
            sse: String::with_capacity(if self.raw.is_some() {
                bytes.len() + 16
            } else {
                0
            }),
            tokens: 0,
        };
        for d in datas {
            if d.trim() == "[DONE]" {
                raw.flush(out);
                self.tail.flush_end(out);
                self.close_call(out);
                self.done = true;
                out.push(self.done_event());
                return;
            }
            let step = match self.raw {
                Some(mode) => self.forward(&d, mode, &mut raw, out),
                None => self.read(&d, out),
            };
            if step.is_break() {
                return;
            }
        }
        raw.flush(out);
    }

    /// Read one event's data into events.
    fn read(&mut self, d: &str, out: &mut Vec<Event>) -> ControlFlow<()> {
        // The typed, borrowing parse first (a token's text is usually
        // borrowed straight from the bytes); anything it cannot read goes
        // through the lenient `Value` path, as before.
        match serde_json::from_str::<Chunk<'_>>(d) {
            Ok(c) => self.typed(c, out),
            Err(_) => match serde_json::from_str::<Value>(d) {
                Ok(v) => self.value(&v, out),
                Err(e) => {
                    self.failed = true;
                    out.push(Event::Error(format!("upstream sent malformed SSE: {e}")));
                    ControlFlow::Break(())
                }
            },
        }
    }

    /// The pass-through of one event: scanned, and read only when it
    /// finishes, counts or fails; forwarded unless it is an error or the
    /// usage chunk of a client that did not ask for one.
    fn forward(
        &mut self,
        d: &str,
        mode: RawSse,
        raw: &mut Forwarded,
        out: &mut Vec<Event>,
    ) -> ControlFlow<()> {
        let b = d.as_bytes();
        // Something that cannot be one JSON object (a cut or garbled event,
        // or two events run together without the blank line between them)
        // is read too, so that it fails as malformed, as it would parsed.
        let object = {
            let t = b.trim_ascii();
            t.first() == Some(&b'{')
                && t.last() == Some(&b'}')
                && memchr::memchr(b'\n', t).is_none()
        };
        let set = |v: &[u8]| !v.starts_with(b"null") && !v.starts_with(b"\"\"");
        let read = !object
            || [&b"\"finish_reason\""[..], b"\"usage\"", b"\"error\""]
                .iter()
                .any(|k| value_at(b, k).is_some_and(set));
        if !read {
            let tokens = usize::from(carries_text(b));
            self.chunks += tokens;
            let to = if self.holding { &mut self.tail } else { raw };
            to.push(d, tokens);
            return ControlFlow::Continue(());
        }
        let had_usage = self.usage.is_some();
        let mut seen = Vec::new();
        if self.read(d, &mut seen).is_break() {
            raw.flush(out);
            out.append(&mut seen);
            return ControlFlow::Break(());
        }
        let tokens = seen
            .iter()
            .filter(|e| matches!(e, Event::Token { .. }))
            .count();
        let usage_only = tokens == 0
            && !had_usage
            && self.usage.is_some()
            && value_at(b, b"\"finish_reason\"").is_none_or(|v| !set(v));
        // From the finish chunk (or the usage chunk, when the server sent
        // no finish) on, events wait for the end: the edge adds its timing
        // there and writes no finish or usage of its own.
        self.holding |= self.finish.is_some() || usage_only;
        if !usage_only || mode.usage {
            let to = if self.holding { &mut self.tail } else { raw };
            to.push(d, tokens);
        }
        ControlFlow::Continue(())
    }

    fn typed(&mut self, c: Chunk<'_>, out: &mut Vec<Event>) -> ControlFlow<()> {
        if let Some(err) = c.error {
            return self.error(&err, out);
        }
        if let Some(u) = c.usage.filter(|u| u.is_object()) {
            self.usage(&u);
        }
        let Some(choice) = c.choices.and_then(|v| v.into_iter().next()) else {
            return ControlFlow::Continue(());
        };
        let (content, calls) = match choice.delta {
            Some(d) => (d.content, d.tool_calls),
            None => (None, None),
        };
        let text = content.or(choice.text).unwrap_or_default();
        if let Some(calls) = calls {
            self.tool_calls(&calls, out);
        }
        if let Some(lp) = &choice.logprobs {
            reports(lp, out);
        }
        self.token(&text, choice.finish_reason.as_deref(), out);
        self.stop_reason(choice.stop_reason.as_ref());
        ControlFlow::Continue(())
    }

    fn value(&mut self, v: &Value, out: &mut Vec<Event>) -> ControlFlow<()> {
        if let Some(err) = v.get("error") {
            return self.error(err, out);
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            self.usage(u);
        }
        let Some(c) = v["choices"].get(0) else {
            return ControlFlow::Continue(());
        };
        let text = c["delta"]["content"]
            .as_str()
            .or_else(|| c["text"].as_str())
            .unwrap_or("");
        self.tool_calls(&c["delta"]["tool_calls"], out);
        reports(&c["logprobs"], out);
        self.token(text, c["finish_reason"].as_str(), out);
        self.stop_reason(c.get("stop_reason"));
        ControlFlow::Continue(())
    }

    /// An upstream's `tool_calls` deltas as the engine writes calls
    /// (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`), so that
    /// one reader (`shape::Shaper`) turns either into each dialect's calls.
    fn tool_calls(&mut self, calls: &Value, out: &mut Vec<Event>) {
        let Some(calls) = calls.as_array() else {
            return;
        };
        for c in calls {
            let index = c["index"].as_u64().unwrap_or(0);
            let mut text = String::new();
            if self.call.map(|c| c.0) != Some(index) {
                self.close_into(&mut text);
                let name = c["function"]["name"].as_str().unwrap_or_default();
                text.push_str(ultrafast_engine::guide::CALL_OPEN);
                text.push_str("{\"name\": ");
                text.push_str(&Value::from(name).to_string());
                text.push_str(", \"arguments\": ");
                self.call = Some((index, false));
            }
            // Arguments are a JSON string by the protocol; a server that
            // sends the object itself is read as its text.
            let args = match &c["function"]["arguments"] {
                Value::String(a) => a.clone(),
                Value::Null => String::new(),
                other => other.to_string(),
            };
            if !args.trim().is_empty() {
                text.push_str(&args);
                if let Some(c) = self.call.as_mut() {
                    c.1 = true;
                }
            }
            if !text.is_empty() {
                self.chunks += 1;
                out.push(Event::Token { id: 0, text });
            }
        }
    }

    /// End the open tool call, if any.
    fn close_call(&mut self, out: &mut Vec<Event>) {
        let mut text = String::new();
        self.close_into(&mut text);
        if !text.is_empty() {
            out.push(Event::Token { id: 0, text });
        }
    }

    /// The end of the open call, if any (`{}` for a call that sent no
    /// arguments, so its block stays well formed).
    fn close_into(&mut self, text: &mut String) {
        if let Some((_, sent)) = self.call.take() {
            if !sent {
                text.push_str("{}");
            }
            text.push_str(CLOSE_CALL);
        }
    }

    fn error(&mut self, err: &Value, out: &mut Vec<Event>) -> ControlFlow<()> {
        self.failed = true;
        let msg = err["message"].as_str().unwrap_or("upstream error");
        out.push(Event::Error(format!("upstream error: {msg}")));
        ControlFlow::Break(())
    }

    fn usage(&mut self, u: &Value) {
        let n = |k: &str| u[k].as_u64().unwrap_or(0) as usize;
        self.usage = Some(Usage {
            prompt_tokens: n("prompt_tokens"),
            completion_tokens: n("completion_tokens"),
            cached_tokens: u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0) as usize,
        });
    }

    fn token(&mut self, text: &str, finish: Option<&str>, out: &mut Vec<Event>) {
        if !text.is_empty() {
            self.chunks += 1;
            out.push(Event::Token {
                id: 0,
                text: text.to_string(),
            });
        }
        // Some servers send `""` for "not yet": only a reason ends it.
        if let Some(f) = finish.filter(|f| !f.is_empty()) {
            self.close_call(out);
            self.finish = Some(if f == "length" {
                FinishReason::Length
            } else {
                FinishReason::Stop
            });
        }
    }

    /// A `stop` finish that vLLM says was one of the request's stop
    /// strings becomes that stop sequence's finish.
    fn stop_reason(&mut self, r: Option<&Value>) {
        let Some(Value::String(s)) = r else { return };
        if self.finish == Some(FinishReason::Stop) {
            // Indexed as the engine's: among the non-empty stop strings.
            let mut nonempty = self.stops.iter().filter(|x| !x.is_empty());
            if let Some(i) = nonempty.position(|x| x == s) {
                self.finish = Some(FinishReason::StopSequence(i));
            }
        }
    }

    pub(super) fn done_event(&self) -> Event {
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

/// The events of one read that go out as they are.
#[derive(Default)]
struct Forwarded {
    sse: String,
    tokens: usize,
}

impl Forwarded {
    /// One event's data, framed again as the upstream framed it (a
    /// multi-line data keeps one `data:` line per line).
    fn push(&mut self, data: &str, tokens: usize) {
        self.sse.push_str("data: ");
        if data.contains('\n') {
            self.sse.push_str(&data.replace('\n', "\ndata: "));
        } else {
            self.sse.push_str(data);
        }
        self.sse.push_str("\n\n");
        self.tokens += tokens;
    }

    /// What was gathered, as one event for the consumer.
    fn flush(&mut self, out: &mut Vec<Event>) {
        self.emit(out, false);
    }

    /// What was gathered, as the stream's last events.
    fn flush_end(&mut self, out: &mut Vec<Event>) {
        self.emit(out, true);
    }

    fn emit(&mut self, out: &mut Vec<Event>, end: bool) {
        if !self.sse.is_empty() {
            out.push(Event::Raw {
                sse: std::mem::take(&mut self.sse),
                tokens: std::mem::take(&mut self.tokens),
                end,
            });
        }
    }
}

/// The keys the pass-through looks for.
const KEYS: [&[u8]; 6] = [
    b"\"finish_reason\"",
    b"\"usage\"",
    b"\"error\"",
    b"\"content\"",
    b"\"text\"",
    b"\"tool_calls\"",
];

/// The bytes after the first `key` (a quoted JSON key) and its colon,
/// whitespace skipped; None when the key is absent. A key's quotes cannot
/// occur unescaped inside a JSON string, so a match is a key (or a string
/// value of that spelling, which only costs a parse).
fn value_at<'a>(b: &'a [u8], key: &[u8]) -> Option<&'a [u8]> {
    // Building a searcher costs more than searching one short event: the
    // keys' searchers are built once.
    static FINDERS: std::sync::LazyLock<Vec<memchr::memmem::Finder<'static>>> =
        std::sync::LazyLock::new(|| KEYS.iter().map(memchr::memmem::Finder::new).collect());
    let at = match KEYS.iter().position(|k| *k == key) {
        Some(i) => FINDERS[i].find(b)?,
        None => memchr::memmem::find(b, key)?,
    };
    let rest = b[at + key.len()..].trim_ascii_start();
    let rest = rest.strip_prefix(b":")?;
    Some(rest.trim_ascii_start())
}

/// Whether a chunk carries output: non-empty `content` or `text`, or tool
/// calls.
fn carries_text(b: &[u8]) -> bool {
    let nonempty = |v: &[u8]| v.starts_with(b"\"") && v.get(1).is_some_and(|&c| c != b'"');
    value_at(b, b"\"content\"").is_some_and(nonempty)
        || value_at(b, b"\"text\"").is_some_and(nonempty)
        || value_at(b, b"\"tool_calls\"").is_some_and(|v| v.starts_with(b"["))
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
    fn odd_but_valid_chunks_read_as_before() {
        let mut st = StreamState::default();
        let mut out = Vec::new();
        // Escapes (an owned string), nulls, a non-string text, an empty
        // choice list, legacy completions' `text`, a string error.
        st.feed(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"a\\\"b\\n\"}}]}\n\n",
            &mut out,
        );
        st.feed(b"data: {\"choices\":null,\"usage\":null}\n\n", &mut out);
        st.feed(
            b"data: {\"choices\":[{\"delta\":null,\"text\":\"t\"}]}\n\n",
            &mut out,
        );
        st.feed(b"data: {\"choices\":[{\"text\":5}]}\n\n", &mut out);
        st.feed(b"data: {\"choices\":[]}\n\n", &mut out);
        let texts: Vec<_> = out
            .iter()
            .map(|e| match e {
                Event::Token { text, .. } => text.clone(),
                e => panic!("{e:?}"),
            })
            .collect();
        assert_eq!(texts, ["a\"b\n", "t"]);
        st.feed(b"data: {\"error\":\"overloaded\"}\n\n", &mut out);
        assert!(matches!(&out[2], Event::Error(m) if m == "upstream error: upstream error"));
    }

    /// The text of the token events.
    fn token_text(out: &[Event]) -> String {
        out.iter()
            .filter_map(|e| match e {
                Event::Token { text, .. } => Some(text.as_str()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn tool_call_deltas_become_call_blocks() {
        let mut st = StreamState::default();
        let mut out = Vec::new();
        st.feed(b"data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"\"}}]}}]}\n\n", &mut out);
        st.feed(b"data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\\\"a\\\": 1}\"}}]}}]}\n\n", &mut out);
        st.feed(b"data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":1,\"id\":\"c2\",\"function\":{\"name\":\"g\",\"arguments\":\"{}\"}}]}}]}\n\n", &mut out);
        st.feed(b"data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\ndata: [DONE]\n\n", &mut out);
        let text = token_text(&out);
        assert_eq!(
            text,
            r#"<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>"#
        );
        let mut sh = crate::inference::shape::Shaper::default();
        let mut pieces = sh.push(&text);
        pieces.extend(sh.finish());
        assert_eq!(sh.calls(), 2, "{pieces:?}");
    }

    #[test]
    fn a_call_without_arguments_is_still_a_well_formed_block() {
        let mut st = StreamState::default();
        let mut out = Vec::new();
        st.feed(b"data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"a\",\"function\":{\"name\":\"f\",\"arguments\":\"\"}}]}}]}\n\n", &mut out);
        st.feed(b"data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":1,\"id\":\"b\",\"function\":{\"name\":\"g\",\"arguments\":{\"x\":1}}}]}}]}\n\ndata: [DONE]\n\n", &mut out);
        let text = token_text(&out);
        let mut sh = crate::inference::shape::Shaper::default();
        let mut col = crate::inference::shape::Collected::default();
        for p in sh.push(&text).iter().chain(sh.finish().iter()) {
            col.add(p);
        }
        assert_eq!(col.calls.len(), 2, "{text}");
        assert_eq!(col.calls[0].arguments, "{}");
        assert_eq!(col.calls[1].arguments, r#"{"x":1}"#);
    }

    #[test]
    fn vllms_stop_reason_names_the_stop_sequence() {
        let mut st = StreamState::with_stops(&["".into(), "END".into(), "\n\n".into()]);
        let mut out = Vec::new();
        st.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\",\"stop_reason\":\"\\n\\n\"}]}\n\ndata: [DONE]\n\n", &mut out);
        assert!(
            matches!(
                out.last(),
                Some(Event::Done {
                    finish: FinishReason::StopSequence(1),
                    ..
                })
            ),
            "{out:?}"
        );
        // A stop token id, or no stop_reason, is the end of the text.
        let mut st = StreamState::with_stops(&["END".into()]);
        let mut out = Vec::new();
        st.feed(b"data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\",\"stop_reason\":2}]}\n\ndata: [DONE]\n\n", &mut out);
        assert!(
            matches!(
                out.last(),
                Some(Event::Done {
                    finish: FinishReason::Stop,
                    ..
                })
            ),
            "{out:?}"
        );
    }

    #[test]
    fn the_pass_through_forwards_events_and_holds_the_finish_for_the_end() {
        let role = b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n";
        let text = b"data: {\"choices\": [{\"delta\": {\"content\": \"Hi\"}, \"finish_reason\": null}]}\n\n";
        let tail = b"data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"length\"}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n";
        for usage in [false, true] {
            let mut st = StreamState::default().forwarding(Some(RawSse { usage }));
            let mut out = Vec::new();
            st.feed(role, &mut out);
            st.feed(text, &mut out);
            st.feed(tail, &mut out);
            let raws: Vec<(&str, usize, bool)> = out
                .iter()
                .filter_map(|e| match e {
                    Event::Raw { sse, tokens, end } => Some((sse.as_str(), *tokens, *end)),
                    _ => None,
                })
                .collect();
            // Forwarded as they came: the role chunk counts no token.
            assert_eq!(raws[0], (std::str::from_utf8(role).unwrap(), 0, false));
            assert_eq!(raws[1], (std::str::from_utf8(text).unwrap(), 1, false));
            // The finish chunk (and the usage chunk, if asked for) last.
            assert!(raws[2].2 && raws[2].0.contains("\"length\""));
            assert_eq!(raws[2].0.contains("usage"), usage, "{}", raws[2].0);
            assert_eq!(raws.len(), 3);
            match out.last().unwrap() {
                Event::Done { finish, usage, .. } => {
                    assert_eq!(*finish, FinishReason::Length);
                    assert_eq!(usage.completion_tokens, 1);
                }
                e => panic!("{e:?}"),
            }
        }
        // A `""` finish is no finish: nothing is held back for it.
        let mut st = StreamState::default().forwarding(Some(RawSse { usage: true }));
        let mut out = Vec::new();
        st.feed(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"},\"finish_reason\":\"\"}]}\n\n",
            &mut out,
        );
        assert!(
            matches!(
                &out[..],
                [Event::Raw {
                    tokens: 1,
                    end: false,
                    ..
                }]
            ),
            "{out:?}"
        );
        // A usage chunk without a finish before it starts the held tail (the
        // sink then writes no usage of its own).
        st.feed(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n", &mut out);
        assert!(matches!(&out[1], Event::Raw { end: true, .. }), "{out:?}");
        // A garbled event, an error object, or two events run together
        // without the blank line between them fail as they do parsed.
        for bad in [
            &b"data: {not json\n\n"[..],
            b"data: {\"error\":{\"message\":\"boom\"}}\n\n",
            b"data: {\"choices\":[]}\ndata: {\"choices\":[]}\n\n",
        ] {
            let mut st = StreamState::default().forwarding(Some(RawSse { usage: false }));
            let mut out = Vec::new();
            st.feed(text, &mut out);
            st.feed(bad, &mut out);
            assert!(matches!(out.last(), Some(Event::Error(_))), "{out:?}");
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
