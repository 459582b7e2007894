//! The kernels on a GPU, through cudarc: [`Gpu::open`] finds the device,
//! compiles every source with NVRTC for its compute capability (cached on
//! disk) and loads the modules; the launchers check shapes, then launch on
//! the GPU's own (non-default) stream. Everything here is the runner's
//! foundation and what the GPU check's kernel parity runs.
//!
//! cudarc panics when a library or symbol is missing, so [`Gpu::open`]
//! probes the driver first ([`crate::cuda::probe`], then cudarc's own
//! `is_culib_present`) and catches any panic of its initialization: a
//! machine without CUDA gets an error with the reason.

// cudarc's launches and its library probe are `unsafe`; each block says
// why it holds.
#![allow(unsafe_code)]

use crate::nvrtc::Nvrtc;
use crate::reference::Format;
use crate::sources::SOURCES;
/// A buffer on the GPU (cudarc's).
pub use cudarc::driver::CudaSlice as DeviceBuffer;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, LaunchConfig,
    PushKernelArg,
};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// A GPU with the kernels loaded.
pub struct Gpu {
    /// The device's compute capability (9, 0 for an H200).
    pub capability: (i32, i32),
    /// Its name, as the driver gives it.
    pub name: String,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) funcs: HashMap<&'static str, CudaFunction>,
    /// cuBLAS on the same stream, for prompt GEMMs (None where the
    /// library is missing: prompts then run through the GEMV).
    pub(crate) blas: Option<cudarc::cublas::CudaBlas>,
}

/// A failed GPU call, as text (the caller logs it or falls back).
pub type Result<T> = std::result::Result<T, String>;

fn e<E: std::fmt::Debug>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |err| format!("{what}: {err:?}")
}

impl Gpu {
    /// Opens GPU `ordinal`, compiling the kernels with `nvrtc` into the
    /// cache folder `cache`.
    pub fn open(ordinal: usize, nvrtc: &Nvrtc, cache: &Path) -> Result<Gpu> {
        let gpus = crate::cuda::probe()?;
        let g = gpus
            .get(ordinal)
            .ok_or_else(|| format!("no GPU {ordinal} ({} found)", gpus.len()))?
            .clone();
        // SAFETY: only asks the loader whether the library opens.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err("cudarc cannot load the CUDA driver library".into());
        }
        let (ctx, stream) = std::panic::catch_unwind(|| -> Result<_> {
            let ctx = CudaContext::new(ordinal).map_err(e("cannot open a CUDA context"))?;
            // SAFETY: everything runs on the one stream below, in order, so
            // cudarc's cross-stream events are not needed; they would also
            // be recorded into CUDA graphs while capturing.
            unsafe { ctx.disable_event_tracking() };
            let stream = ctx.new_stream().map_err(e("cannot create a stream"))?;
            Ok((ctx, stream))
        })
        .map_err(|_| "the CUDA driver panicked while starting".to_string())??;
        // SAFETY: as above, only asks whether the library opens.
        let blas = match unsafe { cudarc::cublas::sys::is_culib_present() } {
            true => std::panic::catch_unwind(|| cudarc::cublas::CudaBlas::new(stream.clone()))
                .ok()
                .and_then(|b| b.ok()),
            false => None,
        };
        let arch = (g.capability.0 * 10 + g.capability.1) as u32;
        let mut funcs = HashMap::new();
        for src in SOURCES {
            let cubin = nvrtc.compile_cached(&src.full(), src.name, arch, cache)?;
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
                .map_err(e(src.name))?;
            for k in src.kernels {
                funcs.insert(*k, module.load_function(k).map_err(e(k))?);
            }
        }
        Ok(Gpu {
            capability: g.capability,
            name: g.name,
            ctx,
            stream,
            funcs,
            blas,
        })
    }

    pub(crate) fn func(&self, name: &str) -> Result<&CudaFunction> {
        self.funcs
            .get(name)
            .ok_or_else(|| format!("kernel {name} not loaded"))
    }

    /// Copies `host` to a new device buffer.
    pub fn upload<T: cudarc::driver::DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(host).map_err(e("upload"))
    }

    /// A zeroed device buffer of `n` values.
    pub fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>> {
        self.stream.alloc_zeros(n).map_err(e("alloc"))
    }

    /// Copies a device buffer back (waits for the stream).
    pub fn download<T: cudarc::driver::DeviceRepr>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>> {
        self.stream.clone_dtoh(dev).map_err(e("download"))
    }

    /// Waits for everything launched so far.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(e("synchronize"))?;
        self.ctx.synchronize().map_err(e("synchronize"))
    }

    /// `gemv_*` ([`crate::reference::gemv_into`]): `tokens` at most
    /// `GEMV_TOKENS` (8) per launch.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv(
        &self,
        format: Format,
        w: &CudaSlice<u8>,
        x: &CudaView<'_, f32>,
        y: &mut CudaViewMut<'_, f32>,
        rows: usize,
        cols: usize,
        tokens: usize,
        acc: bool,
    ) -> Result<()> {
        let blocks = cols / format.per_block();
        if !cols.is_multiple_of(format.per_block())
            || w.len() < rows * blocks * format.block_bytes()
            || x.len() < tokens * cols
            || y.len() < tokens * rows
            || !(1..=8).contains(&tokens)
        {
            return Err(format!("gemv shapes: {rows}x{cols}, {tokens} tokens"));
        }
        let f = self.func(format.kernel())?;
        let warps = 4u32;
        let cfg = LaunchConfig {
            grid_dim: ((rows as u32).div_ceil(warps), 1, 1),
            block_dim: (32 * warps, 1, 1),
            shared_mem_bytes: 0,
        };
        let (r, c, t, a) = (rows as i32, cols as i32, tokens as i32, acc as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(w).arg(x).arg(y).arg(&r).arg(&c).arg(&t).arg(&a);
        // SAFETY: the argument list matches the kernel's signature and the
        // buffers hold what the shapes above say.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(e("gemv"))
    }

    /// `rmsnorm_residual` over `tokens` rows of `dim`.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_residual(
        &self,
        x: &mut CudaSlice<f32>,
        add: Option<&CudaSlice<f32>>,
        w: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        dim: usize,
        tokens: usize,
        eps: f32,
    ) -> Result<()> {
        if x.len() < tokens * dim
            || out.len() < tokens * dim
            || w.len() < dim
            || add.is_some_and(|a| a.len() < tokens * dim)
        {
            return Err(format!("rmsnorm shapes: {tokens} x {dim}"));
        }
        let f = self.func("rmsnorm_residual")?;
        let cfg = LaunchConfig {
            grid_dim: (tokens as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (d, null) = (dim as i32, 0u64);
        let mut b = self.stream.launch_builder(f);
        b.arg(x);
        match add {
            Some(a) => b.arg(a),
            None => b.arg(&null),
        };
        b.arg(w).arg(out).arg(&d).arg(&eps);
        // SAFETY: as in `gemv`; a null `add` is a 64-bit zero pointer.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(e("rmsnorm"))
    }

    /// `rope` in place over `tokens` rows of `stride` floats, on the
    /// `heads` heads starting `off` floats into each row, turned by
    /// `table` (`reference::rope_table` for `hd`, uploaded once).
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        pos: &CudaSlice<i32>,
        heads: usize,
        hd: usize,
        stride: usize,
        off: usize,
        tokens: usize,
        table: &CudaSlice<f32>,
        neox: bool,
    ) -> Result<()> {
        if x.len() < tokens * stride
            || pos.len() < tokens
            || off + heads * hd > stride
            || hd % 2 == 1
            || hd == 0
            || table.len() < hd
        {
            return Err(format!("rope shapes: {tokens} x {heads} x {hd}"));
        }
        let npos = i32::try_from(table.len() / hd).unwrap_or(i32::MAX);
        let f = self.func("rope")?;
        let cfg = LaunchConfig {
            grid_dim: (tokens as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (h, d, s, o, n) = (
            heads as i32,
            hd as i32,
            stride as i32,
            off as i32,
            neox as i32,
        );
        let mut b = self.stream.launch_builder(f);
        b.arg(x)
            .arg(pos)
            .arg(&h)
            .arg(&d)
            .arg(&s)
            .arg(&o)
            .arg(table)
            .arg(&npos)
            .arg(&n);
        // SAFETY: as in `gemv`.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(e("rope"))
    }

    /// `silu_mul` over `tokens` fused gate|up rows.
    pub fn silu_mul(
        &self,
        gu: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        ff: usize,
        tokens: usize,
    ) -> Result<()> {
        if gu.len() < 2 * ff * tokens || out.len() < ff * tokens {
            return Err(format!("silu shapes: {tokens} x {ff}"));
        }
        let f = self.func("silu_mul")?;
        let cfg = LaunchConfig::for_num_elems((ff * tokens) as u32);
        let (n, t) = (ff as i32, tokens as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(gu).arg(out).arg(&n).arg(&t);
        // SAFETY: as in `gemv`.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(e("silu"))
    }

    /// `kv_write`: each token's K and V (at `k_off` and `v_off` of its
    /// `stride`-float row) into its slot, as f16.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_write(
        &self,
        qkv: &CudaSlice<f32>,
        stride: usize,
        k_off: usize,
        v_off: usize,
        kc: &mut CudaSlice<u16>,
        vc: &mut CudaSlice<u16>,
        slots: &CudaSlice<i32>,
        kv_dim: usize,
        tokens: usize,
    ) -> Result<()> {
        if qkv.len() < tokens * stride
            || k_off + kv_dim > stride
            || v_off + kv_dim > stride
            || slots.len() < tokens
            || kc.len() != vc.len()
        {
            return Err(format!("kv_write shapes: {tokens} tokens of {kv_dim}"));
        }
        let f = self.func("kv_write")?;
        let cfg = LaunchConfig {
            grid_dim: (tokens as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (s, ko, vo, kd) = (stride as i32, k_off as i32, v_off as i32, kv_dim as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(qkv)
            .arg(&s)
            .arg(&ko)
            .arg(&vo)
            .arg(kc)
            .arg(vc)
            .arg(slots)
            .arg(&kd);
        // SAFETY: as in `gemv`; slots index the caches (the layout's
        // block ids are checked against the pool when it is built).
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(e("kv_write"))
    }

    /// `paged_attention` for `tokens` query rows, each row's context split
    /// into `split.parts` parts of `split.chunk` positions (see
    /// [`attention_split`]), merged by `attention_merge` through
    /// `split.scratch` when there are several.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention(
        &self,
        q: &CudaSlice<f32>,
        q_stride: usize,
        kc: &CudaSlice<u16>,
        vc: &CudaSlice<u16>,
        tables: &CudaSlice<i32>,
        max_blocks: usize,
        qseq: &CudaSlice<i32>,
        qpos: &CudaSlice<i32>,
        out: &mut CudaSlice<f32>,
        shape: AttnShape,
        tokens: usize,
        split: Split<'_>,
    ) -> Result<()> {
        let AttnShape {
            heads,
            kv_heads,
            hd,
            block_size,
        } = shape;
        let group = heads / kv_heads.max(1);
        if kv_heads == 0
            || heads % kv_heads != 0
            || group > 8
            || hd > 128
            || q.len() < tokens * q_stride
            || out.len() < tokens * heads * hd
            || qseq.len() < tokens
            || qpos.len() < tokens
            || tokens > 65_535
        {
            return Err(format!(
                "attention shapes: {heads}/{kv_heads} heads of {hd}"
            ));
        }
        let parts = split.parts.max(1);
        if parts > 1 && split.scratch.len() < tokens * parts * heads * (hd + 2) || parts > 64 {
            return Err(format!(
                "attention split: {parts} parts of {tokens} rows need {} floats of scratch, not {}",
                tokens * parts * heads * (hd + 2),
                split.scratch.len()
            ));
        }
        let f = self.func("paged_attention")?;
        let cfg = LaunchConfig {
            grid_dim: (kv_heads as u32, tokens as u32, parts as u32),
            block_dim: (32 * group as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let scale = 1.0 / (hd as f32).sqrt();
        let (qs, mb, h, kh, d, bs) = (
            q_stride as i32,
            max_blocks as i32,
            heads as i32,
            kv_heads as i32,
            hd as i32,
            block_size as i32,
        );
        let chunk = split.chunk.clamp(1, i32::MAX as usize) as i32;
        {
            let mut b = self.stream.launch_builder(f);
            b.arg(q)
                .arg(&qs)
                .arg(kc)
                .arg(vc)
                .arg(tables)
                .arg(&mb)
                .arg(qseq)
                .arg(qpos)
                .arg(&mut *out);
            b.arg(&h).arg(&kh).arg(&d).arg(&bs).arg(&scale).arg(&chunk);
            b.arg(&mut *split.scratch);
            // SAFETY: as in `gemv`; the tables and positions come from a
            // `StepLayout`, which checks them against the pool; the scratch
            // holds every part's sums (checked above).
            unsafe { b.launch(cfg) }.map_err(e("attention"))?;
        }
        if parts == 1 {
            return Ok(());
        }
        let f = self.func("attention_merge")?;
        let cfg = LaunchConfig {
            grid_dim: (heads as u32, tokens as u32, 1),
            block_dim: (hd as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let pz = parts as i32;
        let mut b = self.stream.launch_builder(f);
        b.arg(&*split.scratch).arg(out).arg(&pz).arg(&h).arg(&d);
        // SAFETY: as above: the scratch and out were checked for these
        // shapes.
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(e("attention_merge"))
    }

    /// `top_k`: the k best of each of `rows` rows of `vocab` logits into
    /// `out`, indices then values' bits ([`candidates`] reads them).
    pub fn top_k(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        rows: usize,
        k: usize,
        out: &mut CudaSlice<i32>,
    ) -> Result<()> {
        if logits.len() < rows * vocab || out.len() < 2 * rows * k || k == 0 {
            return Err(format!("top_k shapes: {rows} x {vocab}, k {k}"));
        }
        let f = self.func("top_k")?;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (v, kk) = (vocab as i32, k as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(logits).arg(&v).arg(&kk).arg(out);
        // SAFETY: as in `gemv`.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(e("top_k"))
    }

    /// `log_norm`: each of `rows` rows' log-normaliser (`ln Σ e^x`) into
    /// `out`, for the rows whose log-probabilities are reported.
    pub fn log_norm(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        rows: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if logits.len() < rows * vocab || out.len() < rows || rows == 0 {
            return Err(format!("log_norm shapes: {rows} x {vocab}"));
        }
        let f = self.func("log_norm")?;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let v = vocab as i32;
        let mut b = self.stream.launch_builder(f);
        b.arg(logits).arg(&v).arg(out);
        // SAFETY: as in `gemv`; the shapes are checked above.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(e("log_norm"))
    }
}

/// Row `row`'s k candidates from what `top_k` wrote for `rows` rows
/// (brought back whole): (index, value) pairs, best first; index -1 for
/// slots past the row's last non-NaN logit.
pub fn candidates(
    raw: &[i32],
    rows: usize,
    k: usize,
    row: usize,
) -> impl Iterator<Item = (i32, f32)> + '_ {
    let idx = &raw[row * k..][..k];
    let val = &raw[rows * k + row * k..][..k];
    idx.iter()
        .zip(val)
        .map(|(i, v)| (*i, f32::from_bits(*v as u32)))
}

/// How one attention launch splits each row's context (flash-decoding).
pub struct Split<'a> {
    /// Parts per row (1: no split, the kernel writes the output itself).
    pub parts: usize,
    /// Positions per part.
    pub chunk: usize,
    /// `tokens * parts * heads * (hd + 2)` floats where `parts` > 1
    /// (unread otherwise).
    pub scratch: &'a mut CudaSlice<f32>,
}

/// Blocks an attention launch should have at least to keep a GPU busy:
/// a few per streaming multiprocessor of the largest GPUs (132 on an
/// H100/H200).
pub const ATTENTION_TARGET_BLOCKS: usize = 264;

/// Most parts a row's context is split into.
pub const ATTENTION_MAX_PARTS: usize = 32;

/// Positions per part at least: one tile of the kernel's, so no part is
/// mostly overhead.
pub const ATTENTION_MIN_CHUNK: usize = 64;

/// Parts and positions per part for `tokens` query rows over `kv_heads`
/// KV heads with contexts of at most `positions`: enough blocks to fill
/// the GPU ([`ATTENTION_TARGET_BLOCKS`]), parts of at least
/// [`ATTENTION_MIN_CHUNK`] positions, a multiple of 32. A prompt's many
/// rows already fill it: one part. The answer depends on its arguments
/// only, so a captured graph's launches stay valid for its bucket and
/// width.
pub fn attention_split(tokens: usize, kv_heads: usize, positions: usize) -> (usize, usize) {
    let blocks = tokens.max(1) * kv_heads.max(1);
    let want = ATTENTION_TARGET_BLOCKS.div_ceil(blocks);
    let most = positions.div_ceil(ATTENTION_MIN_CHUNK).max(1);
    let parts = want.min(most).clamp(1, ATTENTION_MAX_PARTS);
    let chunk = positions.max(1).div_ceil(parts).next_multiple_of(32);
    (positions.max(1).div_ceil(chunk), chunk)
}

/// Scratch floats a split attention needs at most for up to `rows` rows
/// (what [`attention_split`] can ask for, at any context and any row
/// count up to `rows`: rows x parts is not monotonic in the rows).
pub fn attention_scratch(rows: usize, heads: usize, kv_heads: usize, hd: usize) -> usize {
    let most = (1..=rows.min(ATTENTION_TARGET_BLOCKS))
        .map(|t| t * attention_split(t, kv_heads, usize::MAX / 4).0)
        .max()
        .unwrap_or(0)
        .max(rows)
        .max(1);
    most * heads * (hd + 2)
}

#[cfg(test)]
mod split_tests {
    use super::*;

    #[test]
    fn a_decode_row_is_split_until_the_gpu_is_busy_and_a_prompt_is_not() {
        // One row, 3 KV heads, 640 positions: parts of 64 (10), as many as
        // the context allows short of 88.
        assert_eq!(attention_split(1, 3, 640), (10, 64));
        // 8,192 positions: capped at 32 parts of 256.
        assert_eq!(attention_split(1, 3, 8192), (32, 256));
        // 64 rows already make 192 blocks: two parts.
        assert_eq!(attention_split(64, 3, 640), (2, 320));
        // A prompt's 512 rows: one part, the whole context.
        assert_eq!(attention_split(512, 3, 640), (1, 640));
        // Short contexts are not split below 64 positions a part.
        assert_eq!(attention_split(1, 3, 1), (1, 32));
        assert_eq!(attention_split(1, 3, 100), (2, 64));
    }

    #[test]
    fn candidates_are_read_back_from_one_buffer() {
        // Two rows, k = 2: indices first, then the values' bits.
        let vals = [3.5f32, -1.0, 7.25, f32::NEG_INFINITY];
        let mut raw = vec![10, 4, 99, -1];
        raw.extend(vals.iter().map(|v| v.to_bits() as i32));
        let row0: Vec<(i32, f32)> = candidates(&raw, 2, 2, 0).collect();
        let row1: Vec<(i32, f32)> = candidates(&raw, 2, 2, 1).collect();
        assert_eq!(row0, vec![(10, 3.5), (4, -1.0)]);
        assert_eq!(row1, vec![(99, 7.25), (-1, f32::NEG_INFINITY)]);
    }

    #[test]
    fn the_parts_cover_every_position_once() {
        for tokens in [1, 2, 3, 7, 64, 100] {
            for positions in [1, 31, 32, 33, 100, 640, 4097] {
                let (parts, chunk) = attention_split(tokens, 3, positions);
                assert!((1..=ATTENTION_MAX_PARTS).contains(&parts));
                assert_eq!(chunk % 32, 0);
                assert!(parts * chunk >= positions, "{tokens} {positions}");
                assert!((parts - 1) * chunk < positions, "no empty last part");
                let need = tokens * parts * 9 * 66;
                assert!(need <= attention_scratch(tokens.max(64), 9, 3, 64));
            }
        }
    }
}

/// The attention's head layout.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Query heads.
    pub heads: usize,
    /// KV heads (a divisor of `heads`, at most 8 query heads each).
    pub kv_heads: usize,
    /// Values per head (at most 128).
    pub hd: usize,
    /// Positions per KV block.
    pub block_size: usize,
}
