//! OpenAI's two shapes of log-probabilities, from the engine's reports:
//! chat's `logprobs.content` (each token with its `bytes` and
//! `top_logprobs`) and completions' legacy object (`tokens`,
//! `token_logprobs`, `top_logprobs`, `text_offset`). A stream's chunk
//! carries the reports of the tokens whose text it carries; a whole
//! response carries them all. The scores are of the distribution the model
//! produced, before temperature, penalties, bias or a grammar mask (as
//! OpenAI and vLLM report by default).

use serde_json::{json, Map, Value};
use ultrafast_engine::api::TokenLogprob;

/// What OpenAI writes for a probability of zero (JSON has no `-inf`).
const NEG_INF: f64 = -9999.0;

/// A score as JSON writes it: the f32's shortest decimal (as f64 it
/// would print as -0.10000000149011612).
fn lp(v: f32) -> f64 {
    if v.is_finite() {
        v.to_string().parse().unwrap_or(v as f64)
    } else {
        NEG_INF
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The shape a request gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Chat completions' `content` list.
    Chat,
    /// Completions' legacy object.
    Legacy,
}

/// Chat's `logprobs` object for these tokens.
pub fn chat(tokens: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let top: Vec<Value> = t
                .top
                .iter()
                .map(|a| json!({"token": text(&a.bytes), "logprob": lp(a.logprob), "bytes": a.bytes}))
                .collect();
            json!({"token": text(&t.bytes), "logprob": lp(t.logprob.unwrap_or(0.0)),
                "bytes": t.bytes, "top_logprobs": top})
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// Completions' legacy object, built a chunk at a time: `text_offset`
/// counts characters from the start of the response's text (the echoed
/// prompt included) across chunks, of the text as it is decoded whole: a
/// token that ends inside a character leaves its bytes for the next.
#[derive(Debug, Default)]
pub struct Legacy {
    offset: usize,
    /// Bytes of a character not complete yet.
    partial: Vec<u8>,
}

impl Legacy {
    /// Move past one token's bytes: the characters they complete.
    fn advance(&mut self, bytes: &[u8]) {
        self.partial.extend_from_slice(bytes);
        let mut rest: &[u8] = &self.partial;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    self.offset += s.chars().count();
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (ok, tail) = rest.split_at(e.valid_up_to());
                    self.offset += std::str::from_utf8(ok).map_or(0, |s| s.chars().count());
                    match e.error_len() {
                        // Invalid bytes decode as one U+FFFD each run.
                        Some(n) => {
                            self.offset += 1;
                            rest = &tail[n..];
                        }
                        // Incomplete: wait for the next token.
                        None => {
                            rest = tail;
                            break;
                        }
                    }
                }
            }
        }
        self.partial = rest.to_vec();
    }
}

impl Legacy {
    /// The object for `tokens`, the next ones of the response. A token's
    /// `top_logprobs` holds the alternatives and the token itself (as vLLM
    /// lists it); an unscored token (the prompt's first) has nulls.
    pub fn next(&mut self, tokens: &[TokenLogprob]) -> Value {
        let mut toks = Vec::with_capacity(tokens.len());
        let mut lps = Vec::with_capacity(tokens.len());
        let mut tops = Vec::with_capacity(tokens.len());
        let mut offs = Vec::with_capacity(tokens.len());
        for t in tokens {
            let s = text(&t.bytes);
            offs.push(self.offset);
            self.advance(&t.bytes);
            match t.logprob {
                None => {
                    lps.push(Value::Null);
                    tops.push(Value::Null);
                }
                Some(v) => {
                    lps.push(json!(lp(v)));
                    let mut m = Map::new();
                    for a in &t.top {
                        m.entry(text(&a.bytes)).or_insert(json!(lp(a.logprob)));
                    }
                    m.entry(s.clone()).or_insert(json!(lp(v)));
                    tops.push(Value::Object(m));
                }
            }
            toks.push(Value::String(s));
        }
        json!({"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs})
    }
}

/// A response's reports, as its sink receives them: those not yet
/// written, and the running state of the legacy shape.
#[derive(Debug)]
pub struct Reports {
    shape: Shape,
    pending: Vec<TokenLogprob>,
    legacy: Legacy,
}

impl Reports {
    /// Reports in `shape`.
    pub fn new(shape: Shape) -> Self {
        Reports {
            shape,
            pending: Vec::new(),
            legacy: Legacy::default(),
        }
    }

    /// More tokens' reports, for the next chunk (or the whole response).
    pub fn add(&mut self, mut tokens: Vec<TokenLogprob>) {
        self.pending.append(&mut tokens);
    }

    /// The `logprobs` value of the next chunk: the reports added since the
    /// last one.
    pub fn take(&mut self) -> Value {
        let tokens = std::mem::take(&mut self.pending);
        match self.shape {
            Shape::Chat => chat(&tokens),
            Shape::Legacy => self.legacy.next(&tokens),
        }
    }

    /// Whether reports wait for a chunk.
    pub fn waiting(&self) -> bool {
        !self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ultrafast_engine::api::Alt;

    fn tok(s: &str, lp: Option<f32>, top: &[(&str, f32)]) -> TokenLogprob {
        TokenLogprob {
            id: 0,
            bytes: s.as_bytes().to_vec(),
            logprob: lp,
            top: top
                .iter()
                .map(|(t, l)| Alt {
                    id: 1,
                    bytes: t.as_bytes().to_vec(),
                    logprob: *l,
                })
                .collect(),
        }
    }

    fn tok_bytes(b: &[u8]) -> TokenLogprob {
        TokenLogprob {
            id: 0,
            bytes: b.to_vec(),
            logprob: Some(-1.0),
            top: Vec::new(),
        }
    }

    #[test]
    fn chat_lists_tokens_with_bytes_and_alternatives() {
        let v = chat(&[tok(
            " Paris",
            Some(-0.5),
            &[(" Paris", -0.5), (" Lyon", f32::NEG_INFINITY)],
        )]);
        let c = &v["content"][0];
        assert_eq!(c["token"], " Paris");
        assert_eq!(c["logprob"], -0.5);
        assert_eq!(c["bytes"], json!([32, 80, 97, 114, 105, 115]));
        assert_eq!(c["top_logprobs"][1]["logprob"], NEG_INF);
        assert_eq!(v["refusal"], Value::Null);
    }

    #[test]
    fn legacy_offsets_run_across_chunks_and_the_first_token_is_null() {
        let mut r = Reports::new(Shape::Legacy);
        r.add(vec![
            tok("Hé", None, &[]),
            tok("llo", Some(-1.0), &[("llo", -1.0)]),
        ]);
        let a = r.take();
        assert_eq!(a["tokens"], json!(["Hé", "llo"]));
        assert_eq!(a["token_logprobs"], json!([null, -1.0]));
        assert_eq!(a["top_logprobs"], json!([null, {"llo": -1.0}]));
        assert_eq!(a["text_offset"], json!([0, 2]));
        assert!(!r.waiting());
        r.add(vec![tok(" x", Some(-3.0), &[(" y", -0.1)])]);
        let b = r.take();
        assert_eq!(b["text_offset"], json!([5]));
        // A character split across tokens counts once, where it completes.
        let mut l = Legacy::default();
        let ja = "日本".as_bytes();
        let v = l.next(&[
            tok_bytes(&ja[..2]),
            tok_bytes(&ja[2..4]),
            tok_bytes(&ja[4..]),
            tok_bytes(b"x"),
        ]);
        assert_eq!(v["text_offset"], json!([0, 0, 1, 2]));
        // The chosen token is listed beside the alternatives.
        assert_eq!(b["top_logprobs"], json!([{" y": -0.1, " x": -3.0}]));
    }
}
