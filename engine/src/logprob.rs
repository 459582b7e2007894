//! Log-probabilities of a row of logits, for the `logprobs`, `top_logprobs`
//! and `echo` reports: the softmax's log-normaliser in one fused,
//! vectorized pass (the sampler's `exp`), the chosen token's value minus
//! it, and the k likeliest tokens by a threshold scan that skips whole
//! blocks below the k-th largest so far (k is at most 20: a sorted array
//! beats a heap). Only sequences
//! that ask pay for it; the rest of the batch never sees this module.

use crate::simd::ops;

/// `ln Σ e^l` over `row`: a logit minus it is that token's log-probability.
/// `-inf` for a row with nothing finite.
pub fn log_norm(row: &[f32]) -> f32 {
    let max = ops::max(row);
    if !max.is_finite() {
        return max;
    }
    max + ops::exp_sum(row, max).ln() as f32
}

/// Values per block of [`top`]'s scan: a block whose largest value cannot
/// enter the list is skipped after one vectorized pass.
const TOP_BLOCK: usize = 128;

/// The `k` largest logits as (token, logit), largest first, ties to the
/// smaller id (so a report is the same from run to run); NaN never chosen.
pub fn top(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k == 0 {
        return best;
    }
    let mut floor = f32::NEG_INFINITY;
    for (bi, block) in row.chunks(TOP_BLOCK).enumerate() {
        // Most blocks hold nothing above the k-th largest so far.
        if best.len() == k && ops::max(block) <= floor {
            continue;
        }
        for (j, &l) in block.iter().enumerate() {
            // `<=` keeps the earlier (smaller) id on a tie with the floor.
            if best.len() == k && l <= floor || l.is_nan() {
                continue;
            }
            let at = best.partition_point(|&(_, v)| v >= l);
            best.insert(at, ((bi * TOP_BLOCK + j) as u32, l));
            best.truncate(k);
            if best.len() == k {
                floor = best[k - 1].1;
            }
        }
    }
    best
}

/// One position's scores: the log-probability of `chosen` and the `k`
/// likeliest tokens with theirs.
pub fn score(row: &[f32], chosen: u32, k: usize) -> (f32, Vec<(u32, f32)>) {
    Before::take(row, k, false).chosen(row, chosen)
}

/// A row's scores taken before sampling changes it (penalties, bias, a
/// grammar mask, `min_p`), for the token sampling is about to pick.
#[derive(Debug)]
pub struct Before {
    norm: f32,
    top: Vec<(u32, f32)>,
    /// The row as it was, when sampling is going to change it.
    raw: Option<Vec<f32>>,
}

impl Before {
    /// Scores of `row` with `k` alternatives; `keep` it whole when
    /// sampling is going to change it in place.
    pub fn take(row: &[f32], k: usize, keep: bool) -> Self {
        Before {
            norm: log_norm(row),
            top: top(row, k),
            raw: keep.then(|| row.to_vec()),
        }
    }

    /// The log-probability of `chosen` and the alternatives', once it is
    /// known; `row` is the row sampling read (the same row when nothing
    /// was kept).
    pub fn chosen(self, row: &[f32], chosen: u32) -> (f32, Vec<(u32, f32)>) {
        let norm = self.norm;
        let lp = |l: f32| {
            if norm.is_finite() {
                l - norm
            } else {
                f32::NEG_INFINITY
            }
        };
        let row = self.raw.as_deref().unwrap_or(row);
        let mine = row
            .get(chosen as usize)
            .map_or(f32::NEG_INFINITY, |&l| lp(l));
        (
            mine,
            self.top.into_iter().map(|(t, l)| (t, lp(l))).collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(row: &[f32]) -> Vec<f64> {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let s: f64 = row.iter().map(|&l| (l as f64 - max).exp()).sum();
        row.iter().map(|&l| l as f64 - max - s.ln()).collect()
    }

    #[test]
    fn scores_are_the_log_softmax_and_top_is_ordered() {
        let mut r = ultrafast_kernels::reference::XorShift(7);
        let row: Vec<f32> = (0..49_152).map(|_| r.f() * 12.0).collect();
        let want = reference(&row);
        for chosen in [0u32, 17, 49_151] {
            let (lp, alts) = score(&row, chosen, 5);
            assert!((lp as f64 - want[chosen as usize]).abs() < 1e-4, "{lp}");
            let mut sorted: Vec<u32> = (0..row.len() as u32).collect();
            sorted.sort_by(|a, b| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b)));
            let ids: Vec<u32> = alts.iter().map(|a| a.0).collect();
            assert_eq!(ids, sorted[..5]);
            for (t, l) in alts {
                assert!((l as f64 - want[t as usize]).abs() < 1e-4);
            }
        }
        let total: f64 = want.iter().map(|l| l.exp()).sum();
        assert!((total - 1.0).abs() < 1e-9);
    }

    #[test]
    fn ties_go_to_the_smaller_id_and_nan_is_never_listed() {
        let row = [1.0, f32::NAN, 3.0, 3.0, 2.0, 3.0];
        assert_eq!(top(&row, 2), vec![(2, 3.0), (3, 3.0)]);
        assert_eq!(top(&row, 0), vec![]);
        assert_eq!(top(&row, 9).len(), 5);
        let masked = [f32::NEG_INFINITY, 0.0];
        let (lp, _) = score(&masked, 1, 1);
        assert_eq!(lp, 0.0);
        assert_eq!(score(&masked, 0, 0).0, f32::NEG_INFINITY);
        assert_eq!(score(&[f32::NEG_INFINITY; 3], 0, 0).0, f32::NEG_INFINITY);
    }
}
