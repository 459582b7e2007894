//! GGUF block types the kernels do not read, rewritten at load into the
//! two they do (Q4_1 and Q8_0 file blocks, which `weights` then puts in
//! panels), and the dequantization of every type the CPU runner takes.
//!
//! Why rewrite rather than a kernel per type: the kernels' panels, their
//! AVX2, AVX-512 and AMX variants and every test of them stay one pair of
//! formats, and a type costs one loop over the file's bytes at load. What
//! each rewrite keeps (the kernel tests hold it):
//! - **Q5_0 → Q8_0, exact**: a Q5_0 value is `d * (q - 16)` with `q` in
//!   0..=31, which is a Q8_0 value with the same `d` (and whose panels take
//!   the narrow kernels, `simd::Format::Q5`).
//! - **Q4_K → Q4_1**, each 32-value piece as one block: values and their
//!   order exact; the piece's scale `d * sc` and minimum `-dmin * m` are
//!   f32 products rounded to f16 (a relative error under 2^-11 each).
//! - **Q5_K, Q6_K → Q8_0**, requantized per 32 values (scale = largest
//!   magnitude / 127, rounded to f16): each weight within half a Q8_0 step
//!   (largest magnitude / 254) plus the scale's rounding. Q6_K's 6-bit and
//!   Q5_K's 5-bit steps are 4x and 8x coarser than that step, so the
//!   rewrite adds a small fraction of the file's own quantization error.
//!
//! The cost is bytes: a Q5_0 matrix grows from 22 to 34 bytes per 32
//! weights, Q4_K from 18 to 20, Q5_K from 22 to 34 and Q6_K from 26.25 to
//! 34 (see `benches/RESULTS.md` for what it costs decode).

use super::simd::Format;
use candle_core::quantized::GgmlDType;
use half::f16;
use ultrafast_kernels::reference::{self as kref, Format as KFormat};

fn h(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Weights per block and bytes per block of the types the CPU runner
/// reads (None: not one of them).
pub fn block_shape(t: GgmlDType) -> Option<(usize, usize)> {
    Some(match t {
        // Floats in runs of 32 (widths are multiples of 32), so an
        // embedding row is a few calls, not one per value.
        GgmlDType::F32 => (32, 128),
        GgmlDType::F16 => (32, 64),
        GgmlDType::Q4_1 => (32, 20),
        GgmlDType::Q8_0 => (32, 34),
        GgmlDType::Q5_0 => (32, 22),
        GgmlDType::Q4K => (256, 144),
        GgmlDType::Q5K => (256, 176),
        GgmlDType::Q6K => (256, 210),
        _ => return None,
    })
}

/// The 6-bit scale and minimum of piece `j` (0..8) of a Q4_K or Q5_K
/// block's 12 packed bytes.
fn scale_min(sc: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (sc[j] & 63, sc[j + 4] & 63)
    } else {
        (
            (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4),
            (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4),
        )
    }
}

/// The 32 values of a Q5_0 block as `q - 16` (-16..=15).
fn q5_0_values(b: &[u8]) -> [i8; 32] {
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let mut q = [0i8; 32];
    for j in 0..16 {
        let lo = (b[6 + j] & 15) | ((((qh >> j) & 1) as u8) << 4);
        let hi = (b[6 + j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
        q[j] = lo as i8 - 16;
        q[j + 16] = hi as i8 - 16;
    }
    q
}

/// Q5_K block `b` (176 bytes) into 256 floats, as llama.cpp's reference:
/// `d * sc * q - dmin * m` per 32-value piece, `q` a nibble plus one bit
/// of `qh`.
fn q5_k_into(b: &[u8], w: &mut [f32]) {
    let (d, dmin) = (h(b, 0), h(b, 2));
    let (sc, qh, ql) = (&b[4..16], &b[16..48], &b[48..176]);
    for piece in 0..8 {
        let (s, m) = scale_min(sc, piece);
        let (ds, dm) = (d * s as f32, dmin * m as f32);
        let q = &ql[(piece / 2) * 32..][..32];
        for l in 0..32 {
            let low = if piece % 2 == 1 { q[l] >> 4 } else { q[l] & 15 };
            let high = (qh[l] >> piece) & 1;
            w[piece * 32 + l] = ds * (low | (high << 4)) as f32 - dm;
        }
    }
}

/// One block of type `t` (its [`block_shape`]) into its weights, as the
/// GGUF reference dequantizes it. Returns false for a type not read here.
pub fn dequantize_into(t: GgmlDType, b: &[u8], w: &mut [f32]) -> bool {
    match t {
        GgmlDType::F32 => {
            for (v, x) in w.iter_mut().zip(b.chunks_exact(4)) {
                *v = f32::from_le_bytes([x[0], x[1], x[2], x[3]]);
            }
        }
        GgmlDType::F16 => {
            for (v, x) in w.iter_mut().zip(b.chunks_exact(2)) {
                *v = h(x, 0);
            }
        }
        GgmlDType::Q4_1 => kref::dequantize_into(KFormat::Q4_1, b, w),
        GgmlDType::Q8_0 => kref::dequantize_into(KFormat::Q8_0, b, w),
        GgmlDType::Q4K => kref::dequantize_into(KFormat::Q4K, b, w),
        GgmlDType::Q6K => kref::dequantize_into(KFormat::Q6K, b, w),
        GgmlDType::Q5K => q5_k_into(b, w),
        GgmlDType::Q5_0 => {
            let d = h(b, 0);
            for (v, q) in w.iter_mut().zip(q5_0_values(b)) {
                *v = d * q as f32;
            }
        }
        _ => return false,
    }
    true
}

/// 32 floats as one Q8_0 file block (34 bytes), llama.cpp's way: scale
/// = largest magnitude / 127 (in f16), values rounded half away from zero.
fn q8_0_block(v: &[f32], out: &mut Vec<u8>) {
    let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    // The values are rounded against the scale as stored (f16), so the
    // kernel's product uses the scale they were made for.
    let d = f16::from_f32(amax / 127.0);
    let id = if d.to_f32() > 0.0 {
        1.0 / d.to_f32()
    } else {
        0.0
    };
    out.extend_from_slice(&d.to_le_bytes());
    out.extend(
        v.iter()
            .map(|x| (x * id).round().clamp(-127.0, 127.0) as i8 as u8),
    );
}

/// The tensor `raw` (blocks of type `t`, whole rows) as file blocks of a
/// format the kernels take: the input unchanged for Q4_1 and Q8_0, the
/// rewrite the module's comment describes for Q5_0, Q4_K, Q5_K and Q6_K.
pub fn to_kernel_blocks(t: GgmlDType, raw: Vec<u8>) -> Result<(Format, Vec<u8>), String> {
    let per_block = |n: usize| raw.len() / n;
    Ok(match t {
        GgmlDType::Q4_1 => (Format::Q4_1, raw),
        GgmlDType::Q8_0 => (Format::Q8_0, raw),
        GgmlDType::Q5_0 => {
            let mut out = Vec::with_capacity(per_block(22) * 34);
            for b in raw.chunks_exact(22) {
                out.extend_from_slice(&b[..2]);
                out.extend(q5_0_values(b).map(|q| q as u8));
            }
            (Format::Q8_0, out)
        }
        GgmlDType::Q4K => {
            let mut out = Vec::with_capacity(per_block(144) * 8 * 20);
            for b in raw.chunks_exact(144) {
                let (d, dmin) = (h(b, 0), h(b, 2));
                for piece in 0..8 {
                    let (s, m) = scale_min(&b[4..16], piece);
                    out.extend_from_slice(&f16::from_f32(d * s as f32).to_le_bytes());
                    out.extend_from_slice(&f16::from_f32(-(dmin * m as f32)).to_le_bytes());
                    let q = &b[16 + (piece / 2) * 32..][..32];
                    let nib = |l: usize| if piece % 2 == 1 { q[l] >> 4 } else { q[l] & 15 };
                    out.extend((0..16).map(|l| nib(l) | (nib(l + 16) << 4)));
                }
            }
            (Format::Q4_1, out)
        }
        GgmlDType::Q5K | GgmlDType::Q6K => {
            let bytes = if t == GgmlDType::Q5K { 176 } else { 210 };
            let mut out = Vec::with_capacity(per_block(bytes) * 8 * 34);
            let mut w = [0f32; 256];
            for b in raw.chunks_exact(bytes) {
                dequantize_into(t, b, &mut w);
                for v in w.chunks_exact(32) {
                    q8_0_block(v, &mut out);
                }
            }
            (Format::Q8_0, out)
        }
        other => {
            return Err(format!(
                "{other:?} weights (the CPU kernels take Q4_1, Q8_0, Q5_0, Q4_K, Q5_K and Q6_K)"
            ))
        }
    })
}

/// `n` random blocks of `t` for tests and checks: random bytes (every
/// value, sub-scale and high-bit pattern occurs), then f16 scales of a
/// realistic size where `t` keeps them, so none is NaN or infinite.
pub fn random_blocks(g: &mut kref::XorShift, t: GgmlDType, n: usize) -> Vec<u8> {
    let (_, bytes) = block_shape(t).expect("a type the CPU runner reads");
    let mut out: Vec<u8> = (0..n * bytes).map(|_| g.next_u64() as u8).collect();
    for b in out.chunks_exact_mut(bytes) {
        let mut put = |at: usize, v: f32| {
            b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
        };
        match t {
            GgmlDType::Q6K => put(208, g.f() * 0.0005),
            GgmlDType::Q4K | GgmlDType::Q5K => {
                put(0, g.f() * 0.002);
                put(2, g.f() * 0.002);
            }
            GgmlDType::Q4_1 | GgmlDType::Q8_0 | GgmlDType::Q5_0 => put(0, g.f() * 0.02),
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests;
