//! The integer dot-product kernels, picked at run time for the CPU.
//!
//! Weights stay in the GGUF file's block formats, repacked at load into
//! groups of four rows (`weights::QMat`): for Q4_1 a group block is the four
//! rows' f16 scales, their f16 minimums and their 4 x 16 bytes of nibbles,
//! 80 bytes for 4 x 32 weights (the file's 20 bytes per 32); for Q8_0 the
//! four f16 scales and 4 x 32 signed bytes (the file's 34 per 32).
//! Activations are quantized per 32 values to 8 bits with their scale and
//! the scaled sum (llama.cpp's Q8_1, [`Q8Block`]).
//!
//! A tile is 4 weight rows by up to [`MAX_T`] tokens. Every (row, token)
//! pair has its own accumulator and goes through the same instructions in
//! the same order whatever the tile's width, and the block sums are exact
//! integers, so a token's result does not depend on what it was batched
//! with, nor on which of these kernels ran (the batching-invariance test
//! and `kernels_agree` below).
//!
//! `unsafe` here is the SIMD entry points: each runs only after
//! [`Isa::detect`] found the features it is compiled for, and reads only
//! inside the slices it was given (lengths checked by the safe wrappers).

#![allow(unsafe_code)]

/// One block of 32 activations quantized to 8 bits (as llama.cpp's Q8_1).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C)]
pub struct Q8Block {
    /// Scale: value = d * q.
    pub d: f32,
    /// d * sum(q): what a Q4_1 block's minimum is multiplied by.
    pub s: f32,
    /// The quantized values.
    pub q: [i8; 32],
}

/// A function compiled twice, for any x86-64 and for AVX2 + FMA + F16C,
/// the second called where [`Isa::current`] found them. For plain loops
/// the compiler vectorizes: the release binary targets baseline x86-64
/// (so that it runs anywhere) and these still get 256-bit code.
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($a:ident: $t:ty),* $(,)?) $(-> $r:ty)? $body:block) => {
        $(#[$m])*
        #[allow(unsafe_code)]
        $vis fn $name($($a: $t),*) $(-> $r)? {
            #[inline(always)]
            fn body($($a: $t),*) $(-> $r)? $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma,f16c")]
            fn avx2($($a: $t),*) $(-> $r)? {
                body($($a),*)
            }
            #[cfg(target_arch = "x86_64")]
            if $crate::backend::cpu::simd::Isa::current() != $crate::backend::cpu::simd::Isa::Scalar {
                // SAFETY: the CPU has AVX2, FMA and F16C (`Isa::current`).
                return unsafe { avx2($($a),*) };
            }
            body($($a),*)
        }
    };
}
pub(crate) use multiversion;

/// Bytes of one 4-row group block.
pub const Q4_1_GROUP: usize = 80;
/// Bytes of one 4-row group block.
pub const Q8_0_GROUP: usize = 136;
/// Tokens per tile at most.
pub const MAX_T: usize = 8;

/// Weight block formats the kernels take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// GGML Q4_1: 4-bit values with a scale and a minimum per 32.
    Q4_1,
    /// GGML Q8_0: 8-bit values with a scale per 32.
    Q8_0,
}

impl Format {
    /// Bytes of one 4-row group block.
    pub fn group_bytes(self) -> usize {
        match self {
            Format::Q4_1 => Q4_1_GROUP,
            Format::Q8_0 => Q8_0_GROUP,
        }
    }
}

/// The instruction sets the kernels come in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust (any CPU).
    Scalar,
    /// AVX2 + FMA + F16C: `vpmaddubsw` / `vpmaddwd`.
    Avx2,
    /// AVX-512 VNNI with VL: `vpdpbusd` on 256-bit registers (and 32 of
    /// them, so wider tiles).
    Avx512Vnni,
}

impl Isa {
    /// [`detect`](Self::detect)'s answer, read once per process.
    pub fn current() -> Isa {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(Isa::detect)
    }

    /// The best this CPU runs; `ULTRAFAST_ISA=scalar|avx2` caps it (for
    /// comparisons and tests).
    pub fn detect() -> Isa {
        let best = Self::best();
        match std::env::var("ULTRAFAST_ISA").ok().as_deref() {
            Some("scalar") => Isa::Scalar,
            Some("avx2") if best != Isa::Scalar => Isa::Avx2,
            _ => best,
        }
    }

    #[cfg(target_arch = "x86_64")]
    fn best() -> Isa {
        let avx2 = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        if avx2
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
        {
            Isa::Avx512Vnni
        } else if avx2 {
            Isa::Avx2
        } else {
            Isa::Scalar
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn best() -> Isa {
        Isa::Scalar
    }

    /// Every kernel set this CPU can run (for tests).
    pub fn available() -> Vec<Isa> {
        let best = Self::best();
        [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni]
            .into_iter()
            .filter(|i| *i == Isa::Scalar || best == Isa::Avx512Vnni || *i == best)
            .collect()
    }

    /// Name for logs and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512Vnni => "avx512-vnni",
        }
    }
}

/// `out[t][r]` = row `r` of the 4-row group `w` (`nb` group blocks) times
/// token `t` of `x` (token `t`'s blocks start at `t * stride`), for
/// `tokens` tokens (1..=[`MAX_T`]).
#[allow(clippy::too_many_arguments)]
pub fn tile(
    isa: Isa,
    fmt: Format,
    w: &[u8],
    nb: usize,
    x: &[Q8Block],
    stride: usize,
    tokens: usize,
    out: &mut [[f32; 4]; MAX_T],
) {
    assert!((1..=MAX_T).contains(&tokens), "tile of {tokens} tokens");
    assert!(w.len() >= nb * fmt.group_bytes(), "short weight group");
    assert!(
        stride >= nb && x.len() >= (tokens - 1) * stride + nb,
        "short activations"
    );
    // Eight tokens at once only where 32 registers hold their sums; the
    // other kernels take two tiles of at most four (the same instructions
    // per token either way).
    if tokens > 4 && isa != Isa::Avx512Vnni {
        let mut rest = [[0f32; 4]; MAX_T];
        tile(isa, fmt, w, nb, x, stride, 4, out);
        tile(
            isa,
            fmt,
            w,
            nb,
            &x[4 * stride..],
            stride,
            tokens - 4,
            &mut rest,
        );
        out[4..tokens].copy_from_slice(&rest[..tokens - 4]);
        return;
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512Vnni => {
            // SAFETY: `Isa::detect` found AVX2, FMA and F16C (and the
            // AVX-512 set for the VNNI variant); bounds checked above.
            unsafe { x86::tile(isa, fmt, w, nb, x, stride, tokens, out) }
        }
        _ => scalar_tile(fmt, w, nb, x, stride, tokens, out),
    }
}

fn f16(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32()
}

/// The reference semantics: exact block sums, then the same float steps
/// as the SIMD kernels (scale product, one fused multiply-add per block
/// into eight lanes, the minimums per block).
#[allow(clippy::needless_range_loop)]
fn scalar_tile(
    fmt: Format,
    w: &[u8],
    nb: usize,
    x: &[Q8Block],
    stride: usize,
    tokens: usize,
    out: &mut [[f32; 4]; MAX_T],
) {
    let gb = fmt.group_bytes();
    for t in 0..tokens {
        for r in 0..4 {
            let mut lanes = [0f32; 8];
            let mut min = 0f32;
            for b in 0..nb {
                let g = &w[b * gb..(b + 1) * gb];
                let xb = &x[t * stride + b];
                let mut sums = [0i32; 8];
                let scale = f16(g, r) * xb.d;
                match fmt {
                    Format::Q4_1 => {
                        let q = &g[16 + 16 * r..32 + 16 * r];
                        // Lane j: the low nibbles of bytes 4j..4j+4 (values
                        // 4j..) and their high nibbles (values 16+4j..);
                        // lanes 4-7 stay zero.
                        for j in 0..16 {
                            let lo = (q[j] & 0x0f) as i32;
                            let hi = (q[j] >> 4) as i32;
                            sums[j / 4] += lo * xb.q[j] as i32 + hi * xb.q[j + 16] as i32;
                        }
                        min = f16(g, 4 + r).mul_add(xb.s, min);
                    }
                    Format::Q8_0 => {
                        let q = &g[8 + 32 * r..40 + 32 * r];
                        for j in 0..32 {
                            sums[j / 4] += (q[j] as i8) as i32 * xb.q[j] as i32;
                        }
                    }
                }
                for l in 0..8 {
                    lanes[l] = (sums[l] as f32).mul_add(scale, lanes[l]);
                }
            }
            out[t][r] = hsum8(&lanes) + min;
        }
    }
}

/// The horizontal sum in the order the SIMD kernels use.
fn hsum8(l: &[f32; 8]) -> f32 {
    let a = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    let b = [a[0] + a[2], a[1] + a[3]];
    b[0] + b[1]
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Format, Isa, Q8Block, MAX_T};
    use std::arch::x86_64::*;

    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn tile(
        isa: Isa,
        fmt: Format,
        w: &[u8],
        nb: usize,
        x: &[Q8Block],
        stride: usize,
        tokens: usize,
        out: &mut [[f32; 4]; MAX_T],
    ) {
        // SAFETY (all arms): the caller checked the CPU features and that
        // `w` and `x` hold what the kernel reads.
        unsafe {
            match (isa, fmt, tokens) {
                (Isa::Avx512Vnni, Format::Q4_1, 8) => q4_512::<8>(w, nb, x, stride, out),
                (Isa::Avx512Vnni, Format::Q4_1, 7) => q4_512::<7>(w, nb, x, stride, out),
                (Isa::Avx512Vnni, Format::Q4_1, 6) => q4_512::<6>(w, nb, x, stride, out),
                (Isa::Avx512Vnni, Format::Q4_1, 5) => q4_512::<5>(w, nb, x, stride, out),
                (Isa::Avx512Vnni, Format::Q4_1, 4) => q4_512::<4>(w, nb, x, stride, out),
                (Isa::Avx512Vnni, Format::Q4_1, 3) => q4_512::<3>(w, nb, x, stride, out),
                (Isa::Avx512Vnni, Format::Q4_1, 2) => q4_512::<2>(w, nb, x, stride, out),
                (Isa::Avx512Vnni, Format::Q4_1, _) => q4_512::<1>(w, nb, x, stride, out),
                (Isa::Avx512Vnni, Format::Q8_0, 8) => q8_512::<8>(w, nb, x, stride, out),
                (Isa::Avx512Vnni, Format::Q8_0, 7) => q8_512::<7>(w, nb, x, stride, out),
                (Isa::Avx512Vnni, Format::Q8_0, 6) => q8_512::<6>(w, nb, x, stride, out),
                (Isa::Avx512Vnni, Format::Q8_0, 5) => q8_512::<5>(w, nb, x, stride, out),
                (Isa::Avx512Vnni, Format::Q8_0, 4) => q8_512::<4>(w, nb, x, stride, out),
                (Isa::Avx512Vnni, Format::Q8_0, 3) => q8_512::<3>(w, nb, x, stride, out),
                (Isa::Avx512Vnni, Format::Q8_0, 2) => q8_512::<2>(w, nb, x, stride, out),
                (Isa::Avx512Vnni, Format::Q8_0, _) => q8_512::<1>(w, nb, x, stride, out),
                (_, Format::Q4_1, 4) => q4_avx2::<4>(w, nb, x, stride, out),
                (_, Format::Q4_1, 3) => q4_avx2::<3>(w, nb, x, stride, out),
                (_, Format::Q4_1, 2) => q4_avx2::<2>(w, nb, x, stride, out),
                (_, Format::Q4_1, _) => q4_avx2::<1>(w, nb, x, stride, out),
                (_, Format::Q8_0, 4) => {
                    q8_avx2::<2>(w, nb, x, stride, out, 0);
                    q8_avx2::<2>(w, nb, x, stride, out, 2);
                }
                (_, Format::Q8_0, 3) => {
                    q8_avx2::<2>(w, nb, x, stride, out, 0);
                    q8_avx2::<1>(w, nb, x, stride, out, 2);
                }
                (_, Format::Q8_0, 2) => q8_avx2::<2>(w, nb, x, stride, out, 0),
                (_, Format::Q8_0, _) => q8_avx2::<1>(w, nb, x, stride, out, 0),
            }
        }
    }

    /// AVX2 quantization of one block (see `quantize_scalar`).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize(v: &[f32], out: &mut Q8Block) {
        // SAFETY: the caller checked 32 floats.
        let x = unsafe {
            [
                _mm256_loadu_ps(v.as_ptr()),
                _mm256_loadu_ps(v.as_ptr().add(8)),
                _mm256_loadu_ps(v.as_ptr().add(16)),
                _mm256_loadu_ps(v.as_ptr().add(24)),
            ]
        };
        let sign = _mm256_set1_ps(-0.0);
        let a = x.map(|v| _mm256_andnot_ps(sign, v));
        let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        // Round to nearest even (the default rounding mode).
        let q = x.map(|v| _mm256_cvtps_epi32(_mm256_mul_ps(v, id)));
        let sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let s4 = _mm_add_epi32(
            _mm256_castsi256_si128(sum),
            _mm256_extracti128_si256::<1>(sum),
        );
        let s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
        let s4 = _mm_add_epi32(s4, _mm_shuffle_epi32::<1>(s4));
        let total = _mm_cvtsi128_si32(s4);
        // Packing interleaves 128-bit lanes; the permutation undoes it.
        let p = _mm256_packs_epi16(
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        );
        let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: 32 bytes into the block's 32 values.
        unsafe { _mm256_storeu_si256(out.q.as_mut_ptr() as *mut __m256i, p) };
        out.d = d;
        out.s = d * total as f32;
    }

    /// Sum of 8 lanes: high half onto low, then pairs (as `hsum8`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// The four rows' f16 values at `p` as f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn four_f16(p: *const u8) -> [f32; 4] {
        // SAFETY: the caller's group block has 8 bytes at `p`.
        let v = _mm_cvtph_ps(unsafe { _mm_loadl_epi64(p as *const __m128i) });
        let mut o = [0f32; 4];
        // SAFETY: 4 floats into a 4-float array.
        unsafe { _mm_storeu_ps(o.as_mut_ptr(), v) };
        o
    }

    macro_rules! kernel {
        ($name:ident, $feat:literal, $fmt:ident, $gb:expr, $dot:ident) => {
            #[target_feature(enable = $feat)]
            unsafe fn $name<const T: usize>(
                w: &[u8],
                nb: usize,
                x: &[Q8Block],
                stride: usize,
                out: &mut [[f32; 4]; MAX_T],
                t0: usize,
            ) {
                let mut acc = [[_mm256_setzero_ps(); 4]; T];
                #[allow(unused_mut)]
                let mut min = [[0f32; 4]; T];
                for b in 0..nb {
                    // SAFETY: block `b` of the group lies in `w` (checked
                    // by the caller: nb * group bytes).
                    let g = unsafe { w.as_ptr().add(b * $gb) };
                    // SAFETY: in the block.
                    let d = unsafe { four_f16(g) };
                    let wq = load!($fmt, g);
                    for t in 0..T {
                        let xb = &x[(t0 + t) * stride + b];
                        // SAFETY: 32 bytes of the block's values.
                        let xq = unsafe { _mm256_loadu_si256(xb.q.as_ptr() as *const __m256i) };
                        extra!($fmt, g, min[t], xb);
                        for r in 0..4 {
                            let p = $dot(wq[r], xq);
                            let s = _mm256_set1_ps(d[r] * xb.d);
                            acc[t][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[t][r]);
                        }
                    }
                }
                for t in 0..T {
                    for r in 0..4 {
                        out[t0 + t][r] = hsum(acc[t][r]) + min[t][r];
                    }
                }
            }
        };
    }

    macro_rules! load {
        (Q8, $g:ident) => {{
            // SAFETY: the four rows' 32 bytes follow the 8 bytes of scales.
            unsafe {
                [
                    _mm256_loadu_si256($g.add(8) as *const __m256i),
                    _mm256_loadu_si256($g.add(40) as *const __m256i),
                    _mm256_loadu_si256($g.add(72) as *const __m256i),
                    _mm256_loadu_si256($g.add(104) as *const __m256i),
                ]
            }
        }};
    }

    macro_rules! extra {
        (Q8, $g:ident, $min:expr, $xb:ident) => {{}};
    }

    /// u8 x i8 pairs summed to i32 lanes: `vpmaddubsw` then `vpmaddwd`
    /// (no saturation: at most 2 x 15 x 127, or 2 x 128 x 127 for Q8_0).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_q4_avx2(w: __m256i, x: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
    }

    /// Signed x signed through the sign trick (|w| x sign(x, w)).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_q8_avx2(w: __m256i, x: __m256i) -> __m256i {
        let aw = _mm256_sign_epi8(w, w);
        let sx = _mm256_sign_epi8(x, w);
        dot_q4_avx2(aw, sx)
    }

    kernel!(q8_avx2, "avx2,fma,f16c", Q8, 136, dot_q8_avx2);
    /// Bytes ahead of the block in use that the kernels ask the memory for:
    /// decode is one pass over every weight, and the hardware prefetcher
    /// alone left a single thread at 8 of its 12.5 GB/s.
    const AHEAD: usize = 2048;

    /// Prefetch the two cache lines `AHEAD` bytes past `g` (blocks are 80
    /// or 136 bytes, so two lines per block cover every line). The
    /// address may lie past the weights: a prefetch never faults, and the
    /// pointer is only formed with wrapping arithmetic.
    #[inline(always)]
    fn prefetch(g: *const u8) {
        // SAFETY: prefetching has no architectural effect and cannot
        // fault, whatever the address.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(g.wrapping_add(AHEAD) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(g.wrapping_add(AHEAD + 64) as *const i8);
        }
    }

    /// Sum of the four lanes in the order of the reference: (0+2)+(1+3).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum4(v: __m128) -> f32 {
        let s = _mm_add_ps(v, _mm_movehl_ps(v, v));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }

    /// Q4_1 on AVX2, two rows per register: a register's 128-bit halves
    /// are rows r and r+1, each four i32 lanes (lane j: low nibbles of
    /// bytes 4j.. times values 4j.., plus their high nibbles times values
    /// 16+4j..), so the activation halves are broadcast once per block and
    /// token for all four rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_avx2<const T: usize>(
        w: &[u8],
        nb: usize,
        x: &[Q8Block],
        stride: usize,
        out: &mut [[f32; 4]; MAX_T],
    ) {
        let mask = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let i01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
        let i23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
        let mut acc = [[_mm256_setzero_ps(); 2]; T];
        let mut min = [_mm_setzero_ps(); T];
        for b in 0..nb {
            // SAFETY: block b of the group is in `w` (checked by `tile`):
            // 8 bytes of scales, 8 of minimums, 64 of nibbles.
            let (d, m, raw) = unsafe {
                let g = w.as_ptr().add(b * 80);
                prefetch(g);
                (
                    _mm_cvtph_ps(_mm_loadl_epi64(g as *const __m128i)),
                    _mm_cvtph_ps(_mm_loadl_epi64(g.add(8) as *const __m128i)),
                    [
                        _mm256_loadu_si256(g.add(16) as *const __m256i),
                        _mm256_loadu_si256(g.add(48) as *const __m256i),
                    ],
                )
            };
            let d = _mm256_castps128_ps256(d);
            let dz = [
                _mm256_permutevar8x32_ps(d, i01),
                _mm256_permutevar8x32_ps(d, i23),
            ];
            let lo = raw.map(|v| _mm256_and_si256(v, mask));
            let hi = raw.map(|v| _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask));
            for t in 0..T {
                let xb = &x[t * stride + b];
                // SAFETY: 32 bytes of values in the block.
                let (xa, xh) = unsafe {
                    (
                        _mm256_broadcastsi128_si256(_mm_loadu_si128(
                            xb.q.as_ptr() as *const __m128i
                        )),
                        _mm256_broadcastsi128_si256(_mm_loadu_si128(
                            xb.q.as_ptr().add(16) as *const __m128i
                        )),
                    )
                };
                let xd = _mm256_set1_ps(xb.d);
                for h in 0..2 {
                    let p = _mm256_add_epi32(
                        _mm256_madd_epi16(_mm256_maddubs_epi16(lo[h], xa), ones),
                        _mm256_madd_epi16(_mm256_maddubs_epi16(hi[h], xh), ones),
                    );
                    let s = _mm256_mul_ps(dz[h], xd);
                    acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[t][h]);
                }
                min[t] = _mm_fmadd_ps(m, _mm_set1_ps(xb.s), min[t]);
            }
        }
        for t in 0..T {
            let mut mins = [0f32; 4];
            // SAFETY: four floats into four.
            unsafe { _mm_storeu_ps(mins.as_mut_ptr(), min[t]) };
            for h in 0..2 {
                let a = acc[t][h];
                out[t][2 * h] = hsum4(_mm256_castps256_ps128(a)) + mins[2 * h];
                out[t][2 * h + 1] = hsum4(_mm256_extractf128_ps::<1>(a)) + mins[2 * h + 1];
            }
        }
    }

    /// Q8_0 on AVX-512 VNNI: two rows per 512-bit register (a 256-bit
    /// half per row, eight i32 lanes each as in the AVX2 kernel), the sign
    /// trick through a mask (there is no 512-bit `vpsignb`).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
    unsafe fn q8_512<const T: usize>(
        w: &[u8],
        nb: usize,
        x: &[Q8Block],
        stride: usize,
        out: &mut [[f32; 4]; MAX_T],
    ) {
        let i01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        let i23 = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        let zero = _mm512_setzero_si512();
        let mut acc = [[_mm512_setzero_ps(); 2]; T];
        for b in 0..nb {
            // SAFETY: block b of the group is in `w` (checked by `tile`):
            // 8 bytes of scales, then 4 x 32 bytes of values.
            let (d, raw) = unsafe {
                let g = w.as_ptr().add(b * 136);
                prefetch(g);
                (
                    _mm_cvtph_ps(_mm_loadl_epi64(g as *const __m128i)),
                    [
                        _mm512_loadu_si512(g.add(8) as *const __m512i),
                        _mm512_loadu_si512(g.add(72) as *const __m512i),
                    ],
                )
            };
            let d = _mm512_castps128_ps512(d);
            let dz = [_mm512_permutexvar_ps(i01, d), _mm512_permutexvar_ps(i23, d)];
            let neg = raw.map(|v| _mm512_movepi8_mask(v));
            let aw = raw.map(|v| _mm512_abs_epi8(v));
            for t in 0..T {
                let xb = &x[t * stride + b];
                // SAFETY: 32 bytes of values in the block.
                let xq = _mm512_broadcast_i64x4(unsafe {
                    _mm256_loadu_si256(xb.q.as_ptr() as *const __m256i)
                });
                let xd = _mm512_set1_ps(xb.d);
                for h in 0..2 {
                    let sx = _mm512_mask_sub_epi8(xq, neg[h], zero, xq);
                    let p = _mm512_dpbusd_epi32(zero, aw[h], sx);
                    let s = _mm512_mul_ps(dz[h], xd);
                    acc[t][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, acc[t][h]);
                }
            }
        }
        for t in 0..T {
            for h in 0..2 {
                let a = acc[t][h];
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
                out[t][2 * h] = hsum(_mm512_castps512_ps256(a));
                out[t][2 * h + 1] = hsum(hi);
            }
        }
    }

    /// Q4_1 on AVX-512 VNNI: all four rows in one 512-bit register (a
    /// 128-bit lane per row, laid out as in `q4_avx2`), `vpdpbusd` for the
    /// byte products.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
    unsafe fn q4_512<const T: usize>(
        w: &[u8],
        nb: usize,
        x: &[Q8Block],
        stride: usize,
        out: &mut [[f32; 4]; MAX_T],
    ) {
        let mask = _mm512_set1_epi8(0x0f);
        let idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        let mut acc = [_mm512_setzero_ps(); T];
        let mut min = [_mm_setzero_ps(); T];
        for b in 0..nb {
            // SAFETY: as in `q4_avx2`.
            let (d, m, raw) = unsafe {
                let g = w.as_ptr().add(b * 80);
                prefetch(g);
                (
                    _mm_cvtph_ps(_mm_loadl_epi64(g as *const __m128i)),
                    _mm_cvtph_ps(_mm_loadl_epi64(g.add(8) as *const __m128i)),
                    _mm512_loadu_si512(g.add(16) as *const __m512i),
                )
            };
            let dz = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(d));
            let lo = _mm512_and_si512(raw, mask);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask);
            for t in 0..T {
                let xb = &x[t * stride + b];
                // SAFETY: 32 bytes of values in the block.
                let (xa, xh) = unsafe {
                    (
                        _mm512_broadcast_i32x4(_mm_loadu_si128(xb.q.as_ptr() as *const __m128i)),
                        _mm512_broadcast_i32x4(_mm_loadu_si128(
                            xb.q.as_ptr().add(16) as *const __m128i
                        )),
                    )
                };
                let p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xa);
                let p = _mm512_dpbusd_epi32(p, hi, xh);
                let s = _mm512_mul_ps(dz, _mm512_set1_ps(xb.d));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, acc[t]);
                min[t] = _mm_fmadd_ps(m, _mm_set1_ps(xb.s), min[t]);
            }
        }
        for t in 0..T {
            let mut mins = [0f32; 4];
            // SAFETY: four floats into four.
            unsafe { _mm_storeu_ps(mins.as_mut_ptr(), min[t]) };
            let a = acc[t];
            out[t][0] = hsum4(_mm512_extractf32x4_ps::<0>(a)) + mins[0];
            out[t][1] = hsum4(_mm512_extractf32x4_ps::<1>(a)) + mins[1];
            out[t][2] = hsum4(_mm512_extractf32x4_ps::<2>(a)) + mins[2];
            out[t][3] = hsum4(_mm512_extractf32x4_ps::<3>(a)) + mins[3];
        }
    }
}

/// Quantize 32 values to a [`Q8Block`] (round to nearest even, scale by
/// the largest magnitude), with the AVX2 version where the CPU has it
/// (the same result bit for bit).
pub fn quantize_block(isa: Isa, v: &[f32], out: &mut Q8Block) {
    assert!(v.len() >= 32, "short block");
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512Vnni => {
            // SAFETY: the CPU has AVX2 (`Isa::detect`); 32 floats checked.
            unsafe { x86::quantize(v, out) }
        }
        _ => quantize_scalar(v, out),
    }
}

fn quantize_scalar(v: &[f32], out: &mut Q8Block) {
    let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (q, x) in out.q.iter_mut().zip(v) {
        // Ties to even: one vector instruction (round-half-away is not).
        let r = (x * id).round_ties_even() as i32;
        *q = r as i8;
        sum += r;
    }
    out.d = d;
    out.s = d * sum as f32;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A random-ish Q4_1 / Q8_0 group of `nb` blocks and its dequantized
    /// rows.
    fn group(fmt: Format, nb: usize, seed: u32) -> (Vec<u8>, Vec<Vec<f32>>) {
        let mut s = seed;
        let mut next = || {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (s >> 8) as u8
        };
        let gb = fmt.group_bytes();
        let mut w = vec![0u8; nb * gb];
        let mut rows = vec![vec![0f32; nb * 32]; 4];
        for b in 0..nb {
            let g = &mut w[b * gb..(b + 1) * gb];
            for r in 0..4 {
                let d = half::f16::from_f32(0.01 + (next() as f32) / 4000.0);
                g[2 * r..2 * r + 2].copy_from_slice(&d.to_le_bytes());
                match fmt {
                    Format::Q4_1 => {
                        let m = half::f16::from_f32(-(next() as f32) / 300.0);
                        g[8 + 2 * r..10 + 2 * r].copy_from_slice(&m.to_le_bytes());
                        for j in 0..16 {
                            let q = next();
                            g[16 + 16 * r + j] = q;
                            rows[r][b * 32 + j] = d.to_f32() * (q & 15) as f32 + m.to_f32();
                            rows[r][b * 32 + j + 16] = d.to_f32() * (q >> 4) as f32 + m.to_f32();
                        }
                    }
                    Format::Q8_0 => {
                        for j in 0..32 {
                            let q = (next() as i8).max(-127);
                            g[8 + 32 * r + j] = q as u8;
                            rows[r][b * 32 + j] = d.to_f32() * q as f32;
                        }
                    }
                }
            }
        }
        (w, rows)
    }

    fn acts(n: usize, nb: usize) -> (Vec<Q8Block>, Vec<Vec<f32>>) {
        let mut blocks = vec![Q8Block::default(); n * nb];
        let mut vals = Vec::new();
        for t in 0..n {
            let v: Vec<f32> = (0..nb * 32)
                .map(|i| (((i * 31 + t * 17) % 61) as f32 - 30.0) / 11.0)
                .collect();
            for b in 0..nb {
                quantize_block(
                    Isa::Scalar,
                    &v[b * 32..(b + 1) * 32],
                    &mut blocks[t * nb + b],
                );
            }
            // What the kernel sees: the quantized values.
            let deq: Vec<f32> = (0..nb * 32)
                .map(|i| {
                    let b = &blocks[t * nb + i / 32];
                    b.d * b.q[i % 32] as f32
                })
                .collect();
            vals.push(deq);
        }
        (blocks, vals)
    }

    #[test]
    fn kernels_match_the_dequantized_product_and_each_other_bit_for_bit() {
        for fmt in [Format::Q4_1, Format::Q8_0] {
            let nb = 9;
            let (w, rows) = group(fmt, nb, 7);
            let (x, xv) = acts(MAX_T, nb);
            let mut all = [[0f32; 4]; MAX_T];
            tile(Isa::Scalar, fmt, &w, nb, &x, nb, MAX_T, &mut all);
            for isa in Isa::available() {
                for tokens in 1..=MAX_T {
                    // Every offset in the tile: a token's result must not
                    // depend on the tile's width or its place in it.
                    for t0 in 0..=(MAX_T - tokens) {
                        let mut out = [[0f32; 4]; MAX_T];
                        tile(isa, fmt, &w, nb, &x[t0 * nb..], nb, tokens, &mut out);
                        for t in 0..tokens {
                            assert_eq!(out[t], all[t0 + t], "{fmt:?} {isa:?} {tokens} {t0}");
                            for r in 0..4 {
                                let exact: f32 =
                                    rows[r].iter().zip(&xv[t0 + t]).map(|(a, b)| a * b).sum();
                                let got = out[t][r];
                                assert!(
                                    (got - exact).abs() <= 1e-3 * (1.0 + exact.abs()),
                                    "{fmt:?} {isa:?}: {got} vs {exact}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn quantized_blocks_carry_their_scaled_sums() {
        let v: Vec<f32> = (0..32).map(|i| i as f32 - 10.5).collect();
        let mut b = Q8Block::default();
        quantize_block(Isa::Scalar, &v, &mut b);
        for isa in Isa::available() {
            let mut o = Q8Block::default();
            quantize_block(isa, &v, &mut o);
            assert_eq!(o, b, "{isa:?}");
            let w: Vec<f32> = (0..32)
                .map(|i| ((i * 37) % 19) as f32 * 0.37 - 3.3)
                .collect();
            let (mut p, mut q) = (Q8Block::default(), Q8Block::default());
            quantize_block(Isa::Scalar, &w, &mut p);
            quantize_block(isa, &w, &mut q);
            assert_eq!(p, q, "{isa:?}");
        }
        let sum: i32 = b.q.iter().map(|q| *q as i32).sum();
        assert_eq!(b.s, b.d * sum as f32);
        assert_eq!(b.q.iter().map(|q| q.unsigned_abs()).max(), Some(127));
        let zero = [0f32; 32];
        quantize_block(Isa::Scalar, &zero, &mut b);
        assert_eq!((b.d, b.s), (0.0, 0.0));
    }
}
