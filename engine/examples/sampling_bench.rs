//! Sampling's cost: microseconds per token to pick from a real 49,152-wide
//! logits row (greedy, temperature 0.8, temperature 0.8 with top-p 0.95,
//! and the full sort the sampler used to do, as the reference), then
//! single-stream decode tokens/s on the real model, greedy against
//! temperature 0.8 / top-p 0.95, alternating. Prints one JSON object.
//! `cargo run --release -p ultrafast-engine --example sampling_bench [-- ROUNDS]`
#![allow(clippy::unwrap_used)]
mod common;
use common::median;
use serde_json::json;
use std::sync::Arc;
use std::time::Instant;
use ultrafast_engine::api::Event;
use ultrafast_engine::sampling::{Sampler, SamplingParams};
use ultrafast_engine::scheduler::GenerateRequest;
use ultrafast_engine::scheduler::{Engine, EngineConfig};
use ultrafast_engine::tokenizer::ChatMessage;
use ultrafast_engine::{fetch, generate};

const TOKENS: usize = 128;

/// Microseconds per call of `f` over `n` calls.
fn per_call(n: usize, mut f: impl FnMut() -> u32) -> f64 {
    let t = Instant::now();
    let mut x = 0u32;
    for _ in 0..n {
        x ^= f();
    }
    std::hint::black_box(x);
    t.elapsed().as_secs_f64() * 1e6 / n as f64
}

/// What the sampler did before: every logit scaled, paired and sorted.
fn full_sort(logits: &[f32], scratch: &mut Vec<(f32, u32)>) -> u32 {
    scratch.clear();
    scratch.extend(logits.iter().enumerate().map(|(i, l)| (*l / 0.8, i as u32)));
    scratch.sort_unstable_by(|a, b| b.0.total_cmp(&a.0));
    scratch[0].1
}

fn decode_tok_s(e: &Engine, l: &generate::Loaded, sampling: SamplingParams) -> f64 {
    let text = l
        .codec
        .render_chat(&[ChatMessage::new(
            "user",
            "Write a very long story about a dragon.",
        )])
        .unwrap();
    let mut rx = e
        .submit(GenerateRequest {
            prompt: l.codec.encode(&text).unwrap(),
            max_tokens: TOKENS,
            sampling,
            stop: Vec::new(),
            lane_rank: 1,
            tenant: None,
            guide: None,
        })
        .unwrap();
    let (mut first, mut n) = (None, 0usize);
    let mut last = Instant::now();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token { .. } => {
                last = Instant::now();
                first.get_or_insert(last);
                n += 1;
            }
            Event::Done { .. } => break,
            Event::Error(e) => panic!("{e}"),
            Event::Raw { .. } => panic!("the engine sent a raw event"),
            Event::Prompt(_) | Event::Logprob(_) | Event::Indexed(..) => {}
        }
    }
    (n - 1) as f64 / last.duration_since(first.unwrap()).as_secs_f64()
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    let l = Arc::new(generate::load(&fetch::pull(&fetch::SMOLLM2).unwrap()).unwrap());
    let prompt = l
        .codec
        .encode(
            &l.codec
                .render_chat(&[ChatMessage::new("user", "Tell me a story.")])
                .unwrap(),
        )
        .unwrap();
    let mut cache = l.model.new_cache();
    let row: Vec<f32> = l
        .model
        .forward(&prompt, &mut cache)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let sampler = |temperature: f32, top_p: f32| {
        Sampler::new(SamplingParams {
            temperature,
            top_p,
            top_k: 0,
            seed: Some(1),
            ..SamplingParams::default()
        })
    };
    let (mut g, mut t, mut tp) = (sampler(0.0, 1.0), sampler(0.8, 1.0), sampler(0.8, 0.95));
    let mut scratch = Vec::new();
    let n = 2000;
    let micro = json!({
        "greedy_us": per_call(n, || g.sample(&row)),
        "temperature_0.8_us": per_call(n, || t.sample(&row)),
        "temperature_0.8_top_p_0.95_us": per_call(n, || tp.sample(&row)),
        "before_full_sort_us": per_call(n, || full_sort(&row, &mut scratch)),
    });
    let e = Engine::start(l.clone(), EngineConfig::default()).unwrap();
    let greedy = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let sampled = SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        seed: Some(5),
        ..SamplingParams::default()
    };
    decode_tok_s(&e, &l, greedy.clone()); // warm-up
    let (mut gs, mut ss) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        gs.push(decode_tok_s(&e, &l, greedy.clone()));
        ss.push(decode_tok_s(&e, &l, sampled.clone()));
    }
    let cpu = common::cpu_model();
    let (gm, sm) = (median(gs.clone()), median(ss.clone()));
    println!(
        "{}",
        json!({"cpu": cpu, "vocab": row.len(), "sample_call": micro, "decode_tokens": TOKENS,
            "decode_tok_s": {"greedy": gm, "temperature_0.8_top_p_0.95": sm, "runs_greedy": gs, "runs_sampled": ss},
            "sampled_vs_greedy": sm / gm})
    );
}
