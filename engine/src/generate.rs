//! Loading a model with its tokenizer, and a single-sequence greedy
//! generation loop used by tests and tools until the scheduler lands.

use crate::error::{EngineError, Result};
use crate::model::llama::Model;
use crate::tokenizer::{ChatMessage, TextCodec};
use candle_core::quantized::gguf_file;
use candle_core::{Device, D};
use std::path::Path;

/// A model and its text codec.
pub struct Loaded {
    /// The network.
    pub model: Model,
    /// Tokenizer and template.
    pub codec: TextCodec,
    /// The grammar compiler for structured outputs (None: the vocabulary
    /// could not be read for it; such requests are refused with the reason).
    pub guides: std::result::Result<crate::guide::Guides, String>,
    /// The weights in the CPU kernels' layout (Err: what they do not
    /// cover; the scheduler then runs candle's forward pass).
    pub fast: std::result::Result<std::sync::Arc<crate::backend::cpu::weights::Weights>, String>,
    /// The GGUF it came from (a GPU runner reads its blocks again).
    pub path: std::path::PathBuf,
}

/// Load a GGUF model and its tokenizer on the CPU.
pub fn load(path: &Path) -> Result<Loaded> {
    let device = Device::Cpu;
    let mut f = std::fs::File::open(path).map_err(|e| EngineError::model(path, e.to_string()))?;
    let ct = gguf_file::Content::read(&mut f)
        .map_err(|e| EngineError::model(path, format!("not a valid GGUF file: {e}")))?;
    let codec = TextCodec::from_gguf(&ct).map_err(|e| EngineError::model(path, e.to_string()))?;
    let model = Model::load(path, &device)?;
    let fast = crate::backend::cpu::weights::Weights::load(&ct, &mut f, &model.cfg)
        .map(std::sync::Arc::new);
    if let Err(e) = &fast {
        log::info!(
            "{}: the CPU kernels do not cover this model: {e}",
            path.display()
        );
    }
    let eos = codec.eos.first().copied().unwrap_or(0);
    let guides = crate::guide::Guides::from_gguf(&ct, eos);
    if let Err(e) = &guides {
        log::warn!("{}: structured outputs unavailable: {e}", path.display());
    }
    Ok(Loaded {
        model,
        codec,
        guides,
        fast,
        path: path.to_path_buf(),
    })
}

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
