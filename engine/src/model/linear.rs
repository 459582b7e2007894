//! Linear layers over quantized weights, batched over every token of a step.
//!
//! candle-core has SIMD dot products for some GGML types but only a scalar
//! fallback for Q4_1, the type of most SmolLM2 weights; that fallback was
//! 86% of the engine's time. Q4_1 layers therefore run on our own kernel:
//! tiles of 4 weight rows by up to 4 tokens, each weight block unpacked to
//! floats once per tile and multiplied with f32 activations (exact, no
//! activation quantization), 32 independent accumulator lanes per tile so
//! the adds are not one latency-bound chain. A step's tokens share every
//! weight read (what continuous batching buys on a CPU), and row groups are
//! split across cores with rayon. The loops are written over fixed-size
//! arrays so the compiler vectorizes them (an AVX2/FMA version of the tile,
//! picked at run time). Other types go through candle.

// Index loops over fixed-size arrays are how the kernels get vectorized.
#![allow(clippy::needless_range_loop)]

use crate::simd::multiversion;
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Module, Tensor};
use rayon::prelude::*;

const QK: usize = 32;

/// Q4_1 weights, unpacked from GGML's block layout into separate arrays.
pub struct Q4Matrix {
    rows: usize,
    cols: usize,
    nb: usize,
    d: Vec<f32>,
    m: Vec<f32>,
    qs: Vec<[u8; 16]>,
}

/// Activations in 32-blocks, with each block's sum (for the Q4_1 minimum).
pub struct Acts {
    n: usize,
    x: Vec<[f32; QK]>,
    sum: Vec<f32>,
}

impl Acts {
    /// Split `n` rows of `cols` floats into blocks.
    pub fn new(data: &[f32], n: usize, cols: usize) -> Acts {
        let blocks = n * (cols / QK);
        let mut x = Vec::with_capacity(blocks);
        let mut sum = Vec::with_capacity(blocks);
        for blk in data.chunks_exact(QK) {
            let mut b = [0f32; QK];
            b.copy_from_slice(blk);
            sum.push(b.iter().sum());
            x.push(b);
        }
        Acts { n, x, sum }
    }
}

impl Q4Matrix {
    /// Unpack a Q4_1 tensor of shape (rows, cols).
    pub fn from_qtensor(t: &QTensor) -> candle_core::Result<Q4Matrix> {
        let (rows, cols) = t.shape().dims2()?;
        if rows % 16 != 0 {
            candle_core::bail!("Q4_1 tensor with {rows} rows (not a multiple of 16)");
        }
        if cols % QK != 0 {
            candle_core::bail!("Q4_1 tensor with {cols} columns (not a multiple of 32)");
        }
        let nb = cols / QK;
        let raw = t.data()?;
        if raw.len() != rows * nb * 20 {
            candle_core::bail!(
                "Q4_1 tensor of {} bytes, expected {}",
                raw.len(),
                rows * nb * 20
            );
        }
        let mut d = Vec::with_capacity(rows * nb);
        let mut m = Vec::with_capacity(rows * nb);
        let mut qs = Vec::with_capacity(rows * nb);
        for b in raw.chunks_exact(20) {
            d.push(half::f16::from_le_bytes([b[0], b[1]]).to_f32());
            m.push(half::f16::from_le_bytes([b[2], b[3]]).to_f32());
            let mut q = [0u8; 16];
            q.copy_from_slice(&b[4..20]);
            qs.push(q);
        }
        Ok(Q4Matrix {
            rows,
            cols,
            nb,
            d,
            m,
            qs,
        })
    }

    /// `out[t][r] = x[t] . w[r]` for every token `t` of `x`.
    pub fn matmul(&self, x: &Acts) -> Vec<f32> {
        let n = x.n;
        const ROWS: usize = 16;
        // Rows-major partial output (rows x n), filled in parallel by row
        // groups, then transposed.
        let mut yt = vec![0f32; self.rows * n];
        yt.par_chunks_mut(ROWS * n)
            .enumerate()
            .for_each(|(g, chunk)| {
                for r4 in 0..ROWS / 4 {
                    let row0 = g * ROWS + r4 * 4;
                    let mut t = 0;
                    while t + 4 <= n {
                        let o = tile::<4, 4>(self, row0, x, t);
                        for (r, row) in o.iter().enumerate() {
                            chunk[(r4 * 4 + r) * n + t..][..4].copy_from_slice(row);
                        }
                        t += 4;
                    }
                    while t < n {
                        let o = tile::<4, 1>(self, row0, x, t);
                        for (r, row) in o.iter().enumerate() {
                            chunk[(r4 * 4 + r) * n + t] = row[0];
                        }
                        t += 1;
                    }
                }
            });
        if n == 1 {
            return yt;
        }
        let mut y = vec![0f32; n * self.rows];
        for r in 0..self.rows {
            for t in 0..n {
                y[t * self.rows + r] = yt[r * n + t];
            }
        }
        y
    }
}

multiversion! {
    /// A tile of `R` weight rows by `T` tokens: each weight block is unpacked
    /// to floats once and used for every token of the tile, and the `R * T`
    /// accumulators are independent chains (a single row-token dot is bound by
    /// the latency of its one add chain). The AVX2 copy is the unit the
    /// loops around it call (a target-feature function is not inlined
    /// into them), or the compiler would stop vectorizing.
    fn tile<const R: usize, const T: usize>(
        w: &Q4Matrix,
        row0: usize,
        x: &Acts,
        tok0: usize,
    ) -> [[f32; T]; R] {
        let nb = w.nb;
        let mut acc = [[[0f32; 8]; T]; R];
        let mut min_part = [[0f32; T]; R];
        for b in 0..nb {
            let mut wf = [[0f32; QK]; R];
            for r in 0..R {
                let q = &w.qs[(row0 + r) * nb + b];
                for j in 0..16 {
                    wf[r][j] = (q[j] & 0x0f) as f32;
                    wf[r][j + 16] = (q[j] >> 4) as f32;
                }
            }
            for t in 0..T {
                let xi = (tok0 + t) * nb + b;
                let xb = &x.x[xi];
                let sx = x.sum[xi];
                for r in 0..R {
                    let wi = (row0 + r) * nb + b;
                    let mut blk = [0f32; 8];
                    for c in 0..QK / 8 {
                        for l in 0..8 {
                            blk[l] += wf[r][c * 8 + l] * xb[c * 8 + l];
                        }
                    }
                    let dw = w.d[wi];
                    for l in 0..8 {
                        acc[r][t][l] += blk[l] * dw;
                    }
                    min_part[r][t] += w.m[wi] * sx;
                }
            }
        }
        let mut out = [[0f32; T]; R];
        for r in 0..R {
            for t in 0..T {
                out[r][t] = acc[r][t].iter().sum::<f32>() + min_part[r][t];
            }
        }
        out
    }
}

/// A linear layer: our Q4_1 kernel, or candle's quantized matmul.
pub enum Linear {
    /// Q4_1 weights on our kernel.
    Q4(Q4Matrix),
    /// Anything else.
    Candle(QMatMul),
}

impl Linear {
    /// Wrap a quantized weight.
    pub fn from_qtensor(t: QTensor) -> candle_core::Result<Linear> {
        if t.dtype() == GgmlDType::Q4_1
            && matches!(t.shape().dims(), [r, c] if r % 16 == 0 && c % QK == 0)
        {
            return Ok(Linear::Q4(Q4Matrix::from_qtensor(&t)?));
        }
        Ok(Linear::Candle(QMatMul::from_qtensor(t)?))
    }

    /// `x` (tokens, in) -> (tokens, out).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Linear::Candle(m) => m.forward(x),
            Linear::Q4(w) => {
                let dims = x.dims().to_vec();
                let cols = *dims.last().unwrap_or(&0);
                if cols != w.cols {
                    candle_core::bail!("linear: input has {cols} columns, weight has {}", w.cols);
                }
                let n = x.elem_count() / cols.max(1);
                let data = x.flatten_all()?.to_vec1::<f32>()?;
                let acts = Acts::new(&data, n, cols);
                let y = w.matmul(&acts);
                let mut out_dims = dims;
                if let Some(l) = out_dims.last_mut() {
                    *l = w.rows;
                }
                Tensor::from_vec(y, out_dims, x.device())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn q4_kernel_matches_candle() {
        let dev = Device::Cpu;
        let (rows, cols, n) = (48, 128, 5);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
            .collect();
        let wt = Tensor::from_vec(w, (rows, cols), &dev).unwrap();
        let q = QTensor::quantize(&wt, GgmlDType::Q4_1).unwrap();
        let ours = Linear::from_qtensor(QTensor::quantize(&wt, GgmlDType::Q4_1).unwrap()).unwrap();
        assert!(matches!(ours, Linear::Q4(_)));
        let theirs = QMatMul::from_qtensor(q).unwrap();
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 30.0)
            .collect();
        let xt = Tensor::from_vec(x, (n, cols), &dev).unwrap();
        let a = ours.forward(&xt).unwrap().to_vec2::<f32>().unwrap();
        let b = theirs.forward(&xt).unwrap().to_vec2::<f32>().unwrap();
        // Exact product with the dequantized weights: both kernels quantize
        // activations to 8 bits, so both are judged against it.
        let wd = QTensor::quantize(&wt, GgmlDType::Q4_1)
            .unwrap()
            .dequantize(&dev)
            .unwrap();
        let exact = xt
            .matmul(&wd.t().unwrap())
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let max_err = |got: &Vec<Vec<f32>>| {
            got.iter()
                .flatten()
                .zip(exact.iter().flatten())
                .map(|(g, e)| (g - e).abs())
                .fold(0f32, f32::max)
        };
        let (ea, eb) = (max_err(&a), max_err(&b));
        assert!(ea <= eb * 1.5 + 1e-4, "ours {ea} vs candle {eb}");
        assert!(ea < 0.05, "{ea}");
    }
}
