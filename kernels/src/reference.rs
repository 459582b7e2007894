//! What each CUDA kernel of [`crate::sources`] computes, in plain Rust:
//! the same inputs, layouts and order of operations as the kernel's own
//! comment, one thread. The GPU check holds the kernels to these; the
//! engine's tests hold these to the engine's CPU code, so the two devices
//! are tied through one written-down meaning.

use half::f16;

/// A GGUF block format the GEMV kernels read as it is in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// 32 weights in 20 bytes: f16 scale and minimum, 4-bit values.
    Q4_1,
    /// 32 weights in 34 bytes: f16 scale, 8-bit signed values.
    Q8_0,
    /// 256 weights in 144 bytes: 8 sub-blocks with 6-bit scales and mins.
    Q4K,
    /// 256 weights in 210 bytes: 6-bit values, 16 8-bit scales.
    Q6K,
}

impl Format {
    /// Weights per block.
    pub fn per_block(self) -> usize {
        match self {
            Format::Q4_1 | Format::Q8_0 => 32,
            Format::Q4K | Format::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Format::Q4_1 => 20,
            Format::Q8_0 => 34,
            Format::Q4K => 144,
            Format::Q6K => 210,
        }
    }

    /// The kernel that reads this format.
    pub fn kernel(self) -> &'static str {
        match self {
            Format::Q4_1 => "gemv_q4_1",
            Format::Q8_0 => "gemv_q8_0",
            Format::Q4K => "gemv_q4_k",
            Format::Q6K => "gemv_q6_k",
        }
    }

    /// The kernel that dequantizes this format into bfloat16.
    pub fn dequant_kernel(self) -> &'static str {
        match self {
            Format::Q4_1 => "dequant_q4_1",
            Format::Q8_0 => "dequant_q8_0",
            Format::Q4K => "dequant_q4_k",
            Format::Q6K => "dequant_q6_k",
        }
    }
}

/// `to_bf16` for one value: bfloat16 bits, rounded to nearest even (NaN
/// stays NaN).
pub fn bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// A bfloat16 value as f32 (exact).
pub fn bf16_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// `dequant_*`: the row-major GGUF blocks `w` (`rows` x `cols`) as
/// row-major bfloat16.
pub fn dequant_bf16(format: Format, w: &[u8], rows: usize, cols: usize) -> Vec<u16> {
    let mut out = vec![0.0; format.per_block()];
    let mut m = Vec::with_capacity(rows * cols);
    for b in w
        .chunks_exact(format.block_bytes())
        .take(rows * cols / format.per_block())
    {
        dequantize_into(format, b, &mut out);
        m.extend(out.iter().map(|v| bf16(*v)));
    }
    m
}

/// The prompt GEMM (cuBLAS `gemm_ex`, bfloat16 in, f32 accumulate and
/// out): `y[t * rows + r] (+)= sum_k W[r][k] * bf16(x[t * cols + k])`
/// with `W` from [`dequant_bf16`].
pub fn gemm_bf16(
    w: &[u16],
    x: &[f32],
    rows: usize,
    cols: usize,
    tokens: usize,
    acc: bool,
    y: &mut [f32],
) {
    for t in 0..tokens {
        let xb: Vec<f32> = x[t * cols..][..cols]
            .iter()
            .map(|v| bf16_f32(bf16(*v)))
            .collect();
        for r in 0..rows {
            let dot: f32 = w[r * cols..][..cols]
                .iter()
                .zip(&xb)
                .map(|(a, b)| bf16_f32(*a) * b)
                .sum();
            let o = &mut y[t * rows + r];
            *o = if acc { *o + dot } else { dot };
        }
    }
}

fn h(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The weights of one block (`format.per_block()` of them).
pub fn dequantize(format: Format, b: &[u8]) -> Vec<f32> {
    let mut w = vec![0.0; format.per_block()];
    dequantize_into(format, b, &mut w);
    w
}

/// [`dequantize`] into `w` (`format.per_block()` long), allocating nothing.
pub fn dequantize_into(format: Format, b: &[u8], w: &mut [f32]) {
    match format {
        Format::Q4_1 => {
            let (d, m) = (h(b, 0), h(b, 2));
            for j in 0..16 {
                w[j] = d * (b[4 + j] & 15) as f32 + m;
                w[j + 16] = d * (b[4 + j] >> 4) as f32 + m;
            }
        }
        Format::Q8_0 => {
            let d = h(b, 0);
            for j in 0..32 {
                w[j] = d * (b[2 + j] as i8) as f32;
            }
        }
        Format::Q4K => {
            let (d, dmin) = (h(b, 0), h(b, 2));
            let sc = &b[4..16];
            for piece in 0..8 {
                let (s, m) = if piece < 4 {
                    (sc[piece] & 63, sc[piece + 4] & 63)
                } else {
                    (
                        (sc[piece + 4] & 15) | ((sc[piece - 4] >> 6) << 4),
                        (sc[piece + 4] >> 4) | ((sc[piece] >> 6) << 4),
                    )
                };
                let q = &b[16 + (piece / 2) * 32..][..32];
                for (j, v) in q.iter().enumerate() {
                    let n = if piece % 2 == 1 { v >> 4 } else { v & 15 };
                    w[piece * 32 + j] = d * s as f32 * n as f32 - dmin * m as f32;
                }
            }
        }
        Format::Q6K => {
            let d = h(b, 208);
            for piece in 0..8 {
                let ql = &b[(piece / 4) * 64..];
                let qh = &b[128 + (piece / 4) * 32..];
                let sc = &b[192 + (piece / 4) * 8..];
                let quarter = piece % 4;
                for l in 0..32 {
                    let low = if quarter & 1 == 1 { ql[l + 32] } else { ql[l] };
                    let low = if quarter & 2 == 2 { low >> 4 } else { low & 15 };
                    let high = (qh[l] >> (2 * quarter)) & 3;
                    let q = (low | (high << 4)) as i32 - 32;
                    w[piece * 32 + l] = d * (sc[l / 16 + 2 * quarter] as i8) as f32 * q as f32;
                }
            }
        }
    }
}

/// `gemv_*`: `y[t * rows + r] = sum_k W[r][k] * x[t * cols + k]` over the
/// row-major GGUF blocks `w` (`rows` rows of `cols` weights).
pub fn gemv(
    format: Format,
    w: &[u8],
    x: &[f32],
    rows: usize,
    cols: usize,
    tokens: usize,
) -> Vec<f32> {
    let mut y = vec![0.0f32; tokens * rows];
    gemv_into(format, w, x, rows, cols, tokens, false, &mut y);
    y
}

/// [`gemv`] into `y`; with `acc`, added to what `y` holds (the kernels'
/// `acc` flag: the residual add in the epilogue).
#[allow(clippy::too_many_arguments)]
pub fn gemv_into(
    format: Format,
    w: &[u8],
    x: &[f32],
    rows: usize,
    cols: usize,
    tokens: usize,
    acc: bool,
    y: &mut [f32],
) {
    let (per, bytes) = (format.per_block(), format.block_bytes());
    let nb = cols / per;
    let mut row = vec![0.0f32; cols];
    for r in 0..rows {
        for b in 0..nb {
            let blk = &w[(r * nb + b) * bytes..][..bytes];
            dequantize_into(format, blk, &mut row[b * per..][..per]);
        }
        for t in 0..tokens {
            let xt = &x[t * cols..][..cols];
            let s: f32 = row.iter().zip(xt).map(|(a, b)| a * b).sum();
            let o = &mut y[t * rows + r];
            *o = if acc { *o + s } else { s };
        }
    }
}

/// `rmsnorm_residual` for one token: `x += add` (if any), then
/// `x * w / sqrt(mean(x^2) + eps)`.
pub fn rmsnorm_residual(x: &mut [f32], add: Option<&[f32]>, w: &[f32], eps: f32) -> Vec<f32> {
    if let Some(a) = add {
        for (v, a) in x.iter_mut().zip(a) {
            *v += a;
        }
    }
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * inv * w).collect()
}

/// The `rope` kernel's table for heads of `hd` values and positions below
/// `npos`: for position p and pair i, the cosine and sine of
/// p * theta^(-2i / hd), at `(p * hd / 2 + i) * 2`. The frequency and the
/// angle are f32 products as in [`rope`]; the power and the sine and cosine
/// in f64, rounded once.
pub fn rope_table(theta: f32, hd: usize, npos: usize) -> Vec<f32> {
    let half = hd / 2;
    let freq: Vec<f32> = (0..half)
        .map(|i| (1.0 / (theta as f64).powf(2.0 * i as f64 / hd as f64)) as f32)
        .collect();
    let mut t = Vec::with_capacity(npos * half * 2);
    for p in 0..npos {
        for f in &freq {
            let (s, c) = ((p as f32 * f) as f64).sin_cos();
            t.push(c as f32);
            t.push(s as f32);
        }
    }
    t
}

/// `rope` for one token's `heads` heads of `hd` values at position `pos`.
pub fn rope(x: &mut [f32], pos: usize, heads: usize, hd: usize, theta: f32, neox: bool) {
    let half = hd / 2;
    for hh in 0..heads {
        let v = &mut x[hh * hd..][..hd];
        for i in 0..half {
            let angle = pos as f32 * (1.0 / theta.powf(2.0 * i as f32 / hd as f32));
            let (s, c) = angle.sin_cos();
            let (a, b) = if neox {
                (i, i + half)
            } else {
                (2 * i, 2 * i + 1)
            };
            let (x0, x1) = (v[a], v[b]);
            v[a] = x0 * c - x1 * s;
            v[b] = x0 * s + x1 * c;
        }
    }
}

/// `silu_mul`: per token, `silu(gate) * up` from the fused gate|up row.
pub fn silu_mul(gu: &[f32], ff: usize, tokens: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(ff * tokens);
    for t in 0..tokens {
        let row = &gu[t * 2 * ff..][..2 * ff];
        for i in 0..ff {
            let g = row[i];
            out.push(g / (1.0 + (-g).exp()) * row[ff + i]);
        }
    }
    out
}

/// The paged KV cache as `kv_write` fills it and `paged_attention` reads
/// it: `kv_dim` f16 values per slot, slot = block id * block size + offset.
#[derive(Debug, Clone)]
pub struct PagedKv {
    /// Keys, `slots * kv_dim`.
    pub k: Vec<f16>,
    /// Values, the same shape.
    pub v: Vec<f16>,
    /// Values per slot (KV heads x head size).
    pub kv_dim: usize,
    /// Positions per block.
    pub block_size: usize,
}

impl PagedKv {
    /// An empty cache of `blocks` blocks.
    pub fn new(blocks: usize, block_size: usize, kv_dim: usize) -> PagedKv {
        let n = blocks * block_size * kv_dim;
        PagedKv {
            k: vec![f16::ZERO; n],
            v: vec![f16::ZERO; n],
            kv_dim,
            block_size,
        }
    }

    /// The slot of position `pos` in a sequence with block table `table`.
    pub fn slot(&self, table: &[u32], pos: usize) -> usize {
        table[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }

    /// `kv_write` for one token: its keys and values into `slot`.
    pub fn write(&mut self, slot: usize, k: &[f32], v: &[f32]) {
        for i in 0..self.kv_dim {
            self.k[slot * self.kv_dim + i] = f16::from_f32(k[i]);
            self.v[slot * self.kv_dim + i] = f16::from_f32(v[i]);
        }
    }

    /// `paged_attention` for one query token at position `pos` of the
    /// sequence with `table`: `q` holds `heads` heads of `hd`; returns the
    /// same shape. Query head h reads KV head h / (heads / kv_heads).
    pub fn attend(
        &self,
        q: &[f32],
        table: &[u32],
        pos: usize,
        heads: usize,
        hd: usize,
    ) -> Vec<f32> {
        let group = heads / (self.kv_dim / hd);
        let mut out = vec![0.0f32; heads * hd];
        for hh in 0..heads {
            let g = hh / group;
            let scores = self.scores(&q[hh * hd..][..hd], table, g, 0..pos + 1);
            let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
            let l: f32 = e.iter().sum();
            for (p, ep) in e.iter().enumerate() {
                let s = self.at(table, p, g, hd);
                for d in 0..hd {
                    out[hh * hd + d] += ep * self.v[s + d].to_f32() / l;
                }
            }
        }
        out
    }

    /// Where KV head `g`'s values of position `pos` start.
    fn at(&self, table: &[u32], pos: usize, g: usize, hd: usize) -> usize {
        self.slot(table, pos) * self.kv_dim + g * hd
    }

    /// One query head's scaled scores against KV head `g` at `positions`.
    fn scores(
        &self,
        qh: &[f32],
        table: &[u32],
        g: usize,
        positions: std::ops::Range<usize>,
    ) -> Vec<f32> {
        let hd = qh.len();
        let scale = 1.0 / (hd as f32).sqrt();
        positions
            .map(|p| {
                let s = self.at(table, p, g, hd);
                (0..hd)
                    .map(|d| qh[d] * scale * self.k[s + d].to_f32())
                    .sum()
            })
            .collect()
    }

    /// [`attend`](PagedKv::attend) as a split launch computes it: the
    /// positions in parts of `chunk`, each part's unnormalized sums, max and
    /// sum of exponentials, then `attention_merge`'s combination (a part
    /// past the last position weighs nothing). Equal to `attend` up to
    /// rounding: the split's arithmetic, held here where it can be read.
    pub fn attend_split(
        &self,
        q: &[f32],
        table: &[u32],
        pos: usize,
        heads: usize,
        hd: usize,
        (parts, chunk): (usize, usize),
    ) -> Vec<f32> {
        let group = heads / (self.kv_dim / hd);
        let mut out = vec![0.0f32; heads * hd];
        for hh in 0..heads {
            let (g, qh) = (hh / group, &q[hh * hd..][..hd]);
            // (max, sum of exponentials, sums) of each part.
            let part: Vec<(f32, f32, Vec<f32>)> = (0..parts)
                .map(|z| {
                    let (lo, hi) = (z * chunk, ((z + 1) * chunk).min(pos + 1));
                    let sc = self.scores(qh, table, g, lo..hi.max(lo));
                    let m = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut acc = vec![0.0f32; hd];
                    let mut l = 0.0;
                    for (i, s) in sc.iter().enumerate() {
                        let (e, at) = ((s - m).exp(), self.at(table, lo + i, g, hd));
                        l += e;
                        for (a, v) in acc.iter_mut().zip(&self.v[at..at + hd]) {
                            *a += e * v.to_f32();
                        }
                    }
                    (m, l, acc)
                })
                .collect();
            let m = part.iter().map(|p| p.0).fold(f32::NEG_INFINITY, f32::max);
            let weight = |p: &(f32, f32, Vec<f32>)| if p.1 > 0.0 { (p.0 - m).exp() } else { 0.0 };
            let l: f32 = part.iter().map(|p| weight(p) * p.1).sum();
            for d in 0..hd {
                let a: f32 = part.iter().map(|p| weight(p) * p.2[d]).sum();
                out[hh * hd + d] = a / l;
            }
        }
        out
    }
}

/// `top_k` for one row: the k largest logits, largest first, ties to the
/// smaller index; NaN never chosen.
pub fn top_k(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..row.len() as u32)
        .filter(|i| !row[*i as usize].is_nan())
        .collect();
    idx.sort_by(|a, b| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b)));
    idx.into_iter()
        .take(k)
        .map(|i| (i, row[i as usize]))
        .collect()
}

/// `log_norm` for one row: `ln Σ e^x` in `f64`, NaN skipped, `-inf` for a
/// row with nothing finite.
pub fn log_norm(row: &[f32]) -> f32 {
    let m = row
        .iter()
        .filter(|x| !x.is_nan())
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    if !m.is_finite() {
        return m;
    }
    let s: f64 = row
        .iter()
        .filter(|x| !x.is_nan())
        .map(|&x| ((x - m) as f64).exp())
        .sum();
    m + s.ln() as f32
}

/// A small deterministic generator (xorshift64) for test and check data,
/// so a failure reproduces from its seed.
#[derive(Debug, Clone)]
pub struct XorShift(pub u64);

impl XorShift {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in [-1, 1).
    pub fn f(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    /// `n` values uniform in [-scale, scale).
    pub fn fs(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
}

/// `rows` rows of `cols` weights in `format`'s blocks: random values, and
/// each block's scale (and minimum, where the format has one) from
/// `scale`, so they are never NaN or infinite.
pub fn random_blocks(
    rng: &mut XorShift,
    format: Format,
    rows: usize,
    cols: usize,
    mut scale: impl FnMut(&mut XorShift) -> (f32, f32),
) -> Vec<u8> {
    let n = rows * cols / format.per_block();
    let mut out = Vec::with_capacity(n * format.block_bytes());
    for _ in 0..n {
        let start = out.len();
        out.extend((0..format.block_bytes()).map(|_| rng.next_u64() as u8));
        let b = &mut out[start..];
        let (d, m) = scale(rng);
        let (d, m) = (
            f16::from_f32(d).to_le_bytes(),
            f16::from_f32(m).to_le_bytes(),
        );
        match format {
            Format::Q4_1 | Format::Q4K => {
                b[..2].copy_from_slice(&d);
                b[2..4].copy_from_slice(&m);
            }
            Format::Q8_0 => b[..2].copy_from_slice(&d),
            Format::Q6K => b[208..].copy_from_slice(&d),
        }
    }
    out
}

/// Scales of a realistic size per format, for [`random_blocks`].
pub fn realistic_scale(format: Format) -> impl FnMut(&mut XorShift) -> (f32, f32) {
    let s = match format {
        Format::Q4_1 | Format::Q4K => 0.02,
        Format::Q8_0 => 0.01,
        Format::Q6K => 0.002,
    };
    move |g: &mut XorShift| (g.f() * s, g.f() * s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_1_blocks_read_low_nibbles_first() {
        let mut b = vec![0u8; 20];
        b[..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        b[4] = 0x3a; // weight 0 = 10, weight 16 = 3
        let w = dequantize(Format::Q4_1, &b);
        assert_eq!((w[0], w[16], w[1]), (4.0, 0.5, -1.0));
    }

    #[test]
    fn top_k_orders_by_value_then_index_and_skips_nan() {
        let row = [1.0, f32::NAN, 3.0, 3.0, -1.0];
        assert_eq!(top_k(&row, 3), vec![(2, 3.0), (3, 3.0), (0, 1.0)]);
    }

    #[test]
    fn the_rope_table_turns_as_rope_does() {
        let (hd, theta) = (64, 100_000.0f32);
        let table = rope_table(theta, hd, 8192);
        assert_eq!(table.len(), 8192 * hd);
        let mut g = XorShift(9);
        for pos in [0usize, 1, 97, 4000, 8191] {
            let x = g.fs(hd, 1.0);
            let mut want = x.clone();
            rope(&mut want, pos, 1, hd, theta, false);
            let row = &table[pos * hd..][..hd];
            // `rope`'s f32 power may differ from the f64 one by an ulp of
            // the frequency, which the position multiplies.
            let tol = 1e-5 + pos as f32 * 1.2e-7;
            for i in 0..hd / 2 {
                let (c, s) = (row[2 * i], row[2 * i + 1]);
                let (x0, x1) = (x[2 * i], x[2 * i + 1]);
                assert!(
                    (x0 * c - x1 * s - want[2 * i]).abs() < tol,
                    "pos {pos} pair {i}"
                );
                assert!(
                    (x0 * s + x1 * c - want[2 * i + 1]).abs() < tol,
                    "pos {pos} pair {i}"
                );
            }
        }
    }

    #[test]
    fn split_attention_equals_whole_attention() {
        let (heads, kv_heads, hd, bs) = (9, 3, 64, 16);
        let mut g = XorShift(5);
        let mut kv = PagedKv::new(16, bs, kv_heads * hd);
        let table: Vec<u32> = (0..12).rev().collect();
        for p in 0..190 {
            let slot = kv.slot(&table, p);
            let (k, v) = (g.fs(kv_heads * hd, 2.0), g.fs(kv_heads * hd, 2.0));
            kv.write(slot, &k, &v);
        }
        let q = g.fs(heads * hd, 2.0);
        for pos in [0, 31, 32, 100, 189] {
            let whole = kv.attend(&q, &table, pos, heads, hd);
            // Parts of 32 (some past the end) and a few wide ones.
            for split in [(1, 192), (6, 32), (2, 128), (3, 64)] {
                let parts = kv.attend_split(&q, &table, pos, heads, hd, split);
                let worst = whole
                    .iter()
                    .zip(&parts)
                    .map(|(a, b)| (a - b).abs() / (1.0 + a.abs()))
                    .fold(0.0f32, f32::max);
                assert!(worst < 1e-5, "pos {pos} split {split:?}: {worst}");
            }
        }
    }

    #[test]
    fn attention_over_one_position_returns_its_value() {
        // Two KV heads of one value each, two query heads (no grouping).
        let mut kv = PagedKv::new(4, 16, 2);
        let table = [3u32];
        kv.write(kv.slot(&table, 0), &[1.0, 0.0], &[0.25, -2.0]);
        assert_eq!(kv.slot(&table, 0), 48);
        assert_eq!(kv.attend(&[5.0, 1.0], &table, 0, 2, 1), vec![0.25, -2.0]);
    }
}
