//! The batched forward pass over a paged KV cache.
//!
//! One step runs any mix of sequences (prefill chunks and single decode
//! tokens): the linear layers run once over all tokens of the step, so the
//! weights are read once per step instead of once per sequence (what makes
//! continuous batching pay on a CPU). Keys and values live in fixed-size
//! blocks (`PagedKv`) addressed through each sequence's block table from
//! `kv::BlockPool`; attention reads a sequence's own slots in place, with
//! RoPE applied at each token's own position.

use super::llama::Model;
use super::ModelConfig;
use crate::error::{EngineError, Result};
use crate::simd::ops::dot;
use candle_core::{Device, Tensor};
use rayon::prelude::*;

/// Causal attention of every row of a step over its own sequence's slots
/// (grouped-query: query head `h` reads kv head `h / rep`), in plain loops:
/// no tensor, gather or mask is built per sequence and layer, and rows run
/// in parallel. Returns (rows, dim).
fn attend(c: &ModelConfig, q: &[f32], rows: &[Vec<usize>], k: &[f32], v: &[f32]) -> Vec<f32> {
    let (hd, dim) = (c.head_dim, c.dim);
    let kvd = c.n_kv_head * hd;
    let rep = c.n_head / c.n_kv_head;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; rows.len() * dim];
    out.par_chunks_mut(dim).enumerate().for_each(|(r, o)| {
        let slots = &rows[r];
        let mut p = vec![0f32; slots.len()];
        for h in 0..c.n_head {
            let qh = &q[r * dim + h * hd..][..hd];
            let off = (h / rep) * hd;
            let mut max = f32::NEG_INFINITY;
            for (pj, &s) in p.iter_mut().zip(slots) {
                let kh = &k[s * kvd + off..][..hd];
                *pj = dot(qh, kh) * scale;
                max = max.max(*pj);
            }
            let mut sum = 0f32;
            for pj in p.iter_mut() {
                *pj = (*pj - max).exp();
                sum += *pj;
            }
            let oh = &mut o[h * hd..(h + 1) * hd];
            for (pj, &s) in p.iter().zip(slots) {
                let w = pj / sum;
                let vh = &v[s * kvd + off..][..hd];
                for (a, b) in oh.iter_mut().zip(vh) {
                    *a += w * b;
                }
            }
        }
    });
    out
}

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
        slot_of(blocks, pos, self.block_size, self.slots)
    }
}

/// The cache slot of position `pos` through a sequence's block table
/// (`block_size` slots per block, `slots` in the pool); both runners index
/// their storage with it.
pub fn slot_of(blocks: &[u32], pos: usize, block_size: usize, slots: usize) -> Result<usize> {
    let b = *blocks
        .get(pos / block_size)
        .ok_or_else(|| EngineError::Invalid(format!("no block for position {pos}")))?;
    let s = b as usize * block_size + pos % block_size;
    if s >= slots {
        return Err(EngineError::Invalid(format!("block {b} outside the pool")));
    }
    Ok(s)
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
        let run = self.forward_paged_until(kv, seqs, &|_| false)?;
        run.ok_or_else(|| EngineError::Invalid("step stopped without a stop condition".into()))
    }

    /// [`forward_paged`](Self::forward_paged) that asks `stop(layer)` before
    /// each layer and gives up (`Ok(None)`) when it says so, so that a
    /// step can make way for more urgent work. Giving up loses nothing but
    /// the layers already run: the keys and values they stored sit at
    /// positions the sequences have not reached yet, and running the same
    /// tokens again stores the same values before anything reads them.
    pub fn forward_paged_until(
        &self,
        kv: &mut PagedKv,
        seqs: &[SeqStep],
        stop: &dyn Fn(usize) -> bool,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        let c = self.cfg.clone();
        let dev = Device::Cpu;
        let total: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        if total == 0 {
            return Ok(Some(Vec::new()));
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
        // Per row of the step: its sequence's slots up to and including
        // its own position (resolved once per step, not per layer).
        let mut rows: Vec<Vec<usize>> = Vec::with_capacity(total);
        let mut slots_by_seq = Vec::with_capacity(seqs.len());
        for s in seqs {
            let ctx = s.start + s.tokens.len();
            let slots = (0..ctx)
                .map(|p| kv.slot(s.blocks, p))
                .collect::<Result<Vec<usize>>>()?;
            slots_by_seq.push(slots);
        }
        for (s, slots) in seqs.iter().zip(&slots_by_seq) {
            for i in 0..s.tokens.len() {
                rows.push(slots[..=s.start + i].to_vec());
            }
        }
        let d = kv.kv_dim;
        for layer in 0..c.n_layer {
            if stop(layer) {
                return Ok(None);
            }
            let (q, k, v) = self.qkv(layer, &x, &cos, &sin)?;
            // Store this step's keys and values in their slots.
            let k_rows: Vec<f32> = k.flatten_all()?.to_vec1()?;
            let v_rows: Vec<f32> = v.flatten_all()?.to_vec1()?;
            for (t, slots) in rows.iter().enumerate() {
                let slot = slots[slots.len() - 1];
                kv.k[layer][slot * d..(slot + 1) * d].copy_from_slice(&k_rows[t * d..(t + 1) * d]);
                kv.v[layer][slot * d..(slot + 1) * d].copy_from_slice(&v_rows[t * d..(t + 1) * d]);
            }
            let q_rows: Vec<f32> = q.flatten_all()?.to_vec1()?;
            let out = attend(&c, &q_rows, &rows, &kv.k[layer], &kv.v[layer]);
            let out = Tensor::from_vec(out, (total, c.dim), &dev)?;
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
        Ok(Some(logits.to_vec2()?))
    }
}
