//! The start-up agreement check of a device runner: before a model is
//! served on a GPU, one short prompt runs through the device runner and
//! through the CPU runner, and their last logits must agree as well as the
//! CPU runner agrees with the kernels' exact references (its int8
//! activations move logits by up to about 1; `engine/tests/reference_runner.rs`).
//! It catches a device path that computes garbage (a kernel, a driver or a
//! library that misbehaves), not small numerical drift: that is the GPU
//! check's business (`benches/scripts/gpu_check.sh`). The CPU runner is
//! built for the check and dropped after it: its repacked weights are held
//! for that time only (for SmolLM2, about 100 MB for a second or two).

use super::loaded::Loaded;
use super::{cpu_runner, KvDtype, ModelRunner};
use crate::model::paged::SeqStep;
use std::sync::Arc;

/// Largest |device - CPU| over the probe's logits that passes.
pub const MAX_DIFF: f32 = 1.5;
/// Top-two margin of the CPU's logits above which both must pick the same
/// token.
pub const CLEAR_MARGIN: f32 = 0.5;

/// Whether `device`'s logits for a probe prompt agree with the CPU
/// runner's (`Ok` with a summary for the log), or why not. `device`'s KV
/// cache is written in its first blocks, which nothing has used yet.
pub fn agrees_with_cpu(
    device: &mut dyn ModelRunner,
    loaded: &Arc<Loaded>,
    block_size: usize,
    kv_dtype: KvDtype,
    init: fn(),
) -> Result<String, String> {
    let tokens = loaded
        .codec
        .encode("The quick brown fox jumps over the lazy dog.")
        .unwrap_or_else(|_| (1..12).collect());
    let blocks: Vec<u32> = (0..tokens.len().div_ceil(block_size) as u32).collect();
    let seq = [SeqStep {
        tokens: &tokens,
        start: 0,
        blocks: &blocks,
    }];
    let mut cpu = cpu_runner(loaded, blocks.len(), block_size, kv_dtype, init)
        .map_err(|e| format!("the CPU runner for the check: {e}"))?;
    let (mut want, mut got) = (Vec::new(), Vec::new());
    cpu.step(&seq, &|_| false, &mut want)
        .map_err(|e| format!("the CPU step: {e}"))?;
    device
        .step(&seq, &|_| false, &mut got)
        .map_err(|e| format!("the device step: {e}"))?;
    compare(&got, &want)
}

/// The verdict on one row of logits (see the module's comment).
pub fn compare(got: &[f32], want: &[f32]) -> Result<String, String> {
    let (worst, verdict) = agreement(got, want, |_| MAX_DIFF);
    verdict.map(|_| format!("agrees with the CPU on a probe prompt (max |diff| {worst:.3})"))
}

/// How one row of logits agrees with `want`'s: the largest |got - want|,
/// and whether every logit is within `tol(|want|)` (NaN never is) and the
/// greedy token the same where `want`'s top two are [`CLEAR_MARGIN`] apart.
pub fn agreement(got: &[f32], want: &[f32], tol: impl Fn(f32) -> f32) -> (f32, Result<(), String>) {
    if got.len() != want.len() || want.len() < 2 {
        let why = format!("{} logits against {}", got.len(), want.len());
        return (f32::INFINITY, Err(why));
    }
    let mut worst = 0.0f32;
    let mut verdict = Ok(());
    for (a, b) in got.iter().zip(want) {
        let d = (a - b).abs();
        if verdict.is_ok() && (d.is_nan() || d > tol(b.abs())) {
            verdict = Err(format!(
                "a logit differs by {d} (at most {} passes)",
                tol(b.abs())
            ));
        }
        worst = worst.max(d);
    }
    let top = ultrafast_kernels::reference::top_k(want, 2);
    let (g, w) = (crate::sampling::argmax(got), crate::sampling::argmax(want));
    if verdict.is_ok() && top[0].1 - top[1].1 >= CLEAR_MARGIN && g != w {
        verdict = Err(format!(
            "greedy token {g} where the reference's is clearly {w}"
        ));
    }
    (worst, verdict)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agreement_is_within_the_cpu_runners_own_spread_and_keeps_clear_tokens() {
        let want = vec![0.0, 3.0, 1.0, -2.0];
        assert!(compare(&[0.4, 3.9, 1.2, -2.5], &want).is_ok());
        assert!(compare(&[0.0, 3.0, 1.0, 0.0], &want).is_err(), "2.0 off");
        assert!(compare(&[0.0, 3.0, f32::NAN, -2.0], &want).is_err());
        // A clear winner must stay the winner.
        assert!(compare(&[0.0, 3.0, 4.1, -2.0], &want).is_err());
        // Within the margin either may win.
        let close = vec![0.0, 3.0, 2.8, -2.0];
        assert!(compare(&[0.0, 3.0, 3.3, -2.0], &close).is_ok());
        assert!(compare(&[1.0], &want).is_err());
    }
}
