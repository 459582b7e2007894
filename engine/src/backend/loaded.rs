//! A model loaded for the runners: the network, its text codec, the
//! grammar compiler of its vocabulary and its weights in the CPU kernels'
//! layout, read from one GGUF file.

use crate::error::{EngineError, Result};
use crate::model::llama::Model;
use crate::tokenizer::TextCodec;
use candle_core::quantized::gguf_file;
use candle_core::Device;
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
