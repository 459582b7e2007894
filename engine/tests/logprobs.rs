//! Log-probabilities on the real model (#49 part 1), held to the float32
//! numpy reference (`tests/reference/llama_ref.py`, its `score` mode: one
//! forward pass over every position, a float64 log-softmax of each row):
//! a prompt scored with `echo` and `max_tokens` 0, across chunk
//! boundaries; greedy output's tokens with their alternatives; the two
//! agreeing with each other; and a scored sequence batched beside a plain
//! one leaving the plain one as it is alone.
//!
//! Tolerance: the engine's kernels quantize activations to 8 bits (golden
//! test: first-step logits within 1.5 of the reference), so a token's
//! log-probability is held within [`LP_TOL`] nats; the reference's top
//! alternative must be ours wherever its margin over the second is at
//! least [`NEAR_TIE`] (below that, quantized arithmetic may flip it).

#![allow(clippy::unwrap_used)]
use std::sync::OnceLock;
use ultrafast_engine::api::{Event, TokenLogprob};
use ultrafast_engine::sampling::SamplingParams;
use ultrafast_engine::scheduler::{Engine, EngineConfig};

mod common;
use common::{loaded, prompt, request as req};

/// Measured at most 0.63 (a chat-template token the model finds unlikely),
/// 0.23 over a long plain-text prompt and 0.10 over greedy output (AMD EPYC
/// Zen 3).
const LP_TOL: f64 = 1.0;
const NEAR_TIE: f64 = 0.5;

fn engine() -> &'static Engine {
    static E: OnceLock<Engine> = OnceLock::new();
    E.get_or_init(|| Engine::start(loaded(), EngineConfig::default()).unwrap())
}

/// What a request reported: the prompt's report, the tokens, and each
/// token's report.
#[derive(Default, Debug)]
struct Out {
    prompt: Option<Vec<TokenLogprob>>,
    ids: Vec<u32>,
    scores: Vec<TokenLogprob>,
}

fn collect(mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> Out {
    let mut out = Out::default();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Prompt(p) => {
                assert!(
                    out.prompt.is_none() && out.ids.is_empty(),
                    "one prompt report, first"
                );
                out.prompt = Some(p);
            }
            Event::Logprob(l) => out.scores.push(*l),
            Event::Token { id, .. } => out.ids.push(id),
            Event::Done { .. } => return out,
            Event::Error(e) => panic!("engine error: {e}"),
            Event::Raw { .. } => panic!("the engine sent a raw event"),
            Event::Indexed(..) => panic!("one choice was asked for"),
        }
    }
    out
}

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..Default::default()
    }
}

/// The reference's scores of each id list: per position, None for the
/// first, else (logprob, top [(id, logprob)], margin).
type RefScores = Vec<Option<(f64, Vec<(u32, f64)>, f64)>>;

fn reference(prompts: &[Vec<u32>], k: usize) -> Vec<RefScores> {
    let model = ultrafast_engine::fetch::pull(&ultrafast_engine::fetch::SMOLLM2).unwrap();
    let v = common::float32_reference(
        &serde_json::json!({"model": model, "prompts": prompts, "score": k}),
    );
    v.into_iter()
        .map(|rows| {
            rows.as_array()
                .unwrap()
                .iter()
                .map(|r| {
                    let lp = r["logprob"].as_f64()?;
                    let top = r["top"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap()))
                        .collect();
                    Some((lp, top, r["margin"].as_f64().unwrap()))
                })
                .collect()
        })
        .collect()
}

/// `ours` (reports of `ids[from..]`) against the reference's scores of
/// `ids`: returns the largest log-probability difference.
fn check(ours: &[TokenLogprob], ids: &[u32], refs: &RefScores, from: usize, k: usize) -> f64 {
    let l = loaded();
    let mut worst = 0f64;
    for (i, r) in ours.iter().enumerate() {
        let p = from + i;
        assert_eq!(r.id, ids[p], "position {p}");
        assert_eq!(r.bytes, l.codec.token_bytes(r.id));
        let Some((want, top, margin)) = &refs[p] else {
            assert_eq!(r.logprob, None, "nothing predicts the first token");
            assert!(r.top.is_empty());
            continue;
        };
        let got = r.logprob.unwrap() as f64;
        worst = worst.max((got - want).abs());
        assert!((got - want).abs() < LP_TOL, "position {p}: {got} vs {want}");
        assert_eq!(r.top.len(), k);
        for w in r.top.windows(2) {
            assert!(w[0].logprob >= w[1].logprob, "alternatives likeliest first");
        }
        if *margin >= NEAR_TIE {
            assert_eq!(r.top[0].id, top[0].0, "position {p}: top alternative");
        }
        for a in &r.top {
            // Each alternative's score is the reference's for that token
            // (where the reference lists it too).
            if let Some((_, lp)) = top.iter().find(|(t, _)| *t == a.id) {
                assert!(
                    (a.logprob as f64 - lp).abs() < LP_TOL,
                    "position {p}: alt {}",
                    a.id
                );
            }
            assert_eq!(a.bytes, l.codec.token_bytes(a.id));
        }
        let total: f64 = r.top.iter().map(|a| (a.logprob as f64).exp()).sum();
        assert!(total <= 1.0 + 1e-4);
    }
    worst
}

#[test]
fn prompt_and_output_scores_match_the_float32_reference() {
    // Two prompts: a short chat turn, and one longer than a scored step's
    // chunk (256), so the report is stitched across steps.
    let short = prompt("What is the capital of France?");
    let long_text = "The quick brown fox jumps over the lazy dog. ".repeat(30);
    let long = loaded().codec.encode(&long_text).unwrap();
    assert!(long.len() > 300, "{}", long.len());
    let scoring = SamplingParams {
        echo: true,
        prompt_logprobs: Some(3),
        ..greedy()
    };
    let a = collect(
        engine()
            .submit(req(short.clone(), scoring.clone(), 0))
            .unwrap(),
    );
    let b = collect(engine().submit(req(long.clone(), scoring, 0)).unwrap());
    assert!(
        a.ids.is_empty() && b.ids.is_empty(),
        "max_tokens 0 scores only"
    );
    // Greedy output with its five alternatives per token.
    let gen = collect(
        engine()
            .submit(req(
                short.clone(),
                SamplingParams {
                    logprobs: Some(5),
                    ..greedy()
                },
                8,
            ))
            .unwrap(),
    );
    assert_eq!(gen.scores.len(), gen.ids.len().max(gen.scores.len()));
    let scored_ids: Vec<u32> = gen.scores.iter().map(|s| s.id).collect();
    assert_eq!(&scored_ids[..gen.ids.len()], &gen.ids[..]);
    let full: Vec<u32> = short.iter().chain(&scored_ids).copied().collect();
    let refs = reference(&[short.clone(), long.clone(), full.clone()], 5);
    let (pa, pb) = (a.prompt.unwrap(), b.prompt.unwrap());
    assert_eq!(pa.len(), short.len());
    assert_eq!(pb.len(), long.len());
    let w1 = check(&pa, &short, &refs[0], 0, 3);
    let w2 = check(&pb, &long, &refs[1], 0, 3);
    let w3 = check(&gen.scores, &full, &refs[2], short.len(), 5);
    eprintln!("largest logprob difference: prompt {w1:.3}, long prompt {w2:.3}, output {w3:.3}");
    for s in &gen.scores {
        // Greedy picks the likeliest: its score is the first alternative's.
        assert_eq!(s.top[0].id, s.id);
        assert_eq!(s.top[0].logprob, s.logprob.unwrap());
    }
    // The prompt scored by one pass and the same tokens decoded one at a
    // time agree closely (the kernels' two paths, not the reference).
    let again = collect(
        engine()
            .submit(req(
                full.clone(),
                SamplingParams {
                    echo: true,
                    prompt_logprobs: Some(1),
                    ..greedy()
                },
                0,
            ))
            .unwrap(),
    );
    let echoed = again.prompt.unwrap();
    for (s, e) in gen.scores.iter().zip(&echoed[short.len()..]) {
        let d = (s.logprob.unwrap() - e.logprob.unwrap()).abs();
        assert!(
            d < 0.25,
            "decode {:?} vs prefill {:?}",
            s.logprob,
            e.logprob
        );
    }
}

#[test]
fn a_scored_sequence_leaves_its_batch_neighbour_as_it_is_alone() {
    let q = prompt("Write a haiku about the sea.");
    let alone = collect(engine().submit(req(q.clone(), greedy(), 16)).unwrap());
    let scored = SamplingParams {
        logprobs: Some(20),
        echo: true,
        prompt_logprobs: Some(20),
        ..greedy()
    };
    let rx_scored = engine().submit(req(q.clone(), scored, 16)).unwrap();
    let rx_plain = engine().submit(req(q.clone(), greedy(), 16)).unwrap();
    let (s, p) = (collect(rx_scored), collect(rx_plain));
    assert_eq!(p.ids, alone.ids);
    assert!(
        p.prompt.is_none() && p.scores.is_empty(),
        "nothing asked, nothing sent"
    );
    assert_eq!(
        s.ids, alone.ids,
        "scoring does not change what greedy picks"
    );
    assert_eq!(s.scores.len(), s.ids.len() + usize::from(s.ids.len() < 16));
    assert!(s.scores.iter().all(|r| r.top.len() == 20));
    // Echo alone lists the prompt's tokens without scores.
    let echo = collect(
        engine()
            .submit(req(
                q.clone(),
                SamplingParams {
                    echo: true,
                    ..greedy()
                },
                1,
            ))
            .unwrap(),
    );
    let listed = echo.prompt.unwrap();
    assert_eq!(listed.iter().map(|t| t.id).collect::<Vec<_>>(), q);
    assert!(listed
        .iter()
        .all(|t| t.logprob.is_none() && t.top.is_empty()));
    let text: Vec<u8> = listed.iter().flat_map(|t| t.bytes.clone()).collect();
    assert_eq!(
        String::from_utf8(text).unwrap(),
        loaded().codec.decode(&q, false).unwrap()
    );
}
