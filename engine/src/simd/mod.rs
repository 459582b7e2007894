//! The integer dot-product kernels, picked at run time for the CPU.
//!
//! Weights stay in the GGUF file's block formats and sizes, repacked at
//! load into panels of 16 rows (`backend::cpu::weights::QMat`). Per 32-column block a
//! panel holds the 16 rows' f16 scales (and Q4_1 minimums), then the
//! values laid out so that one 512-bit register holds the same four bytes
//! of all 16 rows (`v[j][n]`: bytes 4j..4j+4 of row n): Q4_1 keeps its
//! packed nibbles (low nibbles are values 4j.., high ones 16+4j..), 320
//! bytes for 16 x 32 weights (the file's 20 per 32); Q8_0 stores each
//! value plus 128 as an unsigned byte, 544 bytes (the file's 34 per 32).
//! Activations are quantized per 32 values to 8 bits with their scale,
//! scaled sum and integer sum ([`Q8Block`], llama.cpp's Q8_1).
//!
//! With that layout a `vpdpbusd` of a value register and a broadcast of
//! four activation bytes adds four products into each of 16 row lanes, so
//! a block's sums are exact integers per row with no horizontal step, and
//! the float steps ([`reference`]) run on 16 rows per instruction. AMX
//! tiles take the same layout (`backend::cpu::amx`). Every kernel follows
//! [`reference`] bit for bit, whatever the tile's width, so a token's
//! result does not depend on what it was batched with nor on which of
//! these kernels ran (the batching-invariance test and the tests below).
//!
//! `unsafe` here is the SIMD entry points: each runs only after
//! [`Isa::detect`] found the features it is compiled for, and reads only
//! inside the slices it was given (lengths checked by the safe wrappers).

#![allow(unsafe_code)]

pub mod ops;

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
    /// sum(q) (what a value stored plus 128 needs taken back).
    pub n: i32,
}

/// A function compiled twice, for any x86-64 and for AVX2 + FMA + F16C,
/// the second called where [`Isa::current`] found them (plain, type- or
/// const-generic functions). For plain loops
/// the compiler vectorizes: the release binary targets baseline x86-64
/// (so that it runs anywhere) and these still get 256-bit code.
macro_rules! multiversion {
    (@emit [$($gd:tt)*] [$($gc:tt)*] $(#[$m:meta])* $vis:vis fn $name:ident($($a:ident: $t:ty),* $(,)?) $(-> $r:ty)? $body:block) => {
        $(#[$m])*
        #[allow(unsafe_code)]
        $vis fn $name<$($gd)*>($($a: $t),*) $(-> $r)? {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn body<$($gd)*>($($a: $t),*) $(-> $r)? $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma,f16c")]
            #[allow(clippy::too_many_arguments)]
            fn avx2<$($gd)*>($($a: $t),*) $(-> $r)? {
                body::<$($gc)*>($($a),*)
            }
            #[cfg(target_arch = "x86_64")]
            if $crate::simd::Isa::current() != $crate::simd::Isa::Scalar {
                // SAFETY: the CPU has AVX2, FMA and F16C (`Isa::current`).
                return unsafe { avx2::<$($gc)*>($($a),*) };
            }
            body::<$($gc)*>($($a),*)
        }
    };
    ($(#[$m:meta])* $vis:vis fn $name:ident<$($g:ident: $gb:path),+> $($rest:tt)*) => {
        $crate::simd::multiversion!(@emit [$($g: $gb),+] [$($g),+] $(#[$m])* $vis fn $name $($rest)*);
    };
    ($(#[$m:meta])* $vis:vis fn $name:ident<$(const $c:ident: $ct:ty),+> $($rest:tt)*) => {
        $crate::simd::multiversion!(@emit [$(const $c: $ct),+] [$($c),+] $(#[$m])* $vis fn $name $($rest)*);
    };
    ($(#[$m:meta])* $vis:vis fn $name:ident $($rest:tt)*) => {
        $crate::simd::multiversion!(@emit [] [] $(#[$m])* $vis fn $name $($rest)*);
    };
}
pub(crate) use multiversion;

/// `f32` to `bf16`, rounding to nearest even (the rounding of
/// `vcvtneps2bf16`), for the activations.
#[inline(always)]
pub fn bf16(v: f32) -> u16 {
    let b = v.to_bits();
    (b.wrapping_add(0x7fff + (b >> 16 & 1)) >> 16) as u16
}

/// Rows per weight panel.
pub const PANEL: usize = 16;
/// Bytes of one Q4_1 panel block (16 rows x 32 values).
pub const Q4_1_PANEL: usize = 320;
/// Bytes of one Q8_0 panel block.
pub const Q8_0_PANEL: usize = 544;
/// Tokens per tile at most.
pub const MAX_T: usize = 8;

/// Weight block formats the kernels take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// GGML Q4_1: 4-bit values with a scale and a minimum per 32.
    Q4_1,
    /// GGML Q8_0: 8-bit values with a scale per 32.
    Q8_0,
    /// Q8_0 blocks whose values all lie in -16..=15 (what a Q5_0 file
    /// becomes, `transcode`): the Q8_0 panel stored plus 16 instead of
    /// 128, so AVX2 multiplies the unsigned values directly and adds four
    /// products in 16 bits (4 x 2 x 31 x 127 fits), without the sign
    /// trick Q8_0's full range needs.
    Q5,
}

impl Format {
    /// Bytes of one panel block.
    pub fn panel_bytes(self) -> usize {
        match self {
            Format::Q4_1 => Q4_1_PANEL,
            Format::Q8_0 | Format::Q5 => Q8_0_PANEL,
        }
    }

    /// Where a panel block's values start (after scales and minimums).
    pub fn values_at(self) -> usize {
        match self {
            Format::Q4_1 => 64,
            Format::Q8_0 | Format::Q5 => 32,
        }
    }

    /// What a stored value has added to it (8-bit formats).
    pub fn bias(self) -> i32 {
        match self {
            Format::Q5 => 16,
            _ => 128,
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

/// `out[t][r]` = row `r` of the panel `w` (`nb` panel blocks) times
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
    out: &mut [[f32; PANEL]; MAX_T],
) {
    assert!((1..=MAX_T).contains(&tokens), "tile of {tokens} tokens");
    assert!(w.len() >= nb * fmt.panel_bytes(), "short weight panel");
    assert!(
        stride >= nb && x.len() >= (tokens - 1) * stride + nb,
        "short activations"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512Vnni => {
            // SAFETY: `Isa::detect` found AVX2, FMA and F16C (and the
            // AVX-512 set for the VNNI variant); bounds checked above.
            unsafe { x86::tile(isa, fmt, w, nb, x, stride, tokens, out) }
        }
        _ => {
            for (t, o) in out.iter_mut().enumerate().take(tokens) {
                for (r, v) in o.iter_mut().enumerate() {
                    *v = reference(fmt, w, nb, &x[t * stride..], r);
                }
            }
        }
    }
}

fn f16(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32()
}

/// The semantics every kernel here (and `amx`) follows, for row `r` of the
/// panel `w` and the token whose blocks are `x[..nb]`: per block the exact
/// integer sum of the 32 products, then `acc = fma(sum, d_w * d_x, acc)`
/// and, for Q4_1, `acc = fma(m_w, s_x, acc)`, in block order.
pub fn reference(fmt: Format, w: &[u8], nb: usize, x: &[Q8Block], r: usize) -> f32 {
    let pb = fmt.panel_bytes();
    let mut acc = 0f32;
    for (b, xb) in x.iter().enumerate().take(nb) {
        let g = &w[b * pb..(b + 1) * pb];
        let v = &g[fmt.values_at()..];
        let mut sum = 0i32;
        for k in 0..32 {
            let q = match fmt {
                // Value k: byte k % 16 of the row's 16, high nibble from 16.
                Format::Q4_1 => {
                    let byte = v[64 * (k % 16 / 4) + 4 * r + k % 4];
                    (if k < 16 { byte & 0x0f } else { byte >> 4 }) as i32
                }
                Format::Q8_0 | Format::Q5 => v[64 * (k / 4) + 4 * r + k % 4] as i32 - fmt.bias(),
            };
            sum += q * xb.q[k] as i32;
        }
        acc = (sum as f32).mul_add(f16(g, r) * xb.d, acc);
        if fmt == Format::Q4_1 {
            acc = f16(g, PANEL + r).mul_add(xb.s, acc);
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Format, Isa, Q8Block, MAX_T, PANEL};
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
        out: &mut [[f32; PANEL]; MAX_T],
    ) {
        macro_rules! widths {
            ($k:ident, $($f:tt)*) => {
                match tokens {
                    8 => $k::<8, $($f)*>(w, nb, x, stride, out),
                    7 => $k::<7, $($f)*>(w, nb, x, stride, out),
                    6 => $k::<6, $($f)*>(w, nb, x, stride, out),
                    5 => $k::<5, $($f)*>(w, nb, x, stride, out),
                    4 => $k::<4, $($f)*>(w, nb, x, stride, out),
                    3 => $k::<3, $($f)*>(w, nb, x, stride, out),
                    2 => $k::<2, $($f)*>(w, nb, x, stride, out),
                    _ => $k::<1, $($f)*>(w, nb, x, stride, out),
                }
            };
        }
        // SAFETY (all arms): the caller checked the CPU features and that
        // `w` and `x` hold what the kernel reads.
        unsafe {
            match (isa, fmt) {
                (Isa::Avx512Vnni, Format::Q4_1) => widths!(k512, true, 0),
                (Isa::Avx512Vnni, Format::Q8_0) => widths!(k512, false, 128),
                (Isa::Avx512Vnni, Format::Q5) => widths!(k512, false, 16),
                (_, Format::Q4_1) => widths!(kavx2, K_Q4_1),
                (_, Format::Q8_0) => widths!(kavx2, K_Q8_0),
                (_, Format::Q5) => widths!(kavx2, K_Q5),
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
        out.n = total;
    }

    /// Bytes ahead of the block in use that the kernels ask the memory for:
    /// decode is one pass over every weight, and the hardware prefetcher
    /// alone left a single thread at 8 of its 12.5 GB/s.
    const AHEAD: usize = 1024;

    /// Prefetch the panel block `AHEAD` bytes past `g` (`len` bytes). The
    /// address may lie past the weights: a prefetch never faults.
    #[inline(always)]
    fn prefetch(g: *const u8, len: usize) {
        super::prefetch_lines(g.wrapping_add(AHEAD), len);
    }

    /// AVX-512 VNNI: per block, the value registers (`v[j]`: bytes 4j..
    /// of the 16 rows) times a broadcast of the token's matching four
    /// activation bytes, chained with `vpdpbusd` into the 16 rows' exact
    /// sums; then the float steps on 16 rows at once.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
    unsafe fn k512<const T: usize, const Q4: bool, const BIAS: i32>(
        w: &[u8],
        nb: usize,
        x: &[Q8Block],
        stride: usize,
        out: &mut [[f32; PANEL]; MAX_T],
    ) {
        let pb = if Q4 {
            super::Q4_1_PANEL
        } else {
            super::Q8_0_PANEL
        };
        let mask = _mm512_set1_epi8(0x0f);
        let zero = _mm512_setzero_si512();
        let mut acc = [_mm512_setzero_ps(); T];
        for b in 0..nb {
            // SAFETY: panel block b is in `w` (checked by `tile`).
            let g = unsafe { w.as_ptr().add(b * pb) };
            prefetch(g, pb);
            // SAFETY: scales (and Q4_1 minimums) lead the block.
            let (dw, mw) = unsafe {
                (
                    _mm512_cvtph_ps(_mm256_loadu_si256(g as *const __m256i)),
                    _mm512_cvtph_ps(_mm256_loadu_si256(g.add(32) as *const __m256i)),
                )
            };
            // Q4_1: low nibbles pair with activation bytes 4j.., high ones
            // with 16+4j..; Q8_0: register j with bytes 4j.. (j < 8).
            let mut v = [zero; 8];
            for j in 0..4 {
                if Q4 {
                    // SAFETY: 4 x 64 bytes of nibbles at 64.
                    let raw = unsafe { _mm512_loadu_si512(g.add(64 + 64 * j) as *const __m512i) };
                    v[j] = _mm512_and_si512(raw, mask);
                    v[4 + j] = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask);
                } else {
                    // SAFETY: 8 x 64 bytes of values at 32.
                    unsafe {
                        v[j] = _mm512_loadu_si512(g.add(32 + 64 * j) as *const __m512i);
                        v[4 + j] = _mm512_loadu_si512(g.add(32 + 64 * (4 + j)) as *const __m512i);
                    }
                }
            }
            for (t, a) in acc.iter_mut().enumerate() {
                let xb = &x[t * stride + b];
                // SAFETY: four of the block's 32 bytes (j < 8).
                let xq = |j: usize| unsafe {
                    _mm512_set1_epi32((xb.q.as_ptr().add(4 * j) as *const i32).read_unaligned())
                };
                // Two chains of four, for latency; register j (and 4 + j)
                // pairs with activation bytes 4j.. (16 + 4j..) either way.
                let mut s0 = zero;
                let mut s1 = zero;
                for j in 0..4 {
                    s0 = _mm512_dpbusd_epi32(s0, v[j], xq(j));
                    s1 = _mm512_dpbusd_epi32(s1, v[4 + j], xq(4 + j));
                }
                let mut sum = _mm512_add_epi32(s0, s1);
                if !Q4 {
                    sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(BIAS * xb.n));
                }
                let d = _mm512_mul_ps(dw, _mm512_set1_ps(xb.d));
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), d, *a);
                if Q4 {
                    *a = _mm512_fmadd_ps(mw, _mm512_set1_ps(xb.s), *a);
                }
            }
        }
        for (o, a) in out.iter_mut().zip(acc) {
            // SAFETY: 16 floats into 16.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr(), a) };
        }
    }

    /// `kavx2`'s `KIND`s (a const parameter cannot be the `Format` enum).
    const K_Q8_0: u8 = 0;
    const K_Q4_1: u8 = 1;
    const K_Q5: u8 = 2;

    /// AVX2: the same layout as `k512`, each 64-byte value row as two
    /// registers of eight rows; `vpmaddubsw` then `vpmaddwd` for the byte
    /// products. `K_Q4_1` and `K_Q5`: unsigned values straight into
    /// `vpmaddubsw`, products added as i16 first (`K_Q5`: four, at most
    /// 4 x 2 x 31 x 127; `K_Q4_1`: all eight, at most 8 x 2 x 15 x 127),
    /// the half block's values unpacked once for all `T` tokens;
    /// `K_Q8_0`: signed values through the sign trick, each `vpmaddwd` on
    /// its own (2 x 128 x 127 fits i16 once), the weights' side of the
    /// trick made once per four registers for all `T` tokens.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn kavx2<const T: usize, const KIND: u8>(
        w: &[u8],
        nb: usize,
        x: &[Q8Block],
        stride: usize,
        out: &mut [[f32; PANEL]; MAX_T],
    ) {
        let fmt = match KIND {
            K_Q4_1 => Format::Q4_1,
            K_Q5 => Format::Q5,
            _ => Format::Q8_0,
        };
        let pb = fmt.panel_bytes();
        let mask = _mm256_set1_epi8(0x0f);
        let flip = _mm256_set1_epi8(-128);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); 2]; T];
        for b in 0..nb {
            // SAFETY: panel block b is in `w` (checked by `tile`).
            let g = unsafe { w.as_ptr().add(b * pb) };
            prefetch(g, pb);
            for h in 0..2 {
                // SAFETY: scales, minimums and values of rows 8h..8h+8.
                let (dw, mw) = unsafe {
                    (
                        _mm256_cvtph_ps(_mm_loadu_si128(g.add(16 * h) as *const __m128i)),
                        _mm256_cvtph_ps(_mm_loadu_si128(g.add(32 + 16 * h) as *const __m128i)),
                    )
                };
                let vals = |j: usize| {
                    // SAFETY: row j's 32 bytes of this half.
                    unsafe {
                        _mm256_loadu_si256(
                            g.add(fmt.values_at() + 64 * j + 32 * h) as *const __m256i
                        )
                    }
                };
                // Unsigned values paired with activation bytes 4j.. (j < 8).
                let mut u = [_mm256_setzero_si256(); 8];
                if KIND == K_Q4_1 {
                    for j in 0..4 {
                        let raw = vals(j);
                        u[j] = _mm256_and_si256(raw, mask);
                        u[4 + j] = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask);
                    }
                } else if KIND == K_Q5 {
                    for (j, v) in u.iter_mut().enumerate() {
                        *v = vals(j);
                    }
                }
                // Q8_0: the tile's exact sums in two passes of four value
                // registers, each pass's magnitudes and signs made once
                // for all tokens (eight registers; all eight would spill).
                let mut q8 = [_mm256_setzero_si256(); T];
                if KIND == K_Q8_0 {
                    for pass in 0..2 {
                        let mut sw = [_mm256_setzero_si256(); 4];
                        let mut aw = [_mm256_setzero_si256(); 4];
                        for j in 0..4 {
                            sw[j] = _mm256_xor_si256(vals(4 * pass + j), flip);
                            aw[j] = _mm256_sign_epi8(sw[j], sw[j]);
                        }
                        for (t, p) in q8.iter_mut().enumerate() {
                            let xq = x[t * stride + b].q.as_ptr();
                            for j in 0..4 {
                                // SAFETY: four of the block's 32 bytes.
                                let xj = unsafe {
                                    _mm256_set1_epi32(
                                        (xq.add(4 * (4 * pass + j)) as *const i32).read_unaligned(),
                                    )
                                };
                                let sx = _mm256_sign_epi8(xj, sw[j]);
                                *p = _mm256_add_epi32(
                                    *p,
                                    _mm256_madd_epi16(_mm256_maddubs_epi16(aw[j], sx), ones),
                                );
                            }
                        }
                    }
                }
                for (t, a) in acc.iter_mut().enumerate() {
                    let xb = &x[t * stride + b];
                    // SAFETY: four of the block's 32 bytes (j < 8).
                    let xq = |j: usize| unsafe {
                        _mm256_set1_epi32((xb.q.as_ptr().add(4 * j) as *const i32).read_unaligned())
                    };
                    let sum = if KIND != K_Q8_0 {
                        // `n` registers' pair sums from j0 added in i16,
                        // then widened once: Q4_1's values (at most 15) let
                        // all eight add (8 x 2 x 15 x 127 = 30480), Q5's
                        // four (4 x 2 x 31 x 127).
                        let run = |j0: usize, n: usize| {
                            let mut p = _mm256_maddubs_epi16(u[j0], xq(j0));
                            for (j, v) in u.iter().enumerate().skip(j0 + 1).take(n - 1) {
                                p = _mm256_add_epi16(p, _mm256_maddubs_epi16(*v, xq(j)));
                            }
                            _mm256_madd_epi16(p, ones)
                        };
                        let sum = if KIND == K_Q4_1 {
                            run(0, 8)
                        } else {
                            _mm256_add_epi32(run(0, 4), run(4, 4))
                        };
                        if KIND == K_Q5 {
                            _mm256_sub_epi32(sum, _mm256_set1_epi32(16 * xb.n))
                        } else {
                            sum
                        }
                    } else {
                        q8[t]
                    };
                    let d = _mm256_mul_ps(dw, _mm256_set1_ps(xb.d));
                    a[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), d, a[h]);
                    if KIND == K_Q4_1 {
                        a[h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xb.s), a[h]);
                    }
                }
            }
        }
        for (o, a) in out.iter_mut().zip(acc) {
            // SAFETY: 8 + 8 floats into 16.
            unsafe {
                _mm256_storeu_ps(o.as_mut_ptr(), a[0]);
                _mm256_storeu_ps(o.as_mut_ptr().add(8), a[1]);
            }
        }
    }
}

/// Ask the memory for the cache lines of the `len` bytes at `p` (a hint:
/// no effect on results). The address may lie outside any allocation: a
/// prefetch never faults, and the pointers are only formed with wrapping
/// arithmetic.
#[inline(always)]
pub fn prefetch_lines(p: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for off in (0..len).step_by(64) {
        // SAFETY: prefetching has no architectural effect and cannot fault,
        // whatever the address.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                p.wrapping_add(off) as *const i8,
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, len);
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
    out.n = sum;
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A random-ish Q4_1 / Q8_0 panel of `nb` blocks and its dequantized
    /// rows.
    pub(crate) fn panel(fmt: Format, nb: usize, seed: u32) -> (Vec<u8>, Vec<Vec<f32>>) {
        let mut s = seed;
        let mut next = || {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (s >> 8) as u8
        };
        let pb = fmt.panel_bytes();
        let mut w = vec![0u8; nb * pb];
        let mut rows = vec![vec![0f32; nb * 32]; PANEL];
        for b in 0..nb {
            let g = &mut w[b * pb..(b + 1) * pb];
            for r in 0..PANEL {
                let d = half::f16::from_f32(0.01 + (next() as f32) / 4000.0);
                g[2 * r..2 * r + 2].copy_from_slice(&d.to_le_bytes());
                let v = fmt.values_at();
                match fmt {
                    Format::Q4_1 => {
                        let m = half::f16::from_f32(-(next() as f32) / 300.0);
                        g[32 + 2 * r..34 + 2 * r].copy_from_slice(&m.to_le_bytes());
                        for j in 0..16 {
                            let q = next();
                            g[v + 64 * (j / 4) + 4 * r + j % 4] = q;
                            rows[r][b * 32 + j] = ((q & 15) as f32).mul_add(d.to_f32(), m.to_f32());
                            rows[r][b * 32 + j + 16] =
                                ((q >> 4) as f32).mul_add(d.to_f32(), m.to_f32());
                        }
                    }
                    Format::Q8_0 | Format::Q5 => {
                        for j in 0..32 {
                            let q = if fmt == Format::Q5 {
                                (next() % 32) as i8 - 16
                            } else {
                                (next() as i8).max(-127)
                            };
                            g[v + 64 * (j / 4) + 4 * r + j % 4] = (q as i32 + fmt.bias()) as u8;
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
    fn kernels_match_the_reference_the_dequantized_product_and_each_other_bit_for_bit() {
        for fmt in [Format::Q4_1, Format::Q8_0, Format::Q5] {
            let nb = 9;
            let (w, rows) = panel(fmt, nb, 7);
            let (x, xv) = acts(MAX_T, nb);
            let mut all = [[0f32; PANEL]; MAX_T];
            tile(Isa::Scalar, fmt, &w, nb, &x, nb, MAX_T, &mut all);
            for isa in Isa::available() {
                for tokens in 1..=MAX_T {
                    // Every offset in the tile: a token's result must not
                    // depend on the tile's width or its place in it.
                    for t0 in 0..=(MAX_T - tokens) {
                        let mut out = [[0f32; PANEL]; MAX_T];
                        tile(isa, fmt, &w, nb, &x[t0 * nb..], nb, tokens, &mut out);
                        for t in 0..tokens {
                            assert_eq!(out[t], all[t0 + t], "{fmt:?} {isa:?} {tokens} {t0}");
                            for r in 0..PANEL {
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
