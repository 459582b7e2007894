//! The CUDA runner's step on the CPU: the same [`StepLayout`] (slots,
//! padded block tables, buckets with their padding rows), the same kernel
//! order (RMSNorm, Q/K/V GEMVs into one fused row, RoPE, KV write, paged
//! attention, output GEMV with the residual add, gate|up, SiLU-mul, down
//! with the residual add, final norm, head for the last rows), each step
//! through the kernels' CPU references (`ultrafast_kernels::reference`)
//! over the GGUF blocks as they are in the file. Slow (one thread, plain
//! loops) and exact to its definition: the scheduler's tests run it, so
//! the host side of the CUDA path is tested where there is no GPU, and
//! the GPU check compares the GPU against it.

use super::blocks::FileWeights;
use super::layout::{graph_width, StepLayout};
use super::logits::{Need, StepLogits};
use super::ModelRunner;
use crate::error::Result;
use crate::model::paged::SeqStep;
use std::path::Path;
use std::sync::Arc;
use ultrafast_kernels::reference::{self as r, PagedKv};

/// The reference runner (see the module's comment).
pub struct ReferenceRunner {
    w: Arc<FileWeights>,
    kv: Vec<PagedKv>,
    block_size: usize,
    num_blocks: usize,
}

impl ReferenceRunner {
    /// Reads the GGUF at `path`, with a KV cache of `num_blocks` blocks of
    /// `block_size` slots (plus the layout's scratch block).
    pub fn load(path: &Path, num_blocks: usize, block_size: usize) -> Result<ReferenceRunner> {
        Ok(Self::new(
            Arc::new(FileWeights::read(path)?),
            num_blocks,
            block_size,
        ))
    }

    /// A runner over weights already read (or made: [`FileWeights::synthetic`]).
    pub fn new(w: Arc<FileWeights>, num_blocks: usize, block_size: usize) -> ReferenceRunner {
        let kv_dim = w.cfg.n_kv_head * w.cfg.head_dim;
        let kv = (0..w.cfg.n_layer)
            .map(|_| PagedKv::new(num_blocks + 1, block_size, kv_dim))
            .collect();
        ReferenceRunner {
            w,
            kv,
            block_size,
            num_blocks,
        }
    }
}

impl ModelRunner for ReferenceRunner {
    fn describe(&self) -> String {
        "reference (the CUDA runner's step on the CPU)".into()
    }

    fn step(
        &mut self,
        seqs: &[SeqStep],
        stop: &(dyn Fn(usize) -> bool + Sync),
        logits: &mut Vec<f32>,
    ) -> Result<bool> {
        let mut l = StepLayout::build(seqs, self.block_size, self.num_blocks)?;
        // Decode steps read tables as wide as the CUDA runner's graphs do.
        if l.bucket.is_some() {
            let cap = self
                .w
                .cfg
                .context_len
                .div_ceil(self.block_size)
                .min(self.num_blocks);
            if let Some(w) = graph_width(l.max_blocks, cap.max(1)) {
                l.widen(w, self.num_blocks as i32);
            }
        }
        let w = &*self.w;
        let c = &w.cfg;
        let (n, d, hd, ff) = (l.rows(), c.dim, c.head_dim, c.ffn_dim);
        let kvd = c.n_kv_head * hd;
        let stride = d + 2 * kvd;
        let (eps, theta) = (c.rms_eps as f32, c.rope_theta);
        let mut x = vec![0.0f32; n * d];
        w.embed.gather(&l.tokens, &mut x)?;
        let mut h = vec![0.0f32; n * d];
        let mut part = vec![0.0f32; n * d];
        let mut qkv = vec![0.0f32; n * stride];
        let mut att = vec![0.0f32; n * d];
        let mut gu = vec![0.0f32; n * 2 * ff];
        let mut g = vec![0.0f32; n * ff];
        let norm_rows = |x: &mut [f32], w: &[f32], h: &mut [f32]| {
            for (xr, hr) in x.chunks_mut(d).zip(h.chunks_mut(d)) {
                hr.copy_from_slice(&r::rmsnorm_residual(xr, None, w, eps));
            }
        };
        for (li, layer) in w.layers.iter().enumerate() {
            if stop(li) {
                return Ok(false);
            }
            norm_rows(&mut x, &layer.attn_norm, &mut h);
            // Q, K and V into each row's fused q|k|v layout.
            for (m, off, width) in [
                (&layer.q, 0, d),
                (&layer.k, d, kvd),
                (&layer.v, d + kvd, kvd),
            ] {
                m.apply(&h, n, false, &mut part[..n * width]);
                for row in 0..n {
                    qkv[row * stride + off..][..width]
                        .copy_from_slice(&part[row * width..][..width]);
                }
            }
            let kv = &mut self.kv[li];
            for row in 0..n {
                let pos = l.positions[row] as usize;
                let rq = &mut qkv[row * stride..][..stride];
                r::rope(&mut rq[..d], pos, c.n_head, hd, theta, false);
                r::rope(&mut rq[d..d + kvd], pos, c.n_kv_head, hd, theta, false);
                kv.write(l.slots[row] as usize, &rq[d..d + kvd], &rq[d + kvd..]);
            }
            for row in 0..n {
                let table: Vec<u32> = l.table(row).iter().map(|b| *b as u32).collect();
                let q = &qkv[row * stride..][..d];
                let out = kv.attend(q, &table, l.positions[row] as usize, c.n_head, hd);
                att[row * d..][..d].copy_from_slice(&out);
            }
            layer.o.apply(&att, n, true, &mut x);
            norm_rows(&mut x, &layer.ffn_norm, &mut h);
            // Gate and up into each row's fused gate|up layout.
            for (m, off) in [(&layer.gate, 0), (&layer.up, ff)] {
                m.apply(&h, n, false, &mut g);
                for row in 0..n {
                    gu[row * 2 * ff + off..][..ff].copy_from_slice(&g[row * ff..][..ff]);
                }
            }
            let act = r::silu_mul(&gu, ff, n);
            layer.down.apply(&act, n, true, &mut x);
        }
        let mut last = Vec::with_capacity(l.last.len() * d);
        for &row in &l.last {
            let mut xr = x[row * d..][..d].to_vec();
            last.extend(r::rmsnorm_residual(&mut xr, None, &w.norm, eps));
        }
        let head = w.head.as_ref().unwrap_or(&w.embed);
        logits.clear();
        logits.resize(l.last.len() * head.rows, 0.0);
        head.apply(&last, l.last.len(), false, logits);
        Ok(true)
    }

    /// As the CUDA runner: candidates where a sampler needs only those
    /// (picked here by the top-k kernel's reference), so the scheduler's
    /// tests sample the way it does.
    fn step_for(
        &mut self,
        seqs: &[SeqStep],
        needs: &[Need],
        stop: &(dyn Fn(usize) -> bool + Sync),
        out: &mut StepLogits,
    ) -> Result<bool> {
        let mut rows = std::mem::take(&mut out.full);
        let ran = self.step(seqs, stop, &mut rows)?;
        if ran {
            let vocab = rows.len() / seqs.len().max(1);
            out.from_rows(needs, rows.chunks(vocab.max(1)));
        }
        Ok(ran)
    }

    fn kv_bytes(&self) -> usize {
        self.kv.iter().map(|k| (k.k.len() + k.v.len()) * 2).sum()
    }
}
