//! A llama-layout model's weights as the GGUF file stores them (blocks of
//! Q4_1, Q8_0, Q4_K or Q6_K, norms in f32): what the reference runner and
//! the CUDA runner read, from a file or made up with a model's shapes
//! ([`FileWeights::synthetic`], for the GPU check, where the real file is
//! too large to take along).

use crate::error::{EngineError, Result};
use crate::model::{Arch, ModelConfig};
use candle_core::quantized::{gguf_file, GgmlDType};
use candle_core::Device as CDevice;
use std::path::Path;
use ultrafast_kernels::reference::{self as r, Format};

/// A matrix as the file stores it: `rows` rows of `cols` weights.
pub struct Mat {
    /// Block format.
    pub format: Format,
    /// The blocks, row after row.
    pub bytes: Vec<u8>,
    /// Output size.
    pub rows: usize,
    /// Input size.
    pub cols: usize,
}

impl Mat {
    /// `y (+)= W x` for `tokens` rows of `x`, through the reference.
    pub fn apply(&self, x: &[f32], tokens: usize, acc: bool, y: &mut [f32]) {
        r::gemv_into(
            self.format,
            &self.bytes,
            x,
            self.rows,
            self.cols,
            tokens,
            acc,
            y,
        );
    }

    /// The rows of `ids`, dequantized one after another into `out` (the
    /// embedding lookup); an id outside the matrix is an error.
    pub fn gather(&self, ids: &[u32], out: &mut [f32]) -> Result<()> {
        for (i, t) in ids.iter().enumerate() {
            if *t as usize >= self.rows {
                return Err(EngineError::Invalid(format!(
                    "token {t} outside the vocabulary"
                )));
            }
            self.row(*t as usize, &mut out[i * self.cols..][..self.cols]);
        }
        Ok(())
    }

    /// Row `i`, dequantized.
    pub fn row(&self, i: usize, out: &mut [f32]) {
        let (per, bytes) = (self.format.per_block(), self.format.block_bytes());
        let nb = self.cols / per;
        for b in 0..nb {
            let blk = &self.bytes[(i * nb + b) * bytes..][..bytes];
            r::dequantize_into(self.format, blk, &mut out[b * per..][..per]);
        }
    }

    /// `self` and `other` as one matrix, `other`'s rows after `self`'s
    /// (Q|K|V, gate|up); None when their formats or widths differ.
    pub fn stack(&self, other: &Mat) -> Option<Mat> {
        if self.format != other.format || self.cols != other.cols {
            return None;
        }
        let mut bytes = self.bytes.clone();
        bytes.extend_from_slice(&other.bytes);
        Some(Mat {
            format: self.format,
            bytes,
            rows: self.rows + other.rows,
            cols: self.cols,
        })
    }
}

/// One layer's tensors.
pub struct LayerMats {
    /// RMSNorm weight before attention.
    pub attn_norm: Vec<f32>,
    /// Query projection.
    pub q: Mat,
    /// Key projection.
    pub k: Mat,
    /// Value projection.
    pub v: Mat,
    /// Output projection.
    pub o: Mat,
    /// RMSNorm weight before the MLP.
    pub ffn_norm: Vec<f32>,
    /// Gate projection.
    pub gate: Mat,
    /// Up projection.
    pub up: Mat,
    /// Down projection.
    pub down: Mat,
}

/// A whole model's tensors.
pub struct FileWeights {
    /// Shapes and constants.
    pub cfg: ModelConfig,
    /// Token embedding (`vocab` rows).
    pub embed: Mat,
    /// The layers.
    pub layers: Vec<LayerMats>,
    /// Final RMSNorm weight.
    pub norm: Vec<f32>,
    /// Output head (None: tied to the embedding).
    pub head: Option<Mat>,
}

fn format_of(dtype: GgmlDType) -> Option<Format> {
    match dtype {
        GgmlDType::Q4_1 => Some(Format::Q4_1),
        GgmlDType::Q8_0 => Some(Format::Q8_0),
        GgmlDType::Q4K => Some(Format::Q4K),
        GgmlDType::Q6K => Some(Format::Q6K),
        _ => None,
    }
}

impl FileWeights {
    /// Reads a llama-layout GGUF.
    pub fn read(path: &Path) -> Result<FileWeights> {
        let err = |e: &dyn std::fmt::Display| EngineError::model(path, e.to_string());
        let mut f = std::fs::File::open(path).map_err(|e| err(&e))?;
        let ct = gguf_file::Content::read(&mut f).map_err(|e| err(&e))?;
        let cfg = ModelConfig::from_gguf(&ct, path)?;
        if cfg.arch != Arch::Llama {
            return Err(err(&"only llama-layout models are read as blocks"));
        }
        let mut mat = |name: &str| -> Result<Mat> {
            let t = ct
                .tensor(&mut f, name, &CDevice::Cpu)
                .map_err(|e| err(&e))?;
            let format = format_of(t.dtype())
                .ok_or_else(|| err(&format!("{name}: {:?} is not a kernel format", t.dtype())))?;
            let (rows, cols) = t.shape().dims2().map_err(|e| err(&e))?;
            let bytes = t.data().map_err(|e| err(&e))?.into_owned();
            Ok(Mat {
                format,
                bytes,
                rows,
                cols,
            })
        };
        let embed = mat("token_embd.weight")?;
        let head = mat("output.weight").ok();
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let p = |n: &str| format!("blk.{i}.{n}.weight");
            layers.push(LayerMats {
                attn_norm: Vec::new(),
                q: mat(&p("attn_q"))?,
                k: mat(&p("attn_k"))?,
                v: mat(&p("attn_v"))?,
                o: mat(&p("attn_output"))?,
                ffn_norm: Vec::new(),
                gate: mat(&p("ffn_gate"))?,
                up: mat(&p("ffn_up"))?,
                down: mat(&p("ffn_down"))?,
            });
        }
        let mut vector = |name: &str| -> Result<Vec<f32>> {
            let t = ct
                .tensor(&mut f, name, &CDevice::Cpu)
                .map_err(|e| err(&e))?;
            t.dequantize(&CDevice::Cpu)
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(|e| err(&e))
        };
        for (i, l) in layers.iter_mut().enumerate() {
            l.attn_norm = vector(&format!("blk.{i}.attn_norm.weight"))?;
            l.ffn_norm = vector(&format!("blk.{i}.ffn_norm.weight"))?;
        }
        let norm = vector("output_norm.weight")?;
        Ok(FileWeights {
            cfg,
            embed,
            layers,
            norm,
            head,
        })
    }

    /// Random weights with `cfg`'s shapes: Q4_1 layers and a tied Q8_0
    /// embedding, as SmolLM2's file has, with scales that keep activations
    /// in a realistic range. Deterministic in `seed`.
    pub fn synthetic(cfg: ModelConfig, seed: u64) -> FileWeights {
        let mut rng = r::XorShift(seed | 1);
        let mut mat = |format: Format, rows: usize, cols: usize, scale: f32| Mat {
            format,
            // Q4_1 values 0..15 centred by a minimum of -7.5 steps.
            bytes: r::random_blocks(&mut rng, format, rows, cols, |_| (scale, -7.5 * scale)),
            rows,
            cols,
        };
        let (d, kv, ff) = (cfg.dim, cfg.n_kv_head * cfg.head_dim, cfg.ffn_dim);
        let q4 = |fan_in: usize| 2.0 / (fan_in as f32).sqrt() / 7.5;
        let layers = (0..cfg.n_layer)
            .map(|_| LayerMats {
                attn_norm: vec![1.0; d],
                q: mat(Format::Q4_1, d, d, q4(d)),
                k: mat(Format::Q4_1, kv, d, q4(d)),
                v: mat(Format::Q4_1, kv, d, q4(d)),
                o: mat(Format::Q4_1, d, d, q4(d)),
                ffn_norm: vec![1.0; d],
                gate: mat(Format::Q4_1, ff, d, q4(d)),
                up: mat(Format::Q4_1, ff, d, q4(d)),
                down: mat(Format::Q4_1, d, ff, q4(ff)),
            })
            .collect();
        let embed = mat(Format::Q8_0, cfg.vocab, d, 0.02 / 64.0 * 8.0);
        FileWeights {
            norm: vec![1.0; d],
            embed,
            layers,
            head: None,
            cfg,
        }
    }
}

/// SmolLM2-135M's shapes (what [`FileWeights::synthetic`] is given by the
/// GPU check, where the real file does not travel).
pub fn smollm2_shapes() -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        n_layer: 30,
        dim: 576,
        n_head: 9,
        n_kv_head: 3,
        head_dim: 64,
        ffn_dim: 1536,
        vocab: 49_152,
        context_len: 8192,
        rope_theta: 100_000.0,
        rms_eps: 1e-5,
    }
}
