//! The batched forward pass over a paged KV cache.
//!
//! One step runs any mix of sequences (prefill chunks and single decode
//! tokens): the linear layers run once over all tokens of the step, so the
//! weights are read once per step instead of once per sequence (what makes
//! continuous batching pay on a CPU). Keys and values live in fixed-size
//! blocks (`PagedKv`) addressed through each sequence's block table from
//! `kv::BlockPool`; attention gathers a sequence's own blocks and applies
//! RoPE at each token's own position.

use super::llama::Model;
use crate::error::{EngineError, Result};
use candle_core::{Device, Tensor};

/// Key/value storage: per layer, `num_blocks * block_size` slots of
/// `kv_heads * head_dim` floats.
pub struct PagedKv {
    block_size: usize,
    kv_dim: usize,
    slots: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl PagedKv {
    /// Storage for `num_blocks` blocks of `block_size` tokens for `model`.
    pub fn new(model: &Model, num_blocks: usize, block_size: usize) -> Self {
        let c = &model.cfg;
        let kv_dim = c.n_kv_head * c.head_dim;
        let slots = num_blocks * block_size;
        PagedKv {
            block_size,
            kv_dim,
            slots,
            k: vec![vec![0.0; slots * kv_dim]; c.n_layer],
            v: vec![vec![0.0; slots * kv_dim]; c.n_layer],
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        2 * self.k.len() * self.slots * self.kv_dim * 4
    }

    fn slot(&self, blocks: &[u32], pos: usize) -> Result<usize> {
        let b = *blocks
            .get(pos / self.block_size)
            .ok_or_else(|| EngineError::Invalid(format!("no block for position {pos}")))?;
        let s = b as usize * self.block_size + pos % self.block_size;
        if s >= self.slots {
            return Err(EngineError::Invalid(format!("block {b} outside the pool")));
        }
        Ok(s)
    }
}

/// One sequence's share of a step.
pub struct SeqStep<'a> {
    /// Tokens to run (a prefill chunk or one decode token).
    pub tokens: &'a [u32],
    /// Position of the first of them.
    pub start: usize,
    /// The sequence's block table (must cover `start + tokens.len()`).
    pub blocks: &'a [u32],
}

impl Model {
    /// Run one step for `seqs`; returns each sequence's last-position logits.
    pub fn forward_paged(&self, kv: &mut PagedKv, seqs: &[SeqStep]) -> Result<Vec<Vec<f32>>> {
        let c = self.cfg.clone();
        let dev = Device::Cpu;
        let total: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        if total == 0 {
            return Ok(Vec::new());
        }
        let mut ids = Vec::with_capacity(total);
        let mut positions = Vec::with_capacity(total);
        for s in seqs {
            if s.tokens.is_empty() {
                return Err(EngineError::Invalid("empty sequence in step".into()));
            }
            ids.extend_from_slice(s.tokens);
            positions.extend((s.start..s.start + s.tokens.len()).map(|p| p as u32));
        }
        if positions
            .iter()
            .any(|p| *p as usize >= self.max_positions())
        {
            return Err(EngineError::Invalid("position beyond the context".into()));
        }
        let ids_t = Tensor::from_slice(&ids, total, &dev)?;
        let pos_t = Tensor::from_slice(&positions, total, &dev)?;
        let (cos, sin) = self.rope_tables(&pos_t)?;
        let mut x = self.embed_rows(&ids_t)?;
        let rep = c.n_head / c.n_kv_head;
        let scale = 1.0 / (c.head_dim as f64).sqrt();
        for layer in 0..c.n_layer {
            let (q, k, v) = self.qkv(layer, &x, &cos, &sin)?;
            // Store this step's keys and values in their slots.
            let k_rows: Vec<f32> = k.flatten_all()?.to_vec1()?;
            let v_rows: Vec<f32> = v.flatten_all()?.to_vec1()?;
            let mut t = 0;
            for s in seqs {
                for i in 0..s.tokens.len() {
                    let slot = kv.slot(s.blocks, s.start + i)?;
                    let d = kv.kv_dim;
                    kv.k[layer][slot * d..(slot + 1) * d]
                        .copy_from_slice(&k_rows[t * d..(t + 1) * d]);
                    kv.v[layer][slot * d..(slot + 1) * d]
                        .copy_from_slice(&v_rows[t * d..(t + 1) * d]);
                    t += 1;
                }
            }
            // Attention, one sequence at a time over its own blocks.
            let mut outs = Vec::with_capacity(seqs.len());
            let mut row = 0;
            for s in seqs {
                let len = s.tokens.len();
                let ctx = s.start + len;
                let d = kv.kv_dim;
                let mut kg = Vec::with_capacity(ctx * d);
                let mut vg = Vec::with_capacity(ctx * d);
                for p in 0..ctx {
                    let slot = kv.slot(s.blocks, p)?;
                    kg.extend_from_slice(&kv.k[layer][slot * d..(slot + 1) * d]);
                    vg.extend_from_slice(&kv.v[layer][slot * d..(slot + 1) * d]);
                }
                let to_heads = |data: Vec<f32>| -> candle_core::Result<Tensor> {
                    let t = Tensor::from_vec(data, (ctx, c.n_kv_head, c.head_dim), &dev)?
                        .transpose(0, 1)?;
                    if rep == 1 {
                        return t.contiguous();
                    }
                    t.unsqueeze(1)?
                        .expand((c.n_kv_head, rep, ctx, c.head_dim))?
                        .reshape((c.n_head, ctx, c.head_dim))
                };
                let (kh, vh) = (to_heads(kg)?, to_heads(vg)?);
                let qs = q
                    .narrow(0, row, len)?
                    .reshape((len, c.n_head, c.head_dim))?
                    .transpose(0, 1)?
                    .contiguous()?;
                let mut att = (qs.matmul(&kh.t()?.contiguous()?)? * scale)?;
                if len > 1 {
                    let m: Vec<f32> = (0..len)
                        .flat_map(|i| {
                            (0..ctx).map(move |j| {
                                if j > s.start + i {
                                    f32::NEG_INFINITY
                                } else {
                                    0.0
                                }
                            })
                        })
                        .collect();
                    att = att.broadcast_add(&Tensor::from_vec(m, (1, len, ctx), &dev)?)?;
                }
                let att = super::llama::softmax_last(&att)?;
                outs.push(att.matmul(&vh)?.transpose(0, 1)?.reshape((len, c.dim))?);
                row += len;
            }
            let out = Tensor::cat(&outs, 0)?;
            x = self.finish_layer(layer, x, &out)?;
        }
        // Logits for the last token of each sequence, in one matmul.
        let mut last_rows = Vec::with_capacity(seqs.len());
        let mut end = 0;
        for s in seqs {
            end += s.tokens.len();
            last_rows.push((end - 1) as u32);
        }
        let idx = Tensor::from_slice(&last_rows, seqs.len(), &dev)?;
        let logits = self.head(&x.index_select(&idx, 0)?)?;
        Ok(logits.to_vec2()?)
    }
}
