//! Attention of a group of query vectors over a sequence's KV slots, in
//! blocks of positions with an online softmax (flash-style): a task's
//! query vectors are the `rep` heads of one KV head for up to a few
//! tokens, transposed so that each K row is read once and multiplied into
//! all of them in one vectorized loop (no horizontal sums per dot), then
//! each V row is added into every vector's accumulator while a block of
//! scores is still in L1. Scores never exist for more than one block.

// Index loops over fixed-width arrays are how this gets vectorized (with
// separate multiplies and adds: `mul_add` here stopped the vectorizer).
#![allow(clippy::needless_range_loop)]

use super::ops::{exp, AttnSeq, AttnShape};

/// Positions per block.
const JB: usize = 64;
/// Query vectors per task at most (a multiple of 8).
pub const MAX_VECS: usize = 48;

/// Per-thread buffers of [`attend`].
#[derive(Default)]
pub struct AttnScratch {
    qt: Vec<f32>,
    s: Vec<f32>,
    acc: Vec<f32>,
}

/// Tokens per task for `rep` query heads per KV head.
pub fn tokens_per_task(rep: usize) -> usize {
    (MAX_VECS / rep.max(1)).max(1)
}

/// Causal attention of `tokens` of `seq` (token `i` at position
/// `seq.start + i`, its query row at `q[i * q_stride..]`) for KV head `g`;
/// `out(i, h, o)` gets head `h`'s output of token `i`.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    sh: &AttnShape,
    seq: &AttnSeq,
    g: usize,
    tokens: std::ops::Range<usize>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    sc: &mut AttnScratch,
    out: &mut dyn FnMut(usize, usize, &[f32]),
) {
    let nv = tokens.len() * sh.rep;
    let nvp = nv.div_ceil(8) * 8;
    match nvp {
        8 => run::<8>(sh, seq, g, tokens, q, k, v, sc, out),
        16 => run::<16>(sh, seq, g, tokens, q, k, v, sc, out),
        24 => run::<24>(sh, seq, g, tokens, q, k, v, sc, out),
        32 => run::<32>(sh, seq, g, tokens, q, k, v, sc, out),
        40 => run::<40>(sh, seq, g, tokens, q, k, v, sc, out),
        48 => run::<48>(sh, seq, g, tokens, q, k, v, sc, out),
        // More vectors than a task takes: split by token.
        _ => {
            let per = tokens_per_task(sh.rep);
            let mut t = tokens.start;
            while t < tokens.end {
                let e = (t + per).min(tokens.end);
                attend(sh, seq, g, t..e, q, k, v, sc, out);
                t = e;
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn run<const NV: usize>(
    sh: &AttnShape,
    seq: &AttnSeq,
    g: usize,
    tokens: std::ops::Range<usize>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    sc: &mut AttnScratch,
    out: &mut dyn FnMut(usize, usize, &[f32]),
) {
    let (hd, rep) = (sh.hd, sh.rep);
    let nv = tokens.len() * rep;
    let scale = 1.0 / (hd as f32).sqrt();
    // Query vector `u` = token tokens.start + u / rep, head u % rep;
    // transposed: qt[d * NV + u]. Padding vectors are zero and see every
    // position (their results are dropped).
    sc.qt.clear();
    sc.qt.resize(hd * NV, 0.0);
    let mut limit = [usize::MAX; NV];
    for u in 0..nv {
        let i = tokens.start + u / rep;
        let h = g * rep + u % rep;
        let qh = &q[i * sh.q_stride + h * hd..][..hd];
        for d in 0..hd {
            sc.qt[d * NV + u] = qh[d] * scale;
        }
        limit[u] = seq.start + i;
    }
    let ctx = seq.start + tokens.end;
    sc.s.resize(JB * NV, 0.0);
    sc.acc.clear();
    sc.acc.resize(NV * hd, 0.0);
    let mut m = [f32::NEG_INFINITY; NV];
    let mut l = [0f32; NV];
    let mut j0 = 0;
    while j0 < ctx {
        let j1 = (j0 + JB).min(ctx);
        let nb = j1 - j0;
        // Scores: each K row times every query vector.
        for jj in 0..nb {
            let j = j0 + jj;
            let krow = &k[seq.slots[j] * sh.kv_dim + g * hd..][..hd];
            let mut s = [0f32; NV];
            for d in 0..hd {
                let kd = krow[d];
                let qd = &sc.qt[d * NV..(d + 1) * NV];
                for u in 0..NV {
                    s[u] += kd * qd[u];
                }
            }
            for u in 0..NV {
                if j > limit[u] {
                    s[u] = f32::NEG_INFINITY;
                }
            }
            sc.s[jj * NV..(jj + 1) * NV].copy_from_slice(&s);
        }
        // Online softmax: the new running maximum, the old sums rescaled.
        let mut bm = [f32::NEG_INFINITY; NV];
        for jj in 0..nb {
            let row = &sc.s[jj * NV..(jj + 1) * NV];
            for u in 0..NV {
                bm[u] = bm[u].max(row[u]);
            }
        }
        let mut alpha = [0f32; NV];
        for u in 0..NV {
            let mn = m[u].max(bm[u]);
            // The first block always holds position 0, so `mn` is finite
            // from then on; before it, exp(-inf) is 0.
            alpha[u] = if m[u] == f32::NEG_INFINITY { f32::NEG_INFINITY } else { m[u] - mn };
            m[u] = mn;
        }
        exp(&mut alpha);
        for jj in 0..nb {
            let row = &mut sc.s[jj * NV..(jj + 1) * NV];
            for u in 0..NV {
                row[u] -= m[u];
            }
        }
        exp(&mut sc.s[..nb * NV]);
        for u in 0..NV {
            l[u] *= alpha[u];
        }
        for jj in 0..nb {
            let row = &sc.s[jj * NV..(jj + 1) * NV];
            for u in 0..NV {
                l[u] += row[u];
            }
        }
        // Values: each vector's accumulator stays in registers over the
        // block's V rows.
        for u in 0..nv {
            let a = &mut sc.acc[u * hd..(u + 1) * hd];
            for x in a.iter_mut() {
                *x *= alpha[u];
            }
            if hd == 64 {
                let a: &mut [f32; 64] = match a.try_into() {
                    Ok(a) => a,
                    Err(_) => continue,
                };
                add_rows::<64>(a, &sc.s, u, NV, nb, |jj| {
                    &v[seq.slots[j0 + jj] * sh.kv_dim + g * hd..][..64]
                });
            } else {
                for jj in 0..nb {
                    let p = sc.s[jj * NV + u];
                    let vrow = &v[seq.slots[j0 + jj] * sh.kv_dim + g * hd..][..hd];
                    for (o, x) in a.iter_mut().zip(vrow) {
                        *o += p * x;
                    }
                }
            }
        }
        j0 = j1;
    }
    let mut o = vec![0f32; hd];
    for u in 0..nv {
        let inv = 1.0 / l[u];
        for (d, x) in o.iter_mut().enumerate() {
            *x = sc.acc[u * hd + d] * inv;
        }
        out(tokens.start + u / rep, g * rep + u % rep, &o);
    }
}

/// `a += sum_jj p[jj][u] * row(jj)` with `a` in registers.
#[inline(always)]
fn add_rows<'a, const HD: usize>(
    a: &mut [f32; HD],
    p: &[f32],
    u: usize,
    stride: usize,
    n: usize,
    row: impl Fn(usize) -> &'a [f32],
) {
    let mut acc = *a;
    for jj in 0..n {
        let w = p[jj * stride + u];
        let r: &[f32; HD] = match row(jj).try_into() {
            Ok(r) => r,
            Err(_) => return,
        };
        for d in 0..HD {
            acc[d] += w * r[d];
        }
    }
    *a = acc;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against a direct softmax, for head sizes with and without the
    /// specialized path, contexts across several blocks, and tasks that
    /// start mid-sequence.
    #[test]
    fn blocked_attention_matches_a_direct_softmax() {
        for (hd, rep, ntok, start) in [(64, 3, 16, 0), (64, 3, 1, 150), (32, 2, 5, 70), (64, 1, 3, 0)] {
            let kv_heads = 2;
            let kv_dim = kv_heads * hd;
            let q_stride = kv_heads * rep * hd + 7;
            let ctx = start + ntok;
            let slots: Vec<usize> = (0..ctx).map(|j| (j * 7) % ctx).collect();
            let k: Vec<f32> = (0..ctx * kv_dim).map(|i| ((i * 7) % 23) as f32 / 9.0 - 1.0).collect();
            let v: Vec<f32> = (0..ctx * kv_dim).map(|i| ((i * 5) % 13) as f32 / 3.0).collect();
            let q: Vec<f32> = (0..ntok * q_stride).map(|i| ((i * 3) % 17) as f32 / 6.0 - 1.2).collect();
            let sh = AttnShape { hd, rep, kv_dim, q_stride };
            let seq = AttnSeq { slots: &slots, start };
            let mut got = vec![vec![0f32; hd]; ntok * kv_heads * rep];
            let mut sc = AttnScratch::default();
            for g in 0..kv_heads {
                attend(&sh, &seq, g, 0..ntok, &q, &k, &v, &mut sc, &mut |i, h, o| {
                    got[i * kv_heads * rep + h].copy_from_slice(o)
                });
            }
            for i in 0..ntok {
                for h in 0..kv_heads * rep {
                    let g = h / rep;
                    let qh = &q[i * q_stride + h * hd..][..hd];
                    let n = start + i + 1;
                    let s: Vec<f32> = slots[..n]
                        .iter()
                        .map(|&s| {
                            let kr = &k[s * kv_dim + g * hd..][..hd];
                            qh.iter().zip(kr).map(|(a, b)| a * b).sum::<f32>() / (hd as f32).sqrt()
                        })
                        .collect();
                    let mx = s.iter().cloned().fold(f32::MIN, f32::max);
                    let e: Vec<f32> = s.iter().map(|x| (x - mx).exp()).collect();
                    let z: f32 = e.iter().sum();
                    for d in 0..hd {
                        let want: f32 =
                            (0..n).map(|j| e[j] / z * v[slots[j] * kv_dim + g * hd + d]).sum();
                        let g = got[i * kv_heads * rep + h][d];
                        assert!((g - want).abs() < 1e-4, "hd {hd} token {i} head {h}: {g} vs {want}");
                    }
                }
            }
        }
    }
}
