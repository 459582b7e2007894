//! Golden correctness against an independent float32 reference written in
//! Python with the `gguf` package and numpy (`tests/reference/llama_ref.py`):
//! over 32 steps both follow the reference's greedy tokens (teacher forcing),
//! and at every step where the reference's top-two margin is at least 0.5
//! logits our argmax must be the reference's token (below that, a near-tie
//! that quantized arithmetic may legitimately flip, the step is skipped,
//! never loosened); first-step logits must agree within the stated
//! tolerance.

#![allow(clippy::unwrap_used)]
mod common;
use candle_core::D;
use ultrafast_engine::backend::cpu::CpuRunner;
use ultrafast_engine::backend::KvDtype;
use ultrafast_engine::fetch::{self, QWEN25_CODER, SMOLLM2};
use ultrafast_engine::generate;
use ultrafast_engine::kv::BlockPool;
use ultrafast_engine::model::paged::SeqStep;
use ultrafast_engine::sampling::argmax;
use ultrafast_engine::tokenizer::ChatMessage;

const STEPS: usize = 32;
const NEAR_TIE: f64 = 0.5;
/// Largest allowed first-step logit difference (over all 49,152 logits),
/// by path. Candle: Q4_1 layers on f32 activations, only the Q8_0 output
/// head quantizes them to 8 bits; measured 0.30-0.40 on these prompts.
/// The engine's kernels quantize the activations of every product to 8
/// bits per 32 values (as llama.cpp does for these types) and keep K/V in
/// f16: measured 0.57-1.20 against the reference kept in f32 throughout
/// (0.54-0.99 when the reference's attention promoted the rest of each
/// layer to f64; 0.68-1.09 with an f32 cache, so the cache is not the
/// cause). The token rule below is the same for both.
const LOGIT_TOL: [f32; 2] = [1.0, 1.5];

/// A forward pass under test: (prompt, forced tokens) -> (first-step
/// logits, each step's argmax).
type Path<'a> = dyn Fn(&[u32], &[u32]) -> (Vec<f32>, Vec<u32>) + 'a;

const QUESTIONS: [&str; 5] = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "What is 12 times 13?",
    "List three primary colors.",
    "Explain in two sentences why the sky is blue.",
];

/// SmolLM2 (Q4_1 and Q8_0 tensors, llama layout), or any GGUF named by
/// `ULTRAFAST_GOLDEN_MODEL`: both forward passes, five prompts.
#[test]
fn greedy_tokens_and_logits_match_the_float32_reference() {
    let path = match std::env::var_os("ULTRAFAST_GOLDEN_MODEL") {
        Some(p) => std::path::PathBuf::from(p),
        None => fetch::pull(&SMOLLM2).unwrap(),
    };
    check(&path, &QUESTIONS, true, LOGIT_TOL[1], 100);
}

/// Qwen2.5-Coder-0.5B Q4_K_M (Q5_0, Q8_0, Q4_K and Q6_K tensors, rewritten
/// at load; qwen2 layout: Q/K/V biases, NEOX rotary, untied head) on the
/// engine's kernels (candle's pass is this model's fallback only), five
/// prompts: first-step logits measured within 0.18-0.30 of the reference
/// (SmolLM2's: 0.57-1.20), 143 of 160 steps comparable, all equal.
#[test]
fn qwen2_greedy_tokens_and_logits_match_the_float32_reference() {
    let path = fetch::pull(&QWEN25_CODER).unwrap();
    check(&path, &QUESTIONS, false, QWEN_LOGIT_TOL, 100);
}

/// See the Qwen2.5 test: about twice the largest measured difference.
const QWEN_LOGIT_TOL: f32 = 0.6;

/// Teacher-forced check of `path` on `questions`: the kernels (and with
/// `candle_too`, candle's pass at its own tolerance) against the float32
/// reference; at least `min_compared` steps must be comparable.
fn check(
    path: &std::path::Path,
    questions: &[&str],
    candle_too: bool,
    tol: f32,
    min_compared: usize,
) {
    let l = generate::load(path).unwrap();
    let prompts: Vec<Vec<u32>> = questions
        .iter()
        .map(|q| {
            let text = l
                .codec
                .render_chat(&[ChatMessage::new("user", q.to_string())])
                .unwrap();
            l.codec.encode(&text).unwrap()
        })
        .collect();
    let refs = common::float32_reference(
        &serde_json::json!({"model": path, "prompts": prompts, "steps": STEPS}),
    );
    // Both forward passes: candle's (contiguous cache) and the engine's
    // own kernels (the runner the scheduler uses), each teacher-forced on
    // the reference's tokens; returns first-step logits and each step's
    // argmax.
    let candle = |ids: &[u32], forced: &[u32]| -> (Vec<f32>, Vec<u32>) {
        let mut cache = l.model.new_cache();
        let mut logits = l.model.forward(ids, &mut cache).unwrap();
        let first: Vec<f32> = logits.to_vec1().unwrap();
        let mut picks = Vec::new();
        for t in forced {
            picks.push(
                logits
                    .argmax(D::Minus1)
                    .unwrap()
                    .to_scalar::<u32>()
                    .unwrap(),
            );
            logits = l.model.forward(&[*t], &mut cache).unwrap();
        }
        (first, picks)
    };
    let pool = BlockPool::new(64, 16);
    let runner = std::cell::RefCell::new(
        CpuRunner::new(
            l.fast.as_ref().unwrap().clone(),
            64,
            16,
            KvDtype::F16,
            2,
            || {},
        )
        .unwrap(),
    );
    let kernels = |ids: &[u32], forced: &[u32]| -> (Vec<f32>, Vec<u32>) {
        let mut r = runner.borrow_mut();
        let mut seq = pool.allocate(ids).unwrap();
        let mut step = |toks: &[u32], start: usize, blocks: &[u32]| {
            let s = SeqStep {
                tokens: toks,
                start,
                blocks,
            };
            let mut logits = Vec::new();
            assert!(r.step(&[s], &|_| false, &mut logits).unwrap());
            logits
        };
        let mut logits = step(ids, 0, seq.blocks());
        let first = logits.clone();
        let mut picks = Vec::new();
        for (k, t) in forced.iter().enumerate() {
            picks.push(argmax(&logits));
            let pos = ids.len() + k;
            assert!(pool.grow(&mut seq, pos + 1));
            logits = step(&[*t], pos, seq.blocks());
        }
        (first, picks)
    };
    let mut paths: Vec<(&str, &Path, f32)> = vec![("kernels", &kernels, tol)];
    if candle_too {
        paths.insert(0, ("candle", &candle, LOGIT_TOL[0]));
    }
    for (name, run, tol) in paths {
        let mut compared = 0;
        for (i, (ids, r)) in prompts.iter().zip(&refs).enumerate() {
            let ref_first: Vec<f32> = r["first_logits"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .collect();
            let ref_tokens: Vec<u32> = r["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let margins: Vec<f64> = r["margins"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect();
            let (first, picks) = run(ids, &ref_tokens[..STEPS]);
            let max_diff = first
                .iter()
                .zip(&ref_first)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(
                max_diff < tol,
                "{name}, prompt {i}: first-step logits differ by up to {max_diff}"
            );
            let mut skipped = 0;
            for step in 0..STEPS {
                if margins[step] >= NEAR_TIE {
                    assert_eq!(
                        picks[step], ref_tokens[step],
                        "{name}, prompt {i} ({:?}) step {step}",
                        questions[i]
                    );
                    compared += 1;
                } else {
                    skipped += 1;
                }
            }
            eprintln!("{name}, prompt {i}: max first-step logit diff {max_diff:.3}, {skipped} near-tie step(s) skipped");
        }
        // Free text has many near-ties (after punctuation, past the end of an
        // answer); for SmolLM2 115 of 160 steps are comparable, all equal.
        assert!(
            compared >= min_compared,
            "{name}: only {compared} of {} steps were comparable",
            questions.len() * STEPS
        );
    }
}
