//! A single-sequence greedy generation loop over a loaded model (tests
//! and tools); loading itself is `backend::loaded`'s, re-exported here.

use crate::error::Result;
use crate::tokenizer::ChatMessage;
use candle_core::D;

pub use crate::backend::loaded::{load, Loaded};

/// Greedy generation: the prompt's token ids, then up to `max_tokens` new
/// ids (stopping at an end-of-sequence token, not included).
pub fn greedy(l: &Loaded, prompt: &[u32], max_tokens: usize) -> Result<Vec<u32>> {
    let mut cache = l.model.new_cache();
    let mut logits = l.model.forward(prompt, &mut cache)?;
    let mut out = Vec::with_capacity(max_tokens);
    for _ in 0..max_tokens {
        let next = logits.argmax(D::Minus1)?.to_scalar::<u32>()?;
        if l.codec.eos.contains(&next) {
            break;
        }
        out.push(next);
        logits = l.model.forward(&[next], &mut cache)?;
    }
    Ok(out)
}

/// Chat helper: render, tokenize, generate greedily, decode.
pub fn chat(l: &Loaded, messages: &[ChatMessage], max_tokens: usize) -> Result<String> {
    let prompt = l.codec.render_chat(messages)?;
    let ids = l.codec.encode(&prompt)?;
    let out = greedy(l, &ids, max_tokens)?;
    l.codec.decode(&out, true)
}
