//! The model's weights in the CPU kernels' layout, read from the GGUF file.
//!
//! Q4_1 and Q8_0 matrices keep the file's bytes per weight, regrouped in
//! panels of 16 rows (`simd`); other types are rewritten into one of the
//! two first (`transcode`). Q, K and V become one matrix, as do gate and up, so each
//! is one pass over the step's activations. Norm weights and biases are
//! f32. The embedding stays in its file format and rows are dequantized as
//! tokens need them (a dequantized SmolLM2 embedding would be 113 MB).

use super::simd::{Format, PANEL};
use super::transcode;
use crate::model::{Arch, ModelConfig};
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use std::io::{Read, Seek};

/// A quantized matrix in 16-row panels (`simd`'s layout).
pub struct QMat {
    /// Block format.
    pub fmt: Format,
    /// Output rows (the last panel is padded with zero rows).
    pub rows: usize,
    /// Input columns (a multiple of 32).
    pub cols: usize,
    /// Panels of 16 rows, each `cols / 32` panel blocks, from `off`.
    data: Vec<u8>,
    /// Where the panels start in `data`: the first 64-byte boundary, so
    /// that a Q4_1 block's five cache lines are whole lines.
    off: usize,
}

impl QMat {
    /// 32-column blocks per row.
    pub fn nb(&self) -> usize {
        self.cols / 32
    }

    /// Panels of 16 rows.
    pub fn panels(&self) -> usize {
        self.rows.div_ceil(PANEL)
    }

    /// The bytes of panel `p`.
    pub fn panel(&self, p: usize) -> &[u8] {
        let n = self.nb() * self.fmt.panel_bytes();
        &self.data[self.off + p * n..self.off + (p + 1) * n]
    }

    /// Stack `parts` (same format and columns, rows in the file's blocks)
    /// into one matrix, rows in order, in panels.
    pub(crate) fn stack(parts: &[(Format, usize, usize, Vec<u8>)]) -> Result<QMat, String> {
        let (fmt, _, cols, _) = parts[0];
        let mut rows = 0;
        for (f, r, c, _) in parts {
            if *f != fmt || *c != cols {
                return Err("fused matrices of different types or widths".into());
            }
            if !c.is_multiple_of(32) {
                return Err(format!("a {r} x {c} matrix (columns % 32)"));
            }
            rows += r;
        }
        let nb = cols / 32;
        let fb = match fmt {
            Format::Q4_1 => 20,
            _ => 34,
        };
        // Q8_0 blocks whose values all fit 5 bits (a Q5_0 file's) take the
        // faster narrow kernels; a fused matrix only when every part does.
        let fmt = if fmt == Format::Q8_0
            && parts.iter().all(|(_, _, _, raw)| {
                raw.chunks_exact(34)
                    .all(|b| b[2..].iter().all(|q| (-16..=15).contains(&(*q as i8))))
            }) {
            Format::Q5
        } else {
            fmt
        };
        let pb = fmt.panel_bytes();
        let v = fmt.values_at();
        let mut data = vec![0u8; rows.div_ceil(PANEL) * nb * pb + 64];
        let off = (64 - data.as_ptr() as usize % 64) % 64;
        let mut row = 0;
        for (_, r, _, raw) in parts {
            for i in 0..*r {
                let (p, n) = ((row + i) / PANEL, (row + i) % PANEL);
                for b in 0..nb {
                    let src = &raw[(i * nb + b) * fb..(i * nb + b + 1) * fb];
                    let dst = &mut data[off + (p * nb + b) * pb..off + (p * nb + b + 1) * pb];
                    dst[2 * n..2 * n + 2].copy_from_slice(&src[0..2]);
                    match fmt {
                        Format::Q4_1 => {
                            dst[32 + 2 * n..34 + 2 * n].copy_from_slice(&src[2..4]);
                            for (k, q) in src[4..20].iter().enumerate() {
                                dst[v + 64 * (k / 4) + 4 * n + k % 4] = *q;
                            }
                        }
                        Format::Q8_0 | Format::Q5 => {
                            for (k, q) in src[2..34].iter().enumerate() {
                                dst[v + 64 * (k / 4) + 4 * n + k % 4] =
                                    (*q as i8 as i32 + fmt.bias()) as u8;
                            }
                        }
                    }
                }
            }
            row += r;
        }
        Ok(QMat {
            fmt,
            rows,
            cols,
            data,
            off,
        })
    }
}

/// One transformer block's weights.
pub struct LayerW {
    /// Pre-attention RMSNorm.
    pub attn_norm: Vec<f32>,
    /// Q, K, V stacked (rows: dim + 2 * kv_dim).
    pub qkv: QMat,
    /// Q|K|V biases (qwen2), same layout.
    pub qkv_bias: Option<Vec<f32>>,
    /// Attention output.
    pub wo: QMat,
    /// Pre-MLP RMSNorm.
    pub ffn_norm: Vec<f32>,
    /// Gate and up stacked (rows: 2 * ffn_dim).
    pub gate_up: QMat,
    /// Down projection.
    pub down: QMat,
}

/// The embedding table as stored.
pub struct Embedding {
    dtype: GgmlDType,
    row_bytes: usize,
    data: Vec<u8>,
    dim: usize,
}

impl Embedding {
    /// Dequantize row `id` into `out` (`dim` floats); false when the id
    /// is out of range.
    pub fn row(&self, id: usize, out: &mut [f32]) -> bool {
        let Some(raw) = self
            .data
            .get(id * self.row_bytes..(id + 1) * self.row_bytes)
        else {
            return false;
        };
        let Some((n, bytes)) = transcode::block_shape(self.dtype) else {
            return false;
        };
        if out.len() != self.dim {
            return false;
        }
        for (blk, o) in raw.chunks_exact(bytes).zip(out.chunks_exact_mut(n)) {
            transcode::dequantize_into(self.dtype, blk, o);
        }
        true
    }
}

/// Everything the CPU runner reads.
pub struct Weights {
    /// The model's shape.
    pub cfg: ModelConfig,
    /// Token embedding.
    pub embed: Embedding,
    /// Blocks.
    pub layers: Vec<LayerW>,
    /// Final RMSNorm.
    pub norm: Vec<f32>,
    /// Output head (the embedding when tied).
    pub head: QMat,
    /// Rotary tables, `positions x head_dim / 2` each.
    pub cos: Vec<f32>,
    /// See `cos`.
    pub sin: Vec<f32>,
    /// Positions the tables cover.
    pub max_positions: usize,
}

impl Weights {
    /// Read from an open GGUF file whose metadata is `ct`; `Err` names what
    /// the kernels do not cover (the caller falls back to candle).
    pub fn load<R: Read + Seek>(
        ct: &Content,
        f: &mut R,
        cfg: &ModelConfig,
    ) -> Result<Weights, String> {
        let dev = Device::Cpu;
        let mut qt = |name: &str| -> Result<QTensor, String> {
            ct.tensor(f, name, &dev)
                .map_err(|e| format!("tensor `{name}`: {e}"))
        };
        let raw = |t: &QTensor| -> Result<(Format, usize, usize, Vec<u8>), String> {
            let (r, c) = t.shape().dims2().map_err(|e| e.to_string())?;
            let bytes = t.data().map_err(|e| e.to_string())?.to_vec();
            let (fmt, bytes) = transcode::to_kernel_blocks(t.dtype(), bytes)?;
            Ok((fmt, r, c, bytes))
        };
        let vec = |t: QTensor| -> Result<Vec<f32>, String> {
            t.dequantize(&dev)
                .and_then(|x| x.flatten_all()?.to_vec1::<f32>())
                .map_err(|e| e.to_string())
        };
        let embed_t = qt("token_embd.weight")?;
        let (vocab, dim) = embed_t.shape().dims2().map_err(|e| e.to_string())?;
        if dim != cfg.dim || !dim.is_multiple_of(32) {
            return Err(format!("embedding width {dim}"));
        }
        let dtype = embed_t.dtype();
        let data = embed_t.data().map_err(|e| e.to_string())?.to_vec();
        let row_bytes = match transcode::block_shape(dtype) {
            Some((n, bytes)) if dim.is_multiple_of(n) => dim / n * bytes,
            _ => return Err(format!("{dtype:?} embedding of width {dim}")),
        };
        if data.len() != vocab * row_bytes {
            return Err("embedding size".into());
        }
        let head = match qt("output.weight") {
            Ok(o) => QMat::stack(&[raw(&o)?])?,
            Err(_) => QMat::stack(&[raw(&embed_t)?])?,
        };
        let embed = Embedding {
            dtype,
            row_bytes,
            data,
            dim,
        };
        let norm = vec(qt("output_norm.weight")?)?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let mut t = |n: &str| qt(&format!("blk.{i}.{n}"));
            let q = raw(&t("attn_q.weight")?)?;
            let k = raw(&t("attn_k.weight")?)?;
            let v = raw(&t("attn_v.weight")?)?;
            let qkv_bias = if cfg.arch == Arch::Qwen2 {
                let mut b = vec(t("attn_q.bias")?)?;
                b.extend(vec(t("attn_k.bias")?)?);
                b.extend(vec(t("attn_v.bias")?)?);
                Some(b)
            } else {
                None
            };
            let gate = raw(&t("ffn_gate.weight")?)?;
            let up = raw(&t("ffn_up.weight")?)?;
            layers.push(LayerW {
                attn_norm: vec(t("attn_norm.weight")?)?,
                qkv: QMat::stack(&[q, k, v])?,
                qkv_bias,
                wo: QMat::stack(&[raw(&t("attn_output.weight")?)?])?,
                ffn_norm: vec(t("ffn_norm.weight")?)?,
                gate_up: QMat::stack(&[gate, up])?,
                down: QMat::stack(&[raw(&t("ffn_down.weight")?)?])?,
            });
        }
        let kv_dim = cfg.n_kv_head * cfg.head_dim;
        let (d, f) = (cfg.dim, cfg.ffn_dim);
        // Every matrix as the metadata says: the runner's buffers are
        // sized from it, and a mismatch would write across them.
        let shapes_ok = layers.iter().all(|l| {
            (l.qkv.rows, l.qkv.cols) == (d + 2 * kv_dim, d)
                && (l.wo.rows, l.wo.cols) == (d, d)
                && (l.gate_up.rows, l.gate_up.cols) == (2 * f, d)
                && (l.down.rows, l.down.cols) == (d, f)
                && l.attn_norm.len() == d
                && l.ffn_norm.len() == d
                && l.qkv_bias
                    .as_ref()
                    .is_none_or(|b| b.len() == d + 2 * kv_dim)
        });
        if !shapes_ok
            || (head.rows, head.cols) != (cfg.vocab, d)
            || vocab != cfg.vocab
            || norm.len() != d
            || !f.is_multiple_of(32)
            || !cfg.head_dim.is_multiple_of(2)
        {
            return Err("tensor shapes disagree with the metadata".into());
        }
        let half = cfg.head_dim / 2;
        let max_positions = cfg.context_len.min(32_768);
        let inv: Vec<f32> = (0..half)
            .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f32 / cfg.head_dim as f32))
            .collect();
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for p in 0..max_positions {
            for f in &inv {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        Ok(Weights {
            cfg: cfg.clone(),
            embed,
            layers,
            norm,
            head,
            cos,
            sin,
            max_positions,
        })
    }
}
