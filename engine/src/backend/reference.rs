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

use super::layout::StepLayout;
use super::ModelRunner;
use crate::error::{EngineError, Result};
use crate::model::paged::SeqStep;
use crate::model::{Arch, ModelConfig};
use candle_core::quantized::{gguf_file, GgmlDType};
use candle_core::Device as CDevice;
use std::path::Path;
use ultrafast_kernels::reference::{self as r, Format, PagedKv};

/// A matrix as the file stores it.
struct Mat {
    format: Format,
    bytes: Vec<u8>,
    rows: usize,
    cols: usize,
}

impl Mat {
    /// `y (+)= W x` for `tokens` rows of `x`.
    fn apply(&self, x: &[f32], tokens: usize, acc: bool, y: &mut [f32]) {
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

    /// Row `i`, dequantized (the embedding lookup).
    fn row(&self, i: usize, out: &mut [f32]) {
        let (per, bytes) = (self.format.per_block(), self.format.block_bytes());
        let nb = self.cols / per;
        for b in 0..nb {
            let blk = &self.bytes[(i * nb + b) * bytes..][..bytes];
            r::dequantize_into(self.format, blk, &mut out[b * per..][..per]);
        }
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    q: Mat,
    k: Mat,
    v: Mat,
    o: Mat,
    ffn_norm: Vec<f32>,
    gate: Mat,
    up: Mat,
    down: Mat,
}

/// The reference runner (see the module's comment).
pub struct ReferenceRunner {
    cfg: ModelConfig,
    embed: Mat,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    head: Option<Mat>,
    kv: Vec<PagedKv>,
    block_size: usize,
    num_blocks: usize,
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

impl ReferenceRunner {
    /// Reads the GGUF at `path`, with a KV cache of `num_blocks` blocks of
    /// `block_size` slots (plus the layout's scratch block).
    pub fn load(path: &Path, num_blocks: usize, block_size: usize) -> Result<ReferenceRunner> {
        let err = |e: &dyn std::fmt::Display| EngineError::model(path, e.to_string());
        let mut f = std::fs::File::open(path).map_err(|e| err(&e))?;
        let ct = gguf_file::Content::read(&mut f).map_err(|e| err(&e))?;
        let cfg = ModelConfig::from_gguf(&ct, path)?;
        if cfg.arch != Arch::Llama {
            return Err(err(&"the reference runner reads llama-layout models only"));
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
            layers.push(Layer {
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
        let kv = (0..cfg.n_layer)
            .map(|_| PagedKv::new(num_blocks + 1, block_size, cfg.n_kv_head * cfg.head_dim))
            .collect();
        Ok(ReferenceRunner {
            cfg,
            embed,
            layers,
            norm,
            head,
            kv,
            block_size,
            num_blocks,
        })
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
        let l = StepLayout::build(seqs, self.block_size, self.num_blocks)?;
        let c = &self.cfg;
        let (n, d, hd, ff) = (l.rows(), c.dim, c.head_dim, c.ffn_dim);
        let kvd = c.n_kv_head * hd;
        let stride = d + 2 * kvd;
        let (eps, theta) = (c.rms_eps as f32, c.rope_theta);
        let mut x = vec![0.0f32; n * d];
        for (row, t) in l.tokens.iter().enumerate() {
            if *t as usize >= self.embed.rows {
                return Err(EngineError::Invalid(format!(
                    "token {t} outside the vocabulary"
                )));
            }
            self.embed.row(*t as usize, &mut x[row * d..][..d]);
        }
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
        for (li, layer) in self.layers.iter().enumerate() {
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
            last.extend(r::rmsnorm_residual(&mut xr, None, &self.norm, eps));
        }
        let head = self.head.as_ref().unwrap_or(&self.embed);
        logits.clear();
        logits.resize(l.last.len() * head.rows, 0.0);
        head.apply(&last, l.last.len(), false, logits);
        Ok(true)
    }

    fn kv_bytes(&self) -> usize {
        self.kv.iter().map(|k| (k.k.len() + k.v.len()) * 2).sum()
    }
}
