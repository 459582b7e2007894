#![allow(clippy::unwrap_used)]
use super::*;
use crate::backend::cpu::weights::QMat;
use crate::simd::{self, Isa, Q8Block, MAX_T, PANEL};
use ultrafast_kernels::reference::XorShift;

const TYPES: [GgmlDType; 4] = [
    GgmlDType::Q5_0,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

fn blocks(t: GgmlDType, n: usize, seed: u64) -> Vec<u8> {
    random_blocks(&mut XorShift(seed), t, n)
}

fn dequant_all(t: GgmlDType, raw: &[u8]) -> Vec<f32> {
    let (n, bytes) = block_shape(t).unwrap();
    let mut w = vec![0f32; raw.len() / bytes * n];
    for (b, o) in raw.chunks_exact(bytes).zip(w.chunks_exact_mut(n)) {
        assert!(dequantize_into(t, b, o));
    }
    w
}

/// How far a rewritten weight may be from the file's (the module's
/// comment): 0 for Q5_0; the f16 rounding of scale and minimum for Q4_K;
/// half a Q8_0 step plus its scale's rounding for Q5_K and Q6_K.
fn bound(t: GgmlDType, file: &[f32], k: usize) -> f32 {
    let piece = &file[k / 32 * 32..][..32];
    let amax = piece.iter().fold(0f32, |m, x| m.max(x.abs()));
    match t {
        GgmlDType::Q5_0 => 0.0,
        // |d sc q| + |dmin m| <= 2 amax + the largest minimum; each part
        // off by at most 2^-11 of itself.
        GgmlDType::Q4K => 3.0 * amax * 2f32.powi(-11) + 1e-9,
        _ => amax / 254.0 * (1.0 + 2f32.powi(-10)) + amax * 2f32.powi(-11),
    }
}

#[test]
fn each_rewrite_stays_within_its_stated_distance_of_the_file() {
    for (i, t) in TYPES.into_iter().enumerate() {
        let raw = blocks(t, 64, 7 + i as u64);
        let file = dequant_all(t, &raw);
        let (fmt, out) = to_kernel_blocks(t, raw).unwrap();
        let kf = if fmt == Format::Q4_1 {
            KFormat::Q4_1
        } else {
            KFormat::Q8_0
        };
        let mut got = vec![0f32; file.len()];
        for (b, o) in out
            .chunks_exact(kf.block_bytes())
            .zip(got.chunks_exact_mut(32))
        {
            kref::dequantize_into(kf, b, o);
        }
        for (k, (g, f)) in got.iter().zip(&file).enumerate() {
            let e = (g - f).abs();
            assert!(
                e <= bound(t, &file, k),
                "{t:?} weight {k}: {g} against the file's {f}"
            );
            if t == GgmlDType::Q5_0 {
                assert_eq!(g.to_bits(), f.to_bits(), "Q5_0 weight {k}");
            }
        }
    }
}

#[test]
fn the_dequantization_reads_each_field_where_llama_cpp_puts_it() {
    // Q5_0: value 3's high bit is bit 3 of qh, value 19's is bit 19.
    let mut b = [0u8; 22];
    b[..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
    b[2..6].copy_from_slice(&((1u32 << 3) | (1 << 19)).to_le_bytes());
    b[6 + 3] = 0x21;
    let mut w = [0f32; 32];
    assert!(dequantize_into(GgmlDType::Q5_0, &b, &mut w));
    // (17 - 16) * 0.5 and (18 - 16) * 0.5; the rest (0 - 16) * 0.5.
    assert_eq!((w[3], w[19], w[0]), (0.5, 1.0, -8.0));
    // Q5_K: piece 1's high bit is bit 1 of qh[l], its nibble the high one.
    let mut b = [0u8; 176];
    b[..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
    b[4 + 1] = 2; // piece 1: scale 2, minimum 0
    b[16 + 5] = 0b10; // qh[5]: piece 1's bit
    b[48 + 5] = 0x70; // piece 1, value 5: nibble 7
    let mut w = [0f32; 256];
    assert!(dequantize_into(GgmlDType::Q5K, &b, &mut w));
    assert_eq!((w[32 + 5], w[5]), (2.0 * 23.0, 0.0));
    assert!(!dequantize_into(GgmlDType::Q2K, &b, &mut w));
}

fn acts(cols: usize, seed: u64) -> (Vec<Q8Block>, Vec<f32>) {
    let mut g = XorShift(seed);
    let v = g.fs(cols, 1.0);
    let mut blocks = vec![Q8Block::default(); cols / 32];
    for (b, c) in blocks.iter_mut().zip(v.chunks_exact(32)) {
        simd::quantize_block(Isa::Scalar, c, b);
    }
    // What the kernel multiplies: the quantized activations.
    let deq = blocks
        .iter()
        .flat_map(|b| b.q.map(|q| q as f32 * b.d))
        .collect();
    (blocks, deq)
}

#[test]
fn kernels_on_rewritten_panels_give_the_files_products_within_the_bound() {
    let (rows, cols) = (PANEL, 512);
    for (i, t) in TYPES.into_iter().enumerate() {
        let (n, bytes) = block_shape(t).unwrap();
        let raw = blocks(t, rows * cols / n, 31 + i as u64);
        assert_eq!(raw.len(), rows * cols / n * bytes);
        let file = dequant_all(t, &raw);
        let (fmt, out) = to_kernel_blocks(t, raw).unwrap();
        let m = QMat::stack(&[(fmt, rows, cols, out)]).unwrap();
        // A Q5_0 file's values fit the narrow kernels; the others do not.
        let narrow = t == GgmlDType::Q5_0;
        assert_eq!(m.fmt == Format::Q5, narrow, "{t:?}: {:?}", m.fmt);
        let (x, xf) = acts(cols, 5);
        for isa in Isa::available() {
            let mut y = [[0f32; PANEL]; MAX_T];
            simd::tile(isa, m.fmt, m.panel(0), m.nb(), &x, m.nb(), 1, &mut y);
            for r in 0..rows {
                let w = &file[r * cols..(r + 1) * cols];
                let exact: f64 = w.iter().zip(&xf).map(|(a, b)| *a as f64 * *b as f64).sum();
                let slack: f64 = (0..cols)
                    .map(|k| (bound(t, w, k) * xf[k].abs()) as f64)
                    .sum::<f64>()
                    + 1e-5
                        * w.iter()
                            .zip(&xf)
                            .map(|(a, b)| (a * b).abs() as f64)
                            .sum::<f64>()
                    + 1e-6;
                let got = y[0][r] as f64;
                assert!(
                    (got - exact).abs() <= slack,
                    "{t:?} {isa:?} row {r}: {got} against {exact} (bound {slack})"
                );
            }
        }
    }
}
