//! The SSE of one upstream response, turned into the backend's events:
//! tokens as they come, then one `Done` (with the upstream's usage when it
//! sent one) or one `Error` (malformed SSE, an error object).

use super::super::sse::Parser;
use serde::Deserialize;
use serde_json::Value;
use std::borrow::Cow;
use std::ops::ControlFlow;
use std::time::Duration;
use ultrafast_engine::api::{Event, FinishReason, Usage};

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
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(borrow)]
    content: Option<Cow<'a, str>>,
    tool_calls: Option<Value>,
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
        for d in datas {
            if d.trim() == "[DONE]" {
                self.close_call(out);
                self.done = true;
                out.push(self.done_event());
                return;
            }
            // The typed, borrowing parse first (a token's text is usually
            // borrowed straight from the bytes); anything it cannot read
            // goes through the lenient `Value` path, as before.
            let step = match serde_json::from_str::<Chunk<'_>>(&d) {
                Ok(c) => self.typed(c, out),
                Err(_) => match serde_json::from_str::<Value>(&d) {
                    Ok(v) => self.value(&v, out),
                    Err(e) => {
                        self.failed = true;
                        out.push(Event::Error(format!("upstream sent malformed SSE: {e}")));
                        return;
                    }
                },
            };
            if step.is_break() {
                return;
            }
        }
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
        if let Some(f) = finish {
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
    fn malformed_sse_is_an_error_event() {
        let mut st = StreamState::default();
        let mut out = Vec::new();
        st.feed(b"data: {not json\n\n", &mut out);
        assert!(matches!(&out[0], Event::Error(m) if m.contains("malformed")));
    }
}
