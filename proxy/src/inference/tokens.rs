//! vLLM's tokenizer endpoints, for clients that count or score in tokens
//! (lm-evaluation-harness's `remote` tokenizer reads them): `POST
//! /tokenize` (a prompt or chat messages to ids), `POST /detokenize` and
//! `GET /tokenizer_info`, each also under `/v1/`. They serve the models
//! the engine hosts (an upstream's tokenizer is not known here), the one
//! named by `model` or else the first the caller may use. Sizes are
//! bounded before work: a prompt whose byte count alone proves it longer
//! than the model's context is refused, as completions refuse it, and ids
//! are checked against the vocabulary.

use super::context::Incoming;
use super::endpoints::Reply;
use super::openai::{body_object, opt};
use super::Front;
use serde_json::{json, Map, Value};
use std::sync::Arc;
use ultrafast_engine::api::{BackendError, ChatMessage, Prompt};
use ultrafast_engine::scheduler::Engine;

fn bad(param: &'static str, message: String) -> BackendError {
    BackendError::invalid("invalid_request_error", Some(param), message)
}

impl Front {
    /// The engine of `model`, else of the first engine model the caller
    /// may use.
    fn tokenizer_engine(
        &self,
        inc: &Incoming,
        model: Option<&str>,
    ) -> Result<Arc<Engine>, BackendError> {
        let models = inc.cfg.models();
        let name = match model {
            Some(m) => {
                self.allowed(inc, m)?;
                if !models.contains_key(m) {
                    return Err(super::pipeline::not_found_model(m));
                }
                m.to_string()
            }
            None => models
                .keys()
                .find(|m| self.engines.get(m).is_some() && self.allowed(inc, m).is_ok())
                .cloned()
                .ok_or_else(|| bad("model", "no model hosted here has a tokenizer.".into()))?,
        };
        let service = self.engines.get(&name).ok_or_else(|| {
            bad(
                "model",
                format!("model `{name}` is an upstream's: its tokenizer is not known here."),
            )
        })?;
        service
            .engine()
            .ok_or_else(|| BackendError::unavailable(format!("model `{name}` is not ready yet")))
    }

    /// `POST /tokenize`: `{"prompt"}` or `{"messages"}` (rendered with the
    /// chat template and its generation prompt, as a chat request is).
    pub async fn tokenize(&self, inc: &Incoming, body: &[u8]) -> Reply {
        match self.tokenize_inner(inc, body).await {
            Ok(v) => Reply::json(v),
            Err(e) => Reply::error(&e),
        }
    }

    async fn tokenize_inner(&self, inc: &Incoming, body: &[u8]) -> Result<Value, BackendError> {
        let o = body_object(body)?;
        let engine = self.tokenizer_engine(inc, model_of(&o)?)?;
        let prompt = match (opt(&o, "prompt"), opt(&o, "messages")) {
            (Some(Value::String(p)), None) => Prompt::Text(p.clone()),
            (None, Some(Value::Array(m))) => Prompt::Chat(messages(m)?),
            _ => {
                return Err(bad(
                    "prompt",
                    "give a string `prompt` or a list of chat `messages`.".into(),
                ))
            }
        };
        let l = engine.loaded();
        let ctx = l.model.max_positions();
        let bound = ultrafast_engine::api::PromptBound {
            context: ctx,
            max_token_bytes: Some(l.codec.max_token_bytes),
        };
        super::slo::prove_too_long(&prompt, Some(bound))?;
        let add_special = match opt(&o, "add_special_tokens") {
            None => true,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(super::openai::wrong_type(
                    "add_special_tokens",
                    "a boolean",
                    v,
                ))
            }
        };
        let tokens = tokio::task::spawn_blocking(move || {
            let l = engine.loaded();
            let text = match &prompt {
                Prompt::Chat(m) => l.codec.render_chat(m)?,
                Prompt::Text(t) => t.clone(),
                Prompt::Tokens(_) => String::new(),
            };
            let ids = l.codec.encode(&text)?;
            // `add_special_tokens: false` leaves out a BOS the model adds.
            Ok::<_, ultrafast_engine::EngineError>(match (add_special, l.codec.bos) {
                (false, Some(b)) if l.codec.add_bos && ids.first() == Some(&b) => ids[1..].to_vec(),
                _ => ids,
            })
        })
        .await
        .map_err(|e| BackendError::request(500, "tokenizer_failed", e.to_string()))?
        .map_err(|e| bad("prompt", e.to_string()))?;
        Ok(json!({"count": tokens.len(), "max_model_len": ctx, "tokens": tokens}))
    }

    /// `POST /detokenize`: `{"tokens": [ids]}` to `{"prompt": text}`, at
    /// most the model's context of them, decoded off the runtime.
    pub async fn detokenize(&self, inc: &Incoming, body: &[u8]) -> Reply {
        let found = body_object(body).and_then(|o| {
            let engine = self.tokenizer_engine(inc, model_of(&o)?)?;
            Ok((o, engine))
        });
        let (o, engine) = match found {
            Ok(x) => x,
            Err(e) => return Reply::error(&e),
        };
        let run = move || -> Result<Value, BackendError> {
            let l = engine.loaded();
            let vocab = l.model.cfg.vocab;
            let ctx = l.model.max_positions();
            let ids: Option<Vec<u32>> = match opt(&o, "tokens") {
                Some(Value::Array(a)) if a.len() > ctx => {
                    return Err(bad(
                        "tokens",
                        format!("at most {ctx} tokens (the model's context) are decoded at once."),
                    ))
                }
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect(),
                _ => None,
            };
            let ids =
                ids.ok_or_else(|| bad("tokens", "`tokens` must be a list of token ids.".into()))?;
            if let Some(t) = ids.iter().find(|t| **t as usize >= vocab) {
                return Err(bad(
                    "tokens",
                    format!("token id {t} is not in the model's vocabulary ({vocab} tokens)."),
                ));
            }
            let text = l
                .codec
                .decode(&ids, false)
                .map_err(|e| bad("tokens", e.to_string()))?;
            Ok(json!({"prompt": text}))
        };
        match tokio::task::spawn_blocking(run).await {
            Ok(Ok(v)) => Reply::json(v),
            Ok(Err(e)) => Reply::error(&e),
            Err(e) => Reply::error(&BackendError::request(
                500,
                "tokenizer_failed",
                e.to_string(),
            )),
        }
    }

    /// `GET /tokenizer_info`: the special tokens, the chat template and the
    /// context length.
    pub fn tokenizer_info(&self, inc: &Incoming) -> Reply {
        match self.tokenizer_engine(inc, None) {
            Ok(engine) => {
                let l = engine.loaded();
                let (bos, eos) = l.codec.special_texts();
                let some = |s: &str| if s.is_empty() { Value::Null } else { json!(s) };
                Reply::json(json!({
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": some(bos),
                    "eos_token": some(eos),
                    "pad_token": Value::Null,
                    "chat_template": l.codec.chat_template(),
                    "model_max_length": l.model.max_positions(),
                }))
            }
            Err(e) => Reply::error(&e),
        }
    }
}

fn model_of(o: &Map<String, Value>) -> Result<Option<&str>, BackendError> {
    match opt(o, "model") {
        None => Ok(None),
        Some(Value::String(m)) => Ok(Some(m.as_str())),
        Some(v) => Err(super::openai::wrong_type("model", "a string", v)),
    }
}

fn messages(m: &[Value]) -> Result<Vec<ChatMessage>, BackendError> {
    m.iter()
        .map(|x| match (x["role"].as_str(), x["content"].as_str()) {
            (Some(r), Some(c)) => Ok(ChatMessage::new(r, c)),
            _ => Err(bad(
                "messages",
                "each message needs a string `role` and `content`.".into(),
            )),
        })
        .collect()
}
