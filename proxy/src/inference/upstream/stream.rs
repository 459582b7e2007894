//! The SSE of one upstream response, turned into the backend's events:
//! tokens as they come, then one `Done` (with the upstream's usage when it
//! sent one) or one `Error` (malformed SSE, an error object).

use super::super::sse::Parser;
use serde_json::Value;
use std::time::Duration;
use ultrafast_engine::api::{Event, FinishReason, Usage};

/// What the SSE of one upstream response has said so far.
#[derive(Default)]
pub(super) struct StreamState {
    pub(super) parser: Parser,
    pub(super) finish: Option<FinishReason>,
    pub(super) usage: Option<Usage>,
    pub(super) chunks: usize,
    pub(super) done: bool,
    pub(super) failed: bool,
}

impl StreamState {
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
                self.done = true;
                out.push(self.done_event());
                return;
            }
            let v: Value = match serde_json::from_str(&d) {
                Ok(v) => v,
                Err(e) => {
                    self.failed = true;
                    out.push(Event::Error(format!("upstream sent malformed SSE: {e}")));
                    return;
                }
            };
            if let Some(err) = v.get("error") {
                self.failed = true;
                let msg = err["message"].as_str().unwrap_or("upstream error");
                out.push(Event::Error(format!("upstream error: {msg}")));
                return;
            }
            if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                let n = |k: &str| u[k].as_u64().unwrap_or(0) as usize;
                self.usage = Some(Usage {
                    prompt_tokens: n("prompt_tokens"),
                    completion_tokens: n("completion_tokens"),
                    cached_tokens: u["prompt_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .unwrap_or(0) as usize,
                });
            }
            let Some(c) = v["choices"].get(0) else {
                continue;
            };
            let text = c["delta"]["content"]
                .as_str()
                .or_else(|| c["text"].as_str())
                .unwrap_or("");
            if !text.is_empty() {
                self.chunks += 1;
                out.push(Event::Token {
                    id: 0,
                    text: text.to_string(),
                });
            }
            if let Some(f) = c["finish_reason"].as_str() {
                self.finish = Some(if f == "length" {
                    FinishReason::Length
                } else {
                    FinishReason::Stop
                });
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
    fn malformed_sse_is_an_error_event() {
        let mut st = StreamState::default();
        let mut out = Vec::new();
        st.feed(b"data: {not json\n\n", &mut out);
        assert!(matches!(&out[0], Event::Error(m) if m.contains("malformed")));
    }
}
