//! Structured decoding with `llguidance` (the library vLLM and llama.cpp
//! use): a request's `Structure` (a JSON schema, or tool calls) is compiled
//! into a grammar once, at `prepare`, and each constrained sequence carries
//! a `Guide` that gives the allowed-token mask before each sample and is
//! told each token after it. The scheduler computes the masks of a step's
//! constrained sequences on a thread of its own while the forward pass runs
//! (`scheduler`), so unconstrained sequences in the batch do not wait for
//! them.
//!
//! Tool calls are written as Hermes/Qwen2.5 `<tool_call>` blocks, each a
//! JSON object `{"name": ..., "arguments": {...}}` whose arguments follow
//! that tool's schema: the format tool-trained models already produce, and
//! the one the front turns into each API's tool-call shape.

use crate::api::{Structure, Tool, ToolChoice};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{self, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use std::sync::Arc;

pub use crate::api::{CALL_CLOSE, CALL_OPEN};

/// The byte-level BPE's map from its printable stand-ins back to bytes
/// (GPT-2's `bytes_to_unicode`, inverted).
fn byte_level_map() -> std::collections::HashMap<char, u8> {
    let mut m = std::collections::HashMap::new();
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('\0')
        };
        m.insert(c, b);
    }
    m
}

/// The token vocabulary as bytes, for the grammar's token trie: byte-level
/// pieces decoded, control tokens marked as llguidance expects so that a
/// grammar never produces them as text. User-defined tokens (Qwen2.5's
/// `<tool_call>`) are text, as llama.cpp and Hugging Face treat them.
pub fn token_bytes(tokens: &[String], special: &[bool]) -> Vec<Vec<u8>> {
    let map = byte_level_map();
    tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if special.get(i).copied().unwrap_or(false) {
                let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                b.extend_from_slice(t.as_bytes());
                return b;
            }
            let mut out = Vec::with_capacity(t.len());
            for c in t.chars() {
                match map.get(&c) {
                    Some(b) => out.push(*b),
                    None => {
                        let mut buf = [0u8; 4];
                        out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                    }
                }
            }
            out
        })
        .collect()
}

/// The grammar compiler of one model (its vocabulary), shared by all its
/// requests.
pub struct Guides {
    factory: ParserFactory,
}

impl std::fmt::Debug for Guides {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Guides")
    }
}

impl Guides {
    /// A compiler for the vocabulary `bytes` (see `token_bytes`) whose
    /// end-of-sequence token is `eos`.
    pub fn new(bytes: &[Vec<u8>], eos: u32) -> Result<Self, String> {
        let info = TokRxInfo::new(bytes.len() as u32, eos);
        let trie = TokTrie::from(&info, bytes);
        let env: TokEnv = Arc::new(toktrie::ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        // Grammar warnings are the client's problem, returned as errors;
        // nothing is printed to the server's stderr.
        factory.quiet();
        Ok(Guides { factory })
    }

    /// A compiler for a GGUF model's vocabulary (`tokenizer.ggml.tokens`,
    /// control tokens marked special).
    pub fn from_gguf(
        ct: &candle_core::quantized::gguf_file::Content,
        eos: u32,
    ) -> Result<Self, String> {
        let md = |k: &str| ct.metadata.get(k).and_then(|v| v.to_vec().ok());
        let tokens: Vec<String> = md("tokenizer.ggml.tokens")
            .ok_or("the GGUF has no `tokenizer.ggml.tokens`")?
            .iter()
            .map(|v| v.to_string().cloned().unwrap_or_default())
            .collect();
        let special: Vec<bool> = md("tokenizer.ggml.token_type")
            .map(|t| {
                t.iter()
                    .map(|x| matches!(x.to_i32(), Ok(3) | Ok(4)))
                    .collect()
            })
            .unwrap_or_default();
        Guides::new(&token_bytes(&tokens, &special), eos)
    }

    /// Compile `s` for one request. The error is the library's own words
    /// about what it cannot compile (the front makes it a 400).
    pub fn compile(&self, s: &Structure) -> Result<Guide, String> {
        let grammar = grammar(s)?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| e.to_string())?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(e);
        }
        Ok(Guide { m })
    }
}

/// JSON as the output writes it: no free whitespace (a small model given
/// free whitespace can pad forever), `", "` and `": "` as separators.
fn x_guidance(mut schema: Value) -> Value {
    if let Value::Object(o) = &mut schema {
        o.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// The schema of one call: its name, then arguments by the tool's schema.
fn call_schema(t: &Tool) -> Value {
    json!({
        "type": "object",
        "properties": {"name": {"const": t.name}, "arguments": t.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": false,
    })
}

fn grammar(s: &Structure) -> Result<TopLevelGrammar, String> {
    match s {
        Structure::Json(schema) => {
            if !schema.is_object() && !schema.is_boolean() {
                return Err("the JSON schema must be an object".into());
            }
            Ok(TopLevelGrammar::from_json_schema(x_guidance(
                schema.clone(),
            )))
        }
        Structure::Tools {
            tools,
            choice,
            parallel,
        } => {
            let chosen: Vec<&Tool> = match choice {
                ToolChoice::Named(n) => {
                    let t = tools
                        .iter()
                        .find(|t| &t.name == n)
                        .ok_or_else(|| format!("tool_choice names `{n}`, which is not in tools"))?;
                    vec![t]
                }
                _ => tools.iter().collect(),
            };
            if chosen.is_empty() {
                return Err("tools is empty".into());
            }
            let one_of: Vec<Value> = chosen.iter().map(|t| call_schema(t)).collect();
            let schema = x_guidance(json!({"anyOf": one_of}));
            let schema = serde_json::to_string(&schema).map_err(|e| e.to_string())?;
            let many = *parallel && !matches!(choice, ToolChoice::Named(_));
            let calls = if many { "call (\"\\n\" call)*" } else { "call" };
            // A text answer neither begins with `<` nor holds a call
            // anywhere, so that every call there is, is held to the
            // call's grammar.
            let start = match choice {
                ToolChoice::Auto => format!(
                    "start: calls | TEXT\nTEXT: /[^<](?s:.)*/ & ~/(?s:.*){}(?s:.*)/\n",
                    CALL_OPEN
                ),
                _ => "start: calls\n".to_string(),
            };
            let lark = format!(
                "{start}calls: {calls}\ncall: {open:?} args {close:?}\nargs: %json {schema}\n",
                open = CALL_OPEN,
                close = CALL_CLOSE,
            );
            Ok(TopLevelGrammar::from_lark(lark))
        }
    }
}

/// The text that tells a model without a tool-aware template which tools
/// it has and how to call them (Hermes's wording, which Qwen2.5's template
/// also uses).
pub fn tools_prompt(tools: &[Tool]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        let sig = json!({"type": "function", "function": t});
        s.push('\n');
        s.push_str(&sig.to_string());
    }
    s.push_str("\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>");
    s
}

/// One constrained sequence's grammar state.
pub struct Guide {
    m: Matcher,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Guide")
    }
}

impl Clone for Guide {
    fn clone(&self) -> Self {
        Guide {
            m: self.m.deep_clone(),
        }
    }
}

/// The tokens allowed next.
pub struct Mask(llguidance::toktrie::SimpleVob);

impl Mask {
    /// Set every disallowed logit to minus infinity.
    pub fn apply(&self, logits: &mut [f32]) {
        // A head padded past the vocabulary: those rows are never allowed.
        let n = self.0.len();
        for (i, l) in logits.iter_mut().enumerate() {
            if i >= n || !self.0.is_allowed(i as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    /// Whether `token` is allowed.
    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.0.len() && self.0.is_allowed(token)
    }
}

impl Guide {
    /// The tokens allowed next (end-of-sequence alone once the grammar is
    /// complete).
    pub fn mask(&mut self) -> Result<Mask, String> {
        self.m
            .compute_mask_or_eos()
            .map(Mask)
            .map_err(|e| format!("structured output: {e}"))
    }

    /// Advance past `token`.
    pub fn commit(&mut self, token: u32) -> Result<(), String> {
        self.m
            .consume_token(token)
            .map_err(|e| format!("structured output: {e}"))
    }

    /// Whether the grammar has ended (only end-of-sequence may follow).
    pub fn finished(&self) -> bool {
        self.m.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_stand_ins_map_back_to_bytes() {
        let b = token_bytes(
            &["Ġhi".into(), "Ċ".into(), "<|im_end|>".into()],
            &[false, false, true],
        );
        assert_eq!(b[0], b" hi");
        assert_eq!(b[1], b"\n");
        assert_eq!(b[2][0], TokTrie::SPECIAL_TOKEN_MARKER);
    }
}
