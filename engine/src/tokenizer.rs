//! The tokenizer and chat template, both from the GGUF metadata.
//!
//! A byte-level BPE (`tokenizers` crate) built from `tokenizer.ggml.tokens`
//! and `merges`, with the pre-tokenizer chosen by `tokenizer.ggml.pre` (as
//! llama.cpp does), control tokens registered as special (so `<|im_start|>`
//! in a rendered template is one token), and the Jinja chat template
//! rendered with `minijinja`. `StreamDecoder` turns tokens into text pieces
//! that never split a UTF-8 character.

use crate::error::{EngineError, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::Split;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

pub use crate::api::ChatMessage;

/// Tokenizer, special ids and chat template of a model.
pub struct TextCodec {
    tok: Tokenizer,
    /// End-of-sequence token ids (generation stops on any).
    pub eos: Vec<u32>,
    /// Beginning-of-sequence token id.
    pub bos: Option<u32>,
    /// Whether prompts start with BOS.
    pub add_bos: bool,
    template: Option<String>,
    bos_text: String,
    eos_text: String,
    /// The most bytes of text one token stands for: a byte-level token
    /// spells each byte as one character (of one or two UTF-8 bytes), so
    /// its character count; control and user-defined tokens are their own
    /// text, so their UTF-8 length. (SmolLM2's longest: a newline and 80
    /// spaces, 81 bytes.)
    pub max_token_bytes: usize,
}

fn err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Tokenizer(e.to_string())
}

fn strings(v: &Value) -> Result<Vec<String>> {
    v.to_vec()
        .map_err(err)?
        .iter()
        .map(|x| x.to_string().cloned().map_err(err))
        .collect()
}

const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

impl TextCodec {
    /// Build from GGUF metadata.
    pub fn from_gguf(ct: &Content) -> Result<Self> {
        let md = |k: &str| {
            ct.metadata
                .get(k)
                .ok_or_else(|| err(format!("missing `{k}`")))
        };
        let model = md("tokenizer.ggml.model")?
            .to_string()
            .map_err(err)?
            .clone();
        if model != "gpt2" {
            return Err(err(format!(
                "unsupported tokenizer model `{model}` (byte-level BPE `gpt2` only)"
            )));
        }
        let tokens = strings(md("tokenizer.ggml.tokens")?)?;
        let merges: Merges = strings(md("tokenizer.ggml.merges")?)?
            .into_iter()
            .filter_map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
            })
            .collect();
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(err)?;
        let mut tok = Tokenizer::new(bpe);
        let pre = ct
            .metadata
            .get("tokenizer.ggml.pre")
            .and_then(|v| v.to_string().ok().cloned())
            .unwrap_or_default();
        let pre_tok: PreTokenizerWrapper = match pre.as_str() {
            "smollm" => Sequence::new(vec![
                Digits::new(true).into(),
                ByteLevel::new(false, true, true).into(),
            ])
            .into(),
            "qwen2" => Sequence::new(vec![
                Split::new(
                    tokenizers::pre_tokenizers::split::SplitPattern::Regex(QWEN2_PATTERN.into()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .map_err(err)?
                .into(),
                ByteLevel::new(false, true, false).into(),
            ])
            .into(),
            _ => ByteLevel::new(false, true, true).into(),
        };
        tok.with_pre_tokenizer(Some(pre_tok));
        tok.with_decoder(Some(ByteLevelDecoder::default()));
        let mut max_token_bytes = tokens.iter().map(|t| t.chars().count()).max().unwrap_or(1);
        if let Some(types) = ct
            .metadata
            .get("tokenizer.ggml.token_type")
            .and_then(|v| v.to_vec().ok())
        {
            // Control tokens are special (skipped in decoded text);
            // user-defined ones (Qwen2.5's `<tool_call>`) are one token each
            // but text, as in Hugging Face's tokenizer.json and llama.cpp.
            let added = |ty: i32, special: bool| -> Vec<AddedToken> {
                types
                    .iter()
                    .enumerate()
                    .filter(|(_, t)| t.to_i32().ok() == Some(ty))
                    .filter_map(|(i, _)| tokens.get(i))
                    .map(|t| AddedToken::from(t.clone(), special))
                    .collect()
            };
            tok.add_special_tokens(&added(3, true));
            tok.add_tokens(&added(4, false));
            for t in added(3, true).iter().chain(&added(4, false)) {
                max_token_bytes = max_token_bytes.max(t.content.len());
            }
        }
        let id = |k: &str| ct.metadata.get(k).and_then(|v| v.to_u32().ok());
        let mut eos: Vec<u32> = id("tokenizer.ggml.eos_token_id").into_iter().collect();
        // ChatML models end a turn with <|im_end|>; stop there too.
        for t in ["<|im_end|>", "<|endoftext|>", "<|eot_id|>"] {
            if let Some(i) = tokens.iter().position(|x| x == t) {
                if !eos.contains(&(i as u32)) {
                    eos.push(i as u32);
                }
            }
        }
        let bos = id("tokenizer.ggml.bos_token_id");
        let text_of = |i: Option<u32>| {
            i.and_then(|i| tokens.get(i as usize).cloned())
                .unwrap_or_default()
        };
        Ok(TextCodec {
            max_token_bytes,
            tok,
            bos_text: text_of(bos),
            eos_text: text_of(id("tokenizer.ggml.eos_token_id")),
            eos,
            bos,
            add_bos: ct
                .metadata
                .get("tokenizer.ggml.add_bos_token")
                .and_then(|v| v.to_bool().ok())
                .unwrap_or(false),
            template: ct
                .metadata
                .get("tokenizer.chat_template")
                .and_then(|v| v.to_string().ok().cloned()),
        })
    }

    /// The texts of the beginning- and end-of-sequence tokens (empty when
    /// the model has none).
    pub fn special_texts(&self) -> (&str, &str) {
        (&self.bos_text, &self.eos_text)
    }

    /// The chat template (Jinja), when the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.template.as_deref()
    }

    /// The bytes of token `id` (a byte-level token may hold part of a
    /// character, so its text alone could not say). Empty for an id
    /// outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(t) = self.tok.id_to_token(id) else {
            return Vec::new();
        };
        let mut out = Vec::with_capacity(t.len());
        for c in t.chars() {
            match byte_of_char(c) {
                Some(b) => out.push(b),
                // Added tokens are plain text.
                None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
            }
        }
        out
    }

    /// Token ids of `text` (special tokens in it are recognised).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.tok.encode(text, false).map_err(err)?;
        let mut ids = enc.get_ids().to_vec();
        if self.add_bos {
            if let Some(b) = self.bos {
                ids.insert(0, b);
            }
        }
        Ok(ids)
    }

    /// Text of `ids`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.tok.decode(ids, skip_special).map_err(err)
    }

    /// Render the chat template for `messages`, ready for generation.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String> {
        self.render_chat_tools(messages, None)
    }

    /// Whether the chat template describes tools itself in the call format
    /// the grammar writes (a `tools` variable and `<tool_call>`, as
    /// Qwen2.5's); other tool templates (Llama 3.1's) use other formats.
    pub fn template_takes_tools(&self) -> bool {
        self.template
            .as_ref()
            .is_some_and(|t| t.contains("tools") && t.contains(crate::api::CALL_OPEN))
    }

    /// `render_chat` with `tools` given to the template (as OpenAI-style
    /// function entries) for a template that takes them.
    pub fn render_chat_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[crate::api::Tool]>,
    ) -> Result<String> {
        let Some(t) = &self.template else {
            // No template: plain concatenation, one message per line.
            return Ok(messages
                .iter()
                .map(|m| format!("{}: {}\n", m.role, m.model_text()))
                .collect::<String>()
                + "assistant: ");
        };
        let mut env = minijinja::Environment::new();
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_filter("tojson", tojson);
        env.add_template("chat", t).map_err(err)?;
        let tmpl = env.get_template("chat").map_err(err)?;
        tmpl.render(minijinja::context! {
            messages => messages
                .iter()
                .map(|m| {
                    let map: std::collections::BTreeMap<String, String> =
                        [("role".to_string(), m.role.clone()), ("content".to_string(), m.model_text())].into();
                    minijinja::Value::from(map)
                })
                .collect::<Vec<_>>(),
            add_generation_prompt => true,
            tools => tools.map(|t| {
                let t: Vec<serde_json::Value> = t
                    .iter()
                    .map(|f| serde_json::json!({"type": "function", "function": f}))
                    .collect();
                jinja(&serde_json::Value::Array(t))
            }),
            bos_token => self.bos_text.clone(),
            eos_token => self.eos_text.clone(),
        })
        .map_err(err)
    }

    /// A decoder for one generated stream.
    pub fn stream(&self) -> StreamDecoder<'_> {
        StreamDecoder {
            codec: self,
            ids: Vec::new(),
            offsets: DecodeOffsets::default(),
        }
    }

    /// The text completed by the last id of `ids` (ids so far of one
    /// stream), holding back an unfinished UTF-8 character.
    pub fn decode_step(&self, ids: &[u32], o: &mut DecodeOffsets) -> Result<String> {
        let before = self.decode(&ids[o.prefix..o.read], true)?;
        let now = self.decode(&ids[o.prefix..], true)?;
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') {
            let piece = now[before.len()..].to_string();
            o.prefix = o.read;
            o.read = ids.len();
            Ok(piece)
        } else {
            Ok(String::new())
        }
    }
}

/// JSON as a template value (minijinja is built without serde here).
fn jinja(v: &serde_json::Value) -> minijinja::Value {
    use serde_json::Value as J;
    match v {
        J::Null => minijinja::Value::from(()),
        J::Bool(b) => minijinja::Value::from(*b),
        J::Number(n) => match n.as_i64() {
            Some(i) => minijinja::Value::from(i),
            None => minijinja::Value::from(n.as_f64().unwrap_or(0.0)),
        },
        J::String(s) => minijinja::Value::from(s.clone()),
        J::Array(a) => minijinja::Value::from(a.iter().map(jinja).collect::<Vec<_>>()),
        J::Object(o) => minijinja::Value::from(
            o.iter()
                .map(|(k, v)| (k.clone(), jinja(v)))
                .collect::<std::collections::BTreeMap<_, _>>(),
        ),
    }
}

/// Where a stream's decoding stands.
#[derive(Debug, Clone, Copy, Default)]
pub struct DecodeOffsets {
    prefix: usize,
    read: usize,
}

/// Incremental detokenization: each new token yields the text it completes,
/// holding back bytes of an unfinished UTF-8 character.
pub struct StreamDecoder<'a> {
    codec: &'a TextCodec,
    ids: Vec<u32>,
    offsets: DecodeOffsets,
}

impl StreamDecoder<'_> {
    /// Add a token; returns the text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        self.codec.decode_step(&self.ids, &mut self.offsets)
    }
}

/// The byte a byte-level BPE character stands for (GPT-2's table: the
/// printable bytes are themselves; the others, in order, are U+0100 on).
fn byte_of_char(c: char) -> Option<u8> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let u = c as u32;
    if u < 256 {
        return printable(u).then_some(u as u8);
    }
    let n = (u - 256) as usize;
    (0u32..256)
        .filter(|b| !printable(*b))
        .nth(n)
        .map(|b| b as u8)
}

/// Jinja's `tojson` as Hugging Face's templates get it (Python's
/// `json.dumps(x, ensure_ascii=False)`: `", "` and `": "` separators,
/// non-ASCII kept), which is how the models saw tools in training
/// (Qwen2.5's template writes each tool with it). Keyword arguments
/// (`indent`) are accepted and the output stays on one line.
fn tojson(
    v: minijinja::Value,
    _kwargs: minijinja::value::Kwargs,
) -> std::result::Result<String, minijinja::Error> {
    fn write(v: &serde_json::Value, out: &mut String) {
        match v {
            serde_json::Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write(x, out);
                }
                out.push(']');
            }
            serde_json::Value::Object(o) => {
                out.push('{');
                for (i, (k, x)) in o.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    out.push_str(&serde_json::Value::from(k.as_str()).to_string());
                    out.push_str(": ");
                    write(x, out);
                }
                out.push('}');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let json = serde_json::to_value(&v).map_err(|e| {
        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string())
    })?;
    let mut out = String::new();
    write(&json, &mut out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    /// `src` rendered with `tools` = `v`, in an environment with our
    /// `tojson` filter.
    fn render(src: &str, v: &serde_json::Value) -> String {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", super::tojson);
        env.add_template("t", src).unwrap();
        env.get_template("t")
            .unwrap()
            .render(minijinja::context! { tools => super::jinja(v) })
            .unwrap()
    }

    #[test]
    fn json_reaches_a_template_as_it_is() {
        let v = serde_json::json!([{"type": "function", "function": {"name": "f", "n": 2, "x": 1.5, "ok": true, "none": null, "list": ["a"]}}]);
        let out = render(
            "{% for t in tools %}{{ t.function.name }} {{ t.function.n + 1 }} {{ t.function.x }} {{ t.function.ok }} {{ t.function.none is none }} {{ t.function.list[0] }}{% endfor %}",
            &v,
        );
        // Booleans render as Jinja (and Hugging Face templates) render them.
        assert_eq!(out, "f 3 1.5 True True a");
    }

    #[test]
    fn tojson_writes_what_pythons_json_dumps_writes() {
        let v = serde_json::json!({"name": "f", "p": {"list": [1, "é", true, null]}});
        let out = render(
            "{{ tools | tojson }} {{ tools.name | tojson(indent=4) }}",
            &v,
        );
        assert_eq!(
            out,
            r#"{"name": "f", "p": {"list": [1, "é", true, null]}} "f""#
        );
    }
}
