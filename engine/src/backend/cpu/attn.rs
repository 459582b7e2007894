//! Attention over the paged KV cache, one KV block of positions at a time
//! with an online softmax (flash-style): scores for a block never leave
//! L1, and no score row for a whole context is ever built.
//!
//! Keys are stored transposed within each KV block (`KvLayout`): for one
//! block and KV head, `head_dim` rows of `block_size` positions. A query
//! vector's scores for a block are then `head_dim` multiply-adds of whole
//! vectors (a broadcast query value times a row of 16 keys), with no
//! horizontal sum per dot product, which is what made decode attention
//! slow; prefill and decode use the same loop. Values stay one row per
//! position, added into each query vector's accumulator.
//!
//! A task is the `rep` query heads of one KV head for a few tokens of one
//! sequence; each K/V block is read once for all of them. With 16-slot
//! blocks and 64-wide heads on AVX-512 the block loop is written in
//! intrinsics (`x86`); elsewhere in plain loops the compiler vectorizes.
//! Results do not depend on which tokens share a task: blocks past a
//! token's position are masked to exactly nothing.

#![allow(unsafe_code)]
// Index loops over fixed-width arrays are how the portable path gets
// vectorized.
#![allow(clippy::needless_range_loop)]

use super::ops::exp_body;
use super::simd::{multiversion, Isa};

/// Query vectors per task at most.
pub const MAX_VECS: usize = 48;

/// What the KV cache stores: f16 (half the memory and the bandwidth of
/// attention) or f32 (exact).
pub trait KvElem: Copy + Default + Send + Sync + 'static {
    /// Stored as f16.
    const HALF: bool;
    /// Convert for storing.
    fn from_f32(x: f32) -> Self;
    /// Convert for reading.
    fn to_f32(self) -> f32;
    /// Convert a run for reading (`dst` as long as `src`), with the CPU's
    /// conversion instructions where it has them.
    fn to_f32_slice(src: &[Self], dst: &mut [f32]);
    /// Convert a run for storing (`dst` as long as `src`), with the CPU's
    /// conversion instructions where it has them: on the baseline build
    /// [`from_f32`](Self::from_f32) is a call per value, which made
    /// writing K/V a tenth of a 16-stream step.
    fn from_f32_slice(src: &[f32], dst: &mut [Self]);
}

impl KvElem for f32 {
    const HALF: bool = false;
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
}

impl KvElem for half::f16 {
    const HALF: bool = true;
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        assert_eq!(src.len(), dst.len(), "f16 run and f32 run differ");
        #[cfg(target_arch = "x86_64")]
        if Isa::current() != Isa::Scalar {
            // SAFETY: the CPU has F16C (`Isa::current` found AVX2, FMA and
            // F16C); equal lengths checked above.
            return unsafe { x86::f16_to_f32(src.reinterpret_cast(), dst) };
        }
        src.convert_to_f32_slice(dst);
    }
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        use half::slice::HalfFloatSliceExt;
        assert_eq!(src.len(), dst.len(), "f32 run and f16 run differ");
        #[cfg(target_arch = "x86_64")]
        if Isa::current() != Isa::Scalar {
            // SAFETY: as in `to_f32_slice`.
            return unsafe { x86::f32_to_f16(src, dst.reinterpret_cast_mut()) };
        }
        dst.convert_from_f32_slice(src);
    }
}

/// Where keys and values of a slot live in one layer's buffers.
#[derive(Clone, Copy, Debug)]
pub struct KvLayout {
    /// Slots per KV block.
    pub bs: usize,
    /// KV heads.
    pub n_kv: usize,
    /// Per-head size.
    pub hd: usize,
}

impl KvLayout {
    /// Index of key element `d` of KV head `g` at `slot`.
    pub fn k_index(&self, slot: usize, g: usize, d: usize) -> usize {
        let (b, p) = (slot / self.bs, slot % self.bs);
        ((b * self.n_kv + g) * self.hd + d) * self.bs + p
    }

    /// Start of KV head `g`'s transposed key tile in block `b`.
    pub fn k_tile(&self, b: usize, g: usize) -> usize {
        (b * self.n_kv + g) * self.hd * self.bs
    }

    /// Start of KV head `g`'s value row at `slot`.
    pub fn v_index(&self, slot: usize, g: usize) -> usize {
        (slot * self.n_kv + g) * self.hd
    }
}

/// Where one sequence's attention reads: its KV slots in position order.
pub struct AttnSeq<'a> {
    /// Slot of every position up to the step's last token.
    pub slots: &'a [usize],
    /// Position of the sequence's first token in the step.
    pub start: usize,
}

/// Shapes of one attention call.
pub struct AttnShape {
    /// The cache's layout.
    pub lay: KvLayout,
    /// Query heads per KV head.
    pub rep: usize,
    /// Floats per row of `q` (the fused QKV row).
    pub q_stride: usize,
}

/// Per-thread buffers of [`attend`].
#[derive(Default)]
pub struct AttnScratch {
    q: Vec<f32>,
    s: Vec<f32>,
    acc: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    /// One block's keys and value rows in f32 (the portable path on an
    /// f16 cache: `half`'s one-value conversion is a call per element,
    /// which kept the loops from vectorizing and made attention 80% of a
    /// long prompt's step on AVX2).
    kf: Vec<f32>,
    vf: Vec<f32>,
}

/// Tokens per task for `rep` query heads per KV head.
pub fn tokens_per_task(rep: usize) -> usize {
    (MAX_VECS / rep.max(1)).max(1)
}

/// Causal attention of `tokens` of `seq` (token `i` at position
/// `seq.start + i`, its query row at `q[i * q_stride..]`) for KV head `g`;
/// `out(i, h, o)` gets head `h`'s output of token `i`.
#[allow(clippy::too_many_arguments)]
pub fn attend<E: KvElem>(
    isa: Isa,
    sh: &AttnShape,
    seq: &AttnSeq,
    g: usize,
    tokens: std::ops::Range<usize>,
    q: &[f32],
    k: &[E],
    v: &[E],
    sc: &mut AttnScratch,
    out: &mut dyn FnMut(usize, usize, &[f32]),
) {
    let lay = sh.lay;
    let (hd, bs, rep) = (lay.hd, lay.bs, sh.rep);
    let nv = tokens.len() * rep;
    let scale = 1.0 / (hd as f32).sqrt();
    // Query vector u: token tokens.start + u / rep, head g * rep + u % rep.
    sc.q.clear();
    for u in 0..nv {
        let i = tokens.start + u / rep;
        let h = g * rep + u % rep;
        sc.q.extend(
            q[i * sh.q_stride + h * hd..][..hd]
                .iter()
                .map(|x| x * scale),
        );
    }
    sc.s.clear();
    sc.s.resize(nv * bs, 0.0);
    sc.acc.clear();
    sc.acc.resize(nv * hd, 0.0);
    sc.m.clear();
    sc.m.resize(nv, f32::NEG_INFINITY);
    sc.l.clear();
    sc.l.resize(nv, 0.0);
    let ctx = seq.start + tokens.end;
    let mut j0 = 0;
    while j0 < ctx {
        let n = bs.min(ctx - j0);
        let b = seq.slots[j0] / bs;
        let kt = &k[lay.k_tile(b, g)..][..hd * bs];
        let vb = &v[lay.v_index(b * bs, 0)..][..bs * lay.n_kv * hd];
        // The next block's keys and this group's values, asked for while
        // this block computes: a step of many decodes reads each sequence's
        // cache once (nothing is shared between sequences), and without
        // this the reads' latency was most of attention's time.
        if j0 + n < ctx {
            let nb = seq.slots[j0 + n] / bs;
            let kn = &k[lay.k_tile(nb, g)..][..hd * bs];
            let vn = &v[lay.v_index(nb * bs, 0)..][..bs * lay.n_kv * hd];
            prefetch(kn);
            for p in 0..bs.min(ctx - j0 - n) {
                prefetch(&vn[p * lay.n_kv * hd + g * hd..][..hd]);
            }
        }
        // Positions of this block token u may see.
        let visible = |u: usize| -> usize {
            let last = seq.start + tokens.start + u / rep;
            (last + 1).saturating_sub(j0).min(n)
        };
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx512Vnni && hd == 64 && bs == 16 {
            // SAFETY: the CPU has AVX-512F (`Isa::detect`); the block
            // slices hold 64 x 16 keys and 16 value rows (checked above by
            // the slicing), the scratch holds nv vectors.
            unsafe { x86::block(sc, nv, kt, vb, lay.n_kv * hd, g * hd, n, &visible) };
            j0 += n;
            continue;
        }
        // The AVX2 block loop's shape (AVX-512 has its own, above). A
        // decode task's few vectors read the cache in place; a prompt's
        // many would each convert the same values again, so they take the
        // converted copy below (the same numbers either way).
        let avx2_block = isa == Isa::Avx2 && hd == 64 && bs == 16;
        #[cfg(target_arch = "x86_64")]
        if avx2_block && (nv <= 6 || !E::HALF) {
            // SAFETY: the CPU has AVX2, FMA and F16C (`Isa::detect`); the
            // block slices hold 64 x 16 keys and 16 value rows (checked
            // above by the slicing), the scratch holds nv vectors.
            unsafe { x86::block_avx2(sc, nv, kt, vb, lay.n_kv * hd, g * hd, n, &visible) };
            j0 += n;
            continue;
        }
        if E::HALF {
            // Convert the block once for all nv vectors, then run the f32
            // loops on it (values compacted to `hd` apart).
            let (mut kf, mut vf) = (std::mem::take(&mut sc.kf), std::mem::take(&mut sc.vf));
            kf.resize(hd * bs, 0.0);
            vf.resize(bs * hd, 0.0);
            E::to_f32_slice(kt, &mut kf);
            let v_stride = lay.n_kv * hd;
            for p in 0..n {
                let row = &vb[p * v_stride + g * hd..][..hd];
                E::to_f32_slice(row, &mut vf[p * hd..(p + 1) * hd]);
            }
            if avx2_block {
                // (Only x86-64 detects `Isa::Avx2`.)
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above, on the converted copy (64 x 16 keys, 16
                // value rows `hd` apart).
                unsafe {
                    x86::block_avx2(sc, nv, &kf, &vf, hd, 0, n, &visible)
                };
            } else {
                block_portable(sc, nv, hd, bs, &kf, &vf, hd, 0, n, &visible);
            }
            (sc.kf, sc.vf) = (kf, vf);
        } else {
            block_portable(sc, nv, hd, bs, kt, vb, lay.n_kv * hd, g * hd, n, &visible);
        }
        j0 += n;
    }
    for u in 0..nv {
        let inv = 1.0 / sc.l[u];
        let a = &mut sc.acc[u * hd..(u + 1) * hd];
        for x in a.iter_mut() {
            *x *= inv;
        }
        out(tokens.start + u / rep, g * rep + u % rep, a);
    }
}

/// Ask the memory for the cache lines of `xs` (a hint: no effect on
/// results).
#[inline(always)]
fn prefetch<E>(xs: &[E]) {
    super::simd::prefetch_lines(xs.as_ptr() as *const u8, std::mem::size_of_val(xs));
}

/// What the sums so far are multiplied by when the running maximum goes
/// from `m` to `mn`: 0 before any score, and exactly 1 (no `exp`; the
/// AVX-512 block then skips the rescale) while the maximum holds, as it
/// does for most blocks.
#[inline(always)]
fn rescale(m: f32, mn: f32) -> f32 {
    if m == f32::NEG_INFINITY {
        0.0
    } else if m == mn {
        1.0
    } else {
        (m - mn).exp()
    }
}

/// The online softmax step of vector `u` for the `vis` visible scores of
/// its row (`sc.s[u * bs..]`): the running maximum and sum, the row turned
/// into weights, the accumulator rescaled.
#[inline(always)]
fn softmax_update(sc: &mut AttnScratch, u: usize, bs: usize, hd: usize, vis: usize) {
    let s = &mut sc.s[u * bs..u * bs + vis];
    let bm = s.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b));
    let m = sc.m[u];
    let mn = m.max(bm);
    let alpha = rescale(m, mn);
    sc.m[u] = mn;
    for x in s.iter_mut() {
        *x -= mn;
    }
    exp_body(s);
    sc.l[u] = sc.l[u] * alpha + s.iter().sum::<f32>();
    if alpha != 1.0 {
        for x in sc.acc[u * hd..(u + 1) * hd].iter_mut() {
            *x *= alpha;
        }
    }
}

multiversion! {
    /// One KV block for every query vector, in plain loops (compiled for
    /// AVX2 too): scores, the online softmax update, the values.
    #[allow(clippy::too_many_arguments)]
    fn block_portable<E: KvElem>(
        sc: &mut AttnScratch,
        nv: usize,
        hd: usize,
        bs: usize,
        kt: &[E],
        vb: &[E],
        v_stride: usize,
        v_off: usize,
        n: usize,
        visible: &dyn Fn(usize) -> usize,
    ) {
        for u in 0..nv {
            let s = &mut sc.s[u * bs..(u + 1) * bs];
            s.fill(0.0);
            let qu = &sc.q[u * hd..(u + 1) * hd];
            for d in 0..hd {
                let qd = qu[d];
                for (x, kk) in s.iter_mut().zip(&kt[d * bs..(d + 1) * bs]) {
                    *x += qd * kk.to_f32();
                }
            }
            let vis = visible(u);
            if vis == 0 {
                continue;
            }
            softmax_update(sc, u, bs, hd, vis);
            let s = &sc.s[u * bs..u * bs + vis];
            let a = &mut sc.acc[u * hd..(u + 1) * hd];
            for (p, w) in s.iter().enumerate() {
                let vr = &vb[p * v_stride + v_off..][..hd];
                for (x, y) in a.iter_mut().zip(vr) {
                    *x += w * y.to_f32();
                }
            }
        }
        let _ = n;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{rescale, softmax_update, AttnScratch, KvElem};
    use std::arch::x86_64::*;

    /// f16 bits to f32, eight at a time with F16C inline: `half`'s slice
    /// conversion calls a function per eight values (its F16C code cannot
    /// be inlined into a baseline build), which cost AVX2 attention more
    /// than its arithmetic.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f16_to_f32(src: &[u16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: eight values in both runs from i.
            unsafe {
                let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
            i += 8;
        }
        for j in i..n {
            dst[j] = half::f16::from_bits(src[j]).to_f32();
        }
    }

    /// f32 to f16 bits, rounding to nearest even as `half::f16::from_f32`.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f32_to_f16(src: &[f32], dst: &mut [u16]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: eight values in both runs from i.
            unsafe {
                let f = _mm256_loadu_ps(src.as_ptr().add(i));
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(f);
                _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, h);
            }
            i += 8;
        }
        for j in i..n {
            dst[j] = half::f16::from_f32(src[j]).to_bits();
        }
    }

    /// AVX2 block loop for 16 slots and 64-wide heads on the cache's
    /// keys (`kt`, 64 rows of 16) and values (`vb`, row p at `p *
    /// v_stride + v_off`), read in place (f16 converted as it is loaded):
    /// scores six query vectors at a time in registers, the softmax step
    /// per vector, then each vector's 64 accumulators in eight registers
    /// over the block's value rows.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn block_avx2<E: KvElem>(
        sc: &mut AttnScratch,
        nv: usize,
        kt: &[E],
        vb: &[E],
        v_stride: usize,
        v_off: usize,
        n: usize,
        visible: &dyn Fn(usize) -> usize,
    ) {
        const HD: usize = 64;
        assert!(kt.len() >= HD * 16);
        assert!(vb.len() >= (n.max(1) - 1) * v_stride + v_off + HD);
        assert!(sc.q.len() >= nv * HD && sc.s.len() >= nv * 16 && sc.acc.len() >= nv * HD);
        let mut u0 = 0;
        while u0 < nv {
            let ut = (nv - u0).min(6);
            let mut s = [[_mm256_setzero_ps(); 2]; 6];
            for d in 0..HD {
                // SAFETY: row d of the 64 x 16 tile (length checked).
                let (k0, k1) = unsafe {
                    let r = kt.as_ptr().add(d * 16);
                    (load8(r), load8(r.add(8)))
                };
                for t in 0..ut {
                    let qd = _mm256_set1_ps(sc.q[(u0 + t) * HD + d]);
                    s[t][0] = _mm256_fmadd_ps(qd, k0, s[t][0]);
                    s[t][1] = _mm256_fmadd_ps(qd, k1, s[t][1]);
                }
            }
            for t in 0..ut {
                // SAFETY: 16 floats of row u0 + t (length checked).
                unsafe {
                    let r = sc.s.as_mut_ptr().add((u0 + t) * 16);
                    _mm256_storeu_ps(r, s[t][0]);
                    _mm256_storeu_ps(r.add(8), s[t][1]);
                }
            }
            u0 += ut;
        }
        for u in 0..nv {
            let vis = visible(u).min(n);
            if vis == 0 {
                continue;
            }
            softmax_update(sc, u, 16, HD, vis);
            let a = sc.acc[u * HD..(u + 1) * HD].as_mut_ptr();
            let mut acc = [_mm256_setzero_ps(); 8];
            for (c, x) in acc.iter_mut().enumerate() {
                // SAFETY: 64 floats of vector u's accumulator.
                *x = unsafe { _mm256_loadu_ps(a.add(8 * c)) };
            }
            for p in 0..vis {
                let w = _mm256_set1_ps(sc.s[u * 16 + p]);
                for (c, x) in acc.iter_mut().enumerate() {
                    // SAFETY: value row p (p < n, length checked).
                    let v = unsafe { load8(vb.as_ptr().add(p * v_stride + v_off + 8 * c)) };
                    *x = _mm256_fmadd_ps(w, v, *x);
                }
            }
            for (c, x) in acc.iter().enumerate() {
                // SAFETY: as above.
                unsafe { _mm256_storeu_ps(a.add(8 * c), *x) };
            }
        }
    }

    /// 8 stored values at `p` as f32.
    #[inline(always)]
    unsafe fn load8<E: KvElem>(p: *const E) -> __m256 {
        // SAFETY: the caller's slice has 8 elements at `p`; the features
        // are those of the caller (always inlined into it).
        unsafe {
            if E::HALF {
                _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
            } else {
                _mm256_loadu_ps(p as *const f32)
            }
        }
    }

    /// 16 stored values at `p` as f32.
    #[inline(always)]
    unsafe fn load16<E: KvElem>(p: *const E) -> __m512 {
        // SAFETY: the caller's slice has 16 elements at `p`; the features
        // are those of the caller (always inlined into it).
        unsafe {
            if E::HALF {
                _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
            } else {
                _mm512_loadu_ps(p as *const f32)
            }
        }
    }

    /// `e^x` on 16 lanes (x <= 88; below -87 gives 0): x = n ln2 + r, a
    /// degree-6 polynomial, `vscalefps` for 2^n.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn exp16(x: __m512) -> __m512 {
        let tiny = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(-87.0));
        let x = _mm512_max_ps(x, _mm512_set1_ps(-87.0));
        let n =
            _mm512_roundscale_ps::<0>(_mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm512_set1_ps(0.001_388_9);
        for c in [0.008_333_5, 0.041_666_5, 0.166_666_67, 0.5, 1.0, 1.0] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        _mm512_maskz_mov_ps(!tiny, _mm512_scalef_ps(p, n))
    }

    /// The block loop for 16 slots per block and 64-wide heads.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn block<E: KvElem>(
        sc: &mut AttnScratch,
        nv: usize,
        kt: &[E],
        vb: &[E],
        v_stride: usize,
        v_off: usize,
        n: usize,
        visible: &dyn Fn(usize) -> usize,
    ) {
        const HD: usize = 64;
        assert!(kt.len() >= HD * 16 && sc.q.len() >= nv * HD && sc.s.len() >= nv * 16);
        assert!(vb.len() >= (n.max(1) - 1) * v_stride + v_off + HD && sc.acc.len() >= nv * HD);
        // Scores, eight query vectors at a time: one row of 16 keys per d.
        let mut u0 = 0;
        while u0 < nv {
            let ut = (nv - u0).min(8);
            let mut s = [_mm512_setzero_ps(); 8];
            for d in 0..HD {
                // SAFETY: row d of the 64 x 16 tile (length checked).
                let kr = unsafe { load16(kt.as_ptr().add(d * 16)) };
                for t in 0..ut {
                    let qd = sc.q[(u0 + t) * HD + d];
                    s[t] = _mm512_fmadd_ps(_mm512_set1_ps(qd), kr, s[t]);
                }
            }
            for t in 0..ut {
                // SAFETY: 16 floats of row u0 + t (length checked).
                unsafe { _mm512_storeu_ps(sc.s.as_mut_ptr().add((u0 + t) * 16), s[t]) };
            }
            u0 += ut;
        }
        // Softmax update per vector.
        for u in 0..nv {
            let vis = visible(u);
            let keep: __mmask16 = ((1u32 << vis) - 1) as __mmask16;
            // SAFETY: row u of the scores (length checked).
            let row = unsafe { _mm512_loadu_ps(sc.s.as_ptr().add(u * 16)) };
            let row = _mm512_mask_mov_ps(_mm512_set1_ps(f32::NEG_INFINITY), keep, row);
            let bm = _mm512_reduce_max_ps(row);
            let m = sc.m[u];
            let mn = m.max(bm);
            if vis == 0 {
                // Nothing visible: weights 0, state unchanged.
                // SAFETY: as above.
                unsafe { _mm512_storeu_ps(sc.s.as_mut_ptr().add(u * 16), _mm512_setzero_ps()) };
                continue;
            }
            let alpha = rescale(m, mn);
            sc.m[u] = mn;
            let p = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(row, _mm512_set1_ps(mn))));
            sc.l[u] = sc.l[u] * alpha + _mm512_reduce_add_ps(p);
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(sc.s.as_mut_ptr().add(u * 16), p) };
            if alpha == 1.0 {
                continue;
            }
            let a = sc.acc[u * HD..(u + 1) * HD].as_mut_ptr();
            let al = _mm512_set1_ps(alpha);
            for c in 0..4 {
                // SAFETY: 64 floats of vector u's accumulator.
                unsafe {
                    let x = _mm512_loadu_ps(a.add(16 * c));
                    _mm512_storeu_ps(a.add(16 * c), _mm512_mul_ps(x, al));
                }
            }
        }
        // Values, six vectors' accumulators in registers at a time.
        let mut u0 = 0;
        while u0 < nv {
            let ut = (nv - u0).min(6);
            let mut a = [[_mm512_setzero_ps(); 4]; 6];
            for t in 0..ut {
                for c in 0..4 {
                    // SAFETY: vector u0 + t's accumulator (length checked).
                    a[t][c] =
                        unsafe { _mm512_loadu_ps(sc.acc.as_ptr().add((u0 + t) * HD + 16 * c)) };
                }
            }
            for p in 0..n {
                // SAFETY: value row p of the block (length checked).
                let vr = unsafe {
                    let r = vb.as_ptr().add(p * v_stride + v_off);
                    [
                        load16(r),
                        load16(r.add(16)),
                        load16(r.add(32)),
                        load16(r.add(48)),
                    ]
                };
                for t in 0..ut {
                    let w = _mm512_set1_ps(sc.s[(u0 + t) * 16 + p]);
                    for c in 0..4 {
                        a[t][c] = _mm512_fmadd_ps(w, vr[c], a[t][c]);
                    }
                }
            }
            for t in 0..ut {
                for c in 0..4 {
                    // SAFETY: as above.
                    unsafe {
                        _mm512_storeu_ps(sc.acc.as_mut_ptr().add((u0 + t) * HD + 16 * c), a[t][c])
                    };
                }
            }
            u0 += ut;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The run conversions give what the one-value ones give, bit for bit:
    /// rounding ties, overflow to infinity, subnormals, NaN, and runs
    /// whose length is not a multiple of eight.
    #[test]
    fn f16_run_conversions_match_the_value_conversions() {
        let mut xs: Vec<f32> = (0..997)
            .map(|i| (i as f32 - 498.0) * 0.37 * (1.0 + (i % 7) as f32 * 1e-3))
            .collect();
        xs.extend([
            0.0,
            -0.0,
            1.0 + 1.0 / 2048.0, // a tie: rounds to even
            1.0 + 3.0 / 2048.0,
            65504.0,
            70000.0,
            -1e9,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1e-7, // subnormal in f16
            -3e-5,
            1e-10, // flushes to zero
        ]);
        for n in [xs.len(), 7, 8, 9, 1, 0] {
            let src = &xs[..n];
            let mut h = vec![half::f16::ZERO; n];
            <half::f16 as KvElem>::from_f32_slice(src, &mut h);
            for (a, b) in h.iter().zip(src) {
                let want = half::f16::from_f32(*b);
                assert!(
                    a.to_bits() == want.to_bits() || (a.is_nan() && want.is_nan()),
                    "{b} -> {a} want {want}"
                );
            }
            let mut back = vec![0f32; n];
            <half::f16 as KvElem>::to_f32_slice(&h, &mut back);
            for (a, b) in back.iter().zip(&h) {
                assert!(a.to_bits() == b.to_f32().to_bits() || (a.is_nan() && b.is_nan()));
            }
        }
    }

    /// Against a direct softmax, for head sizes with and without the
    /// specialized path, contexts across several blocks, tasks that start
    /// mid-sequence, and every kernel set of this CPU.
    #[test]
    fn blocked_attention_matches_a_direct_softmax() {
        for isa in Isa::available() {
            for (hd, bs, rep, ntok, start) in [
                (64, 16, 3, 16, 0),
                (64, 16, 3, 1, 150),
                (32, 16, 2, 5, 70),
                (64, 8, 1, 3, 0),
                (64, 16, 9, 5, 33),
            ] {
                check::<f32>(isa, hd, bs, rep, ntok, start, 1e-4);
                // f16 keys and values: the reference reads the same
                // rounded values, so only the arithmetic differs.
                check::<half::f16>(isa, hd, bs, rep, ntok, start, 1e-3);
            }
        }
    }

    fn check<E: KvElem>(
        isa: Isa,
        hd: usize,
        bs: usize,
        rep: usize,
        ntok: usize,
        start: usize,
        tol: f32,
    ) {
        let n_kv = 2;
        let lay = KvLayout { bs, n_kv, hd };
        let q_stride = n_kv * rep * hd + 7;
        let ctx = start + ntok;
        let nblocks = ctx.div_ceil(bs) + 3;
        // Logical block i lives in physical block (i * 5 + 2) % nblocks.
        let slots: Vec<usize> = (0..ctx)
            .map(|j| ((j / bs * 5 + 2) % nblocks) * bs + j % bs)
            .collect();
        let key = |s: usize, g: usize, d: usize| {
            E::from_f32(((s * 7 + g * 3 + d * 11) % 23) as f32 / 9.0 - 1.0).to_f32()
        };
        let val = |s: usize, g: usize, d: usize| {
            E::from_f32(((s * 5 + g + d * 3) % 13) as f32 / 3.0).to_f32()
        };
        let mut k = vec![E::default(); nblocks * bs * n_kv * hd];
        let mut v = vec![E::default(); nblocks * bs * n_kv * hd];
        for &s in &slots {
            for g in 0..n_kv {
                for d in 0..hd {
                    k[lay.k_index(s, g, d)] = E::from_f32(key(s, g, d));
                    v[lay.v_index(s, g) + d] = E::from_f32(val(s, g, d));
                }
            }
        }
        let q: Vec<f32> = (0..ntok * q_stride)
            .map(|i| ((i * 3) % 17) as f32 / 6.0 - 1.2)
            .collect();
        let sh = AttnShape { lay, rep, q_stride };
        let seq = AttnSeq {
            slots: &slots,
            start,
        };
        let mut got = vec![vec![0f32; hd]; ntok * n_kv * rep];
        let mut sc = AttnScratch::default();
        for g in 0..n_kv {
            let per = tokens_per_task(rep);
            let mut t = 0;
            while t < ntok {
                let e = (t + per).min(ntok);
                attend(
                    isa,
                    &sh,
                    &seq,
                    g,
                    t..e,
                    &q,
                    &k,
                    &v,
                    &mut sc,
                    &mut |i, h, o| got[i * n_kv * rep + h].copy_from_slice(o),
                );
                t = e;
            }
        }
        for i in 0..ntok {
            for h in 0..n_kv * rep {
                let g = h / rep;
                let qh = &q[i * q_stride + h * hd..][..hd];
                let n = start + i + 1;
                let s: Vec<f32> = slots[..n]
                    .iter()
                    .map(|&s| {
                        (0..hd).map(|d| qh[d] * key(s, g, d)).sum::<f32>() / (hd as f32).sqrt()
                    })
                    .collect();
                let mx = s.iter().cloned().fold(f32::MIN, f32::max);
                let e: Vec<f32> = s.iter().map(|x| (x - mx).exp()).collect();
                let z: f32 = e.iter().sum();
                for d in 0..hd {
                    let want: f32 = (0..n).map(|j| e[j] / z * val(slots[j], g, d)).sum();
                    let g = got[i * n_kv * rep + h][d];
                    assert!(
                        (g - want).abs() < tol,
                        "{isa:?} hd {hd} bs {bs} token {i} head {h}: {g} vs {want}"
                    );
                }
            }
        }
    }
}
