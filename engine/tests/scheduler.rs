//! The engine thread on the real model: continuous batching gives the same
//! greedy tokens as a lone sequence, preemption by recompute keeps outputs
//! right and returns every block, cancellation frees blocks, the ultra lane
//! goes first (starting within two steps of a full engine, its prompt in a
//! step of its own, worse lanes paused rather than recomputed and never held
//! back for long, a long worse-lane step giving way to an ultra arrival),
//! the step-cost model fits the steps, a repeated system
//! prompt is served from the prefix cache, and an impossible request is
//! refused up front.

#![allow(clippy::unwrap_used)]
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use ultrafast_engine::api::{Event, FinishReason};
use ultrafast_engine::backend::cpu::CpuRunner;
use ultrafast_engine::kv::BlockPool;
use ultrafast_engine::model::paged::SeqStep;
use ultrafast_engine::sampling::{argmax, SamplingParams};
use ultrafast_engine::scheduler::GenerateRequest;
use ultrafast_engine::scheduler::{Engine, EngineConfig, StepObserver, StepWork, MAX_HELD_STEPS};
use ultrafast_engine::tokenizer::ChatMessage;

mod common;
use common::{loaded, prompt};

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
        tenant: None,
        guide: None,
    }
}

/// Drain a request's events: (token ids, finish, cached tokens, text).
fn collect(
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
) -> (Vec<u32>, FinishReason, usize, String) {
    drain(rx, Vec::new(), String::new())
}

/// `collect` for a stream whose first `ids` (and `text`) were read.
fn drain(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    mut ids: Vec<u32>,
    mut text: String,
) -> (Vec<u32>, FinishReason, usize, String) {
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
            Event::Raw { .. } => panic!("the engine sent a raw event"),
            Event::Prompt(_) | Event::Logprob(_) | Event::Indexed(..) => {
                panic!("nothing asked for reports or choices")
            }
        }
    }
    panic!("stream ended without Done")
}

/// Lone greedy decoding through the engine's own runner (prompt in one
/// step, then one token per step), with the top-two logit margin at each
/// step.
fn solo_with_margins(p: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let l = loaded();
    let pool = BlockPool::new(64, 16);
    let mut r = CpuRunner::new(
        l.fast.as_ref().unwrap().clone(),
        64,
        16,
        EngineConfig::default().kv_dtype,
        2,
        || {},
    )
    .unwrap();
    let mut seq = pool.allocate(p).unwrap();
    let mut logits = Vec::new();
    let mut step = |toks: &[u32], start: usize, blocks: &[u32], logits: &mut Vec<f32>| {
        let s = SeqStep {
            tokens: toks,
            start,
            blocks,
        };
        assert!(r.step(&[s], &|_| false, logits).unwrap());
    };
    step(p, 0, seq.blocks(), &mut logits);
    let (mut out, mut margins) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let t = argmax(&logits);
        let mut sorted = logits.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        margins.push(sorted[0] - sorted[1]);
        if l.codec.eos.contains(&t) {
            break;
        }
        out.push(t);
        let pos = p.len() + out.len() - 1;
        assert!(pool.grow(&mut seq, pos + 1));
        step(&[t], pos, seq.blocks(), &mut logits);
    }
    (out, margins)
}

/// `ids` must equal lone greedy decoding of `q`, except that it may part at
/// a near-tie (the runner's results do not depend on batching, chunking or
/// recompute, so in practice they are equal; the allowance keeps the test
/// about scheduling, not arithmetic).
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

/// Prompts with answers longer than 40 tokens.
const LONG: [&str; 4] = [
    "Write a long story about a dragon.",
    "Describe the history of Rome in detail.",
    "Explain in detail how computers work.",
    "Write a long poem about the ocean.",
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
    let rxs: Vec<_> = LONG
        .iter()
        .map(|q| e.submit(req(prompt(q), 40, 1)).unwrap())
        .collect();
    // A preempted sequence recomputes its tokens as one prefill chunk, which
    // sums in a different order than the token-by-token decode it replaces:
    // logits agree to ~1e-5, so the outputs may part only at a near-tie
    // (top-two margin under 0.5 logits, as in the golden test), never
    // where the choice is clear.
    for (q, rx) in LONG.iter().zip(rxs) {
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
    // Ultra starts even though the one slot is taken: the standard request
    // already running is paused (keeps its blocks, not recomputed) and
    // resumes before the waiting standard one starts.
    let order = order.lock().unwrap().clone();
    assert_eq!(order[..2], ["ultra", "first"], "{order:?}");
    assert_eq!(e.stats().preemptions.load(Ordering::Relaxed), 0);
}

/// Every step, sequence by sequence, with its duration.
#[derive(Default)]
struct Log(Mutex<Vec<(Duration, Vec<StepWork>)>>);

impl StepObserver for Log {
    fn step(&self, _: Duration, _: usize, _: usize) {}
    fn step_work(&self, elapsed: Duration, work: &[StepWork]) {
        self.0.lock().unwrap().push((elapsed, work.to_vec()));
    }
}

impl Log {
    fn steps(&self) -> Vec<(Duration, Vec<StepWork>)> {
        self.0.lock().unwrap().clone()
    }
    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

fn observed(cfg: EngineConfig) -> (Engine, Arc<Log>) {
    let log = Arc::new(Log::default());
    let e = Engine::start_observed(loaded(), cfg, Some(log.clone() as Arc<dyn StepObserver>));
    (e.unwrap(), log)
}

fn ranks(work: &[StepWork]) -> Vec<(u32, usize, bool)> {
    work.iter()
        .map(|w| (w.lane_rank, w.tokens, w.prefill))
        .collect()
}

/// A stream whose first token has arrived.
struct Started {
    first: (u32, String),
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
}

/// Wait for a stream's first token.
fn started(mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> Started {
    match rx.blocking_recv() {
        Some(Event::Token { id, text }) => Started {
            first: (id, text),
            rx,
        },
        other => panic!("expected a token, got {other:?}"),
    }
}

impl Started {
    fn collect(self) -> (Vec<u32>, FinishReason, usize, String) {
        drain(self.rx, vec![self.first.0], self.first.1)
    }
}

#[test]
fn ultra_starts_within_two_steps_of_a_full_engine_and_prefills_alone() {
    let (e, log) = observed(EngineConfig {
        max_num_seqs: 4,
        ..Default::default()
    });
    assert_eq!(e.max_num_seqs(), 4);
    // Four standard streams fill every slot and keep decoding.
    let std_rx: Vec<_> = LONG
        .iter()
        .map(|q| started(e.submit(req(prompt(q), 40, 1)).unwrap()))
        .collect();
    let before = log.len();
    let q = "Write one word that rhymes with cat.";
    let ultra_prompt = prompt(q);
    let ultra = started(e.submit(req(ultra_prompt.clone(), 6, 0)).unwrap());
    let (ids, _, cached, _) = ultra.collect();
    assert_matches_solo(&ids, q, 6);
    let steps = log.steps();
    let p = steps
        .iter()
        .position(|(_, w)| w.iter().any(|w| w.lane_rank == 0))
        .expect("the ultra request never ran");
    // Submitted during step `before` at the latest (or between steps): its
    // prompt runs in the step after that at the latest.
    assert!(
        p <= before + 1,
        "ultra prefilled in step {p}, submitted at step {before}"
    );
    // (b) Its prompt (less what the prefix cache held) runs whole, with no
    // standard work in the step.
    assert_eq!(
        ranks(&steps[p].1),
        [(0, ultra_prompt.len() - cached, true)],
        "step {p}"
    );
    // Standard decodes resume as soon as it is done: ultra's decode and
    // three of them fill the four slots (the latest one waits, paused).
    assert_eq!(
        ranks(&steps[p + 1].1),
        [(0, 1, false), (1, 1, false), (1, 1, false), (1, 1, false)],
        "step {}",
        p + 1
    );
    // The standard streams were paused, never recomputed, and finish with
    // the tokens they would have had alone.
    for (q, s) in LONG.iter().zip(std_rx) {
        let (ids, _, _, _) = s.collect();
        assert_eq!(ids.len(), 40, "{q}: expected a long answer");
        assert_matches_solo(&ids, q, 40);
    }
    assert_eq!(e.stats().preemptions.load(Ordering::Relaxed), 0);
    for (i, (_, w)) in log.steps().iter().enumerate() {
        assert!(w.len() <= 4, "step {i} ran {} sequences", w.len());
    }
    wait_idle(&e);
    assert_eq!(e.pool_stats().used, 0);
}

#[test]
fn a_long_ultra_prompt_holds_standard_back_only_a_few_steps_in_a_row() {
    // 16-token chunks: the ultra prompt takes many steps to prefill.
    let (e, log) = observed(EngineConfig {
        max_batched_tokens: 16,
        ..Default::default()
    });
    let standard = started(e.submit(req(prompt(LONG[0]), 40, 1)).unwrap());
    let long = "Describe the history of Rome in detail, from its founding to the fall of the western empire. ".repeat(5);
    let ultra_prompt = prompt(&long);
    assert!(ultra_prompt.len() > 16 * (MAX_HELD_STEPS as usize + 2));
    drop(started(e.submit(req(ultra_prompt, 2, 0)).unwrap()));
    let (ids, _, _, _) = standard.collect();
    assert_matches_solo(&ids, LONG[0], 40);
    let steps = log.steps();
    let prefill: Vec<&Vec<StepWork>> = steps
        .iter()
        .map(|(_, w)| w)
        .filter(|w| w.iter().any(|w| w.lane_rank == 0 && w.prefill))
        .collect();
    assert!(prefill.len() > MAX_HELD_STEPS as usize + 1);
    // Standard sits out at most MAX_HELD_STEPS prefill steps in a row,
    // then shares one.
    let mut run = 0;
    let mut shared = 0;
    for w in &prefill {
        if w.iter().any(|w| w.lane_rank == 1) {
            run = 0;
            shared += 1;
        } else {
            run += 1;
            assert!(run <= MAX_HELD_STEPS, "held back {run} steps in a row");
        }
    }
    assert!(
        shared > 0 && shared < prefill.len(),
        "{shared} of {}",
        prefill.len()
    );
}

#[test]
fn an_ultra_arrival_stops_a_long_standard_step_and_runs_first() {
    let (e, log) = observed(EngineConfig::default());
    // One standard prompt of a few hundred tokens: one long step.
    let long = format!(
        "{} {}",
        LONG[1],
        "Mention every emperor and every war. ".repeat(40)
    );
    let std_prompt = prompt(&long);
    assert!(std_prompt.len() > 300, "{}", std_prompt.len());
    let standard = e.submit(req(std_prompt.clone(), 4, 1)).unwrap();
    // Its step is in flight once the engine has published its size.
    let deadline = Instant::now() + Duration::from_secs(30);
    while e.stats().last_step_tokens.load(Ordering::Relaxed) != std_prompt.len() {
        assert!(Instant::now() < deadline, "the standard step never started");
        std::thread::sleep(Duration::from_millis(1));
    }
    let q = "Write one word that rhymes with cat.";
    let mut standard = standard;
    let ultra = started(e.submit(req(prompt(q), 6, 0)).unwrap());
    // The ultra request's first token came before the standard prompt
    // finished: the step in flight gave way instead of running to its end.
    assert!(
        standard.try_recv().is_err(),
        "the standard step ran to its end first"
    );
    assert_eq!(e.stats().interrupted.load(Ordering::Relaxed), 1);
    let (ids, _, _, _) = ultra.collect();
    assert_matches_solo(&ids, q, 6);
    // The standard prompt ran again, whole, and its answer is unchanged:
    // the layers the stopped step had stored were overwritten alike.
    let (ids, _, _, _) = collect(standard);
    assert_matches_solo(&ids, &long, 4);
    let steps = log.steps();
    assert_eq!(ranks(&steps[0].1)[0].0, 0, "the first step run is ultra's");
    // The stopped step is not counted as a step (no observer call, no cost
    // sample): the whole prompt appears in exactly one finished step.
    let whole = |w: &&(Duration, Vec<StepWork>)| {
        w.1.iter()
            .any(|w| w.lane_rank == 1 && w.tokens == std_prompt.len())
    };
    assert_eq!(steps.iter().filter(whole).count(), 1);
    wait_idle(&e);
    assert_eq!(e.pool_stats().used, 0);
}

#[test]
fn the_step_cost_model_fits_the_steps() {
    let (e, log) = observed(EngineConfig::default());
    assert_eq!(e.step_cost().samples, 0);
    // Warm-up-like requests: prefill steps of several sizes, then decodes.
    for n in [8usize, 64, 160, 32] {
        let p: Vec<u32> = (0..n as u32).map(|i| 1 + (i * 7919) % 40_000).collect();
        collect(e.submit(req(p, 3, 1)).unwrap());
    }
    let c = e.step_cost();
    let steps = log.steps();
    assert_eq!(c.samples, steps.len() as u64);
    assert_eq!(c.samples, e.stats().steps.load(Ordering::Relaxed));
    assert!(c.fixed_s >= 0.0, "{c:?}");
    assert!(
        c.per_prompt_token_s > 1e-5 && c.per_prompt_token_s < 0.1,
        "{c:?}"
    );
    // Single-sequence decodes alone do not tell the per-step cost from the
    // per-decode one (the service's warm-up adds a batch for that): only
    // their sum must be real.
    assert!(c.per_decode_s >= 0.0 && c.per_decode_s < 0.5, "{c:?}");
    assert!(c.fixed_s + c.per_decode_s > 1e-5, "{c:?}");
    // The line accounts for the time the steps took (within a factor of
    // two over all of them; single steps are noisy on a shared machine).
    let tokens = |w: &[StepWork]| w.iter().map(|w| w.tokens).sum::<usize>();
    let decodes = |w: &[StepWork]| w.iter().filter(|w| !w.prefill).count();
    let took: f64 = steps.iter().map(|(d, _)| d.as_secs_f64()).sum();
    let predicted: f64 = steps
        .iter()
        .map(|(_, w)| c.predict(decodes(w), tokens(w) - decodes(w)).as_secs_f64())
        .sum();
    assert!(
        predicted > took / 2.0 && predicted < took * 2.0,
        "{c:?}: predicted {predicted:.3}s, took {took:.3}s"
    );
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
                ChatMessage::new("system", long.clone()),
                ChatMessage::new("user", "Say hello."),
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
