//! The CUDA runner's forward pass: the model on the device and the
//! kernels in the reference runner's order, over one step's device
//! buffers. The same code runs a step directly and records a decode
//! step's CUDA graph, which is why it never allocates, copies or waits.

use super::super::blocks::Mat;
use super::super::layout::graph_width;
use crate::error::{EngineError, Result};
use crate::model::ModelConfig;
use ultrafast_kernels::gpu::{
    attention_scratch, attention_split, AttnShape, DeviceBuffer as Buf, Gpu, Split,
};
use ultrafast_kernels::reference::Format;

/// Tokens per GEMV launch (the kernel's accumulators per lane).
pub const GEMV_TOKENS: usize = 8;

pub(super) fn err(what: &str) -> impl FnOnce(String) -> EngineError + '_ {
    move |e| EngineError::Invalid(format!("CUDA runner: {what}: {e}"))
}

/// A weight matrix: the file's blocks for the GEMV, and a bfloat16 copy
/// for prompt GEMMs where cuBLAS is there.
pub(super) struct DevMat {
    pub format: Format,
    pub w: Buf<u8>,
    pub bf16: Option<Buf<u16>>,
    pub rows: usize,
    pub cols: usize,
}

impl DevMat {
    pub fn upload(g: &Gpu, m: &Mat, gemm: bool) -> Result<DevMat> {
        let w = g.upload(&m.bytes).map_err(err("upload"))?;
        let bf16 = match gemm {
            true => Some(
                g.dequant_bf16(m.format, &w, m.rows, m.cols)
                    .map_err(err("dequantize"))?,
            ),
            false => None,
        };
        Ok(DevMat {
            format: m.format,
            w,
            bf16,
            rows: m.rows,
            cols: m.cols,
        })
    }
}

pub(super) struct DevLayer {
    pub attn_norm: Buf<f32>,
    pub qkv: DevMat,
    pub o: DevMat,
    pub ffn_norm: Buf<f32>,
    pub gate_up: DevMat,
    pub down: DevMat,
}

/// The model on the device.
pub(super) struct DevModel {
    pub gpu: Gpu,
    pub cfg: ModelConfig,
    pub layers: Vec<DevLayer>,
    pub norm: Buf<f32>,
    pub head: DevMat,
    pub block_size: usize,
    /// RoPE's cosines and sines for every position of the context
    /// (`reference::rope_table`), made once at load.
    pub rope: Buf<f32>,
    /// The widest block table a sequence can have (graphs' width cap).
    pub max_width: usize,
}

/// The KV cache: one K and one V buffer per layer, f16, in the pool's
/// block ids plus the scratch block.
pub(super) struct DevKv {
    pub k: Vec<Buf<u16>>,
    pub v: Vec<Buf<u16>>,
}

/// One step's inputs on the device.
pub(super) struct StepIo {
    pub x: Buf<f32>,
    pub pos: Buf<i32>,
    pub slots: Buf<i32>,
    pub qseq: Buf<i32>,
    pub tables: Buf<i32>,
}

/// Activations of up to `rows` rows.
pub(super) struct Acts {
    pub rows: usize,
    pub h: Buf<f32>,
    pub qkv: Buf<f32>,
    pub att: Buf<f32>,
    pub gu: Buf<f32>,
    pub act: Buf<f32>,
    /// A prompt's activations as bfloat16 for the GEMM (widest input).
    pub xb: Buf<u16>,
    /// A split attention's partial sums (`gpu::attention_scratch`).
    pub part: Buf<f32>,
}

impl Acts {
    pub fn new(g: &Gpu, rows: usize, c: &ModelConfig) -> Result<Acts> {
        let z = |len: usize| g.zeros::<f32>(rows * len).map_err(err("alloc"));
        let stride = c.dim + 2 * c.n_kv_head * c.head_dim;
        Ok(Acts {
            rows,
            h: z(c.dim)?,
            qkv: z(stride)?,
            att: z(c.dim)?,
            gu: z(2 * c.ffn_dim)?,
            act: z(c.ffn_dim)?,
            xb: g
                .zeros::<u16>(rows * c.dim.max(c.ffn_dim))
                .map_err(err("alloc"))?,
            part: g
                .zeros::<f32>(attention_scratch(rows, c.n_head, c.n_kv_head, c.head_dim))
                .map_err(err("alloc"))?,
        })
    }
}

impl DevModel {
    /// `y (+)= W x` over `tokens` rows: a prompt through cuBLAS when
    /// `gemm` and the bfloat16 copy allow, else the GEMV eight at a time.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        m: &DevMat,
        x: &Buf<f32>,
        xb: &mut Buf<u16>,
        y: &mut Buf<f32>,
        tokens: usize,
        acc: bool,
        gemm: bool,
    ) -> Result<()> {
        let g = &self.gpu;
        if let (true, true, Some(w)) = (gemm, tokens > GEMV_TOKENS, &m.bf16) {
            let n = tokens * m.cols;
            g.to_bf16(&x.slice(..n), &mut xb.slice_mut(..n), n)
                .map_err(err("to_bf16"))?;
            return g
                .gemm_bf16(
                    w,
                    &xb.slice(..n),
                    &mut y.slice_mut(..tokens * m.rows),
                    m.rows,
                    m.cols,
                    tokens,
                    acc,
                )
                .map_err(err("gemm"));
        }
        let mut t0 = 0;
        while t0 < tokens {
            let t1 = (t0 + GEMV_TOKENS).min(tokens);
            let xv = x.slice(t0 * m.cols..t1 * m.cols);
            let mut yv = y.slice_mut(t0 * m.rows..t1 * m.rows);
            g.gemv(m.format, &m.w, &xv, &mut yv, m.rows, m.cols, t1 - t0, acc)
                .map_err(err("gemv"))?;
            t0 = t1;
        }
        Ok(())
    }

    /// The layers and the final norm over `n` rows (into `a.h`); false
    /// when `stop(layer)` said to give up first.
    #[allow(clippy::too_many_arguments)]
    pub fn layers(
        &self,
        kv: &mut DevKv,
        io: &mut StepIo,
        a: &mut Acts,
        n: usize,
        max_blocks: usize,
        gemm: bool,
        stop: &(dyn Fn(usize) -> bool + Sync),
    ) -> Result<bool> {
        let (c, g) = (&self.cfg, &self.gpu);
        let (d, hd, ff) = (c.dim, c.head_dim, c.ffn_dim);
        let kvd = c.n_kv_head * hd;
        let stride = d + 2 * kvd;
        let eps = c.rms_eps as f32;
        let shape = AttnShape {
            heads: c.n_head,
            kv_heads: c.n_kv_head,
            hd,
            block_size: self.block_size,
        };
        // Each row's context split so that a decode step fills the GPU,
        // from the width its graph has (or would have): a step run
        // directly splits as its graph does, so the two agree bit for bit.
        let split_blocks = graph_width(max_blocks, self.max_width).unwrap_or(max_blocks);
        let (parts, chunk) = attention_split(n, c.n_kv_head, split_blocks * self.block_size);
        let x = &mut io.x;
        for (li, layer) in self.layers.iter().enumerate() {
            if stop(li) {
                return Ok(false);
            }
            g.rmsnorm_residual(x, None, &layer.attn_norm, &mut a.h, d, n, eps)
                .map_err(err("rmsnorm"))?;
            self.matmul(&layer.qkv, &a.h, &mut a.xb, &mut a.qkv, n, false, gemm)?;
            // K's heads follow Q's in the fused row: one launch rotates both.
            let heads = c.n_head + c.n_kv_head;
            g.rope(
                &mut a.qkv, &io.pos, heads, hd, stride, 0, n, &self.rope, false,
            )
            .map_err(err("rope"))?;
            let (kc, vc) = (&mut kv.k[li], &mut kv.v[li]);
            g.kv_write(&a.qkv, stride, d, d + kvd, kc, vc, &io.slots, kvd, n)
                .map_err(err("kv_write"))?;
            let split = Split {
                parts,
                chunk,
                scratch: &mut a.part,
            };
            g.paged_attention(
                &a.qkv, stride, kc, vc, &io.tables, max_blocks, &io.qseq, &io.pos, &mut a.att,
                shape, n, split,
            )
            .map_err(err("attention"))?;
            self.matmul(&layer.o, &a.att, &mut a.xb, x, n, true, gemm)?;
            g.rmsnorm_residual(x, None, &layer.ffn_norm, &mut a.h, d, n, eps)
                .map_err(err("rmsnorm"))?;
            self.matmul(&layer.gate_up, &a.h, &mut a.xb, &mut a.gu, n, false, gemm)?;
            g.silu_mul(&a.gu, &mut a.act, ff, n).map_err(err("silu"))?;
            self.matmul(&layer.down, &a.act, &mut a.xb, x, n, true, gemm)?;
        }
        g.rmsnorm_residual(x, None, &self.norm, &mut a.h, d, n, eps)
            .map_err(err("rmsnorm"))?;
        Ok(true)
    }

    /// The head's logits of `rows` (rows of `a.h`) into `out`, row i of
    /// `out` from `rows[i]`: contiguous rows from 0 eight at a time (a
    /// decode step), others one by one (a prompt's last rows).
    pub fn head(&self, a: &Acts, rows: &[usize], out: &mut Buf<f32>) -> Result<()> {
        let (d, vocab, m) = (self.cfg.dim, self.head.rows, &self.head);
        let g = &self.gpu;
        if rows.iter().enumerate().all(|(i, r)| i == *r) {
            let mut t0 = 0;
            while t0 < rows.len() {
                let t1 = (t0 + GEMV_TOKENS).min(rows.len());
                let xv = a.h.slice(t0 * d..t1 * d);
                let mut yv = out.slice_mut(t0 * vocab..t1 * vocab);
                g.gemv(m.format, &m.w, &xv, &mut yv, vocab, d, t1 - t0, false)
                    .map_err(err("head"))?;
                t0 = t1;
            }
            return Ok(());
        }
        for (i, row) in rows.iter().enumerate() {
            let xv = a.h.slice(row * d..(row + 1) * d);
            let mut yv = out.slice_mut(i * vocab..(i + 1) * vocab);
            g.gemv(m.format, &m.w, &xv, &mut yv, vocab, d, 1, false)
                .map_err(err("head"))?;
        }
        Ok(())
    }
}
