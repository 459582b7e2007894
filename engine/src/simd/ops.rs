//! The per-token work between the matrix products, in plain loops over
//! slices (no tensors, no allocation): RMSNorm fused with the activation
//! quantization, RoPE, SiLU-and-multiply fused with quantization, the
//! `bf16` rounding of the AMX products' rows, and a vectorizable `exp`.

// Index loops over fixed-width chunks are how these get vectorized.
#![allow(clippy::needless_range_loop)]

use super::{multiversion, quantize_block, Isa, Q8Block};

multiversion! {
    /// `tmp` = `x * w / rms(x)`.
    pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, tmp: &mut [f32]) {
        let ss = dot(x, x);
        let scale = 1.0 / (ss / x.len() as f32 + eps).sqrt();
        for ((t, v), g) in tmp.iter_mut().zip(x).zip(w) {
            *t = v * scale * g;
        }
    }
}

/// `out` = quantized `x * w / rms(x)`; `tmp` holds the normed row.
pub fn rmsnorm_quant(
    isa: Isa,
    x: &[f32],
    w: &[f32],
    eps: f32,
    tmp: &mut [f32],
    out: &mut [Q8Block],
) {
    rmsnorm(x, w, eps, tmp);
    quantize(isa, tmp, out);
}

multiversion! {
    /// The `bf16` rounding of a row (the AMX products' activations).
    pub fn to_bf16(x: &[f32], out: &mut [u16]) {
        for (o, v) in out.iter_mut().zip(x) {
            *o = super::bf16(*v);
        }
    }
}

/// Quantize a row (a multiple of 32 long) block by block.
pub fn quantize(isa: Isa, x: &[f32], out: &mut [Q8Block]) {
    for (b, o) in x.chunks_exact(32).zip(out.iter_mut()) {
        quantize_block(isa, b, o);
    }
}

multiversion! {
    /// `tmp` = `silu(g) * u`.
    pub fn silu_mul(g: &[f32], u: &[f32], tmp: &mut [f32]) {
        for (t, a) in tmp.iter_mut().zip(g) {
            *t = -a;
        }
        exp_body(tmp);
        for ((t, a), b) in tmp.iter_mut().zip(g).zip(u) {
            *t = a / (1.0 + *t) * b;
        }
    }
}

/// `silu(g) * u` quantized; `tmp` holds the products.
pub fn silu_mul_quant(isa: Isa, g: &[f32], u: &[f32], tmp: &mut [f32], out: &mut [Q8Block]) {
    silu_mul(g, u, tmp);
    quantize(isa, tmp, out);
}

multiversion! {
    /// Rotate each `hd`-wide head of `x` by the position's `cos`/`sin` rows
    /// (`hd / 2` each): adjacent pairs (llama's GGUF layout) or halves (NEOX).
    pub fn rope(x: &mut [f32], hd: usize, cos: &[f32], sin: &[f32], neox: bool) {
        let half = hd / 2;
        for h in x.chunks_exact_mut(hd) {
            for i in 0..half {
                let (a, b) = if neox {
                    (i, i + half)
                } else {
                    (2 * i, 2 * i + 1)
                };
                let (x0, x1) = (h[a], h[b]);
                h[a] = x0 * cos[i] - x1 * sin[i];
                h[b] = x0 * sin[i] + x1 * cos[i];
            }
        }
    }
}

/// Dot product in eight lanes (vectorizes; a single sum does not).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

multiversion! {
    /// `e^x` in place, in a form the compiler vectorizes (libm's is one
    /// call per value): x = n ln2 + r, a degree-6 polynomial for e^r, 2^n
    /// through the exponent bits. Relative error about 2e-7; inputs below
    /// -87 give 0, above 88 the value at 88.
    pub fn exp(xs: &mut [f32]) {
        exp_body(xs)
    }
}

multiversion! {
    /// `out = e^((x - sub) * mul)` for sampling's weights; NaN gives 0.
    pub fn scaled_exp(xs: &[f32], sub: f32, mul: f32, out: &mut [f32]) {
        for (o, x) in out.iter_mut().zip(xs) {
            *o = (x - sub) * mul;
        }
        exp_body(out);
        for o in out.iter_mut() {
            if o.is_nan() {
                *o = 0.0;
            }
        }
    }
}

multiversion! {
    /// `Σ e^(x - sub)` over `xs` in one pass (a softmax's normaliser):
    /// 64 values at a time through `exp` in a buffer that stays in
    /// registers and L1, summed in 16 `f32` lanes per block (each term is
    /// at most 1 when `sub` is the maximum) and the blocks in `f64`. NaN
    /// counts 0.
    pub fn exp_sum(xs: &[f32], sub: f32) -> f64 {
        let mut total = 0.0f64;
        let mut buf = [0.0f32; 64];
        let mut chunks = xs.chunks_exact(64);
        for c in &mut chunks {
            for j in 0..64 {
                buf[j] = c[j] - sub;
            }
            exp_body(&mut buf);
            let mut acc = [0.0f32; 16];
            for l in 0..4 {
                for j in 0..16 {
                    // `max` drops NaN: it adds nothing.
                    acc[j] += buf[l * 16 + j].max(0.0);
                }
            }
            total += acc.iter().map(|a| *a as f64).sum::<f64>();
        }
        let rest = chunks.remainder();
        let n = rest.len();
        for (b, x) in buf.iter_mut().zip(rest) {
            *b = x - sub;
        }
        exp_body(&mut buf[..n]);
        total + buf[..n].iter().map(|v| v.max(0.0) as f64).sum::<f64>()
    }
}

multiversion! {
    /// The largest value, NaN ignored (`-inf` for none), in 16 lanes so it
    /// vectorizes.
    pub fn max(xs: &[f32]) -> f32 {
        let mut acc = [f32::NEG_INFINITY; 16];
        let mut chunks = xs.chunks_exact(16);
        for c in &mut chunks {
            for j in 0..16 {
                acc[j] = acc[j].max(c[j]);
            }
        }
        let tail = chunks.remainder().iter().copied().fold(f32::NEG_INFINITY, f32::max);
        acc.iter().copied().fold(tail, f32::max)
    }
}

/// Values per sum of `block_sums`.
pub const SUM_BLOCK: usize = 64;

multiversion! {
    /// `out[b]` = the `f64` sum of `xs[b * SUM_BLOCK..][..SUM_BLOCK]`, so
    /// that a walk through the cumulative weights skips whole blocks.
    pub fn block_sums(xs: &[f32], out: &mut Vec<f64>) {
        out.clear();
        for c in xs.chunks(SUM_BLOCK) {
            let mut acc = [0.0f64; 8];
            let mut lanes = c.chunks_exact(8);
            for l in &mut lanes {
                for j in 0..8 {
                    acc[j] += l[j] as f64;
                }
            }
            let tail: f64 = lanes.remainder().iter().map(|x| *x as f64).sum();
            out.push(acc.iter().sum::<f64>() + tail);
        }
    }
}

multiversion! {
    /// Zeroes `w[i]` unless `bin[i] < edge` (a select, not a branch).
    pub fn keep_below(w: &mut [f32], bin: &[u16], edge: u16) {
        for (w, b) in w.iter_mut().zip(bin) {
            *w = if *b < edge { *w } else { 0.0 };
        }
    }
}

multiversion! {
    /// `out[i]` = `floor((max - xs[i]) * scale)`, at most `last` (NaN and
    /// `-inf` give `last`): sampling's histogram bins of log-weights.
    pub fn log_bins(xs: &[f32], max: f32, scale: f32, last: u16, out: &mut [u16]) {
        // Integer bits through the 2^23 shift, as in `exp_body`.
        const SHIFT: f32 = 8_388_608.0;
        let top = last as f32;
        for (o, x) in out.iter_mut().zip(xs) {
            let f = ((max - x) * scale).min(top).floor() + SHIFT;
            *o = f.to_bits().wrapping_sub(SHIFT.to_bits()) as u16;
        }
    }
}

/// `exp`'s loop, for inlining into a caller's own vector code.
#[inline(always)]
pub fn exp_body(xs: &mut [f32]) {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const SHIFT: f32 = 12_582_912.0;
    for v in xs.iter_mut() {
        let x = v.clamp(-87.0, 88.0);
        // Rounding by adding 1.5 * 2^23: the sum's low mantissa bits hold
        // n as an integer, which vectorizes where `as i32` (saturating)
        // does not.
        let t = x * std::f32::consts::LOG2_E + SHIFT;
        let n = t - SHIFT;
        let r = x - n * LN2_HI - n * LN2_LO;
        let p = 1.0
            + r * (1.0
                + r * (0.5
                    + r * (0.166_666_67
                        + r * (0.041_666_5 + r * (0.008_333_5 + r * 0.001_388_9)))));
        let scale =
            f32::from_bits(t.to_bits().wrapping_sub(SHIFT.to_bits()).wrapping_add(127) << 23);
        *v = if *v < -87.0 { 0.0 } else { p * scale };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std() {
        let mut xs: Vec<f32> = (0..3500).map(|i| 87.5 - (i as f32) * 0.05).collect();
        xs.push(-100.0);
        let want: Vec<f32> = xs.iter().map(|x| x.exp()).collect();
        exp(&mut xs);
        for (g, w) in xs.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-6 * w + 1e-37, "{g} vs {w}");
        }
    }

    #[test]
    fn exp_sum_is_the_sum_of_exp() {
        let xs: Vec<f32> = (0..1000)
            .map(|i| -((i * 37 % 200) as f32) * 0.1)
            .chain([f32::NAN])
            .collect();
        let want: f64 = xs
            .iter()
            .filter(|x| !x.is_nan())
            .map(|x| ((*x - 0.5) as f64).exp())
            .sum();
        let got = exp_sum(&xs, 0.5);
        assert!((got - want).abs() < 1e-5 * want, "{got} vs {want}");
    }

    #[test]
    fn rope_rotates_pairs_or_halves() {
        let mut x = vec![1.0, 0.0, 0.0, 1.0];
        let (c, s) = ([0.0f32, 1.0], [1.0f32, 0.0]);
        rope(&mut x, 4, &c, &s, false);
        assert_eq!(x, vec![0.0, 1.0, 0.0, 1.0]);
        let mut y = vec![1.0, 0.0, 0.0, 1.0];
        rope(&mut y, 4, &c, &s, true);
        // Pair (0, 2) by 90 degrees, pair (1, 3) by 0.
        assert_eq!(y, vec![0.0, 0.0, 1.0, 1.0]);
    }
}
