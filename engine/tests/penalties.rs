//! Penalties, logit bias and `min_p` on the real model (#49 part 2): a
//! banned token never appears, a forced one is all there is, frequency,
//! presence and repetition penalties lower the repeats of a greedy
//! generation (counted), `min_p = 1` samples exactly what greedy picks,
//! and a biased sequence batched beside a plain one leaves the plain one
//! as it is alone.

#![allow(clippy::unwrap_used)]
use std::collections::HashSet;
use std::sync::OnceLock;
use ultrafast_engine::api::Event;
use ultrafast_engine::sampling::SamplingParams;
use ultrafast_engine::scheduler::{Engine, EngineConfig, GenerateRequest};

mod common;
use common::loaded;

fn engine() -> &'static Engine {
    static E: OnceLock<Engine> = OnceLock::new();
    E.get_or_init(|| Engine::start(loaded(), EngineConfig::default()).unwrap())
}

fn req(q: &str, sampling: SamplingParams, max_tokens: usize) -> GenerateRequest {
    common::request(common::prompt(q), sampling, max_tokens)
}

fn ids(mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> Vec<u32> {
    let mut out = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token { id, .. } => out.push(id),
            Event::Done { .. } => return out,
            Event::Error(e) => panic!("engine error: {e}"),
            Event::Raw { .. } => panic!("the engine sent a raw event"),
            Event::Prompt(_) | Event::Logprob(_) | Event::Indexed(..) => {
                panic!("nothing asked for reports or choices")
            }
        }
    }
    out
}

fn run(q: &str, sampling: SamplingParams, max_tokens: usize) -> Vec<u32> {
    ids(engine().submit(req(q, sampling, max_tokens)).unwrap())
}

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..Default::default()
    }
}

/// Tokens generated again after their first appearance.
fn repeats(ids: &[u32]) -> usize {
    ids.len() - ids.iter().collect::<HashSet<_>>().len()
}

/// A prompt the model answers with a loop (47 of 64 greedy tokens are
/// repeats).
const LOOPY: &str = "Write a poem where every line is 'the cat sat on the mat'.";

#[test]
fn a_banned_token_never_appears_and_a_forced_one_is_all_there_is() {
    let plain = run("What is the capital of France?", greedy(), 24);
    assert!(plain.len() >= 4, "{plain:?}");
    let banned = plain[0];
    let out = run(
        "What is the capital of France?",
        SamplingParams {
            logit_bias: vec![(banned, -100.0)],
            ..greedy()
        },
        24,
    );
    assert!(!out.contains(&banned), "{banned} in {out:?}");
    assert_ne!(out, plain);
    // +100 on a token the model would not pick first: every step picks it.
    let forced = *plain.iter().find(|t| **t != plain[0]).unwrap();
    let out = run(
        "What is the capital of France?",
        SamplingParams {
            logit_bias: vec![(forced, 100.0)],
            ..greedy()
        },
        12,
    );
    assert_eq!(out, vec![forced; 12]);
}

#[test]
fn penalties_lower_the_repeats_of_a_greedy_generation() {
    let base = run(LOOPY, greedy(), 64);
    let base_repeats = repeats(&base);
    assert!(base_repeats >= 20, "the prompt should loop: {base:?}");
    for (name, p) in [
        (
            "frequency_penalty",
            SamplingParams {
                frequency_penalty: 1.5,
                ..greedy()
            },
        ),
        (
            "presence_penalty",
            SamplingParams {
                presence_penalty: 1.5,
                ..greedy()
            },
        ),
        (
            "repetition_penalty",
            SamplingParams {
                repetition_penalty: 1.8,
                ..greedy()
            },
        ),
    ] {
        let out = run(LOOPY, p, 64);
        let r = repeats(&out);
        println!("{name}: {base_repeats} repeats without, {r} with");
        // At least a quarter fewer.
        assert!(
            r * 4 <= base_repeats * 3,
            "{name}: {r} repeats with it, {base_repeats} without: {out:?}"
        );
    }
    // A negative frequency penalty does the opposite: no fewer repeats.
    let out = run(
        LOOPY,
        SamplingParams {
            frequency_penalty: -1.0,
            ..greedy()
        },
        64,
    );
    assert!(repeats(&out) >= base_repeats, "{out:?}");
}

#[test]
fn min_p_of_one_keeps_only_the_likeliest_token() {
    let plain = run("Name three colors.", greedy(), 24);
    for seed in [1, 2, 3] {
        let out = run(
            "Name three colors.",
            SamplingParams {
                temperature: 1.0,
                min_p: 1.0,
                seed: Some(seed),
                ..Default::default()
            },
            24,
        );
        assert_eq!(out, plain, "seed {seed}");
    }
}

#[test]
fn a_biased_sequence_leaves_its_batch_neighbour_alone() {
    let alone = run("Name three colors.", greedy(), 24);
    let e = engine();
    let biased = e
        .submit(req(
            "Name three colors.",
            SamplingParams {
                logit_bias: vec![(alone[0], -100.0)],
                frequency_penalty: 2.0,
                ..greedy()
            },
            24,
        ))
        .unwrap();
    let plain = e.submit(req("Name three colors.", greedy(), 24)).unwrap();
    let (b, p) = (ids(biased), ids(plain));
    assert_eq!(p, alone);
    assert!(!b.contains(&alone[0]));
}

#[test]
fn min_p_is_cut_after_the_grammar_mask() {
    // Were min_p cut before the mask, a likeliest token the grammar
    // forbids could take every allowed one with it.
    let l = loaded();
    let schema = serde_json::json!({"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
        "additionalProperties": false});
    let s = ultrafast_engine::api::Structure::Json(schema);
    for seed in [1, 2] {
        let mut r = req(
            "Say hello.",
            SamplingParams {
                temperature: 1.0,
                min_p: 0.9,
                seed: Some(seed),
                ..Default::default()
            },
            40,
        );
        r.guide = Some(l.guides.as_ref().unwrap().compile(&s).unwrap());
        let text = l.codec.decode(&run_req(r), true).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(
            ["red", "green", "blue"].contains(&v["color"].as_str().unwrap()),
            "{text}"
        );
    }
}

fn run_req(r: GenerateRequest) -> Vec<u32> {
    ids(engine().submit(r).unwrap())
}
