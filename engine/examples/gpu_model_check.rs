//! The GPU check's model parity and speed: the CUDA runner against the
//! reference runner (the kernels' CPU references in the CUDA runner's
//! step layout) on random weights with SmolLM2-135M's shapes and tensor
//! types (the 94 MB file does not travel to the GPU machine), then the
//! CUDA runner's speed with and without CUDA graphs and cuBLAS prompts.
//! Exits 1 on a parity failure, 2 without a GPU. Run through
//! `bash benches/scripts/gpu_check.sh`.
//!
//! Parity, stated once and never loosened to pass:
//! - the GEMV path (prompts through the GEMV, decode with and without
//!   graphs): every logit within 0.05 + 1% of the reference's magnitude
//!   (the GPU sums in a different order, with fast-math `exp` and f16 K/V
//!   as the reference), and the greedy token equal wherever the
//!   reference's top-two margin is at least 0.5;
//! - a decode step through its graph: logits bit-identical to the same
//!   step run directly (the same kernels on the same rows);
//! - prompts through cuBLAS (bfloat16 weights and activations): every
//!   logit within 0.1 + 2%, the greedy token as above;
//! - candidates: a step's top-k pairs equal the top-k of its whole row.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Instant;
use ultrafast_engine::backend::blocks::{smollm2_shapes, FileWeights};
use ultrafast_engine::backend::cuda::{CudaOptions, CudaRunner};
use ultrafast_engine::backend::logits::{Need, Row, StepLogits};
use ultrafast_engine::backend::probe::agreement;
use ultrafast_engine::backend::reference::ReferenceRunner;
use ultrafast_engine::backend::ModelRunner;
use ultrafast_engine::model::paged::SeqStep;
use ultrafast_engine::sampling::argmax;

const BLOCK: usize = 16;
const BLOCKS: usize = 4096;

/// Largest |a - b| over rows of `vocab`, and the parity verdict at
/// `abs + rel * |b|` (`probe::agreement` on each row).
fn compare(gpu: &[f32], reference: &[f32], vocab: usize, abs: f32, rel: f32) -> (f32, bool) {
    let mut worst = 0.0f32;
    let mut ok = gpu.len() == reference.len();
    for (g, r) in gpu.chunks(vocab).zip(reference.chunks(vocab)) {
        let (w, verdict) = agreement(g, r, |b| abs + rel * b);
        worst = worst.max(w);
        ok &= verdict.is_ok();
    }
    (worst, ok)
}

struct Check {
    failed: bool,
}

impl Check {
    fn row(&mut self, what: &str, worst: f32, ok: bool) {
        self.failed |= !ok;
        println!(
            "| {what} | {worst:.4} | {} |",
            if ok { "pass" } else { "FAIL" }
        );
    }
}

fn seq<'a>(tokens: &'a [u32], start: usize, blocks: &'a [u32]) -> SeqStep<'a> {
    SeqStep {
        tokens,
        start,
        blocks,
    }
}

fn main() {
    let cfg = smollm2_shapes();
    let t = Instant::now();
    let opts = CudaOptions {
        graphs: true,
        gemm: true,
    };
    let w = FileWeights::synthetic(cfg.clone(), 7);
    let mut gpu = match CudaRunner::new(w, 0, BLOCKS, BLOCK, opts) {
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
    let weights = Arc::new(FileWeights::synthetic(cfg.clone(), 7));
    let mut reference = ReferenceRunner::new(weights, 64, BLOCK);
    let vocab = cfg.vocab;
    let mut check = Check { failed: false };
    println!("\n| model parity (random weights, SmolLM2-135M shapes) | max abs diff | verdict |");
    println!("|---|---|---|");
    if !gpu.options().gemm {
        check.row("cuBLAS loaded for prompt GEMMs", 0.0, false);
    }

    // One sequence: a 24-token prompt through the GEMV, then 8 greedy
    // decode steps, each with and without its graph.
    gpu.set_gemm(false);
    let blocks: Vec<u32> = (0..8).map(|i| 63 - i).collect();
    let mut toks: Vec<u32> = (0..24).map(|i| (i * 7919 + 11) % 49_000).collect();
    let mut start = 0;
    for step in 0..9 {
        let chunk: Vec<u32> = toks[start..].to_vec();
        let s = [seq(&chunk, start, &blocks)];
        let (mut a, mut b, mut direct) = (Vec::new(), Vec::new(), Vec::new());
        gpu.set_graphs(true);
        gpu.step(&s, &|_| false, &mut a).unwrap();
        reference.step(&s, &|_| false, &mut b).unwrap();
        let (worst, ok) = compare(&a, &b, vocab, 0.05, 0.01);
        let what = if step == 0 {
            "prefill 24 (GEMV)"
        } else {
            "decode (graph)"
        };
        check.row(&format!("step {step}: {what}"), worst, ok);
        if step > 0 {
            // The same tokens again store the same K/V: run it directly.
            gpu.set_graphs(false);
            gpu.step(&s, &|_| false, &mut direct).unwrap();
            let same = direct == a;
            check.row(
                &format!("step {step}: graph = direct, bit for bit"),
                0.0,
                same,
            );
        }
        start = toks.len();
        toks.push(argmax(&b));
    }
    gpu.set_graphs(true);

    // The 24-token prompt again through cuBLAS (same K/V rewritten).
    gpu.set_gemm(true);
    let s = [seq(&toks[..24], 0, &blocks)];
    let (mut a, mut b) = (Vec::new(), Vec::new());
    gpu.step(&s, &|_| false, &mut a).unwrap();
    reference.step(&s, &|_| false, &mut b).unwrap();
    let (worst, ok) = compare(&a, &b, vocab, 0.1, 0.02);
    check.row("prefill 24 (cuBLAS bf16)", worst, ok);

    // Three sequences in one decode step (a bucket of 4 with a padding row),
    // after their prompts in one step; then candidates from the device.
    let tables: Vec<Vec<u32>> = (0..3).map(|s| vec![10 + s, 20 + s]).collect();
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|s| (0..5 + s).map(|i| i * 31 + s).collect())
        .collect();
    let pre: Vec<SeqStep> = (0..3).map(|s| seq(&prompts[s], 0, &tables[s])).collect();
    gpu.step(&pre, &|_| false, &mut a).unwrap();
    reference.step(&pre, &|_| false, &mut b).unwrap();
    let next: Vec<[u32; 1]> = b.chunks(vocab).map(|r| [argmax(r)]).collect();
    let dec: Vec<SeqStep> = (0..3)
        .map(|s| seq(&next[s], prompts[s].len(), &tables[s]))
        .collect();
    gpu.step(&dec, &|_| false, &mut a).unwrap();
    reference.step(&dec, &|_| false, &mut b).unwrap();
    let (worst, ok) = compare(&a, &b, vocab, 0.05, 0.01);
    check.row("3 sequences, one decode step (graph, bucket 4)", worst, ok);
    let mut out = StepLogits::default();
    let needs = [Need::Top(8), Need::Full, Need::Top(1)];
    gpu.step_for(&dec, &needs, &|_| false, &mut out).unwrap();
    let mut same = true;
    for (i, need) in needs.iter().enumerate() {
        let row = &a[i * vocab..][..vocab];
        same &= match (need, out.row(i, vocab)) {
            (Need::Top(k), Some(Row::Top(c))) => {
                c == ultrafast_kernels::reference::top_k(row, *k).as_slice()
            }
            (Need::Full, Some(Row::Full(r))) => r == row,
            _ => false,
        };
    }
    check.row(
        "candidates: device top-k = top-k of the whole row",
        0.0,
        same,
    );
    // Scores from candidates: the device's log-normaliser of each row.
    let needs = [Need::Scored(4), Need::Full, Need::Scored(1)];
    gpu.step_for(&dec, &needs, &|_| false, &mut out).unwrap();
    let mut worst = 0.0f32;
    let mut same = true;
    for i in [0, 2] {
        let row = &a[i * vocab..][..vocab];
        match out.row(i, vocab) {
            Some(Row::Scored(c, n)) => {
                let want = ultrafast_kernels::reference::log_norm(row);
                worst = worst.max((n - want).abs() / (1.0 + want.abs()));
                same &= c == ultrafast_kernels::reference::top_k(row, needs[i].k()).as_slice();
            }
            _ => same = false,
        }
    }
    check.row(
        "scored: log_norm on the device",
        worst,
        same && worst < 1e-4,
    );
    // A scored prompt: every row of its chunk, each the last row of the
    // prompt up to it (the same K/V rewritten).
    let p0 = seq(&prompts[0], 0, &tables[0]);
    gpu.step_for(&[p0], &[Need::Every], &|_| false, &mut out)
        .unwrap();
    let rows = out.every(0, vocab).map(<[f32]>::to_vec).unwrap_or_default();
    let mut worst = 0.0f32;
    let mut ok = rows.len() == prompts[0].len() * vocab;
    for j in 0..prompts[0].len().min(rows.len() / vocab) {
        reference
            .step(&[seq(&prompts[0][..=j], 0, &tables[0])], &|_| false, &mut b)
            .unwrap();
        let (w, o) = compare(&rows[j * vocab..][..vocab], &b, vocab, 0.05, 0.01);
        worst = worst.max(w);
        ok &= o;
    }
    check.row("scored prompt: every row's logits", worst, ok);

    speed(&mut gpu);
    if check.failed {
        println!("\ngpu_model_check: model parity FAILED");
        std::process::exit(1);
    }
    println!("\ngpu_model_check: model parity passed");
}

/// Speed of the CUDA runner alone: tokens sampled greedily on the device
/// (one id copied back per sequence), with and without graphs and GEMMs.
fn speed(gpu: &mut CudaRunner) {
    println!("\n| speed (CUDA runner, greedy on the device) | value |");
    println!("|---|---|");
    let mut out = StepLogits::default();
    let table: Vec<u32> = (0..48).collect();
    let prompt: Vec<u32> = (0..512).map(|i| (i * 104_729 + 3) % 49_000).collect();
    let first = |out: &mut StepLogits, i: usize| match out.row(i, 0) {
        Some(Row::Top(c)) => c[0].0,
        _ => 0,
    };
    for gemm in [true, false] {
        gpu.set_gemm(gemm);
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            gpu.step_for(
                &[seq(&prompt, 0, &table)],
                &[Need::Top(1)],
                &|_| false,
                &mut out,
            )
            .unwrap();
            best = best.min(t.elapsed().as_secs_f64());
        }
        let how = if gemm { "cuBLAS bf16" } else { "GEMV" };
        println!(
            "| prefill, 512-token prompt ({how}), best of 3 | {:.2} ms ({:.0} tokens/s) |",
            best * 1e3,
            512.0 / best
        );
    }
    gpu.set_gemm(true);
    for graphs in [true, false] {
        gpu.set_graphs(graphs);
        let how = if graphs { "graphs" } else { "no graphs" };
        let mut tok = [first(&mut out, 0)];
        // A first step captures the graph; timed from the second.
        let one = |gpu: &mut CudaRunner, tok: &[u32; 1], at: usize, out: &mut StepLogits| {
            gpu.step_for(&[seq(tok, at, &table)], &[Need::Top(1)], &|_| false, out)
                .unwrap()
        };
        one(gpu, &tok, 512, &mut out);
        let t = Instant::now();
        for i in 1..=128 {
            one(gpu, &tok, 512 + i, &mut out);
            tok = [first(&mut out, 0)];
        }
        println!(
            "| single-stream decode ({how}) | {:.1} tokens/s |",
            128.0 / t.elapsed().as_secs_f64()
        );
        let tables: Vec<Vec<u32>> = (0..64u32)
            .map(|s| (0..4).map(|b| 1000 + s * 4 + b).collect())
            .collect();
        let mut toks: Vec<[u32; 1]> = (0..64).map(|s| [s as u32 + 1]).collect();
        let needs = [Need::Top(1); 64];
        let mut run = |toks: &[[u32; 1]], at: usize, out: &mut StepLogits| {
            let seqs: Vec<SeqStep> = (0..64).map(|s| seq(&toks[s], at, &tables[s])).collect();
            gpu.step_for(&seqs, &needs, &|_| false, out).unwrap();
        };
        run(&toks, 0, &mut out);
        let t = Instant::now();
        for i in 1..=32 {
            run(&toks, i, &mut out);
            for (s, tok) in toks.iter_mut().enumerate() {
                *tok = [first(&mut out, s)];
            }
        }
        println!(
            "| aggregate decode, 64 streams ({how}) | {:.1} tokens/s |",
            64.0 * 32.0 / t.elapsed().as_secs_f64()
        );
    }
    gpu.set_graphs(true);
}
