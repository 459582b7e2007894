//! The CPU runner: one step of the whole model as one job of a thread team,
//! with no tensor library inside it.
//!
//! Per layer the team goes through ten phases separated by barriers; work
//! inside a phase is claimed in chunks (tokens, 16-row weight panels, or
//! attention tasks), so a thread that lost its core does not hold the
//! others back. Buffers are preallocated and grow only with the step's
//! size. Activations are token-major: row `t` of a buffer is token `t` of
//! the step.
//!
//! 1. RMSNorm fused with the 8-bit quantization of the activations
//! 2. Q|K|V as one matrix product
//! 3. biases, RoPE and the K/V write into the paged cache
//! 4. attention, by (sequence, KV head, query tokens)
//! 5. quantization of the attention output
//! 6. the output projection, added into the residual in its epilogue
//! 7. RMSNorm and quantization again
//! 8. gate|up as one matrix product
//! 9. SiLU-and-multiply fused with quantization
//! 10. the down projection, added into the residual
//!
//! and at the end the final norm and the output head for each sequence's
//! last token. `unsafe` here is confined to reading and writing the shared
//! buffers ([`team::Shared`]): which thread writes what is decided by the
//! claims, and phases are separated by barriers.

#![allow(unsafe_code)]

// The SIMD primitives the runner, the model and the sampler share.
pub use crate::simd::{self, ops};

pub mod amx;
pub mod attn;
pub mod profile;
pub mod team;
pub mod transcode;
pub mod weights;

use super::KvDtype;
use crate::error::{EngineError, Result};
use crate::model::paged::{slot_of, SeqStep};
use crate::model::Arch;
use attn::{AttnSeq, AttnShape, KvElem, KvLayout};
use simd::{Isa, Q8Block, MAX_T, PANEL};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use team::{Ctx, Shared, Team};
use weights::{QMat, Weights};

/// Phases per layer (for the claim counters).
const PHASES: usize = 10;

#[derive(Default)]
struct Scratch {
    row: Vec<f32>,
    attn: attn::AttnScratch,
    amx: amx::Scratch,
}

/// Buffers of one step, grown to the largest step seen.
#[derive(Default)]
struct Bufs {
    x: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    gu: Vec<f32>,
    xq: Vec<Q8Block>,
    xqf: Vec<Q8Block>,
    /// `bf16` rows of prompt tokens for the AMX products (dim, ffn wide).
    xb: Vec<u16>,
    xbf: Vec<u16>,
}

fn grow<T: Clone + Default>(v: &mut Vec<T>, n: usize) {
    if v.len() < n {
        v.resize(n, T::default());
    }
}

/// The model on the CPU kernels with its paged KV cache.
pub struct CpuRunner {
    w: Arc<Weights>,
    isa: Isa,
    /// Prompt tokens' products on AMX BF16 tiles ([`amx`]).
    amx: bool,
    team: Team,
    block_size: usize,
    slots: usize,
    kv: Kv,
    bufs: Bufs,
    counters: Vec<AtomicUsize>,
    scratch: Vec<Mutex<Scratch>>,
}

/// Keys and values, per layer, in the configured precision.
enum Kv {
    F32(Vec<Vec<f32>>, Vec<Vec<f32>>),
    F16(Vec<Vec<half::f16>>, Vec<Vec<half::f16>>),
}

/// What a step's job reads, resolved before the team starts.
struct Plan {
    total: usize,
    ids: Vec<u32>,
    pos: Vec<usize>,
    /// Slot each token's K/V goes to.
    write: Vec<usize>,
    /// Per sequence: first row in the step, tokens, start position, and
    /// the slots of positions 0..start+tokens.
    seqs: Vec<(usize, usize, usize, Vec<usize>)>,
    /// Attention tasks: (sequence, KV head, first token, end token).
    tasks: Vec<(usize, usize, usize, usize)>,
    /// Per token: whether its products run on AMX (`bf16` rows) rather
    /// than `simd` (8-bit rows).
    bf: Vec<bool>,
    /// Runs of rows `(first, count)` of each kind.
    bf_runs: Vec<Run>,
    q8_runs: Vec<Run>,
    /// Rows the output head runs on, in order: each sequence's last, or
    /// all of a sequence's rows when its every position is scored.
    head: Vec<usize>,
}

impl CpuRunner {
    /// A runner over `w` with `num_blocks` KV blocks of `block_size` slots,
    /// on a team of `threads`; `init` runs first on each team thread.
    pub fn new(
        w: Arc<Weights>,
        num_blocks: usize,
        block_size: usize,
        kv_dtype: KvDtype,
        threads: usize,
        init: fn(),
    ) -> Result<CpuRunner> {
        let c = &w.cfg;
        let kv_dim = c.n_kv_head * c.head_dim;
        let slots = num_blocks * block_size;
        let team = Team::new(threads, init)
            .map_err(|e| EngineError::Invalid(format!("cannot start the engine's threads: {e}")))?;
        let n = team.threads();
        if std::env::var_os("ULTRAFAST_PHASE_TIMES").is_some() {
            profile::enable(true);
        }
        Ok(CpuRunner {
            isa: Isa::current(),
            amx: amx::available(),
            team,
            block_size,
            slots,
            kv: match kv_dtype {
                KvDtype::F32 => Kv::F32(
                    vec![vec![0.0; slots * kv_dim]; c.n_layer],
                    vec![vec![0.0; slots * kv_dim]; c.n_layer],
                ),
                KvDtype::F16 => Kv::F16(
                    vec![vec![half::f16::ZERO; slots * kv_dim]; c.n_layer],
                    vec![vec![half::f16::ZERO; slots * kv_dim]; c.n_layer],
                ),
            },
            bufs: Bufs::default(),
            counters: (0..(c.n_layer + 1) * PHASES + 2)
                .map(|_| AtomicUsize::new(0))
                .collect(),
            scratch: (0..n).map(|_| Mutex::new(Scratch::default())).collect(),
            w,
        })
    }

    /// The kernel set in use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Whether prompt tokens' matrix products run on AMX tiles.
    pub fn amx(&self) -> bool {
        self.amx
    }

    /// The vocabulary's size (the width of a row of logits).
    pub fn vocab(&self) -> usize {
        self.w.cfg.vocab
    }

    /// The KV cache's precision.
    pub fn kv_dtype(&self) -> KvDtype {
        match self.kv {
            Kv::F32(..) => KvDtype::F32,
            Kv::F16(..) => KvDtype::F16,
        }
    }

    /// Threads in the team.
    pub fn threads(&self) -> usize {
        self.team.threads()
    }

    /// Bytes of KV cache held.
    pub fn kv_bytes(&self) -> usize {
        let elem = match self.kv {
            Kv::F32(..) => 4,
            Kv::F16(..) => 2,
        };
        2 * self.w.cfg.n_layer * self.slots * self.w.cfg.n_kv_head * self.w.cfg.head_dim * elem
    }

    fn plan(&self, seqs: &[SeqStep], every: &[bool]) -> Result<Plan> {
        let c = &self.w.cfg;
        let mut p = Plan {
            total: 0,
            ids: Vec::new(),
            pos: Vec::new(),
            write: Vec::new(),
            seqs: Vec::with_capacity(seqs.len()),
            tasks: Vec::new(),
            bf: Vec::new(),
            bf_runs: Vec::new(),
            q8_runs: Vec::new(),
            head: Vec::with_capacity(seqs.len()),
        };
        for (si, s) in seqs.iter().enumerate() {
            let n = s.tokens.len();
            if n == 0 {
                return Err(EngineError::Invalid("empty sequence in step".into()));
            }
            if s.start + n > self.w.max_positions {
                return Err(EngineError::Invalid("position beyond the context".into()));
            }
            if let Some(bad) = s.tokens.iter().find(|t| **t as usize >= c.vocab) {
                return Err(EngineError::Invalid(format!(
                    "token id {bad} beyond the vocabulary"
                )));
            }
            let slots = (0..s.start + n)
                .map(|q| slot_of(s.blocks, q, self.block_size, self.slots))
                .collect::<Result<Vec<_>>>()?;
            p.ids.extend_from_slice(s.tokens);
            p.pos.extend(s.start..s.start + n);
            p.write.extend_from_slice(&slots[s.start..]);
            let chunk = attn::tokens_per_task(c.n_head / c.n_kv_head);
            for g in 0..c.n_kv_head {
                let mut t = 0;
                while t < n {
                    let e = (t + chunk).min(n);
                    p.tasks.push((si, g, t, e));
                    t = e;
                }
            }
            // A sequence's kind depends on it alone (never on the rest of
            // the step), so its results do not depend on its batch.
            let bf = self.amx && n > 1;
            p.bf.extend(std::iter::repeat_n(bf, n));
            let runs = if bf { &mut p.bf_runs } else { &mut p.q8_runs };
            match runs.last_mut() {
                Some((r0, rn)) if *r0 + *rn == p.total => *rn += n,
                _ => runs.push((p.total, n)),
            }
            match every.get(si) {
                Some(true) => p.head.extend(p.total..p.total + n),
                _ => p.head.push(p.total + n - 1),
            }
            p.seqs.push((p.total, n, s.start, slots));
            p.total += n;
        }
        // Two tokens writing one slot would race (and be a scheduler bug).
        let mut w = p.write.clone();
        w.sort_unstable();
        if w.windows(2).any(|x| x[0] == x[1]) {
            return Err(EngineError::Invalid(
                "two tokens of a step share a KV slot".into(),
            ));
        }
        // Longest contexts first, so the last tasks claimed are short.
        p.tasks
            .sort_by_key(|&(s, _, _, e)| std::cmp::Reverse(p.seqs[s].2 + e));
        Ok(p)
    }

    /// Run one step: `logits` gets each sequence's last-token logits, one
    /// after another; `Ok(false)` when `stop(layer)` said to give up
    /// before a layer.
    pub fn step(
        &mut self,
        seqs: &[SeqStep],
        stop: &(dyn Fn(usize) -> bool + Sync),
        logits: &mut Vec<f32>,
    ) -> Result<bool> {
        self.step_rows(seqs, &[], stop, logits)
    }

    /// [`step`](Self::step), where a sequence with `every[i]` gets the
    /// logits of each of its tokens (in order, its last one last) instead
    /// of its last token's alone.
    pub fn step_rows(
        &mut self,
        seqs: &[SeqStep],
        every: &[bool],
        stop: &(dyn Fn(usize) -> bool + Sync),
        logits: &mut Vec<f32>,
    ) -> Result<bool> {
        if seqs.is_empty() {
            logits.clear();
            return Ok(true);
        }
        let plan = self.plan(seqs, every)?;
        let c = self.w.cfg.clone();
        let (t, ns) = (plan.total, plan.head.len());
        let kv_dim = c.n_kv_head * c.head_dim;
        let qkv_dim = c.dim + 2 * kv_dim;
        let b = &mut self.bufs;
        grow(&mut b.x, t * c.dim);
        grow(&mut b.qkv, t * qkv_dim);
        grow(&mut b.attn, t * c.dim);
        grow(&mut b.gu, t * 2 * c.ffn_dim);
        grow(&mut b.xq, t * c.dim / 32);
        grow(&mut b.xqf, t * c.ffn_dim / 32);
        if !plan.bf_runs.is_empty() {
            grow(&mut b.xb, (t + amx::PAD_ROWS) * c.dim);
            grow(&mut b.xbf, (t + amx::PAD_ROWS) * c.ffn_dim);
        }
        logits.resize(ns * c.vocab, 0.0);
        for s in &self.scratch {
            let mut s = s.lock().unwrap_or_else(|e| e.into_inner());
            grow(&mut s.row, c.dim.max(c.ffn_dim));
        }
        for a in &self.counters {
            a.store(0, Ordering::Relaxed);
        }
        let common = Common {
            w: &self.w,
            isa: self.isa,
            plan: &plan,
            block_size: self.block_size,
            x: Shared::new(&mut b.x),
            qkv: Shared::new(&mut b.qkv),
            attn: Shared::new(&mut b.attn),
            gu: Shared::new(&mut b.gu),
            xq: Shared::new(&mut b.xq),
            xqf: Shared::new(&mut b.xqf),
            xb: Shared::new(&mut b.xb),
            xbf: Shared::new(&mut b.xbf),
            logits: Shared::new(&mut logits[..]),
            counters: &self.counters,
            scratch: &self.scratch,
            stop,
        };
        match &mut self.kv {
            Kv::F32(k, v) => launch(&mut self.team, common, k, v),
            Kv::F16(k, v) => launch(&mut self.team, common, k, v),
        }
    }
}

/// Run one step's job on the team; `Ok(false)` when it stopped early.
fn launch<E: KvElem>(
    team: &mut Team,
    common: Common<'_>,
    k: &mut [Vec<E>],
    v: &mut [Vec<E>],
) -> Result<bool> {
    let job = Job {
        c: common,
        k: k.iter_mut().map(|v| Shared::new(v)).collect(),
        v: v.iter_mut().map(|v| Shared::new(v)).collect(),
        stopped: AtomicBool::new(false),
    };
    team.run(&|ctx: &Ctx| job.run(ctx))
        .map_err(EngineError::Invalid)?;
    Ok(!job.stopped.load(Ordering::Relaxed))
}

/// What a step's job shares whatever the KV precision.
struct Common<'a> {
    w: &'a Weights,
    isa: Isa,
    plan: &'a Plan,
    block_size: usize,
    x: Shared<'a, f32>,
    qkv: Shared<'a, f32>,
    attn: Shared<'a, f32>,
    gu: Shared<'a, f32>,
    xq: Shared<'a, Q8Block>,
    xqf: Shared<'a, Q8Block>,
    xb: Shared<'a, u16>,
    xbf: Shared<'a, u16>,
    logits: Shared<'a, f32>,
    counters: &'a [AtomicUsize],
    scratch: &'a [Mutex<Scratch>],
    stop: &'a (dyn Fn(usize) -> bool + Sync),
}

/// One step's job, shared by the team.
struct Job<'a, E> {
    c: Common<'a>,
    k: Vec<Shared<'a, E>>,
    v: Vec<Shared<'a, E>>,
    stopped: AtomicBool,
}

impl<'a, E> std::ops::Deref for Job<'a, E> {
    type Target = Common<'a>;
    fn deref(&self) -> &Common<'a> {
        &self.c
    }
}

/// Keys converted to the cache's precision per run of this many values.
const KV_RUN: usize = 128;

/// Rows `(first, count)` of a step.
type Run = (usize, usize);

/// How a matrix product's results land in its output buffer.
#[derive(Clone, Copy)]
enum Epilogue {
    /// `out[t * ld + col0 + row] = y`
    Store,
    /// `out[t * ld + col0 + row] += y` (the residual add)
    Add,
}

impl<E: KvElem> Job<'_, E> {
    fn counter(&self, layer: usize, phase: usize) -> &AtomicUsize {
        &self.counters[layer * PHASES + phase]
    }

    fn scratch(&self, tid: usize) -> std::sync::MutexGuard<'_, Scratch> {
        self.scratch[tid].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// For each token claimed from `counter` (`chunk` at a time),
    /// `f(token)`.
    fn per_token(
        &self,
        ctx: &Ctx,
        counter: &AtomicUsize,
        n: usize,
        chunk: usize,
        f: &mut dyn FnMut(usize),
    ) {
        while let Some(r) = ctx.claim(counter, n, chunk) {
            for t in r {
                f(t);
            }
        }
    }

    /// RMSNorm of residual row `src(i)` into row `i` of `xq` (quantized)
    /// or, for a prompt token of a layer's norm (`layer`), of `xb`
    /// (`bf16`), for the `n` rows claimed from `counter` (the two norms of
    /// a layer, and the final norm of each sequence's last token).
    fn norm_rows(
        &self,
        ctx: &Ctx,
        counter: &AtomicUsize,
        n: usize,
        src: &dyn Fn(usize) -> usize,
        norm: &[f32],
        layer: bool,
    ) {
        let (dim, nbd) = (self.w.cfg.dim, self.w.cfg.dim / 32);
        let eps = self.w.cfg.rms_eps as f32;
        let mut s = self.scratch(ctx.tid);
        self.per_token(ctx, counter, n, 1, &mut |i| {
            // SAFETY: x is read-only in this phase.
            let x = unsafe { self.x.slice(src(i) * dim, dim) };
            let tmp = &mut s.row[..dim];
            ops::rmsnorm(x, norm, eps, tmp);
            // SAFETY: row i of xq / xb is this thread's (claimed).
            unsafe {
                if layer && self.plan.bf[i] {
                    ops::to_bf16(tmp, self.xb.slice_mut(i * dim, dim));
                } else {
                    ops::quantize(self.isa, tmp, self.xq.slice_mut(i * nbd, nbd));
                }
            }
        });
    }

    /// `out` = `m` x the step's tokens, claimed by 16-row panels: the
    /// 8-bit rows of `x` (blocks `stride` apart) on `simd`'s kernels, the
    /// `bf16` rows of `xb` (`stride * 32` apart) on AMX tiles. With
    /// `runs`, only rows `0..runs` of `x` (the head's packed rows).
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        ctx: &Ctx,
        counter: &AtomicUsize,
        m: &QMat,
        (x, xb): (&Shared<Q8Block>, &Shared<u16>),
        stride: usize,
        head: Option<usize>,
        out: &Shared<f32>,
        ld: usize,
        epi: Epilogue,
    ) {
        let panels = m.panels();
        let nb = m.nb();
        let p = self.plan;
        let all = [(0, head.unwrap_or(0))];
        let (q8_runs, bf_runs): (&[Run], &[Run]) = match head {
            Some(_) => (&all, &[]),
            None => (&p.q8_runs, &p.bf_runs),
        };
        let rows = head.unwrap_or(p.total);
        // SAFETY: `x` and `xb` were written in an earlier phase (a barrier
        // ago) and nothing writes them in this one.
        let xs = unsafe { x.slice(0, rows * stride) };
        let xbs = if bf_runs.is_empty() {
            &[][..]
        } else {
            // SAFETY: as above (`step` grew it by the padding rows).
            unsafe { xb.slice(0, (rows + amx::PAD_ROWS) * stride * 32) }
        };
        // Panels two at a time for the AMX tiles.
        let chunk = if bf_runs.is_empty() {
            (panels / (ctx.n * 8)).clamp(1, 8)
        } else {
            2 * (panels / (ctx.n * 8)).clamp(1, 4)
        };
        let write = |t: usize, p: usize, vals: &[f32]| {
            let n = (m.rows - PANEL * p).min(PANEL);
            // SAFETY: rows 16p..16p+16 of every token are this thread's
            // (its claim) for this phase.
            let dst = unsafe { out.slice_mut(t * ld + PANEL * p, n) };
            match epi {
                Epilogue::Store => dst.copy_from_slice(&vals[..n]),
                Epilogue::Add => {
                    for (d, y) in dst.iter_mut().zip(vals) {
                        *d += y;
                    }
                }
            }
        };
        let mut s = self.scratch(ctx.tid);
        let mut o = [[0f32; PANEL]; MAX_T];
        while let Some(r) = ctx.claim(counter, panels, chunk) {
            if !bf_runs.is_empty() {
                let ws: [&[u8]; 8] = std::array::from_fn(|i| m.panel((r.start + i).min(r.end - 1)));
                for &(r0, n) in bf_runs {
                    amx::gemm(
                        m.fmt,
                        &ws[..r.len()],
                        nb,
                        &xbs[r0 * stride * 32..],
                        stride * 32,
                        n,
                        &mut s.amx,
                        &mut |t0, i, tile| {
                            for (k, row) in tile.iter().enumerate().take(n - t0.min(n)) {
                                write(r0 + t0 + k, r.start + i, row);
                            }
                        },
                    );
                }
            }
            for p in r {
                for &(r0, rn) in q8_runs {
                    let mut t = r0;
                    while t < r0 + rn {
                        let n = (r0 + rn - t).min(MAX_T);
                        simd::tile(
                            self.isa,
                            m.fmt,
                            m.panel(p),
                            nb,
                            &xs[t * stride..],
                            stride,
                            n,
                            &mut o,
                        );
                        for (i, row) in o.iter().enumerate().take(n) {
                            write(t + i, p, row);
                        }
                        t += n;
                    }
                }
            }
        }
    }

    fn run(&self, ctx: &Ctx) {
        let w = self.w;
        let c = &w.cfg;
        let p = self.plan;
        let (t_all, hd) = (p.total, c.head_dim);
        let kv_dim = c.n_kv_head * hd;
        let qkv_dim = c.dim + 2 * kv_dim;
        let (nbd, nbf) = (c.dim / 32, c.ffn_dim / 32);
        let half = hd / 2;
        let neox = c.arch == Arch::Qwen2;
        // Heads of whole 32-value blocks: attention quantizes each head's
        // output itself (the same blocks as quantizing the row after).
        let fused = hd % 32 == 0;
        let last = c.n_layer * PHASES;
        let lay = KvLayout {
            bs: self.block_size,
            n_kv: c.n_kv_head,
            hd,
        };
        let mut clock = profile::Clock::start(ctx);
        // Embedding rows.
        self.per_token(ctx, &self.counters[last + PHASES], t_all, 1, &mut |t| {
            // SAFETY: token t's row is this thread's (claimed).
            let row = unsafe { self.x.slice_mut(t * c.dim, c.dim) };
            // In range: `plan` checked the ids against the vocabulary,
            // which `Weights::load` checked against the embedding.
            let found = w.embed.row(p.ids[t] as usize, row);
            debug_assert!(found, "token id beyond the embedding");
        });
        ctx.barrier();
        clock.tick(ctx, profile::EMBED);
        for (l, lw) in w.layers.iter().enumerate() {
            if ctx.tid == 0 && (self.stop)(l) {
                self.stopped.store(true, Ordering::Relaxed);
            }
            // 1. Norm and quantize.
            self.norm_rows(ctx, self.counter(l, 0), t_all, &|t| t, &lw.attn_norm, true);
            ctx.barrier();
            clock.tick(ctx, profile::NORM);
            if self.stopped.load(Ordering::Relaxed) {
                return;
            }
            // 2. Q|K|V.
            let qkv = &self.qkv;
            self.gemm(
                ctx,
                self.counter(l, 1),
                &lw.qkv,
                (&self.xq, &self.xb),
                nbd,
                None,
                qkv,
                qkv_dim,
                Epilogue::Store,
            );
            ctx.barrier();
            clock.tick(ctx, profile::QKV);
            // 3. Biases, RoPE, K/V into the cache.
            // Whole KV blocks per claim when a sequence brings several tokens: a
            // block's transposed keys share cache lines across its positions,
            // and two threads writing one line took twice as long. Decode
            // tokens each have a block of their own.
            let chunk = if t_all > p.seqs.len() {
                self.block_size
            } else {
                1
            };
            self.per_token(ctx, self.counter(l, 2), t_all, chunk, &mut |t| {
                // SAFETY: token t's QKV row and its own KV slot (slots of a
                // step are distinct, checked in `plan`) are ours.
                let row = unsafe { qkv.slice_mut(t * qkv_dim, qkv_dim) };
                if let Some(bias) = &lw.qkv_bias {
                    for (v, b) in row.iter_mut().zip(bias) {
                        *v += b;
                    }
                }
                let at = p.pos[t] * half;
                let (cos, sin) = (&w.cos[at..at + half], &w.sin[at..at + half]);
                let (q, kv) = row.split_at_mut(c.dim);
                ops::rope(q, hd, cos, sin, neox);
                let (k, v) = kv.split_at_mut(kv_dim);
                ops::rope(k, hd, cos, sin, neox);
                let slot = p.write[t];
                // SAFETY: see above.
                unsafe {
                    // Keys are stored transposed (a block's positions side
                    // by side per dimension): converted as a run first.
                    let mut kc = [E::default(); KV_RUN];
                    for g in 0..c.n_kv_head {
                        let base = lay.k_index(slot, g, 0);
                        for d0 in (0..hd).step_by(KV_RUN) {
                            let n = (hd - d0).min(KV_RUN);
                            let src = &k[g * hd + d0..g * hd + d0 + n];
                            E::from_f32_slice(src, &mut kc[..n]);
                            for (d, x) in kc[..n].iter().enumerate() {
                                self.k[l].set(base + (d0 + d) * lay.bs, *x);
                            }
                        }
                    }
                    let vs = self.v[l].slice_mut(lay.v_index(slot, 0), kv_dim);
                    E::from_f32_slice(v, vs);
                }
            });
            ctx.barrier();
            clock.tick(ctx, profile::ROPE_KV);
            // 4. Attention.
            let sh = AttnShape {
                lay,
                rep: c.n_head / c.n_kv_head,
                q_stride: qkv_dim,
            };
            {
                let mut s = self.scratch(ctx.tid);
                let s = &mut *s;
                // SAFETY: the QKV rows and the cache are read-only now.
                let (q_all, k, v) = unsafe {
                    (
                        qkv.slice(0, t_all * qkv_dim),
                        self.k[l].slice(0, self.k[l].len()),
                        self.v[l].slice(0, self.v[l].len()),
                    )
                };
                while let Some(r) = ctx.claim(self.counter(l, 3), p.tasks.len(), 1) {
                    for &(si, g, t0, t1) in &p.tasks[r] {
                        let (row0, _, start, slots) = &p.seqs[si];
                        let seq = AttnSeq {
                            slots,
                            start: *start,
                        };
                        let q = &q_all[row0 * qkv_dim..];
                        attn::attend(
                            self.isa,
                            &sh,
                            &seq,
                            g,
                            t0..t1,
                            q,
                            k,
                            v,
                            &mut s.attn,
                            &mut |i, h, o| {
                                let t = row0 + i;
                                // SAFETY (all three): head h of token t
                                // belongs to this task (its KV group, its
                                // tokens), and with heads a whole number of
                                // 32-value blocks, so do its blocks of xq.
                                if !fused {
                                    let dst =
                                        unsafe { self.attn.slice_mut(t * c.dim + h * hd, hd) };
                                    dst.copy_from_slice(o);
                                } else if p.bf[t] {
                                    let dst = unsafe { self.xb.slice_mut(t * c.dim + h * hd, hd) };
                                    ops::to_bf16(o, dst);
                                } else {
                                    let at = t * nbd + h * hd / 32;
                                    let dst = unsafe { self.xq.slice_mut(at, hd / 32) };
                                    ops::quantize(self.isa, o, dst);
                                }
                            },
                        );
                    }
                }
            }
            ctx.barrier();
            clock.tick(ctx, profile::ATTENTION);
            // 5. Quantize the attention output, unless each head was
            // quantized as it came (above): a pass and a barrier fewer.
            if !fused {
                self.per_token(ctx, self.counter(l, 4), t_all, 1, &mut |t| {
                    // SAFETY: read-only attn row; xq / xb row t is ours.
                    unsafe {
                        let a = self.attn.slice(t * c.dim, c.dim);
                        if p.bf[t] {
                            ops::to_bf16(a, self.xb.slice_mut(t * c.dim, c.dim));
                        } else {
                            ops::quantize(self.isa, a, self.xq.slice_mut(t * nbd, nbd));
                        }
                    }
                });
                ctx.barrier();
            }
            clock.tick(ctx, profile::QUANT);
            // 6. Output projection into the residual.
            self.gemm(
                ctx,
                self.counter(l, 5),
                &lw.wo,
                (&self.xq, &self.xb),
                nbd,
                None,
                &self.x,
                c.dim,
                Epilogue::Add,
            );
            ctx.barrier();
            clock.tick(ctx, profile::WO);
            // 7. Norm and quantize.
            self.norm_rows(ctx, self.counter(l, 6), t_all, &|t| t, &lw.ffn_norm, true);
            ctx.barrier();
            clock.tick(ctx, profile::NORM);
            // 8. Gate|up.
            let gw = 2 * c.ffn_dim;
            self.gemm(
                ctx,
                self.counter(l, 7),
                &lw.gate_up,
                (&self.xq, &self.xb),
                nbd,
                None,
                &self.gu,
                gw,
                Epilogue::Store,
            );
            ctx.barrier();
            clock.tick(ctx, profile::GATE_UP);
            // 9. SiLU and multiply, quantized.
            let mut s = self.scratch(ctx.tid);
            self.per_token(ctx, self.counter(l, 8), t_all, 1, &mut |t| {
                // SAFETY: read-only gu row; xqf / xbf row t is ours.
                unsafe {
                    let (gate, up) = self.gu.slice(t * gw, gw).split_at(c.ffn_dim);
                    let tmp = &mut s.row[..c.ffn_dim];
                    ops::silu_mul(gate, up, tmp);
                    if p.bf[t] {
                        ops::to_bf16(tmp, self.xbf.slice_mut(t * c.ffn_dim, c.ffn_dim));
                    } else {
                        ops::quantize(self.isa, tmp, self.xqf.slice_mut(t * nbf, nbf));
                    }
                }
            });
            drop(s);
            ctx.barrier();
            clock.tick(ctx, profile::SILU);
            // 10. Down projection into the residual.
            self.gemm(
                ctx,
                self.counter(l, 9),
                &lw.down,
                (&self.xqf, &self.xbf),
                nbf,
                None,
                &self.x,
                c.dim,
                Epilogue::Add,
            );
            ctx.barrier();
            clock.tick(ctx, profile::DOWN);
        }
        // The head, for each sequence's last token or every token scored
        // (quantized rows packed at the front of xq).
        let ns = p.head.len();
        let head_row = |i: usize| p.head[i];
        self.norm_rows(ctx, &self.counters[last], ns, &head_row, &w.norm, false);
        ctx.barrier();
        clock.tick(ctx, profile::HEAD_NORM);
        self.gemm(
            ctx,
            &self.counters[last + 1],
            &w.head,
            (&self.xq, &self.xb),
            nbd,
            Some(ns),
            &self.logits,
            c.vocab,
            Epilogue::Store,
        );
        clock.tick(ctx, profile::HEAD);
    }
}
