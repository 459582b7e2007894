//! The engine thread on the real model: continuous batching gives the same
//! greedy tokens as a lone sequence, preemption by recompute keeps outputs
//! right and returns every block, cancellation frees blocks, the ultra lane
//! goes first, a repeated system prompt is served from the prefix cache, and
//! an impossible request is refused up front.

#![allow(clippy::unwrap_used)]
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use ultrafast_engine::api::{Event, FinishReason, GenerateRequest};
use ultrafast_engine::fetch::{self, SMOLLM2};
use ultrafast_engine::generate::{self, Loaded};
use ultrafast_engine::sampling::{argmax, SamplingParams};
use ultrafast_engine::scheduler::{Engine, EngineConfig};
use ultrafast_engine::tokenizer::ChatMessage;

fn loaded() -> Arc<Loaded> {
    static L: OnceLock<Arc<Loaded>> = OnceLock::new();
    L.get_or_init(|| Arc::new(generate::load(&fetch::pull(&SMOLLM2).unwrap()).unwrap()))
        .clone()
}

fn prompt(q: &str) -> Vec<u32> {
    let l = loaded();
    let t = l
        .codec
        .render_chat(&[ChatMessage {
            role: "user".into(),
            content: q.into(),
        }])
        .unwrap();
    l.codec.encode(&t).unwrap()
}

fn req(p: Vec<u32>, max_tokens: usize, lane: u32) -> GenerateRequest {
    GenerateRequest {
        prompt: p,
        max_tokens,
        sampling: SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        stop: vec![],
        lane_rank: lane,
    }
}

/// Drain a request's events: (token ids, finish, cached tokens, text).
fn collect(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
) -> (Vec<u32>, FinishReason, usize, String) {
    let mut ids = Vec::new();
    let mut text = String::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token { id, text: t } => {
                ids.push(id);
                text.push_str(&t);
            }
            Event::Done {
                text: t,
                finish,
                usage,
                ..
            } => {
                text.push_str(&t);
                assert_eq!(usage.completion_tokens, ids.len());
                return (ids, finish, usage.cached_tokens, text);
            }
            Event::Error(e) => panic!("engine error: {e}"),
        }
    }
    panic!("stream ended without Done")
}

/// Lone greedy decoding, with the top-two logit margin at each step.
fn solo_with_margins(p: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let l = loaded();
    let mut cache = l.model.new_cache();
    let (mut out, mut margins) = (Vec::new(), Vec::new());
    let mut logits = l
        .model
        .forward(p, &mut cache)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    for _ in 0..n {
        let t = argmax(&logits);
        let mut sorted = logits.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        margins.push(sorted[0] - sorted[1]);
        if l.codec.eos.contains(&t) {
            break;
        }
        out.push(t);
        logits = l
            .model
            .forward(&[t], &mut cache)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
    }
    (out, margins)
}

/// `ids` must equal lone greedy decoding of `q`, except that it may part at
/// a near-tie: chunked prefill and recompute sum in a different order than
/// token-by-token decoding (logits agree to ~1e-5), which can flip a choice
/// whose top-two margin is tiny, never a clear one.
fn assert_matches_solo(ids: &[u32], q: &str, n: usize) {
    let (want, margins) = solo_with_margins(&prompt(q), n);
    match ids.iter().zip(&want).position(|(a, b)| a != b) {
        Some(d) => assert!(
            margins[d] < 0.5,
            "{q}: diverged at step {d} where the margin was {}",
            margins[d]
        ),
        None => assert_eq!(ids.len(), want.len(), "{q}"),
    }
}

const QS: [&str; 4] = [
    "What is the capital of France? Answer in one sentence.",
    "Name a prime number larger than ten.",
    "Say hello in Spanish.",
    "How many legs does a spider have?",
];

fn wait_idle(e: &Engine) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline && e.pool_stats().used > 0 {
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn batched_requests_match_lone_greedy_decoding() {
    let e = Engine::start(
        loaded(),
        EngineConfig {
            max_batched_tokens: 64,
            ..Default::default()
        },
    )
    .unwrap();
    let rxs: Vec<_> = QS
        .iter()
        .enumerate()
        .map(|(i, q)| e.submit(req(prompt(q), 10, (i % 2) as u32)).unwrap())
        .collect();
    for (q, rx) in QS.iter().zip(rxs) {
        let (ids, _, _, text) = collect(rx);
        assert_matches_solo(&ids, q, 10);
        assert_eq!(text, loaded().codec.decode(&ids, true).unwrap());
    }
    assert!(e.stats().steps.load(std::sync::atomic::Ordering::Relaxed) > 0);
    wait_idle(&e);
    assert_eq!(e.pool_stats().used, 0);
}

#[test]
fn preemption_by_recompute_keeps_outputs_and_frees_every_block() {
    // 8 blocks of 16 tokens; four requests growing to ~75 tokens (5 blocks
    // each, the first shared through the prefix cache) cannot all fit.
    let e = Engine::start(
        loaded(),
        EngineConfig {
            num_blocks: 8,
            block_size: 16,
            ..Default::default()
        },
    )
    .unwrap();
    let long = [
        "Write a long story about a dragon.",
        "Describe the history of Rome in detail.",
        "Explain in detail how computers work.",
        "Write a long poem about the ocean.",
    ];
    let rxs: Vec<_> = long
        .iter()
        .map(|q| e.submit(req(prompt(q), 40, 1)).unwrap())
        .collect();
    // A preempted sequence recomputes its tokens as one prefill chunk, which
    // sums in a different order than the token-by-token decode it replaces:
    // logits agree to ~1e-5, so the outputs may part only at a near-tie
    // (top-two margin under 0.5 logits, as in the golden test), never
    // where the choice is clear.
    for (q, rx) in long.iter().zip(rxs) {
        let (ids, _, _, _) = collect(rx);
        assert_eq!(ids.len(), 40, "{q}: expected a long answer");
        assert_matches_solo(&ids, q, 40);
    }
    assert!(
        e.stats()
            .preemptions
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0,
        "the pool was never short"
    );
    wait_idle(&e);
    let s = e.pool_stats();
    assert_eq!((s.used, s.free + s.cached), (0, 8));
}

#[test]
fn a_dropped_receiver_cancels_and_frees_blocks() {
    let e = Engine::start(loaded(), EngineConfig::default()).unwrap();
    let mut rx = e
        .submit(req(prompt("Write a long story about a dragon."), 400, 1))
        .unwrap();
    for _ in 0..3 {
        assert!(matches!(rx.blocking_recv(), Some(Event::Token { .. })));
    }
    drop(rx);
    wait_idle(&e);
    assert_eq!(e.pool_stats().used, 0, "cancelled sequence kept its blocks");
}

#[test]
fn ultra_is_served_before_waiting_standard_work() {
    let e = Engine::start(
        loaded(),
        EngineConfig {
            max_num_seqs: 1,
            ..Default::default()
        },
    )
    .unwrap();
    let first = e.submit(req(prompt(QS[0]), 8, 1)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let std_rx: Vec<_> = (1..3)
        .map(|i| e.submit(req(prompt(QS[i]), 8, 1)).unwrap())
        .collect();
    let ultra = e.submit(req(prompt(QS[3]), 8, 0)).unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut hs = Vec::new();
    for (name, rx) in [
        ("first", first),
        ("std1", std_rx.into_iter().next().unwrap()),
        ("ultra", ultra),
    ] {
        let order = order.clone();
        hs.push(std::thread::spawn(move || {
            collect(rx);
            order.lock().unwrap().push(name);
        }));
    }
    for h in hs {
        h.join().unwrap();
    }
    let order = order.lock().unwrap().clone();
    assert_eq!(order[..2], ["first", "ultra"], "{order:?}");
}

#[test]
fn a_repeated_system_prompt_comes_from_the_prefix_cache() {
    let e = Engine::start(loaded(), EngineConfig::default()).unwrap();
    let long = "You are a careful assistant. Always answer briefly and precisely, in plain English, without lists. ".repeat(4);
    let make = || {
        let l = loaded();
        let t = l
            .codec
            .render_chat(&[
                ChatMessage {
                    role: "system".into(),
                    content: long.clone(),
                },
                ChatMessage {
                    role: "user".into(),
                    content: "Say hello.".into(),
                },
            ])
            .unwrap();
        l.codec.encode(&t).unwrap()
    };
    let (a, _, cached_a, _) = collect(e.submit(req(make(), 8, 1)).unwrap());
    let (b, _, cached_b, _) = collect(e.submit(req(make(), 8, 1)).unwrap());
    assert_eq!(cached_a, 0);
    assert!(cached_b >= 64, "only {cached_b} prompt tokens were reused");
    assert_eq!(a, b, "the cached prefix changed the output");
    assert!(e.pool_stats().hits > 0);
}

#[test]
fn a_request_that_can_never_fit_is_refused_at_once() {
    let e = Engine::start(
        loaded(),
        EngineConfig {
            num_blocks: 8,
            block_size: 16,
            ..Default::default()
        },
    )
    .unwrap();
    let err = e
        .submit(req(prompt("hi"), 9000, 1))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("context_length_exceeded"), "{err}");
    let err = e
        .submit(req(prompt("hi"), 200, 1))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("KV blocks"), "{err}");
}
