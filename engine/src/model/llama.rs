//! The llama-family forward pass on candle-core with quantized weights.
//!
//! Weights are looked up by their GGUF names (`blk.N.attn_q.weight`, ...).
//! Matmuls run on the quantized weights (`linear`); activations are f32.
//! The KV cache is an explicit argument of `forward`, so the caller owns
//! sequence state (the scheduler will hand in paged blocks through the same
//! seam). Rotary embeddings follow the GGUF layout: interleaved pairs for
//! llama (the converter permutes Q/K), half-split (NEOX) for qwen2.

use super::linear::Linear;
use super::{Arch, ModelConfig};
use crate::error::{EngineError, Result};
use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor, D};
use std::path::Path;

struct Layer {
    attn_norm: Tensor,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    bq: Option<Tensor>,
    bk: Option<Tensor>,
    bv: Option<Tensor>,
    wo: Linear,
    ffn_norm: Tensor,
    w_gate: Linear,
    w_up: Linear,
    w_down: Linear,
}

/// A loaded model.
pub struct Model {
    /// Its shape.
    pub cfg: ModelConfig,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    output: Linear,
    cos: Tensor,
    sin: Tensor,
    device: Device,
}

/// Per-sequence key/value cache: per layer, (kv_heads, positions, head_dim).
#[derive(Default)]
pub struct KvCache {
    k: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
}

impl KvCache {
    /// Positions cached.
    pub fn len(&self) -> usize {
        self.k
            .first()
            .and_then(|t| t.as_ref())
            .map(|t| t.dims()[1])
            .unwrap_or(0)
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)
}

pub(super) fn softmax_last(x: &Tensor) -> candle_core::Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&max)?.exp()?;
    let s = e.sum_keepdim(D::Minus1)?;
    e.broadcast_div(&s)
}

impl Model {
    /// Load a GGUF model on `device`.
    pub fn load(path: &Path, device: &Device) -> Result<Self> {
        let bad = |e: candle_core::Error| EngineError::model(path, e.to_string());
        let mut f =
            std::fs::File::open(path).map_err(|e| EngineError::model(path, e.to_string()))?;
        let ct = gguf_file::Content::read(&mut f)
            .map_err(|e| EngineError::model(path, format!("not a valid GGUF file: {e}")))?;
        let cfg = ModelConfig::from_gguf(&ct, path)?;
        let mut qt = |name: &str| {
            ct.tensor(&mut f, name, device)
                .map_err(|e| EngineError::model(path, format!("tensor `{name}`: {e}")))
        };
        let embed_q = qt("token_embd.weight")?;
        let embed = embed_q.dequantize(device).map_err(bad)?;
        let output = match qt("output.weight") {
            Ok(o) => Linear::from_qtensor(o).map_err(bad)?,
            // Tied embeddings (SmolLM2): the output head is the embedding.
            Err(_) => Linear::from_qtensor(embed_q).map_err(bad)?,
        };
        let norm = qt("output_norm.weight")?.dequantize(device).map_err(bad)?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let mut mm = |n: &str| -> Result<Linear> {
                Linear::from_qtensor(qt(&format!("blk.{i}.{n}.weight"))?).map_err(bad)
            };
            let wq = mm("attn_q")?;
            let wk = mm("attn_k")?;
            let wv = mm("attn_v")?;
            let wo = mm("attn_output")?;
            let w_gate = mm("ffn_gate")?;
            let w_up = mm("ffn_up")?;
            let w_down = mm("ffn_down")?;
            let mut vec = |n: &str| -> Result<Tensor> {
                qt(&format!("blk.{i}.{n}"))?.dequantize(device).map_err(bad)
            };
            let (bq, bk, bv) = if cfg.arch == Arch::Qwen2 {
                (
                    Some(vec("attn_q.bias")?),
                    Some(vec("attn_k.bias")?),
                    Some(vec("attn_v.bias")?),
                )
            } else {
                (None, None, None)
            };
            layers.push(Layer {
                attn_norm: vec("attn_norm.weight")?,
                ffn_norm: vec("ffn_norm.weight")?,
                wq,
                wk,
                wv,
                bq,
                bk,
                bv,
                wo,
                w_gate,
                w_up,
                w_down,
            });
        }
        let half = cfg.head_dim / 2;
        let inv: Vec<f32> = (0..half)
            .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f32 / cfg.head_dim as f32))
            .collect();
        let max_pos = cfg.context_len.min(32_768);
        let pos: Vec<f32> = (0..max_pos).map(|p| p as f32).collect();
        let pos = Tensor::from_vec(pos, (max_pos, 1), device).map_err(bad)?;
        let inv = Tensor::from_vec(inv, (1, half), device).map_err(bad)?;
        let freqs = pos.broadcast_mul(&inv).map_err(bad)?;
        Ok(Model {
            cos: freqs.cos().map_err(bad)?,
            sin: freqs.sin().map_err(bad)?,
            cfg,
            embed,
            layers,
            norm,
            output,
            device: device.clone(),
        })
    }

    /// A fresh cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        KvCache {
            k: vec![None; self.cfg.n_layer],
            v: vec![None; self.cfg.n_layer],
        }
    }

    /// Positions the rotary tables cover.
    pub fn max_positions(&self) -> usize {
        self.cos.dims()[0]
    }

    /// Rotary cos/sin rows for each token's position: (tokens, head_dim/2).
    pub(super) fn rope_tables(&self, positions: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        Ok((
            self.cos.index_select(positions, 0)?,
            self.sin.index_select(positions, 0)?,
        ))
    }

    /// Embedding rows of `ids`: (tokens, dim).
    pub(super) fn embed_rows(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        self.embed.index_select(ids, 0)
    }

    /// Rotate (tokens, heads, head_dim) by per-token (tokens, head_dim/2) tables.
    fn rope_tokens(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
        let (t, h, hd) = x.dims3()?;
        let cos = cos.unsqueeze(1)?;
        let sin = sin.unsqueeze(1)?;
        match self.cfg.arch {
            Arch::Llama => {
                let x = x.reshape((t, h, hd / 2, 2))?;
                let x0 = x.narrow(D::Minus1, 0, 1)?.squeeze(D::Minus1)?;
                let x1 = x.narrow(D::Minus1, 1, 1)?.squeeze(D::Minus1)?;
                let r0 = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
                let r1 = (x0.broadcast_mul(&sin)? + x1.broadcast_mul(&cos)?)?;
                Tensor::stack(&[r0, r1], D::Minus1)?.reshape((t, h, hd))
            }
            Arch::Qwen2 => {
                let x0 = x.narrow(D::Minus1, 0, hd / 2)?;
                let x1 = x.narrow(D::Minus1, hd / 2, hd / 2)?;
                let r0 = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
                let r1 = (x0.broadcast_mul(&sin)? + x1.broadcast_mul(&cos)?)?;
                Tensor::cat(&[r0, r1], D::Minus1)
            }
        }
    }

    /// Layer `i`'s rotated queries (tokens, dim), rotated keys and values
    /// (tokens, kv_heads * head_dim) for the (tokens, dim) input `x`.
    pub(super) fn qkv(
        &self,
        i: usize,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let (c, l) = (&self.cfg, &self.layers[i]);
        let t = x.dims()[0];
        let h = rms_norm(x, &l.attn_norm, c.rms_eps)?;
        let add = |y: Tensor, b: &Option<Tensor>| -> candle_core::Result<Tensor> {
            match b {
                Some(b) => y.broadcast_add(b),
                None => Ok(y),
            }
        };
        let q = add(l.wq.forward(&h)?, &l.bq)?.reshape((t, c.n_head, c.head_dim))?;
        let k = add(l.wk.forward(&h)?, &l.bk)?.reshape((t, c.n_kv_head, c.head_dim))?;
        let v = add(l.wv.forward(&h)?, &l.bv)?;
        let q = self.rope_tokens(&q, cos, sin)?.reshape((t, c.dim))?;
        let k = self
            .rope_tokens(&k, cos, sin)?
            .reshape((t, c.n_kv_head * c.head_dim))?;
        Ok((q, k, v))
    }

    /// Residual after attention, then the feed-forward block, for layer `i`.
    pub(super) fn finish_layer(
        &self,
        i: usize,
        x: Tensor,
        attn: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let l = &self.layers[i];
        let x = (x + l.wo.forward(attn)?)?;
        let h = rms_norm(&x, &l.ffn_norm, self.cfg.rms_eps)?;
        let ff = (l.w_gate.forward(&h)?.silu()? * l.w_up.forward(&h)?)?;
        x + l.w_down.forward(&ff)?
    }

    /// Final norm and output head over (rows, dim): (rows, vocab) f32.
    pub(super) fn head(&self, rows: &Tensor) -> candle_core::Result<Tensor> {
        let r = rms_norm(rows, &self.norm, self.cfg.rms_eps)?;
        self.output.forward(&r)?.to_dtype(DType::F32)
    }

    /// Run `tokens` at positions `cache.len()..` for one sequence with a
    /// contiguous cache; returns the last position's logits (vocab,).
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor> {
        let pos = cache.len();
        let len = tokens.len();
        if len == 0 {
            return Err(EngineError::Invalid("no tokens".into()));
        }
        if pos + len > self.max_positions() {
            return Err(EngineError::Invalid(format!(
                "sequence of {} tokens exceeds the context",
                pos + len
            )));
        }
        let c = &self.cfg;
        let ids = Tensor::from_slice(tokens, len, &self.device)?;
        let positions: Vec<u32> = (pos..pos + len).map(|p| p as u32).collect();
        let (cos, sin) = self.rope_tables(&Tensor::from_slice(&positions, len, &self.device)?)?;
        let mut x = self.embed_rows(&ids)?;
        let rep = c.n_head / c.n_kv_head;
        let scale = 1.0 / (c.head_dim as f64).sqrt();
        let mask = if len > 1 {
            let t = pos + len;
            let m: Vec<f32> = (0..len)
                .flat_map(|i| {
                    (0..t).map(move |j| if j > pos + i { f32::NEG_INFINITY } else { 0.0 })
                })
                .collect();
            Some(Tensor::from_vec(m, (1, len, t), &self.device)?)
        } else {
            None
        };
        for i in 0..c.n_layer {
            let (q, k, v) = self.qkv(i, &x, &cos, &sin)?;
            let q = q
                .reshape((len, c.n_head, c.head_dim))?
                .transpose(0, 1)?
                .contiguous()?;
            let k = k
                .reshape((len, c.n_kv_head, c.head_dim))?
                .transpose(0, 1)?
                .contiguous()?;
            let v = v
                .reshape((len, c.n_kv_head, c.head_dim))?
                .transpose(0, 1)?
                .contiguous()?;
            let k = match cache.k[i].take() {
                Some(prev) => Tensor::cat(&[&prev, &k], 1)?,
                None => k,
            };
            let v = match cache.v[i].take() {
                Some(prev) => Tensor::cat(&[&prev, &v], 1)?,
                None => v,
            };
            cache.k[i] = Some(k.clone());
            cache.v[i] = Some(v.clone());
            let t = k.dims()[1];
            let expand = |x: &Tensor| -> candle_core::Result<Tensor> {
                if rep == 1 {
                    return Ok(x.clone());
                }
                x.unsqueeze(1)?
                    .expand((c.n_kv_head, rep, t, c.head_dim))?
                    .reshape((c.n_head, t, c.head_dim))
            };
            let (k, v) = (expand(&k)?, expand(&v)?);
            let mut att = (q.matmul(&k.t()?.contiguous()?)? * scale)?;
            if let Some(m) = &mask {
                att = att.broadcast_add(m)?;
            }
            let att = softmax_last(&att)?;
            let out = att
                .matmul(&v.contiguous()?)?
                .transpose(0, 1)?
                .reshape((len, c.dim))?;
            x = self.finish_layer(i, x, &out)?;
        }
        let last = x.narrow(0, len - 1, 1)?;
        Ok(self.head(&last)?.squeeze(0)?)
    }
}
