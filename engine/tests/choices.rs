//! `n` choices from one prompt (#49 part 3) on the real model: the prompt
//! is computed once and its full blocks shared by the other choices (the
//! block pool's prefix hits count them), every event comes indexed, each
//! choice ends on its own, greedy choices equal the single answer, and
//! seeded sampled choices differ from each other yet repeat run to run.

#![allow(clippy::unwrap_used)]
use std::collections::BTreeMap;
use std::sync::OnceLock;
use ultrafast_engine::api::{Event, MAX_CHOICES};
use ultrafast_engine::sampling::SamplingParams;
use ultrafast_engine::scheduler::{Engine, EngineConfig, GenerateRequest};

mod common;
use common::{loaded, prompt};

fn engine() -> &'static Engine {
    static E: OnceLock<Engine> = OnceLock::new();
    E.get_or_init(|| Engine::start(loaded(), EngineConfig::default()).unwrap())
}

fn req(q: &str, sampling: SamplingParams, max_tokens: usize) -> GenerateRequest {
    common::request(prompt(q), sampling, max_tokens)
}

/// The tests share one engine and count its pool's hits: one at a time.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static M: std::sync::Mutex<()> = std::sync::Mutex::new(());
    M.lock().unwrap_or_else(|e| e.into_inner())
}

/// Each choice's tokens and the prompt tokens it found cached, and how
/// many `Done` each got.
fn run(r: GenerateRequest, n: usize) -> BTreeMap<u32, (Vec<u32>, usize, usize)> {
    let mut rx = engine().submit_n(r, n).unwrap();
    let mut out: BTreeMap<u32, (Vec<u32>, usize, usize)> = BTreeMap::new();
    let mut done = 0;
    while done < n {
        let (i, ev) = match rx.blocking_recv().expect("stream ended early") {
            Event::Indexed(i, ev) => (i, *ev),
            ev if n == 1 => (0, ev),
            ev => panic!("an unindexed event of a request for {n}: {ev:?}"),
        };
        let e = out.entry(i).or_default();
        match ev {
            Event::Token { id, .. } => e.0.push(id),
            Event::Done { usage, .. } => {
                assert_eq!(usage.completion_tokens, e.0.len());
                e.1 += 1;
                e.2 = usage.cached_tokens;
                done += 1;
            }
            Event::Error(m) => panic!("{m}"),
            _ => {}
        }
    }
    out
}

#[test]
fn one_prefill_serves_every_choice() {
    let _one = serial();
    // A prompt of several full blocks, not seen before by this engine.
    let q =
        "Describe, in a few words, the colour of the sky over a calm sea at dawn in late spring.";
    let greedy = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    let len = prompt(q).len();
    let bs = engine().block_size();
    let shareable = (len - 1) / bs;
    assert!(shareable >= 2, "{len} tokens");
    let before = engine().pool_stats();
    let four = run(req(q, greedy.clone(), 12), 4);
    let after = engine().pool_stats();
    assert_eq!(four.len(), 4);
    assert!(
        four.values().all(|(_, d, _)| *d == 1),
        "each choice ends once"
    );
    // The leader computed the prompt's blocks (less what earlier prompts
    // left cached: the chat template's system turn); the three others
    // found them all in the cache.
    let lead_cached = four[&0].2 / bs;
    assert!(
        four.values().skip(1).all(|c| c.2 == shareable * bs),
        "{four:?}"
    );
    assert_eq!(
        after.hits - before.hits,
        (lead_cached + 3 * shareable) as u64
    );
    assert_eq!(
        after.misses - before.misses,
        (len / bs - lead_cached) as u64
    );
    let one = run(req(q, greedy, 12), 1);
    for (tokens, _, _) in four.values() {
        assert_eq!(tokens, &one[&0].0, "greedy choices are the single answer");
    }
}

#[test]
fn seeded_choices_differ_and_repeat() {
    let _one = serial();
    let q = "Name an animal.";
    let sampled = SamplingParams {
        temperature: 1.0,
        seed: Some(7),
        ..Default::default()
    };
    let a = run(req(q, sampled.clone(), 8), MAX_CHOICES);
    let b = run(req(q, sampled, 8), MAX_CHOICES);
    assert_eq!(a.len(), MAX_CHOICES);
    let tokens = |m: &BTreeMap<u32, (Vec<u32>, usize, usize)>| -> Vec<Vec<u32>> {
        m.values().map(|c| c.0.clone()).collect()
    };
    assert_eq!(
        tokens(&a),
        tokens(&b),
        "the same seed gives the same choices"
    );
    let distinct: std::collections::HashSet<&Vec<u32>> = a.values().map(|c| &c.0).collect();
    assert!(distinct.len() > 1, "{a:?}");
    assert!(engine()
        .submit_n(req(q, SamplingParams::default(), 1), MAX_CHOICES + 1)
        .is_err());
}
