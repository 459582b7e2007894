//! The CUDA runner: the weights uploaded as the file's blocks (Q|K|V and
//! gate|up stacked into one matrix each) plus a bfloat16 copy for prompt
//! GEMMs on tensor cores (cuBLAS), the KV cache on the GPU in the pool's
//! block ids plus the layout's scratch block, and each step as the
//! [`StepLayout`] uploaded, then the kernels of `ultrafast_kernels` in the
//! order [`super::reference::ReferenceRunner`] runs their references
//! ([`forward`]).
//!
//! Decode steps run as CUDA graphs, one captured per batch-size bucket and
//! block-table width ([`graph_width`]) on first use, over buffers kept per
//! bucket. Logits stay on the device: a sampler that needs only the k
//! largest gets them from the top-k kernel, k pairs copied back; only
//! samplers that need every logit get a whole row ([`super::logits`]).
//!
//! It has not run on a GPU yet: before it serves a model it must agree with
//! the CPU runner on a probe prompt (`super::probe`; `auto` falls back to
//! the CPU where it does not).

mod forward;

use super::blocks::{FileWeights, Mat};
use super::layout::{graph_width, StepLayout};
use super::logits::{Need, RowAt, StepLogits};
use super::{Device, ModelRunner};
use crate::error::Result;
use crate::model::paged::SeqStep;
use forward::{err, Acts, DevKv, DevLayer, DevMat, DevModel, StepIo};
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::path::PathBuf;
use ultrafast_kernels::gpu::{candidates, DeviceBuffer as Buf, Gpu};
use ultrafast_kernels::graph::{Graph, Pinned};
use ultrafast_kernels::nvrtc::Nvrtc;

/// What the runner may use; both on by default (`ULTRAFAST_CUDA_GRAPHS=0`
/// and `ULTRAFAST_CUDA_GEMM=0` turn one off, for comparisons).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    /// Decode steps as captured CUDA graphs.
    pub graphs: bool,
    /// Prompt rows through cuBLAS on bfloat16 weights (else the GEMV).
    pub gemm: bool,
}

impl CudaOptions {
    /// The defaults with the environment's overrides.
    pub fn from_env() -> CudaOptions {
        let on = |k: &str| std::env::var(k).map_or(true, |v| v != "0");
        CudaOptions {
            graphs: on("ULTRAFAST_CUDA_GRAPHS"),
            gemm: on("ULTRAFAST_CUDA_GEMM"),
        }
    }
}

/// A bucket's buffers, shared by its graphs (one per table width).
struct Bucket {
    io: StepIo,
    /// Page-locked copies of `io`'s inputs: a step's uploads are queued
    /// without the host waiting for each.
    pins: StepPins,
    acts: Acts,
    logits: Buf<f32>,
    /// Candidates made inside the graphs, per k (a graph keeps the
    /// pointer it was captured with, so none is ever replaced).
    cands: HashMap<usize, Buf<i32>>,
}

/// Page-locked host buffers, one per input of [`StepIo`], each as long.
struct StepPins {
    x: Pinned<f32>,
    pos: Pinned<i32>,
    slots: Pinned<i32>,
    qseq: Pinned<i32>,
    tables: Pinned<i32>,
}

impl StepPins {
    /// Buffers as long as `io`'s.
    fn like(g: &Gpu, io: &StepIo) -> Result<StepPins> {
        let p = |n: usize| g.pinned::<i32>(n).map_err(err("pinned"));
        Ok(StepPins {
            x: g.pinned(io.x.len()).map_err(err("pinned"))?,
            pos: p(io.pos.len())?,
            slots: p(io.slots.len())?,
            qseq: p(io.qseq.len())?,
            tables: p(io.tables.len())?,
        })
    }

    /// A step's rows (`x`) and layout into `io`, queued.
    fn upload(&mut self, g: &Gpu, x: &[f32], l: &StepLayout, io: &mut StepIo) -> Result<()> {
        g.upload_pinned(x, &mut self.x, &mut io.x)
            .and_then(|_| g.upload_pinned(&l.positions, &mut self.pos, &mut io.pos))
            .and_then(|_| g.upload_pinned(&l.slots, &mut self.slots, &mut io.slots))
            .and_then(|_| g.upload_pinned(&l.qseq, &mut self.qseq, &mut io.qseq))
            .and_then(|_| g.upload_pinned(&l.tables, &mut self.tables, &mut io.tables))
            .map_err(err("copy"))
    }
}

/// The CUDA runner (see the module's comment).
pub struct CudaRunner {
    m: DevModel,
    kv: DevKv,
    ordinal: usize,
    opts: CudaOptions,
    /// Host copy of the embedding: a step's rows are looked up here and
    /// uploaded (a few KB per token).
    embed: Mat,
    num_blocks: usize,
    /// Most blocks one sequence can hold (the widest graph table).
    max_width: usize,
    /// Buffers of steps that run without a graph, grown when needed
    /// (allocations synchronize the device).
    acts: Option<Acts>,
    buckets: HashMap<usize, Bucket>,
    /// Captured decode steps by bucket, table width and candidates' k.
    graphs: HashMap<(usize, usize, usize), Graph>,
    /// Host buffers reused from step to step.
    host: Vec<f32>,
    cands: Cands,
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
        opts: CudaOptions,
    ) -> Result<CudaRunner> {
        let dir = std::env::var_os("ULTRAFAST_NVRTC_DIR").map(PathBuf::from);
        let nvrtc = Nvrtc::open(dir.as_deref()).map_err(err("NVRTC"))?;
        let cache = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(std::env::temp_dir)
            .join("ultrafast/cubin");
        let gpu = Gpu::open(ordinal, &nvrtc, &cache).map_err(err("GPU"))?;
        let opts = CudaOptions {
            gemm: opts.gemm && gpu.has_gemm(),
            ..opts
        };
        let up = |m: &Mat| DevMat::upload(&gpu, m, opts.gemm);
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
        let k = (0..c.n_layer).map(|_| zeros()).collect::<Result<_>>()?;
        let v = (0..c.n_layer).map(|_| zeros()).collect::<Result<_>>()?;
        // The head reads the last rows one at a time: no bfloat16 copy.
        let head = DevMat::upload(&gpu, w.head.as_ref().unwrap_or(&w.embed), false)?;
        let norm = vec(&w.norm)?;
        let max_width = c
            .context_len
            .div_ceil(block_size)
            .clamp(1, num_blocks.max(1));
        // Positions up to the context (the scheduler keeps sequences
        // within it): some MB, against a pow and a sincos per pair per step.
        let table = ultrafast_kernels::reference::rope_table(
            c.rope_theta,
            c.head_dim,
            c.context_len.max(1),
        );
        let rope = gpu.upload(&table).map_err(err("RoPE table"))?;
        Ok(CudaRunner {
            m: DevModel {
                cfg: w.cfg.clone(),
                layers,
                norm,
                head,
                block_size,
                rope,
                max_width,
                gpu,
            },
            kv: DevKv { k, v },
            ordinal,
            opts,
            embed: w.embed,
            num_blocks,
            max_width,
            acts: None,
            buckets: HashMap::new(),
            graphs: HashMap::new(),
            host: Vec::new(),
            cands: Cands::default(),
        })
    }

    /// What the runner uses (GEMM only where cuBLAS loaded).
    pub fn options(&self) -> CudaOptions {
        self.opts
    }

    /// Turns graphs on or off from the next step (the GPU check compares).
    pub fn set_graphs(&mut self, on: bool) {
        self.opts.graphs = on;
    }

    /// Turns prompt GEMMs on or off (on only where the bfloat16 copies
    /// were made at load).
    pub fn set_gemm(&mut self, on: bool) {
        self.opts.gemm = on && self.m.layers.iter().all(|l| l.qkv.bf16.is_some());
    }

    /// The step's rows as embeddings in `self.host`.
    fn embed(&mut self, l: &StepLayout) -> Result<()> {
        self.host.resize(l.rows() * self.m.cfg.dim, 0.0);
        self.embed.gather(&l.tokens, &mut self.host)
    }

    /// A decode step through its bucket's graph (captured on first use);
    /// the logits of its rows are left in the bucket's buffer. False when
    /// the capture failed: nothing ran, graphs are off from now on (logged),
    /// and the step is the caller's to run directly.
    fn graphed(&mut self, l: &StepLayout, bucket: usize, width: usize, k: usize) -> Result<bool> {
        let g = &self.m.gpu;
        let b = match self.buckets.entry(bucket) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                let z = |n: usize| g.zeros::<i32>(n).map_err(err("alloc"));
                let io = StepIo {
                    x: g.zeros(bucket * self.m.cfg.dim).map_err(err("alloc"))?,
                    pos: z(bucket)?,
                    slots: z(bucket)?,
                    qseq: z(bucket)?,
                    tables: z((bucket + 1) * self.max_width)?,
                };
                e.insert(Bucket {
                    pins: StepPins::like(g, &io)?,
                    io,
                    acts: Acts::new(g, bucket, &self.m.cfg)?,
                    logits: g.zeros(bucket * self.m.head.rows).map_err(err("alloc"))?,
                    cands: HashMap::new(),
                })
            }
        };
        b.pins.upload(g, &self.host, l, &mut b.io)?;
        if !self.graphs.contains_key(&(bucket, width, k)) {
            let (m, kv) = (&self.m, &mut self.kv);
            let all: Vec<usize> = (0..bucket).collect();
            if k > 0 && !b.cands.contains_key(&k) {
                let c = g.zeros::<i32>(2 * bucket * k).map_err(err("alloc"))?;
                b.cands.insert(k, c);
            }
            let vocab = m.head.rows;
            let captured = g.capture(|| {
                m.layers(kv, &mut b.io, &mut b.acts, bucket, width, false, &|_| false)
                    .map_err(|e| e.to_string())?;
                m.head(&b.acts, &all, &mut b.logits)
                    .map_err(|e| e.to_string())?;
                // The candidates too: one replay makes all the step needs.
                match b.cands.get_mut(&k) {
                    Some(c) => g.top_k(&b.logits, vocab, bucket, k, c),
                    None => Ok(()),
                }
            });
            match captured {
                Ok((graph, _)) => {
                    self.graphs.insert((bucket, width, k), graph);
                }
                Err(e) => {
                    // A driver or a kernel that cannot be captured must
                    // cost speed, not the step: launches work uncaptured.
                    log::warn!(
                        "CUDA graph capture failed ({bucket} rows, {width} blocks): {e}; \
                         decode steps launch their kernels directly from now on"
                    );
                    self.opts.graphs = false;
                    return Ok(false);
                }
            }
        }
        let graph = self
            .graphs
            .get(&(bucket, width, k))
            .ok_or_else(|| err("graph")("not captured".into()))?;
        graph.launch().map_err(err("graph"))?;
        Ok(true)
    }
}

/// Candidates on the device, kept from step to step, and the rows'
/// log-normalisers where a sequence reports log-probabilities.
#[derive(Default)]
struct Cands {
    /// `top_k`'s output of a direct step (indices, then values' bits).
    dev: Option<Buf<i32>>,
    /// The same brought back, and the rows and k it was made for.
    raw: Vec<i32>,
    rows: usize,
    k: usize,
    dev_norms: Option<Buf<f32>>,
    norms: Vec<f32>,
}

/// `needs` served from `logits` (row i is sequence i's): the top-k kernel
/// for candidates (or what a graph's own top-k left in `pre`, made for
/// that many rows), brought back in one copy; whole rows copied back only
/// where needed.
fn fetch(
    g: &Gpu,
    vocab: usize,
    c: &mut Cands,
    needs: &[Need],
    logits: &Buf<f32>,
    pre: Option<(&Buf<i32>, usize)>,
    out: &mut StepLogits,
) -> Result<()> {
    let rows = needs.len();
    let k = needs.iter().map(Need::k).max().unwrap_or(0);
    if k > 0 {
        let (dev, made_for) = match pre {
            Some(p) => p,
            None => {
                let d = match c.dev.take() {
                    Some(d) if d.len() >= 2 * rows * k => d,
                    _ => g.zeros::<i32>(2 * rows * k).map_err(err("alloc"))?,
                };
                let d = &mut *c.dev.insert(d);
                g.top_k(logits, vocab, rows, k, d).map_err(err("top_k"))?;
                (&*d, rows)
            }
        };
        c.raw.resize(2 * made_for * k, 0);
        g.download_into(&dev.slice(..2 * made_for * k), &mut c.raw)
            .map_err(err("download"))?;
        (c.rows, c.k) = (made_for, k);
    }
    // The log-normaliser of every row, on the device, when a sequence
    // reports scores from candidates: `rows` floats come back, not rows.
    let scored = needs.iter().any(|n| matches!(n, Need::Scored(_)));
    if scored {
        let dn = match c.dev_norms.take() {
            Some(d) if d.len() >= rows => d,
            _ => g.zeros::<f32>(rows).map_err(err("alloc"))?,
        };
        let dn = &mut *c.dev_norms.insert(dn);
        g.log_norm(logits, vocab, rows, dn)
            .map_err(err("log_norm"))?;
        c.norms.resize(rows, 0.0);
        g.download_into(&dn.slice(..rows), &mut c.norms)
            .map_err(err("download"))?;
    }
    out.full.clear();
    out.top.clear();
    out.rows.clear();
    out.norms.clear();
    for (i, need) in needs.iter().enumerate() {
        out.norms.push(match need {
            Need::Scored(_) => c.norms.get(i).copied().unwrap_or(f32::NAN),
            _ => f32::NAN,
        });
        let at = match *need {
            Need::Nothing => RowAt::Nothing,
            // Here only for a one-token chunk (a step with a longer scored
            // chunk is served by `every_row_step`): its one row, whole.
            Need::Full | Need::Every => {
                let at = out.full.len();
                out.full.resize(at + vocab, 0.0);
                g.download_into(
                    &logits.slice(i * vocab..(i + 1) * vocab),
                    &mut out.full[at..],
                )
                .map_err(err("download"))?;
                RowAt::Full(at)
            }
            Need::Top(n) | Need::Scored(n) => {
                let a = out.top.len();
                // Index -1: the row had no more (non-NaN) logits.
                out.top.extend(
                    candidates(&c.raw, c.rows, c.k, i)
                        .take(n)
                        .take_while(|(t, _)| *t >= 0)
                        .map(|(t, v)| (t as u32, v)),
                );
                RowAt::Top(a, out.top.len())
            }
        };
        out.rows.push(at);
    }
    Ok(())
}

/// A step with a scored prompt chunk ([`Need::Every`]): the head runs on
/// every row of those sequences (a sequence's rows are consecutive, ending
/// at its last) and on the others' last rows, and every row comes back
/// whole: rare (echo with logprobs), so the simple way.
fn every_row_step(
    m: &DevModel,
    a: &Acts,
    l: &StepLayout,
    seqs: &[SeqStep],
    needs: &[Need],
    out: &mut StepLogits,
) -> Result<()> {
    let vocab = m.head.rows;
    let mut rows = Vec::new();
    let mut counts = Vec::with_capacity(seqs.len());
    for ((s, need), &last) in seqs.iter().zip(needs).zip(&l.last) {
        let n = if *need == Need::Every {
            s.tokens.len()
        } else {
            1
        };
        rows.extend(last + 1 - n..=last);
        counts.push(n);
    }
    let mut logits = m
        .gpu
        .zeros::<f32>(rows.len() * vocab)
        .map_err(err("alloc"))?;
    m.head(a, &rows, &mut logits)?;
    out.full.resize(rows.len() * vocab, 0.0);
    m.gpu
        .download_into(&logits.slice(..rows.len() * vocab), &mut out.full)
        .map_err(err("download"))?;
    out.all_full_counted(counts.into_iter(), vocab);
    Ok(())
}

impl ModelRunner for CudaRunner {
    fn describe(&self) -> String {
        let g = &self.m.gpu;
        format!(
            "cuda:{} {} sm_{}{} (GEMV decode{}{})",
            self.ordinal,
            g.name,
            g.capability.0,
            g.capability.1,
            if self.opts.graphs {
                ", CUDA graphs"
            } else {
                ""
            },
            if self.opts.gemm {
                ", cuBLAS bf16 prefill"
            } else {
                ""
            }
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
        let mut out = StepLogits {
            full: std::mem::take(logits),
            ..StepLogits::default()
        };
        let ran = self.step_for(seqs, &vec![Need::Full; seqs.len()], stop, &mut out)?;
        *logits = out.full;
        Ok(ran)
    }

    fn step_for(
        &mut self,
        seqs: &[SeqStep],
        needs: &[Need],
        stop: &(dyn Fn(usize) -> bool + Sync),
        out: &mut StepLogits,
    ) -> Result<bool> {
        if needs.len() != seqs.len() {
            return Err(err("step")(format!(
                "{} needs for {} sequences",
                needs.len(),
                seqs.len()
            )));
        }
        let mut l = StepLayout::build(seqs, self.m.block_size, self.num_blocks)?;
        self.embed(&l)?;
        let width = graph_width(l.max_blocks, self.max_width);
        if let (true, Some(bucket), Some(width)) = (self.opts.graphs, l.bucket, width) {
            // A graph runs every layer: a better lane waits for this step.
            if stop(0) {
                return Ok(false);
            }
            l.widen(width, self.num_blocks as i32);
            let k = needs.iter().map(Need::k).max().unwrap_or(0);
            if self.graphed(&l, bucket, width, k)? {
                let b = self
                    .buckets
                    .get(&bucket)
                    .ok_or_else(|| err("graph")("no bucket".into()))?;
                let vocab = self.m.head.rows;
                let pre = b.cands.get(&k).map(|c| (c, bucket));
                fetch(
                    &self.m.gpu,
                    vocab,
                    &mut self.cands,
                    needs,
                    &b.logits,
                    pre,
                    out,
                )?;
                return Ok(true);
            }
        }
        let g = &self.m.gpu;
        let n = l.rows();
        let mut io = StepIo {
            x: g.upload(&self.host).map_err(err("upload"))?,
            pos: g.upload(&l.positions).map_err(err("upload"))?,
            slots: g.upload(&l.slots).map_err(err("upload"))?,
            qseq: g.upload(&l.qseq).map_err(err("upload"))?,
            tables: g.upload(&l.tables).map_err(err("upload"))?,
        };
        let mut a = match self.acts.take() {
            Some(a) if a.rows >= n => a,
            _ => Acts::new(g, n.next_power_of_two(), &self.m.cfg)?,
        };
        // cuBLAS only for steps with a prompt chunk: decode rows keep the
        // GEMV's exact products, graph or not.
        let gemm = self.opts.gemm && seqs.iter().any(|s| s.tokens.len() > 1);
        let vocab = self.m.head.rows;
        let ran = self
            .m
            .layers(&mut self.kv, &mut io, &mut a, n, l.max_blocks, gemm, stop)
            .and_then(|done| {
                if done && needs.contains(&Need::Every) {
                    every_row_step(&self.m, &a, &l, seqs, needs, out)?;
                } else if done {
                    let mut logits = g.zeros::<f32>(l.last.len() * vocab).map_err(err("alloc"))?;
                    self.m.head(&a, &l.last, &mut logits)?;
                    fetch(g, vocab, &mut self.cands, needs, &logits, None, out)?;
                }
                Ok(done)
            });
        self.acts = Some(a);
        ran
    }

    fn every_row(&self) -> bool {
        true
    }

    fn kv_bytes(&self) -> usize {
        self.kv
            .k
            .iter()
            .chain(&self.kv.v)
            .map(|k| k.len() * 2)
            .sum()
    }
}
