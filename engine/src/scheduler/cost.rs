//! The online step-cost model: how long a step of `n` tokens takes on this
//! machine, `elapsed = fixed + per_token * n`.
//!
//! The engine thread feeds every step (its token count and wall time) into
//! an exponentially weighted least-squares fit kept as five running sums,
//! so an update is a few multiply-adds and the fit follows the machine as
//! its load changes (the service's warm-up steps seed it). Other threads
//! read the latest fit lock-free: both coefficients are packed as `f32`
//! into one `AtomicU64`, so a reader never sees the intercept of one fit
//! with the slope of another. The proxy predicts time to first token from
//! it.
//!
//! A line is only identifiable from steps of different sizes. When recent
//! steps are all (nearly) the same size, as under steady decoding, the
//! slope from the last identifiable fit is kept and only the intercept is
//! moved, so that the prediction at the current step size stays right.
//! Both coefficients are kept non-negative (constrained least squares).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Weight kept by a step per later step: the fit remembers about the last
/// 50 steps.
const DECAY: f64 = 0.98;

/// The least weighted variance of step sizes (tokens squared) at which the
/// slope is fitted; below it the slope is kept.
const MIN_VARIANCE: f64 = 1.0;

/// The engine's estimate of its step duration: a step computing `n` tokens
/// (decode tokens and prefill chunk tokens alike) takes about
/// `fixed_s + per_token_s * n` seconds on this machine, now.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepCost {
    /// Seconds a step costs whatever its size (weights read, dispatch).
    pub fixed_s: f64,
    /// Seconds each token of a step adds.
    pub per_token_s: f64,
    /// Steps the estimate has seen (0: no estimate yet, both are 0).
    pub samples: u64,
}

impl StepCost {
    /// Predicted duration of a step of `tokens` tokens.
    pub fn predict(&self, tokens: usize) -> Duration {
        Duration::from_secs_f64((self.fixed_s + self.per_token_s * tokens as f64).max(0.0))
    }
}

/// The fit, owned by the engine thread.
#[derive(Debug, Default)]
pub(super) struct CostFit {
    /// Decayed sums of 1, x, x^2, y and x*y (x: tokens, y: seconds).
    s0: f64,
    s1: f64,
    s2: f64,
    sy: f64,
    sxy: f64,
    fixed: f64,
    per_token: f64,
    samples: u64,
}

impl CostFit {
    /// Add one step of `tokens` tokens that took `elapsed`.
    pub fn observe(&mut self, tokens: usize, elapsed: Duration) {
        let (x, y) = (tokens.max(1) as f64, elapsed.as_secs_f64());
        for s in [
            &mut self.s0,
            &mut self.s1,
            &mut self.s2,
            &mut self.sy,
            &mut self.sxy,
        ] {
            *s *= DECAY;
        }
        self.s0 += 1.0;
        self.s1 += x;
        self.s2 += x * x;
        self.sy += y;
        self.sxy += x * y;
        self.samples += 1;
        let (mx, my) = (self.s1 / self.s0, self.sy / self.s0);
        let var = self.s2 / self.s0 - mx * mx;
        let cov = self.sxy / self.s0 - mx * my;
        let slope = cov / var;
        if var >= MIN_VARIANCE && slope > 0.0 {
            let fixed = my - slope * mx;
            if fixed >= 0.0 {
                (self.fixed, self.per_token) = (fixed, slope);
            } else {
                // The best line with a non-negative intercept goes through
                // the origin.
                (self.fixed, self.per_token) = (0.0, self.sxy / self.s2);
            }
        } else {
            // Not identifiable (or noise): keep the slope, fit the level.
            let fixed = my - self.per_token * mx;
            if fixed >= 0.0 {
                self.fixed = fixed;
            } else {
                (self.fixed, self.per_token) = (0.0, my / mx);
            }
        }
    }

    /// The current estimate.
    pub fn cost(&self) -> StepCost {
        StepCost {
            fixed_s: self.fixed,
            per_token_s: self.per_token,
            samples: self.samples,
        }
    }
}

/// The latest estimate, written by the engine thread, read by any.
#[derive(Debug, Default)]
pub(super) struct SharedCost {
    /// `fixed_s` as f32 bits in the low half, `per_token_s` in the high.
    pair: AtomicU64,
    samples: AtomicU64,
}

impl SharedCost {
    pub fn publish(&self, c: StepCost) {
        let lo = (c.fixed_s as f32).to_bits() as u64;
        let hi = (c.per_token_s as f32).to_bits() as u64;
        self.pair.store(lo | hi << 32, Ordering::Relaxed);
        self.samples.store(c.samples, Ordering::Relaxed);
    }

    pub fn load(&self) -> StepCost {
        let p = self.pair.load(Ordering::Relaxed);
        StepCost {
            fixed_s: f32::from_bits(p as u32) as f64,
            per_token_s: f32::from_bits((p >> 32) as u32) as f64,
            samples: self.samples.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1000.0)
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-6 + 1e-3 * b.abs()
    }

    #[test]
    fn recovers_a_line_from_mixed_step_sizes() {
        let mut f = CostFit::default();
        for i in 0..200 {
            let n = [1, 8, 16, 32, 512][i % 5];
            f.observe(n, ms(7.0 + 5.8 * n as f64));
        }
        let c = f.cost();
        assert!(close(c.fixed_s, 0.007), "{c:?}");
        assert!(close(c.per_token_s, 0.0058), "{c:?}");
        assert_eq!(c.samples, 200);
    }

    #[test]
    fn steady_same_size_steps_keep_the_slope_and_move_the_level() {
        let mut f = CostFit::default();
        for i in 0..50 {
            let n = [1, 16, 64][i % 3];
            f.observe(n, ms(7.0 + 5.8 * n as f64));
        }
        // Steady decoding: only 32-token steps for a long while.
        for _ in 0..1000 {
            f.observe(32, ms(7.0 + 5.8 * 32.0));
        }
        let c = f.cost();
        assert!(close(c.per_token_s, 0.0058), "{c:?}");
        assert!(close(c.fixed_s, 0.007), "{c:?}");
        // The machine gets busier: the same steps now take 250 ms.
        for _ in 0..1000 {
            f.observe(32, ms(250.0));
        }
        let c = f.cost();
        assert!(c.per_token_s > 0.0 && c.fixed_s >= 0.0, "{c:?}");
        assert!(close(c.predict(32).as_secs_f64(), 0.250), "{c:?}");
    }

    #[test]
    fn coefficients_stay_non_negative() {
        // Larger steps that are not slower (noise): no negative slope.
        let mut f = CostFit::default();
        for i in 0..100 {
            let n = [1, 32][i % 2];
            f.observe(n, ms(if n == 1 { 20.0 } else { 10.0 }));
        }
        let c = f.cost();
        assert!(c.fixed_s >= 0.0 && c.per_token_s >= 0.0, "{c:?}");
        // A line through (0, <0): the intercept is clamped to 0.
        let mut f = CostFit::default();
        for i in 0..100 {
            let n = [10, 20][i % 2];
            f.observe(n, ms(if n == 10 { 1.0 } else { 30.0 }));
        }
        let c = f.cost();
        assert_eq!(c.fixed_s, 0.0, "{c:?}");
        assert!(c.per_token_s > 0.0, "{c:?}");
    }

    #[test]
    fn the_shared_copy_round_trips() {
        let s = SharedCost::default();
        assert_eq!(s.load(), StepCost::default());
        let c = StepCost {
            fixed_s: 0.007,
            per_token_s: 0.0058,
            samples: 9,
        };
        s.publish(c);
        let r = s.load();
        assert!(close(r.fixed_s, c.fixed_s) && close(r.per_token_s, c.per_token_s));
        assert_eq!(r.samples, 9);
    }
}
