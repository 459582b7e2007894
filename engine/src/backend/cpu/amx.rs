//! Matrix products on Intel AMX tiles (`tdpbsud` / `tdpbssd`), where the
//! CPU and the kernel allow them.
//!
//! Per 32-value block a weight panel (16 rows, `simd`'s layout) is
//! unpacked once into the tile AMX multiplies (`B`: 8 rows of 16 x 4
//! bytes, which is `simd`'s value layout with nibbles spread to bytes)
//! and multiplied with 16 tokens' quantized activations (`A`: a token's
//! block is 32 contiguous bytes of its [`Q8Block`], so the tile loads
//! straight from the activation buffer) into exact 32-bit block sums
//! (`C`). The float steps then follow `simd::reference`, so these
//! products equal `simd`'s kernels bit for bit: the runner takes AMX for
//! every 16 tokens of a step and `simd` for the rest, and a token's
//! result still does not depend on what it was batched with.
//!
//! `unsafe` here is the tile instructions (inline assembly, after
//! [`supported`] found AMX and the kernel granted the tile state), the
//! AVX-512 unpacking and the raw tile loads and stores, which stay inside
//! the slices the safe entry point checked.

#![allow(unsafe_code)]

use super::simd::{Format, Q8Block, PANEL};

/// Tokens per tile at most (the tile's M).
pub const TOK: usize = 16;

/// Whether this process runs the AMX kernels: `ULTRAFAST_AMX=1` asked
/// for them and [`supported`] says the CPU and kernel allow them. Opt-in:
/// with `simd`'s 16-row kernels the AMX path is no faster on the machines
/// measured so far (benches/RESULTS.md section 5): the per-block float
/// steps, not the products, bound both.
pub fn available() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("ULTRAFAST_AMX").is_ok_and(|v| v == "1") && supported())
}

/// Whether the CPU and the kernel support the kernels (whatever the
/// environment says); asks the kernel for the tile state once.
pub fn supported() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(probe)
}

#[cfg(target_arch = "x86_64")]
fn probe() -> bool {
    let avx512 = is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("f16c")
        && is_x86_feature_detected!("fma");
    // CPUID leaf 7: EDX bit 24 AMX-TILE, bit 25 AMX-INT8.
    let c = std::arch::x86_64::__cpuid_count(7, 0);
    if !avx512 || c.edx >> 24 & 1 == 0 || c.edx >> 25 & 1 == 0 {
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain system call with integer arguments; the permission
    // it asks for is process-wide and harmless when refused.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn probe() -> bool {
    false
}

/// One thread's unpacked panels and tile results, reused across calls.
#[derive(Default)]
pub struct Scratch {
    /// Per panel and block: the `B` tile (512 bytes).
    b: Vec<u8>,
    /// Per panel and block: the 16 rows' scales, then their minimums.
    scales: Vec<f32>,
    /// Two sets (one being filled, one being read) of a `C` tile per
    /// block (16 x 16 i32).
    c: Vec<i32>,
}

/// 16 tokens' results for one panel: `[token][row]`.
pub type Tile = [[f32; PANEL]; TOK];

/// Panels at most per call (the unpacked weights stay in L2).
pub const MAX_PANELS: usize = 8;

/// For each weight panel `panels[p]` (`nb` panel blocks) and each 16
/// tokens `t0..t0+16` of `x` (token `t`'s blocks at `t * stride`;
/// `tokens` a multiple of 16): `sink(t0, p, tile)` with `tile[t][r]` =
/// row `r` of the panel times token `t0 + t`.
///
/// Panics if the slices are short, `tokens` is not a multiple of 16,
/// there are more than [`MAX_PANELS`] panels, or [`supported`] is false.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    fmt: Format,
    panels: &[&[u8]],
    nb: usize,
    x: &[Q8Block],
    stride: usize,
    tokens: usize,
    s: &mut Scratch,
    sink: &mut dyn FnMut(usize, usize, &Tile),
) {
    assert!(supported(), "AMX kernels without AMX");
    assert!(
        (1..=MAX_PANELS).contains(&panels.len()),
        "1-{MAX_PANELS} panels"
    );
    let pb = fmt.panel_bytes();
    assert!(
        panels.iter().all(|g| g.len() >= nb * pb),
        "short weight panel"
    );
    assert!(
        tokens >= TOK
            && tokens.is_multiple_of(TOK)
            && stride >= nb
            && x.len() >= (tokens - 1) * stride + nb,
        "activations: {tokens} tokens"
    );
    if s.b.len() < panels.len() * nb * 512 {
        s.b.resize(panels.len() * nb * 512, 0);
        s.scales.resize(panels.len() * nb * 2 * PANEL, 0.0);
    }
    if s.c.len() < 2 * nb * TOK * PANEL {
        s.c.resize(2 * nb * TOK * PANEL, 0);
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `supported` found the CPU features and the tile permission;
    // the lengths were checked above.
    unsafe {
        x86::gemm(fmt, panels, nb, x, stride, tokens, s, sink)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("AMX on a non-x86 CPU")
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Format, Q8Block, Scratch, Tile, PANEL, TOK};
    use std::arch::asm;
    use std::arch::x86_64::*;
    use std::cell::Cell;

    thread_local! {
        /// Whether this thread loaded the tile configuration (it is per
        /// thread).
        static CONFIGURED: Cell<bool> = const { Cell::new(false) };
    }

    /// The 64-byte tile configuration (palette 1).
    #[repr(C, align(64))]
    struct Config([u8; 64]);

    /// Tiles 0-1 `A` (16 tokens x 32 bytes), 2-3 `B` (8 x 64 bytes), 4-7
    /// `C` (16 tokens x 16 i32): consecutive blocks use different tiles,
    /// so their loads, products and stores overlap.
    fn config() -> Config {
        let mut c = Config([0; 64]);
        c.0[0] = 1;
        let tiles: [(u16, u8); 8] = [
            (32, 16),
            (32, 16),
            (64, 8),
            (64, 8),
            (64, 16),
            (64, 16),
            (64, 16),
            (64, 16),
        ];
        for (i, (colsb, rows)) in tiles.into_iter().enumerate() {
            c.0[16 + 2 * i..18 + 2 * i].copy_from_slice(&colsb.to_le_bytes());
            c.0[48 + i] = rows;
        }
        c
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn gemm(
        fmt: Format,
        panels: &[&[u8]],
        nb: usize,
        x: &[Q8Block],
        stride: usize,
        tokens: usize,
        s: &mut Scratch,
        sink: &mut dyn FnMut(usize, usize, &Tile),
    ) {
        if !CONFIGURED.get() {
            let cfg = config();
            // SAFETY: a valid palette-1 configuration.
            unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack)) };
            CONFIGURED.set(true);
        }
        let pb = fmt.panel_bytes();
        for (p, w) in panels.iter().enumerate() {
            for b in 0..nb {
                // SAFETY: `gemm` checked every panel's `nb` blocks and
                // sized the scratch for them.
                unsafe {
                    let src = w.as_ptr().add(b * pb);
                    let dst = s.b.as_mut_ptr().add(512 * (p * nb + b));
                    let sc = s.scales.as_mut_ptr().add(2 * PANEL * (p * nb + b));
                    match fmt {
                        Format::Q4_1 => unpack_q4(src, dst, sc),
                        Format::Q8_0 => unpack_q8(src, dst, sc),
                    }
                }
            }
        }
        let panels = panels.len();
        let xs = stride * std::mem::size_of::<Q8Block>();
        let q4 = fmt == Format::Q4_1;
        let (bptr, scp, cptr) = (s.b.as_ptr(), s.scales.as_ptr(), s.c.as_mut_ptr());
        let cset = nb * TOK * PANEL;
        let mut out = [[0f32; PANEL]; TOK];
        for t0 in (0..tokens).step_by(TOK) {
            let xt = &x[t0 * stride..];
            // The products of panel p + 1 are issued between the float
            // steps of panel p, so the tile unit and the vector units work
            // at once; panel p's sums were stored a whole panel earlier.
            // SAFETY (both): 16 token rows of every block are in `xt`
            // (checked by `gemm`), 32 bytes each at `xs` after the block's
            // two floats; the B tiles and both C sets are in the scratch.
            let issue = |p: usize, b: usize| unsafe {
                let a = (xt.as_ptr().add(b) as *const u8).add(8);
                let bt = bptr.add(512 * (p * nb + b));
                let ct = cptr.add((p & 1) * cset + TOK * PANEL * b);
                dot(fmt, b & 3, a, xs, bt, ct as *mut u8);
            };
            for b in 0..nb {
                issue(0, b);
            }
            for p in 0..panels {
                let mut acc = [_mm512_setzero_ps(); TOK];
                for b in 0..nb {
                    if p + 1 < panels {
                        issue(p + 1, b);
                    }
                    // SAFETY: block b's scales and C tile are in the
                    // scratch; token t's block b is in `xt`.
                    unsafe {
                        let sc = scp.add(2 * PANEL * (p * nb + b));
                        let (dw, mw) = (_mm512_loadu_ps(sc), _mm512_loadu_ps(sc.add(PANEL)));
                        let c = cptr.add((p & 1) * cset + TOK * PANEL * b) as *const i32;
                        for (t, a) in acc.iter_mut().enumerate() {
                            let xb = &*xt.as_ptr().add(t * stride + b);
                            let sum = _mm512_loadu_si512(c.add(PANEL * t) as *const __m512i);
                            let d = _mm512_mul_ps(dw, _mm512_set1_ps(xb.d));
                            *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), d, *a);
                            if q4 {
                                *a = _mm512_fmadd_ps(mw, _mm512_set1_ps(xb.s), *a);
                            }
                        }
                    }
                }
                for (o, a) in out.iter_mut().zip(acc) {
                    // SAFETY: 16 floats into 16.
                    unsafe { _mm512_storeu_ps(o.as_mut_ptr(), a) };
                }
                sink(t0, p, &out);
            }
        }
    }

    /// One block's product into the C tile at `c`, on the tiles of slot
    /// `k` (0-3).
    #[inline(always)]
    unsafe fn dot(fmt: Format, k: usize, a: *const u8, xs: usize, b: *const u8, c: *mut u8) {
        macro_rules! go {
            ($op:literal, $a:literal, $b:literal, $c:literal) => {
                // SAFETY: the caller's pointers cover the tiles' rows.
                unsafe {
                    asm!(
                        concat!("tileloadd ", $a, ", [{a} + {xs}*1]"),
                        concat!("tileloadd ", $b, ", [{b} + {s64}*1]"),
                        concat!("tilezero ", $c),
                        concat!($op, " ", $c, ", ", $a, ", ", $b),
                        concat!("tilestored [{c} + {s64}*1], ", $c),
                        a = in(reg) a,
                        xs = in(reg) xs,
                        b = in(reg) b,
                        c = in(reg) c,
                        s64 = in(reg) 64usize,
                        options(nostack)
                    )
                }
            };
        }
        match (fmt, k) {
            (Format::Q4_1, 0) => go!("tdpbsud", "tmm0", "tmm2", "tmm4"),
            (Format::Q4_1, 1) => go!("tdpbsud", "tmm1", "tmm3", "tmm5"),
            (Format::Q4_1, 2) => go!("tdpbsud", "tmm0", "tmm2", "tmm6"),
            (Format::Q4_1, _) => go!("tdpbsud", "tmm1", "tmm3", "tmm7"),
            (Format::Q8_0, 0) => go!("tdpbssd", "tmm0", "tmm2", "tmm4"),
            (Format::Q8_0, 1) => go!("tdpbssd", "tmm1", "tmm3", "tmm5"),
            (Format::Q8_0, 2) => go!("tdpbssd", "tmm0", "tmm2", "tmm6"),
            (Format::Q8_0, _) => go!("tdpbssd", "tmm1", "tmm3", "tmm7"),
        }
    }

    /// One Q4_1 panel block into the B tile (`B[k/4][4n + k%4]` = value
    /// `k` of row `n`, unsigned: `simd`'s nibble rows spread to bytes) and
    /// its scales and minimums as f32.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn unpack_q4(src: *const u8, dst: *mut u8, sc: *mut f32) {
        let mask = _mm512_set1_epi8(0x0f);
        // SAFETY: a Q4_1 panel block is 320 bytes; 512 bytes of tile and
        // 32 floats at the caller's pointers.
        unsafe {
            for j in 0..4 {
                let raw = _mm512_loadu_si512(src.add(64 + 64 * j) as *const __m512i);
                _mm512_storeu_si512(dst.add(64 * j) as *mut __m512i, _mm512_and_si512(raw, mask));
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask);
                _mm512_storeu_si512(dst.add(64 * (j + 4)) as *mut __m512i, hi);
            }
            _mm512_storeu_ps(
                sc,
                _mm512_cvtph_ps(_mm256_loadu_si256(src as *const __m256i)),
            );
            _mm512_storeu_ps(
                sc.add(PANEL),
                _mm512_cvtph_ps(_mm256_loadu_si256(src.add(32) as *const __m256i)),
            );
        }
    }

    /// One Q8_0 panel block into the B tile (signed: the stored bytes
    /// less 128) and its scales.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn unpack_q8(src: *const u8, dst: *mut u8, sc: *mut f32) {
        let flip = _mm512_set1_epi8(-128);
        // SAFETY: a Q8_0 panel block is 544 bytes; 512 bytes of tile and
        // 16 floats at the caller's pointers.
        unsafe {
            for j in 0..8 {
                let raw = _mm512_loadu_si512(src.add(32 + 64 * j) as *const __m512i);
                _mm512_storeu_si512(dst.add(64 * j) as *mut __m512i, _mm512_xor_si512(raw, flip));
            }
            _mm512_storeu_ps(
                sc,
                _mm512_cvtph_ps(_mm256_loadu_si256(src as *const __m256i)),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::simd::tests::panel;
    use crate::backend::cpu::simd::{quantize_block, reference, Isa};

    #[test]
    fn tiles_match_the_reference_bit_for_bit() {
        if !supported() {
            eprintln!(
                "SKIP tiles_match_the_reference_bit_for_bit: this CPU or kernel has no AMX \
                 (AMX-TILE and AMX-INT8 with the tile state granted); the AMX kernels cannot run here"
            );
            assert!(!available());
            return;
        }
        let mut s = Scratch::default();
        for fmt in [Format::Q4_1, Format::Q8_0] {
            for (panels, nb, tokens) in [
                (1, 18, 16),
                (8, 3, 32),
                (2, 5, 48),
                (1, 48, 16),
                (3, 18, 64),
            ] {
                let ws: Vec<Vec<u8>> = (0..panels)
                    .map(|p| panel(fmt, nb, 7 + p as u32 + nb as u32).0)
                    .collect();
                let stride = nb + 1;
                let mut x = vec![Q8Block::default(); tokens * stride];
                for (i, blk) in x.iter_mut().enumerate() {
                    let v: Vec<f32> = (0..32)
                        .map(|j| ((i * 37 + j * 11) % 23) as f32 - 11.3)
                        .collect();
                    quantize_block(Isa::Scalar, &v, blk);
                }
                let ps: Vec<&[u8]> = ws.iter().map(|w| &w[..]).collect();
                let mut seen = 0;
                gemm(
                    fmt,
                    &ps,
                    nb,
                    &x,
                    stride,
                    tokens,
                    &mut s,
                    &mut |t0, p, tile| {
                        for (i, row) in tile.iter().enumerate() {
                            let t = t0 + i;
                            for (r, v) in row.iter().enumerate() {
                                let want = reference(fmt, ps[p], nb, &x[t * stride..], r);
                                assert_eq!(
                                    v.to_bits(),
                                    want.to_bits(),
                                    "{fmt:?} token {t} panel {p} row {r}: {v} vs {want}"
                                );
                            }
                        }
                        seen += 1;
                    },
                );
                assert_eq!(seen, tokens / TOK * panels);
            }
        }
    }
}
