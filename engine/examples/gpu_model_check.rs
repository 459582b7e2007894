//! The GPU check's model parity and speed: the CUDA runner against the
//! reference runner (the kernels' CPU references in the CUDA runner's
//! step layout) on random weights with SmolLM2-135M's shapes and tensor
//! types (the 94 MB file does not travel to the GPU machine), then the
//! CUDA runner's speed. Exits 1 on a parity failure, 2 without a GPU.
//! Run through `bash benches/scripts/gpu_check.sh`.
//!
//! Parity, stated once and never loosened to pass: every logit within
//! 0.05 + 1% of the reference's magnitude (the GPU sums in a different
//! order, with fast-math `exp` and f16 K/V as the reference), and the
//! greedy token equal wherever the reference's top-two margin is at least
//! 0.5.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Instant;
use ultrafast_engine::backend::blocks::{smollm2_shapes, FileWeights};
use ultrafast_engine::backend::cuda::CudaRunner;
use ultrafast_engine::backend::reference::ReferenceRunner;
use ultrafast_engine::backend::ModelRunner;
use ultrafast_engine::model::paged::SeqStep;
use ultrafast_engine::sampling::argmax;

const BLOCK: usize = 16;
const BLOCKS: usize = 4096;

/// Largest |a - b| beyond the tolerance's scale, and the parity verdict.
fn compare(gpu: &[f32], reference: &[f32], vocab: usize) -> (f32, bool) {
    let mut worst = 0.0f32;
    let mut ok = true;
    for (g, r) in gpu.chunks(vocab).zip(reference.chunks(vocab)) {
        for (a, b) in g.iter().zip(r) {
            let d = (a - b).abs();
            worst = worst.max(d);
            ok &= d <= 0.05 + 0.01 * b.abs();
        }
        let mut top: Vec<f32> = r.to_vec();
        top.sort_by(|x, y| y.total_cmp(x));
        if top[0] - top[1] >= 0.5 {
            ok &= argmax(g) == argmax(r);
        }
    }
    (worst, ok)
}

fn main() {
    let cfg = smollm2_shapes();
    let t = Instant::now();
    let mut gpu = match CudaRunner::new(FileWeights::synthetic(cfg.clone(), 7), 0, BLOCKS, BLOCK) {
        Ok(r) => r,
        Err(e) => {
            println!("gpu_model_check: no GPU runner: {e}");
            std::process::exit(2);
        }
    };
    println!(
        "gpu_model_check: {} ready in {:.2} s",
        gpu.describe(),
        t.elapsed().as_secs_f64()
    );
    let mut reference =
        ReferenceRunner::new(Arc::new(FileWeights::synthetic(cfg.clone(), 7)), 64, BLOCK);
    let vocab = cfg.vocab;
    let mut failed = false;
    println!("\n| model parity (random weights, SmolLM2-135M shapes) | max abs diff | verdict |");
    println!("|---|---|---|");

    // One sequence: a 24-token prompt, then 8 greedy decode steps.
    let blocks: Vec<u32> = (0..8).map(|i| 63 - i).collect();
    let mut toks: Vec<u32> = (0..24).map(|i| (i * 7919 + 11) % 49_000).collect();
    let mut start = 0;
    for step in 0..9 {
        let chunk: Vec<u32> = toks[start..].to_vec();
        let s = [SeqStep {
            tokens: &chunk,
            start,
            blocks: &blocks,
        }];
        let (mut a, mut b) = (Vec::new(), Vec::new());
        gpu.step(&s, &|_| false, &mut a).unwrap();
        reference.step(&s, &|_| false, &mut b).unwrap();
        let (worst, ok) = compare(&a, &b, vocab);
        failed |= !ok;
        let what = if step == 0 { "prefill 24" } else { "decode" };
        println!(
            "| step {step} ({what}) | {worst:.4} | {} |",
            if ok { "pass" } else { "FAIL" }
        );
        start = toks.len();
        toks.push(argmax(&b));
    }
    // Three sequences in one decode step (a bucket of 4 with a padding row),
    // after their prompts in one step.
    let tables: Vec<Vec<u32>> = (0..3).map(|s| vec![10 + s, 20 + s]).collect();
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|s| (0..5 + s).map(|i| i * 31 + s).collect())
        .collect();
    let pre: Vec<SeqStep> = (0..3)
        .map(|s| SeqStep {
            tokens: &prompts[s],
            start: 0,
            blocks: &tables[s],
        })
        .collect();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    gpu.step(&pre, &|_| false, &mut a).unwrap();
    reference.step(&pre, &|_| false, &mut b).unwrap();
    let next: Vec<[u32; 1]> = b.chunks(vocab).map(|r| [argmax(r)]).collect();
    let dec: Vec<SeqStep> = (0..3)
        .map(|s| SeqStep {
            tokens: &next[s],
            start: prompts[s].len(),
            blocks: &tables[s],
        })
        .collect();
    gpu.step(&dec, &|_| false, &mut a).unwrap();
    reference.step(&dec, &|_| false, &mut b).unwrap();
    let (worst, ok) = compare(&a, &b, vocab);
    failed |= !ok;
    println!(
        "| 3 sequences, one decode step | {worst:.4} | {} |",
        if ok { "pass" } else { "FAIL" }
    );

    // Speed (the CUDA runner alone).
    println!("\n| speed (CUDA runner, no graphs yet) | value |");
    println!("|---|---|");
    let mut logits = Vec::new();
    let table: Vec<u32> = (0..40).collect();
    let prompt: Vec<u32> = (0..512).map(|i| (i * 104_729 + 3) % 49_000).collect();
    let t = Instant::now();
    gpu.step(
        &[SeqStep {
            tokens: &prompt,
            start: 0,
            blocks: &table,
        }],
        &|_| false,
        &mut logits,
    )
    .unwrap();
    println!(
        "| prefill, 512-token prompt | {:.1} ms |",
        t.elapsed().as_secs_f64() * 1e3
    );
    let mut tok = [argmax(&logits)];
    let t = Instant::now();
    for i in 0..128 {
        let s = [SeqStep {
            tokens: &tok,
            start: 512 + i,
            blocks: &table,
        }];
        gpu.step(&s, &|_| false, &mut logits).unwrap();
        tok = [argmax(&logits)];
    }
    println!(
        "| single-stream decode | {:.1} tokens/s |",
        128.0 / t.elapsed().as_secs_f64()
    );
    let tables: Vec<Vec<u32>> = (0..64u32)
        .map(|s| (0..4).map(|b| 1000 + s * 4 + b).collect())
        .collect();
    let toks: Vec<[u32; 1]> = (0..64).map(|s| [s as u32 + 1]).collect();
    let t = Instant::now();
    for i in 0..32 {
        let seqs: Vec<SeqStep> = (0..64)
            .map(|s| SeqStep {
                tokens: &toks[s],
                start: i,
                blocks: &tables[s],
            })
            .collect();
        gpu.step(&seqs, &|_| false, &mut logits).unwrap();
    }
    println!(
        "| aggregate decode, 64 streams | {:.1} tokens/s |",
        64.0 * 32.0 / t.elapsed().as_secs_f64()
    );

    if failed {
        println!("\ngpu_model_check: model parity FAILED");
        std::process::exit(1);
    }
    println!("\ngpu_model_check: model parity passed");
}
