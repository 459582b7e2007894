//! Prompt (prefill) matrix products on Intel AMX BF16 tiles, where the
//! CPU and the kernel allow them.
//!
//! The 8-bit path (`simd`) must scale every 32-value block's integer sum
//! by its own weight and activation scales, so a tile unit could only
//! ever produce one block at a time and the vector units spent as long
//! reading the sums back as the tiles took to make them (an AMX-INT8
//! version measured no faster). Here a weight panel is dequantized once
//! per call into `bf16` tiles (16 rows x 32 values each, in the pair
//! layout `tdpbf16ps` takes) and multiplied with the tokens' `bf16`
//! activations, accumulating in `f32` across the whole row: there is no
//! per-block step left, and the dequantization is shared by every token
//! of the step.
//!
//! Numbers: a weight is `fma(q, d, m)` rounded to `bf16` (relative error
//! 2^-9, far below the 4-bit quantization's own), an activation is its
//! `f32` rounded to `bf16` (finer than the 8-bit path's per-block
//! quantization). A row's result depends on that row only, so the runner
//! can put any set of rows through here: it takes the rows of every
//! sequence that brings several tokens to a step (a prompt), and `simd`
//! takes single-token rows (decodes), so a token's result never depends
//! on what it was batched with.
//!
//! `unsafe` here is the tile instructions (inline assembly, after
//! [`supported`] found AMX and the kernel granted the tile state) and the
//! AVX-512 dequantization, which stay inside the slices the safe entry
//! point checked.

#![allow(unsafe_code)]

use super::simd::{Format, PANEL};

/// Tokens per tile (the tile's M).
pub const TOK: usize = 16;

/// Rows of activations [`gemm`] may read past the last token (it reads
/// whole pairs of 16-token tiles; what it reads there only lands in rows
/// it does not report).
pub const PAD_ROWS: usize = 2 * TOK;

/// Whether this process runs prompt products on AMX: `ULTRAFAST_AMX=1`
/// asked for them and [`supported`] says the CPU and kernel allow them.
/// Opt-in until measured: the machines of the sessions since this path
/// was written had no AMX (benches/RESULTS.md section 5), so neither its
/// speed nor its effect on the model's output has been seen.
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
        && is_x86_feature_detected!("avx512bf16")
        && is_x86_feature_detected!("f16c")
        && is_x86_feature_detected!("fma");
    // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
    let c = std::arch::x86_64::__cpuid_count(7, 0);
    if !avx512 || c.edx >> 22 & 1 == 0 || c.edx >> 24 & 1 == 0 {
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

/// Bytes of one dequantized panel block (16 pairs of values x 16 rows x
/// 2 bytes).
const BLOCK: usize = 1024;

/// One thread's dequantized panels and tile results, reused across calls.
#[derive(Default)]
pub struct Scratch {
    /// Two panels' dequantized blocks, `BLOCK` bytes each.
    b: Vec<u8>,
    /// Four `C` tiles (16 tokens x 16 rows of f32).
    c: Vec<f32>,
}

/// 16 tokens' results for one panel: `[token][row]`.
pub type Tile = [[f32; PANEL]; TOK];

pub use crate::simd::bf16;

/// For each weight panel `panels[p]` (`nb` panel blocks) and each 16
/// tokens `t0..t0+16` of `x` (`bf16`, token `t`'s row at `t * ld`, `ld`
/// at least `32 * nb`): `sink(t0, p, tile)` with `tile[t][r]` = row `r`
/// of the panel times token `t0 + t`. Rows of a tile past `tokens` are
/// not results; `x` must hold `tokens` rounded up to 32 rows.
///
/// Panics if the slices are short or [`supported`] is false.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    fmt: Format,
    panels: &[&[u8]],
    nb: usize,
    x: &[u16],
    ld: usize,
    tokens: usize,
    s: &mut Scratch,
    sink: &mut dyn FnMut(usize, usize, &Tile),
) {
    assert!(supported(), "AMX kernels without AMX");
    let pb = fmt.panel_bytes();
    assert!(
        panels.iter().all(|g| g.len() >= nb * pb),
        "short weight panel"
    );
    let rows = tokens.div_ceil(2 * TOK) * 2 * TOK;
    assert!(
        nb > 0 && ld >= 32 * nb && x.len() >= (rows - 1) * ld + 32 * nb,
        "activations: {tokens} tokens"
    );
    if tokens == 0 {
        return;
    }
    if s.b.len() < 2 * nb * BLOCK {
        s.b.resize(2 * nb * BLOCK, 0);
    }
    s.c.resize(4 * TOK * PANEL, 0.0);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `supported` found the CPU features and the tile permission;
    // the lengths were checked above.
    unsafe {
        x86::configure();
        x86::gemm(fmt, panels, nb, x, ld, tokens, s, sink, x86::product)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("AMX on a non-x86 CPU")
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Format, Scratch, Tile, BLOCK, PANEL, TOK};
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

    /// Eight tiles of 16 rows x 64 bytes: 0-3 `C` (two token tiles x two
    /// panels), 4-5 `A` (16 tokens x 32 values), 6-7 `B` (16 value pairs
    /// x 16 rows).
    fn config() -> Config {
        let mut c = Config([0; 64]);
        c.0[0] = 1;
        for i in 0..8 {
            c.0[16 + 2 * i..18 + 2 * i].copy_from_slice(&64u16.to_le_bytes());
            c.0[48 + i] = 16;
        }
        c
    }

    /// The tile product's signature (see [`product`]; the tests swap in a
    /// scalar model of it on CPUs without tiles).
    pub(super) type Product = unsafe fn(*const u8, usize, *const u8, usize, *mut f32);

    /// Load this thread's tile configuration, once.
    pub(super) unsafe fn configure() {
        if !CONFIGURED.get() {
            let cfg = config();
            // SAFETY: a valid palette-1 configuration, on a CPU with tiles
            // (the caller's promise).
            unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack)) };
            CONFIGURED.set(true);
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn gemm(
        fmt: Format,
        panels: &[&[u8]],
        nb: usize,
        x: &[u16],
        ld: usize,
        tokens: usize,
        s: &mut Scratch,
        sink: &mut dyn FnMut(usize, usize, &Tile),
        product: Product,
    ) {
        let pb = fmt.panel_bytes();
        let lda = 2 * ld;
        let mut out = [[0f32; PANEL]; TOK];
        // Panels two at a time (an odd last one is paired with itself:
        // its second tiles are computed and dropped).
        for p0 in (0..panels.len()).step_by(2) {
            let p1 = (p0 + 1).min(panels.len() - 1);
            for (k, p) in [p0, p1].into_iter().enumerate() {
                for b in 0..nb {
                    // SAFETY: `gemm` checked every panel's `nb` blocks and
                    // sized the scratch for two panels.
                    unsafe {
                        let src = panels[p].as_ptr().add(b * pb);
                        unpack(fmt, src, s.b.as_mut_ptr().add(BLOCK * (k * nb + b)));
                    }
                }
            }
            for t0 in (0..tokens).step_by(2 * TOK) {
                // SAFETY: rows t0..t0+32 of `x` are in bounds (`gemm`
                // rounded `tokens` up to 32 rows); both panels' blocks
                // and the four C tiles are in the scratch.
                unsafe {
                    let a = x.as_ptr().add(t0 * ld) as *const u8;
                    product(a, lda, s.b.as_ptr(), nb, s.c.as_mut_ptr());
                }
                for (k, p) in [p0, p1].into_iter().enumerate() {
                    if k == 1 && p1 == p0 {
                        break;
                    }
                    for h in 0..2 {
                        if t0 + h * TOK >= tokens {
                            break;
                        }
                        let c = &s.c[(2 * k + h) * TOK * PANEL..][..TOK * PANEL];
                        for (o, row) in out.iter_mut().zip(c.chunks_exact(PANEL)) {
                            o.copy_from_slice(row);
                        }
                        sink(t0 + h * TOK, p, &out);
                    }
                }
            }
        }
    }

    /// Two token tiles (`a`, rows `lda` bytes apart) times two panels'
    /// `nb` dequantized blocks (`b`: panel 0's, then panel 1's), into the
    /// four C tiles at `c` (token tile `h` of panel `k` at tile `2k + h`).
    pub(super) unsafe fn product(a: *const u8, lda: usize, b: *const u8, nb: usize, c: *mut f32) {
        // SAFETY: the caller's pointers cover the tiles' rows: 32 token
        // rows of `nb` blocks, 2 x `nb` B tiles, four C tiles.
        unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "2:",
                "tileloadd tmm4, [{a} + {lda}*1]",
                "tileloadd tmm5, [{a2} + {lda}*1]",
                "tileloadd tmm6, [{b} + {s64}*1]",
                "tileloadd tmm7, [{b1} + {s64}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm5, tmm6",
                "tdpbf16ps tmm2, tmm4, tmm7",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {a}, 64",
                "add {a2}, 64",
                "add {b}, 1024",
                "add {b1}, 1024",
                "dec {n}",
                "jnz 2b",
                "tilestored [{c} + {s64}*1], tmm0",
                "tilestored [{c1} + {s64}*1], tmm1",
                "tilestored [{c2} + {s64}*1], tmm2",
                "tilestored [{c3} + {s64}*1], tmm3",
                a = inout(reg) a => _,
                a2 = inout(reg) a.add(TOK * lda) => _,
                lda = in(reg) lda,
                b = inout(reg) b => _,
                b1 = inout(reg) b.add(BLOCK * nb) => _,
                s64 = in(reg) 64usize,
                n = inout(reg) nb => _,
                c = in(reg) c,
                c1 = in(reg) c.add(TOK * PANEL),
                c2 = in(reg) c.add(2 * TOK * PANEL),
                c3 = in(reg) c.add(3 * TOK * PANEL),
                options(nostack)
            )
        }
    }

    /// One panel block (`fmt.panel_bytes()` at `src`) into its `bf16` B
    /// tile (`BLOCK` bytes at `dst`).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn unpack(fmt: Format, src: *const u8, dst: *mut u8) {
        // SAFETY: the caller's block and tile.
        unsafe {
            match fmt {
                Format::Q4_1 => unpack_q4(src, dst),
                Format::Q8_0 => unpack_q8(src, dst, 128),
                Format::Q5 => unpack_q8(src, dst, 16),
            }
        }
    }

    /// Values `v0`/`v1` of 16 rows (lanes) to one B tile row: `bf16`
    /// pairs `(v0[n], v1[n])` for n = 0..16.
    #[inline(always)]
    unsafe fn pair_row(v0: __m512, v1: __m512, dst: *mut u8) {
        // Words n and 16 + n of cvtne2 (v0's, then v1's) to 2n and 2n+1.
        let idx = _mm512_set_epi16(
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20,
            4, 19, 3, 18, 2, 17, 1, 16, 0,
        );
        let packed: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(v1, v0));
        // SAFETY: the caller's 64 bytes.
        unsafe { _mm512_storeu_si512(dst as *mut __m512i, _mm512_permutexvar_epi16(idx, packed)) };
    }

    /// The 4 bytes of each row's dword in `q` (values `k..k+4`, as
    /// integers `+ bias`) times the row scales `d` plus minimums `m`, into
    /// B tile rows `k/2` and `k/2 + 1`.
    #[inline(always)]
    unsafe fn four(q: __m512i, bias: __m512i, d: __m512, m: __m512, dst: *mut u8, k: usize) {
        let byte = _mm512_set1_epi32(0xff);
        let f = |v: __m512i| {
            let i = _mm512_add_epi32(_mm512_and_si512(v, byte), bias);
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), d, m)
        };
        let v0 = f(q);
        let v1 = f(_mm512_srli_epi32::<8>(q));
        let v2 = f(_mm512_srli_epi32::<16>(q));
        let v3 = f(_mm512_srli_epi32::<24>(q));
        // SAFETY: the caller's block of 16 tile rows.
        unsafe {
            pair_row(v0, v1, dst.add(64 * (k / 2)));
            pair_row(v2, v3, dst.add(64 * (k / 2 + 1)));
        }
    }

    /// One Q4_1 panel block into its `bf16` B tile: value `k` of row `n`
    /// at tile row `k/2`, word `2n + k%2`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn unpack_q4(src: *const u8, dst: *mut u8) {
        let mask = _mm512_set1_epi8(0x0f);
        let zero = _mm512_setzero_si512();
        // SAFETY: a Q4_1 panel block is 320 bytes; the tile is 1 KiB.
        unsafe {
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(src as *const __m256i));
            let m = _mm512_cvtph_ps(_mm256_loadu_si256(src.add(32) as *const __m256i));
            for j in 0..4 {
                // Register j: bytes 4j..4j+4 of each row, low nibbles
                // values 4j.., high nibbles values 16 + 4j...
                let raw = _mm512_loadu_si512(src.add(64 + 64 * j) as *const __m512i);
                let lo = _mm512_and_si512(raw, mask);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask);
                four(lo, zero, d, m, dst, 4 * j);
                four(hi, zero, d, m, dst, 16 + 4 * j);
            }
        }
    }

    /// One Q8_0 panel block into its `bf16` B tile (the stored bytes less
    /// 128, times the scale).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn unpack_q8(src: *const u8, dst: *mut u8, stored_plus: i32) {
        let bias = _mm512_set1_epi32(-stored_plus);
        let zero = _mm512_setzero_ps();
        // SAFETY: a Q8_0 panel block is 544 bytes; the tile is 1 KiB.
        unsafe {
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(src as *const __m256i));
            for j in 0..8 {
                let raw = _mm512_loadu_si512(src.add(32 + 64 * j) as *const __m512i);
                four(raw, bias, d, zero, dst, 4 * j);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::tests::panel;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(bf16(1.0), 0x3f80);
        // Halfway cases go to the even neighbour.
        assert_eq!(bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(bf16(-2.0), 0xc000);
    }

    /// The dequantization alone needs only AVX-512 BF16 (no tiles), so
    /// it is checked on more machines than the products.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn unpacked_tiles_hold_the_bf16_weights_in_pairs() {
        if !(is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512bf16")
            && is_x86_feature_detected!("f16c")
            && is_x86_feature_detected!("fma"))
        {
            eprintln!(
                "SKIP unpacked_tiles_hold_the_bf16_weights_in_pairs: no AVX-512 BF16 on this CPU"
            );
            return;
        }
        for fmt in [Format::Q4_1, Format::Q8_0, Format::Q5] {
            let nb = 3;
            let (w, rows) = panel(fmt, nb, 11);
            let pb = fmt.panel_bytes();
            for b in 0..nb {
                let mut tile = vec![0u8; BLOCK];
                // SAFETY: a whole panel block in, a whole tile out, on a
                // CPU with the features checked above.
                unsafe { x86::unpack(fmt, w[b * pb..].as_ptr(), tile.as_mut_ptr()) };
                for (n, row) in rows.iter().enumerate() {
                    for k in 0..32 {
                        let at = 64 * (k / 2) + 2 * (2 * n + k % 2);
                        let got = u16::from_le_bytes([tile[at], tile[at + 1]]);
                        assert_eq!(
                            got,
                            bf16(row[b * 32 + k]),
                            "{fmt:?} block {b} row {n} value {k}"
                        );
                    }
                }
            }
        }
    }

    /// `x86::product` in scalar code, for checking the rest of the
    /// pipeline (dequantization, panel pairs, token tiles, reporting) on
    /// CPUs with AVX-512 BF16 but no tiles.
    unsafe fn product_model(a: *const u8, lda: usize, b: *const u8, nb: usize, c: *mut f32) {
        let rd = |p: *const u8, i: usize| {
            // SAFETY: within the caller's tiles.
            let v = unsafe { u16::from_le_bytes([*p.add(i), *p.add(i + 1)]) };
            f32::from_bits((v as u32) << 16)
        };
        for k in 0..2 {
            for h in 0..2 {
                for m in 0..TOK {
                    for n in 0..PANEL {
                        let mut acc = 0f32;
                        for blk in 0..nb {
                            let at = a as usize + h * TOK * lda + m * lda + 64 * blk;
                            let bt = b as usize + BLOCK * (k * nb + blk);
                            for i in 0..32 {
                                acc += rd(at as *const u8, 2 * i)
                                    * rd(bt as *const u8, 64 * (i / 2) + 2 * (2 * n + i % 2));
                            }
                        }
                        // SAFETY: the four C tiles.
                        unsafe { *c.add((2 * k + h) * TOK * PANEL + m * PANEL + n) = acc };
                    }
                }
            }
        }
    }

    fn from_bf16(v: u16) -> f64 {
        f32::from_bits((v as u32) << 16) as f64
    }

    #[test]
    fn tiles_match_a_bf16_reference() {
        let tiles = supported();
        #[cfg(target_arch = "x86_64")]
        let bf16_cpu = is_x86_feature_detected!("avx512bf16")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl");
        #[cfg(not(target_arch = "x86_64"))]
        let bf16_cpu = false;
        if !tiles && !bf16_cpu {
            eprintln!(
                "SKIP tiles_match_a_bf16_reference: this CPU has neither AMX (AMX-TILE and \
                 AMX-BF16 with the tile state granted) nor AVX-512 BF16 for the scalar model"
            );
            assert!(!available());
            return;
        }
        if !tiles {
            eprintln!(
                "tiles_match_a_bf16_reference: no AMX here; the tile product is a scalar \
                 model, the rest is the real pipeline"
            );
        }
        let mut s = Scratch::default();
        for fmt in [Format::Q4_1, Format::Q8_0, Format::Q5] {
            for (panels, nb, tokens) in [
                (1, 18, 16usize),
                (8, 3, 32),
                (3, 5, 45),
                (1, 48, 7),
                (2, 18, 64),
            ] {
                let ws: Vec<(Vec<u8>, Vec<Vec<f32>>)> = (0..panels)
                    .map(|p| panel(fmt, nb, 7 + p as u32 + nb as u32))
                    .collect();
                let ld = 32 * nb + 32;
                let rows = tokens.div_ceil(32) * 32;
                let x: Vec<u16> = (0..rows * ld)
                    .map(|i| bf16(((i * 37 % 23) as f32 - 11.3) / 7.0))
                    .collect();
                let ps: Vec<&[u8]> = ws.iter().map(|w| &w.0[..]).collect();
                let mut seen = vec![vec![false; panels]; tokens];
                let mut check = |t0: usize, p: usize, tile: &Tile| {
                    for (i, row) in tile.iter().enumerate() {
                        let t = t0 + i;
                        if t >= tokens {
                            continue;
                        }
                        seen[t][p] = true;
                        for (r, v) in row.iter().enumerate() {
                            let (mut want, mut mag) = (0f64, 0f64);
                            for (k, w) in ws[p].1[r].iter().enumerate() {
                                let p = from_bf16(bf16(*w)) * from_bf16(x[t * ld + k]);
                                want += p;
                                mag += p.abs();
                            }
                            assert!(
                                (*v as f64 - want).abs() <= 1e-5 * mag + 1e-6,
                                "{fmt:?} token {t} panel {p} row {r}: {v} vs {want}"
                            );
                        }
                    }
                };
                if tiles {
                    gemm(fmt, &ps, nb, &x, ld, tokens, &mut s, &mut check);
                } else {
                    s.b.resize(2 * nb * BLOCK, 0);
                    s.c.resize(4 * TOK * PANEL, 0.0);
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: AVX-512 BF16 (checked), scratch sized as
                    // `gemm` does, `x` holds `rows` rows.
                    unsafe {
                        x86::gemm(
                            fmt,
                            &ps,
                            nb,
                            &x,
                            ld,
                            tokens,
                            &mut s,
                            &mut check,
                            product_model,
                        )
                    };
                }
                assert!(seen.iter().flatten().all(|s| *s), "every tile reported");
            }
        }
    }
}
