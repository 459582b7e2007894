//! The CUDA runner: the weights uploaded as the file's blocks (Q|K|V and
//! gate|up stacked into one matrix each), the KV cache on the GPU in the
//! pool's block ids plus the layout's scratch block, and each step as the
//! [`StepLayout`] uploaded, then the kernels of `ultrafast_kernels` in the
//! order [`super::reference::ReferenceRunner`] runs their references.
//!
//! Not yet: CUDA graphs for decode steps (the layout's buckets are ready
//! for them), a tensor-core GEMM for prompts (they run through the GEMV
//! eight tokens at a time), and sampling on the device (the last rows'
//! logits are copied back). It has not run on a GPU yet: `device = "auto"`
//! does not choose it until the GPU check has passed; `device = "cuda"`
//! asks for it.

use super::blocks::{FileWeights, Mat};
use super::layout::StepLayout;
use super::{Device, ModelRunner};
use crate::error::{EngineError, Result};
use crate::model::paged::SeqStep;
use crate::model::ModelConfig;
use std::path::PathBuf;
use ultrafast_kernels::gpu::{AttnShape, DeviceBuffer as CudaSlice, Gpu};
use ultrafast_kernels::nvrtc::Nvrtc;
use ultrafast_kernels::reference::Format;

/// Tokens per GEMV launch (the kernel's accumulators per lane).
const GEMV_TOKENS: usize = 8;

struct DevMat {
    format: Format,
    w: CudaSlice<u8>,
    rows: usize,
    cols: usize,
}

struct DevLayer {
    attn_norm: CudaSlice<f32>,
    qkv: DevMat,
    o: DevMat,
    ffn_norm: CudaSlice<f32>,
    gate_up: DevMat,
    down: DevMat,
}

/// The CUDA runner (see the module's comment).
pub struct CudaRunner {
    gpu: Gpu,
    ordinal: usize,
    cfg: ModelConfig,
    /// Host copy of the embedding: a step's rows are looked up here and
    /// uploaded (a few KB per token).
    embed: Mat,
    layers: Vec<DevLayer>,
    norm: CudaSlice<f32>,
    head: DevMat,
    kc: Vec<CudaSlice<u16>>,
    vc: Vec<CudaSlice<u16>>,
    block_size: usize,
    num_blocks: usize,
    acts: Option<Acts>,
}

/// Device buffers for the activations of up to `rows` rows.
struct Acts {
    rows: usize,
    h: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    att: CudaSlice<f32>,
    gu: CudaSlice<f32>,
    act: CudaSlice<f32>,
}

impl Acts {
    fn new(g: &Gpu, rows: usize, d: usize, stride: usize, ff: usize) -> Result<Acts> {
        let z = |len: usize| g.zeros::<f32>(rows * len).map_err(err("alloc"));
        Ok(Acts {
            rows,
            h: z(d)?,
            qkv: z(stride)?,
            att: z(d)?,
            gu: z(2 * ff)?,
            act: z(ff)?,
        })
    }
}

fn err(what: &str) -> impl FnOnce(String) -> EngineError + '_ {
    move |e| EngineError::Invalid(format!("CUDA runner: {what}: {e}"))
}

impl CudaRunner {
    /// Opens GPU `ordinal`, compiles the kernels for it (NVRTC from
    /// `$ULTRAFAST_NVRTC_DIR` or the library search path; CUBINs cached
    /// in `<cache dir>/ultrafast/cubin`), uploads `w` and a KV cache of
    /// `num_blocks` blocks of `block_size` slots.
    pub fn new(
        w: FileWeights,
        ordinal: usize,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<CudaRunner> {
        let dir = std::env::var_os("ULTRAFAST_NVRTC_DIR").map(PathBuf::from);
        let nvrtc = Nvrtc::open(dir.as_deref()).map_err(err("NVRTC"))?;
        let cache = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(std::env::temp_dir)
            .join("ultrafast/cubin");
        let gpu = Gpu::open(ordinal, &nvrtc, &cache).map_err(err("GPU"))?;
        let up = |m: &Mat| -> Result<DevMat> {
            Ok(DevMat {
                format: m.format,
                w: gpu.upload(&m.bytes).map_err(err("upload"))?,
                rows: m.rows,
                cols: m.cols,
            })
        };
        let vec = |v: &[f32]| gpu.upload(v).map_err(err("upload"));
        let mut layers = Vec::with_capacity(w.layers.len());
        for (i, l) in w.layers.iter().enumerate() {
            let mixed = || err("weights")(format!("layer {i}: Q/K/V or gate/up differ in format"));
            let qkv =
                l.q.stack(&l.k)
                    .and_then(|qk| qk.stack(&l.v))
                    .ok_or_else(mixed)?;
            let gate_up = l.gate.stack(&l.up).ok_or_else(mixed)?;
            layers.push(DevLayer {
                attn_norm: vec(&l.attn_norm)?,
                qkv: up(&qkv)?,
                o: up(&l.o)?,
                ffn_norm: vec(&l.ffn_norm)?,
                gate_up: up(&gate_up)?,
                down: up(&l.down)?,
            });
        }
        let c = &w.cfg;
        if c.head_dim > 128 || c.n_head / c.n_kv_head > 8 {
            return Err(err("model")(format!(
                "heads of {} with {} per KV head: the attention kernel takes at most 128 and 8",
                c.head_dim,
                c.n_head / c.n_kv_head
            )));
        }
        let cache_len = (num_blocks + 1) * block_size * c.n_kv_head * c.head_dim;
        let zeros = || gpu.zeros::<u16>(cache_len).map_err(err("KV cache"));
        let kc = (0..c.n_layer)
            .map(|_| zeros())
            .collect::<Result<Vec<_>>>()?;
        let vc = (0..c.n_layer)
            .map(|_| zeros())
            .collect::<Result<Vec<_>>>()?;
        let head = up(w.head.as_ref().unwrap_or(&w.embed))?;
        let norm = vec(&w.norm)?;
        Ok(CudaRunner {
            ordinal,
            cfg: w.cfg.clone(),
            embed: w.embed,
            layers,
            norm,
            head,
            kc,
            vc,
            block_size,
            num_blocks,
            acts: None,
            gpu,
        })
    }

    /// `y (+)= W x` over `tokens` rows, eight at a time.
    fn gemv(
        &self,
        m: &DevMat,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        tokens: usize,
        acc: bool,
    ) -> Result<()> {
        let mut t0 = 0;
        while t0 < tokens {
            let t1 = (t0 + GEMV_TOKENS).min(tokens);
            let xv = x.slice(t0 * m.cols..t1 * m.cols);
            let mut yv = y.slice_mut(t0 * m.rows..t1 * m.rows);
            self.gpu
                .gemv(m.format, &m.w, &xv, &mut yv, m.rows, m.cols, t1 - t0, acc)
                .map_err(err("gemv"))?;
            t0 = t1;
        }
        Ok(())
    }
}

impl ModelRunner for CudaRunner {
    fn describe(&self) -> String {
        format!(
            "cuda:{} {} sm_{}{} (GEMV kernels, no graphs yet)",
            self.ordinal, self.gpu.name, self.gpu.capability.0, self.gpu.capability.1
        )
    }

    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
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
        let g = &self.gpu;
        let mut host = vec![0.0f32; n * d];
        self.embed.gather(&l.tokens, &mut host)?;
        let mut x = g.upload(&host).map_err(err("upload"))?;
        let pos = g.upload(&l.positions).map_err(err("upload"))?;
        let slots = g.upload(&l.slots).map_err(err("upload"))?;
        let qseq = g.upload(&l.qseq).map_err(err("upload"))?;
        let tables = g.upload(&l.tables).map_err(err("upload"))?;
        // A step's activations, kept from step to step and grown when a
        // step has more rows (GPU allocations synchronize the device).
        let mut a = match self.acts.take() {
            Some(a) if a.rows >= n => a,
            _ => Acts::new(g, n.next_power_of_two(), d, stride, ff)?,
        };
        let Acts {
            h,
            qkv,
            att,
            gu,
            act,
            ..
        } = &mut a;
        let shape = AttnShape {
            heads: c.n_head,
            kv_heads: c.n_kv_head,
            hd,
            block_size: self.block_size,
        };
        for (li, layer) in self.layers.iter().enumerate() {
            if stop(li) {
                self.acts = Some(a);
                return Ok(false);
            }
            g.rmsnorm_residual(&mut x, None, &layer.attn_norm, h, d, n, eps)
                .map_err(err("rmsnorm"))?;
            self.gemv(&layer.qkv, h, qkv, n, false)?;
            g.rope(qkv, &pos, c.n_head, hd, stride, 0, n, theta, false)
                .map_err(err("rope"))?;
            g.rope(qkv, &pos, c.n_kv_head, hd, stride, d, n, theta, false)
                .map_err(err("rope"))?;
            let (kc, vc) = (&mut self.kc[li], &mut self.vc[li]);
            g.kv_write(qkv, stride, d, d + kvd, kc, vc, &slots, kvd, n)
                .map_err(err("kv_write"))?;
            g.paged_attention(
                qkv,
                stride,
                kc,
                vc,
                &tables,
                l.max_blocks,
                &qseq,
                &pos,
                att,
                shape,
                n,
            )
            .map_err(err("attention"))?;
            self.gemv(&layer.o, att, &mut x, n, true)?;
            g.rmsnorm_residual(&mut x, None, &layer.ffn_norm, h, d, n, eps)
                .map_err(err("rmsnorm"))?;
            self.gemv(&layer.gate_up, h, gu, n, false)?;
            g.silu_mul(gu, act, ff, n).map_err(err("silu"))?;
            self.gemv(&layer.down, act, &mut x, n, true)?;
        }
        g.rmsnorm_residual(&mut x, None, &self.norm, h, d, n, eps)
            .map_err(err("rmsnorm"))?;
        let vocab = self.head.rows;
        let mut out = g.zeros::<f32>(l.last.len() * vocab).map_err(err("alloc"))?;
        for (i, row) in l.last.iter().enumerate() {
            let xv = h.slice(row * d..(row + 1) * d);
            let mut yv = out.slice_mut(i * vocab..(i + 1) * vocab);
            g.gemv(
                self.head.format,
                &self.head.w,
                &xv,
                &mut yv,
                vocab,
                d,
                1,
                false,
            )
            .map_err(err("head"))?;
        }
        g.synchronize().map_err(err("step"))?;
        *logits = g.download(&out).map_err(err("download"))?;
        self.acts = Some(a);
        Ok(true)
    }

    fn kv_bytes(&self) -> usize {
        self.kc.iter().chain(&self.vc).map(|k| k.len() * 2).sum()
    }
}
