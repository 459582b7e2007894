//! What schema-constrained sequences cost the unconstrained ones batched
//! with them: decode tokens/s of four unconstrained streams when the other
//! four streams of the batch are constrained by a JSON schema, against the
//! same four when all eight are unconstrained, alternating the two in one
//! run. The constrained streams' schema cannot end within `max_tokens` (a
//! string of at least 4000 characters), so the batch keeps its size.
//! Prints one JSON object with the medians and their ratio.
//! `cargo run --release -p ultrafast-engine --example structured_bench [-- ROUNDS]`
#![allow(clippy::unwrap_used)]
mod common;
use common::median;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};
use ultrafast_engine::api::{Event, Structure};
use ultrafast_engine::sampling::SamplingParams;
use ultrafast_engine::scheduler::GenerateRequest;
use ultrafast_engine::scheduler::{Engine, EngineConfig};
use ultrafast_engine::tokenizer::ChatMessage;
use ultrafast_engine::{fetch, generate};

const STREAMS: usize = 8;
const MAX_TOKENS: usize = 96;
const TOPICS: [&str; STREAMS] = [
    "a dragon", "the sea", "a robot", "a city", "a forest", "a ship", "a king", "a storm",
];

/// Token arrival times of each stream.
fn run(e: &Engine, l: &generate::Loaded, constrained: bool) -> Vec<Vec<Instant>> {
    let schema = Structure::Json(json!({"type": "object", "properties": {
        "story": {"type": "string", "minLength": 4000}}, "required": ["story"]}));
    let rxs: Vec<_> = TOPICS
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let q = format!("Write a very long story about {t}.");
            let text = l.codec.render_chat(&[ChatMessage::new("user", q)]).unwrap();
            let guide = (constrained && i >= STREAMS / 2)
                .then(|| l.guides.as_ref().unwrap().compile(&schema).unwrap());
            e.submit(GenerateRequest {
                prompt: l.codec.encode(&text).unwrap(),
                max_tokens: MAX_TOKENS,
                sampling: SamplingParams {
                    temperature: 0.0,
                    ..SamplingParams::default()
                },
                stop: Vec::new(),
                lane_rank: 1,
                tenant: None,
                guide,
            })
            .unwrap()
        })
        .collect();
    let threads: Vec<_> = rxs
        .into_iter()
        .map(|mut rx| {
            std::thread::spawn(move || {
                let mut at = Vec::new();
                while let Some(ev) = rx.blocking_recv() {
                    match ev {
                        Event::Token { .. } => at.push(Instant::now()),
                        Event::Done { .. } => break,
                        Event::Error(e) => panic!("{e}"),
                        Event::Raw { .. } => panic!("the engine sent a raw event"),
                        Event::Prompt(_) | Event::Logprob(_) | Event::Indexed(..) => {
                            panic!("nothing asked for reports or choices")
                        }
                    }
                }
                at
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    let l = Arc::new(generate::load(&fetch::pull(&fetch::SMOLLM2).unwrap()).unwrap());
    let e = Engine::start(
        l.clone(),
        EngineConfig {
            max_num_seqs: 16,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    run(&e, &l, true); // warm-up
    let (mut none, mut half) = (Vec::new(), Vec::new());
    let mut min_tokens = usize::MAX;
    let t0 = Instant::now();
    for _ in 0..rounds {
        for constrained in [false, true] {
            let a = run(&e, &l, constrained);
            min_tokens = min_tokens.min(a.iter().map(Vec::len).min().unwrap());
            let r = common::half_rate(&a, STREAMS / 2);
            if constrained {
                half.push(r)
            } else {
                none.push(r)
            }
        }
        if t0.elapsed() > Duration::from_secs(600) {
            break;
        }
    }
    let cpu = common::cpu_model();
    let (n, h) = (median(none.clone()), median(half.clone()));
    println!(
        "{}",
        json!({"cpu": cpu, "streams": STREAMS, "max_tokens": MAX_TOKENS, "rounds": none.len(),
            "fewest_tokens_of_a_stream": min_tokens,
            "unconstrained_half_tok_s": {"all_unconstrained": n, "half_constrained": h,
                "runs_all_unconstrained": none, "runs_half_constrained": half},
            "ratio": h / n})
    );
}
