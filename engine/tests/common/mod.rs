//! What the engine's tests on the real model share: the model, loaded once
//! per test process, and a user message rendered through its chat template.
#![allow(dead_code, clippy::unwrap_used)]

use std::sync::{Arc, OnceLock};
use ultrafast_engine::fetch::{self, SMOLLM2};
use ultrafast_engine::generate::{self, Loaded};
use ultrafast_engine::tokenizer::ChatMessage;

/// SmolLM2, fetched (sha256-checked) and loaded once.
pub fn loaded() -> Arc<Loaded> {
    static L: OnceLock<Arc<Loaded>> = OnceLock::new();
    L.get_or_init(|| Arc::new(generate::load(&fetch::pull(&SMOLLM2).unwrap()).unwrap()))
        .clone()
}

/// The tokens of `q` as one user turn of the chat template.
pub fn prompt(q: &str) -> Vec<u32> {
    let l = loaded();
    let t = l.codec.render_chat(&[ChatMessage::new("user", q)]).unwrap();
    l.codec.encode(&t).unwrap()
}
