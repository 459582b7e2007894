//! The online step-cost model: how long a step of `d` decoding sequences
//! and `p` prompt tokens takes on this machine, `elapsed = fixed +
//! per_decode * d + per_prompt_token * p`.
//!
//! Two slopes, because the two kinds of work cost differently: a decoding
//! sequence pays for its logits (a row of the vocabulary-sized head) and
//! for attending to its whole context, a prompt token for neither. Measured
//! on a 2-vCPU Xeon with SmolLM2-135M: 6.6 ms a prompt token, 11 ms a
//! decoding sequence, 2 ms a step. One slope fitted over both mispredicts
//! a decode-heavy step by a quarter and a prompt-heavy one the other way,
//! and the time to first token under load with it.
//!
//! The engine thread feeds every finished step into an exponentially
//! weighted least-squares fit kept as decayed sums, so an update is a 3x3
//! solve and the fit follows the machine as its load changes (the
//! service's warm-up steps seed it; the per-decode cost also follows the
//! contexts growing). The terms are only identifiable from steps of
//! different shapes: under steady decoding every step is the same. A small
//! ridge towards the previous fit keeps what it learned in any direction
//! the recent steps do not inform, while the prediction for the steps
//! being run stays right. Every coefficient is kept non-negative (an
//! active-set solve). Other threads read the latest fit through a short
//! lock; the proxy predicts time to first token from it.

use std::sync::Mutex;
use std::time::Duration;

/// Weight kept by a step per later step: the fit remembers about the last
/// 50 steps.
const DECAY: f64 = 0.98;

/// Weight of the previous fit, in steps' worth of evidence per unit of
/// each regressor: enough to hold directions no recent step informs, too
/// little to bias the ones they do.
const RIDGE: f64 = 0.5;

pub use crate::api::StepCost;

/// The fit, owned by the engine thread.
#[derive(Debug, Default)]
pub(super) struct CostFit {
    /// Decayed sums of x x^T and x y, x = (1, decodes, prompt tokens).
    xx: [[f64; 3]; 3],
    xy: [f64; 3],
    theta: [f64; 3],
    samples: u64,
}

impl CostFit {
    /// Add one step of `decodes` decoding sequences and `prompt_tokens`
    /// prompt tokens that took `elapsed`.
    pub fn observe(&mut self, decodes: usize, prompt_tokens: usize, elapsed: Duration) {
        let x = [1.0, decodes as f64, prompt_tokens as f64];
        let y = elapsed.as_secs_f64();
        for i in 0..3 {
            self.xy[i] = self.xy[i] * DECAY + x[i] * y;
            for j in 0..3 {
                self.xx[i][j] = self.xx[i][j] * DECAY + x[i] * x[j];
            }
        }
        self.samples += 1;
        // Ridge towards the previous fit: (XX + rI) t = XY + r t_prev.
        let mut a = self.xx;
        let mut b = self.xy;
        for i in 0..3 {
            a[i][i] += RIDGE;
            b[i] += RIDGE * self.theta[i];
        }
        self.theta = solve_non_negative(a, b);
    }

    /// The current estimate.
    pub fn cost(&self) -> StepCost {
        StepCost {
            fixed_s: self.theta[0],
            per_decode_s: self.theta[1],
            per_prompt_token_s: self.theta[2],
            samples: self.samples,
        }
    }
}

/// Minimise the quadratic `t^T a t - 2 b^T t` over `t >= 0` for a
/// positive definite `a`: solve, and while a coefficient comes out
/// negative, pin the most negative one at zero and solve for the rest.
fn solve_non_negative(a: [[f64; 3]; 3], b: [f64; 3]) -> [f64; 3] {
    let mut free = [true; 3];
    loop {
        let t = solve_on(&a, &b, &free);
        let worst = (0..3)
            .filter(|&i| free[i] && t[i] < 0.0)
            .min_by(|&i, &j| t[i].total_cmp(&t[j]));
        match worst {
            Some(i) => free[i] = false,
            None => return t,
        }
    }
}

/// Solve `a t = b` restricted to the free coordinates (the others are 0),
/// by Gaussian elimination with partial pivoting.
fn solve_on(a: &[[f64; 3]; 3], b: &[f64; 3], free: &[bool; 3]) -> [f64; 3] {
    let idx: Vec<usize> = (0..3).filter(|&i| free[i]).collect();
    let n = idx.len();
    let mut m: Vec<Vec<f64>> = idx
        .iter()
        .map(|&i| {
            let mut row: Vec<f64> = idx.iter().map(|&j| a[i][j]).collect();
            row.push(b[i]);
            row
        })
        .collect();
    for c in 0..n {
        let p = (c..n)
            .max_by(|&r, &s| m[r][c].abs().total_cmp(&m[s][c].abs()))
            .unwrap_or(c);
        m.swap(c, p);
        if m[c][c].abs() < 1e-300 {
            continue;
        }
        let pivot = m[c].clone();
        for row in m.iter_mut().skip(c + 1) {
            let f = row[c] / pivot[c];
            for (x, p) in row.iter_mut().zip(&pivot).skip(c) {
                *x -= f * p;
            }
        }
    }
    let mut out = [0.0; 3];
    let mut t = vec![0.0; n];
    for r in (0..n).rev() {
        let s: f64 = (r + 1..n).map(|k| m[r][k] * t[k]).sum();
        t[r] = if m[r][r].abs() < 1e-300 {
            0.0
        } else {
            (m[r][n] - s) / m[r][r]
        };
    }
    for (k, &i) in idx.iter().enumerate() {
        out[i] = t[k];
    }
    out
}

/// The latest estimate, written by the engine thread, read by any.
#[derive(Debug, Default)]
pub(super) struct SharedCost(Mutex<StepCost>);

impl SharedCost {
    pub fn publish(&self, c: StepCost) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = c;
    }

    pub fn load(&self) -> StepCost {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1000.0)
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-5 + 2e-2 * b.abs()
    }

    /// The shape measured on a 2-vCPU Xeon: 2 ms a step, 11 ms a decoding
    /// sequence, 6.6 ms a prompt token.
    fn step(decodes: usize, prompt: usize) -> Duration {
        ms(2.0 + 11.0 * decodes as f64 + 6.6 * prompt as f64)
    }

    #[test]
    fn recovers_both_slopes_from_mixed_steps() {
        let mut f = CostFit::default();
        for i in 0..200 {
            let (d, p) = [(0, 24), (12, 0), (1, 0), (6, 18), (16, 8)][i % 5];
            f.observe(d, p, step(d, p));
        }
        let c = f.cost();
        assert!(close(c.fixed_s, 0.002), "{c:?}");
        assert!(close(c.per_decode_s, 0.011), "{c:?}");
        assert!(close(c.per_prompt_token_s, 0.0066), "{c:?}");
        assert_eq!(c.samples, 200);
    }

    #[test]
    fn steady_decoding_keeps_the_split_and_follows_the_level() {
        let mut f = CostFit::default();
        for i in 0..100 {
            let (d, p) = [(0, 24), (12, 0), (1, 0), (6, 18)][i % 4];
            f.observe(d, p, step(d, p));
        }
        // Steady decoding: only 12-sequence decode steps for a long while.
        for _ in 0..1000 {
            f.observe(12, 0, step(12, 0));
        }
        let c = f.cost();
        assert!(close(c.per_prompt_token_s, 0.0066), "{c:?}");
        assert!(
            (c.predict(12, 0).as_secs_f64() - 0.134).abs() < 0.001,
            "{c:?}"
        );
        // The machine gets busier: the same steps now take 250 ms.
        for _ in 0..1000 {
            f.observe(12, 0, ms(250.0));
        }
        let c = f.cost();
        assert!(c.per_prompt_token_s > 0.0 && c.per_decode_s >= 0.0 && c.fixed_s >= 0.0);
        assert!(
            (c.predict(12, 0).as_secs_f64() - 0.250).abs() < 0.005,
            "{c:?}"
        );
    }

    #[test]
    fn coefficients_stay_non_negative() {
        // Larger steps that are not slower (noise): no negative slope.
        let mut f = CostFit::default();
        for i in 0..100 {
            let (d, p) = [(1, 0), (8, 32)][i % 2];
            f.observe(d, p, ms(if d == 1 { 20.0 } else { 10.0 }));
        }
        let c = f.cost();
        assert!(c.fixed_s >= 0.0 && c.per_decode_s >= 0.0 && c.per_prompt_token_s >= 0.0);
        // A plane through (0, <0): the intercept is pinned at 0.
        let mut f = CostFit::default();
        for i in 0..100 {
            let p = [10, 20][i % 2];
            f.observe(0, p, ms(if p == 10 { 1.0 } else { 30.0 }));
        }
        let c = f.cost();
        assert_eq!(c.fixed_s, 0.0, "{c:?}");
        assert!(c.per_prompt_token_s > 0.0, "{c:?}");
    }

    #[test]
    fn the_shared_copy_round_trips() {
        let s = SharedCost::default();
        assert_eq!(s.load(), StepCost::default());
        let c = StepCost {
            fixed_s: 0.007,
            per_decode_s: 0.011,
            per_prompt_token_s: 0.0058,
            samples: 9,
        };
        s.publish(c);
        assert_eq!(s.load(), c);
    }
}
