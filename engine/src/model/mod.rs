//! Models read from GGUF: the typed config from the file's metadata and the
//! forward pass (`llama`, which also covers the qwen2 layout: biases on
//! Q/K/V, a separate output head, NEOX rotary).

pub mod linear;
pub mod llama;
pub mod paged;

use crate::error::{EngineError, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use std::path::Path;

/// Architectures we run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// llama (SmolLM2, Llama): interleaved rotary, no attention biases.
    Llama,
    /// qwen2: Q/K/V biases, NEOX (half-split) rotary.
    Qwen2,
}

/// The model's shape, from GGUF metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Architecture.
    pub arch: Arch,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Hidden size.
    pub dim: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention).
    pub n_kv_head: usize,
    /// Per-head size.
    pub head_dim: usize,
    /// Feed-forward size.
    pub ffn_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Trained context length.
    pub context_len: usize,
    /// Rotary base.
    pub rope_theta: f32,
    /// RMS norm epsilon.
    pub rms_eps: f64,
}

fn get<'a>(ct: &'a Content, path: &Path, key: &str) -> Result<&'a Value> {
    ct.metadata
        .get(key)
        .ok_or_else(|| EngineError::model(path, format!("missing GGUF metadata `{key}`")))
}

fn num(ct: &Content, path: &Path, key: &str) -> Result<usize> {
    let v = get(ct, path, key)?;
    v.to_u32()
        .map(|v| v as usize)
        .or_else(|_| v.to_u64().map(|v| v as usize))
        .map_err(|_| EngineError::model(path, format!("GGUF metadata `{key}` is not an integer")))
}

impl ModelConfig {
    /// Read the config of a supported architecture.
    pub fn from_gguf(ct: &Content, path: &Path) -> Result<Self> {
        let arch_name = get(ct, path, "general.architecture")?
            .to_string()
            .map_err(|_| EngineError::model(path, "general.architecture is not a string"))?
            .clone();
        let arch = match arch_name.as_str() {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            other => {
                return Err(EngineError::model(
                    path,
                    format!("unsupported architecture `{other}` (llama, qwen2)"),
                ))
            }
        };
        let p = |k: &str| format!("{arch_name}.{k}");
        let dim = num(ct, path, &p("embedding_length"))?;
        let n_head = num(ct, path, &p("attention.head_count"))?;
        let n_kv_head = num(ct, path, &p("attention.head_count_kv")).unwrap_or(n_head);
        if n_head == 0 || n_kv_head == 0 || dim % n_head != 0 || n_head % n_kv_head != 0 {
            return Err(EngineError::model(path, "inconsistent head counts"));
        }
        let vocab = match ct.metadata.get(&p("vocab_size")) {
            Some(v) => v.to_u32().map(|v| v as usize).unwrap_or(0),
            None => get(ct, path, "tokenizer.ggml.tokens")?
                .to_vec()
                .map(|v| v.len())
                .unwrap_or(0),
        };
        let f = |k: &str, d: f32| {
            ct.metadata
                .get(&p(k))
                .and_then(|v| v.to_f32().ok())
                .unwrap_or(d)
        };
        Ok(ModelConfig {
            arch,
            n_layer: num(ct, path, &p("block_count"))?,
            dim,
            n_head,
            n_kv_head,
            head_dim: dim / n_head,
            ffn_dim: num(ct, path, &p("feed_forward_length"))?,
            vocab,
            context_len: num(ct, path, &p("context_length")).unwrap_or(2048),
            rope_theta: f("rope.freq_base", 10_000.0),
            rms_eps: f("attention.layer_norm_rms_epsilon", 1e-5) as f64,
        })
    }
}
