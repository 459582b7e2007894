//! What #49's reports and choices cost, on the real model, in one run:
//!
//! 1. **`top_logprobs` beside plain sequences**: decode tokens/s of four
//!    plain greedy streams when the other four of the batch ask for
//!    `logprobs` with 5 alternatives, against the same four when all eight
//!    ask nothing, the two modes alternating (from the last first token to
//!    the first end, as `structured_bench` measures).
//! 2. **`n = 8` against 8 separate requests** of one 400-token prompt,
//!    submitted at once: the time until every choice has its first token
//!    (the prefill), the prompt blocks computed (the pool's misses), and
//!    the most KV blocks in use at once (sampled every millisecond).
//!
//! Prints one JSON object with the medians, their runs and the ratios.
//! `cargo run --release -p ultrafast-engine --example scoring_bench [-- ROUNDS]`
#![allow(clippy::unwrap_used)]
mod common;
use common::median;
use serde_json::json;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use ultrafast_engine::api::Event;
use ultrafast_engine::sampling::SamplingParams;
use ultrafast_engine::scheduler::{Engine, EngineConfig, GenerateRequest};
use ultrafast_engine::tokenizer::ChatMessage;
use ultrafast_engine::{fetch, generate};

const STREAMS: usize = 8;
const MAX_TOKENS: usize = 96;
const TOPICS: [&str; STREAMS] = [
    "a dragon", "the sea", "a robot", "a city", "a forest", "a ship", "a king", "a storm",
];

fn greedy(logprobs: Option<usize>) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        logprobs,
        ..SamplingParams::default()
    }
}

fn chat(l: &generate::Loaded, q: &str) -> Vec<u32> {
    let text = l.codec.render_chat(&[ChatMessage::new("user", q)]).unwrap();
    l.codec.encode(&text).unwrap()
}

fn req(prompt: Vec<u32>, sampling: SamplingParams, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt,
        max_tokens,
        sampling,
        stop: Vec::new(),
        lane_rank: 1,
        tenant: None,
        guide: None,
    }
}

/// Token arrival times of each choice of `rx` (unwrapping indexed events).
fn arrivals(mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>, n: usize) -> Vec<Vec<Instant>> {
    let mut at = vec![Vec::new(); n];
    let mut done = 0;
    while let Some(ev) = rx.blocking_recv() {
        let (i, ev) = match ev {
            Event::Indexed(i, e) => (i as usize, *e),
            e => (0, e),
        };
        match ev {
            Event::Token { .. } => at[i].push(Instant::now()),
            Event::Done { .. } => {
                done += 1;
                if done == n {
                    break;
                }
            }
            Event::Error(e) => panic!("{e}"),
            _ => {}
        }
    }
    at
}

/// Part 1: each stream's token times; streams 4-7 scored when `scored`.
fn batch(e: &Engine, l: &generate::Loaded, scored: bool) -> Vec<Vec<Instant>> {
    let rxs: Vec<_> = TOPICS
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let p = chat(l, &format!("Write a very long story about {t}."));
            let lp = (scored && i >= STREAMS / 2).then_some(5);
            e.submit(req(p, greedy(lp), MAX_TOKENS)).unwrap()
        })
        .collect();
    let threads: Vec<_> = rxs
        .into_iter()
        .map(|rx| std::thread::spawn(move || arrivals(rx, 1).remove(0)))
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// Part 2: (seconds until every choice's first token, prompt blocks
/// computed, most blocks in use) for `n = 8` or 8 separate requests.
fn eight(e: &Arc<Engine>, prompt: &[u32], one_request: bool) -> (f64, u64, usize) {
    let before = e.pool_stats();
    let (stop, peak) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicUsize::new(0)),
    );
    let watch = {
        let (e, stop, peak) = (e.clone(), stop.clone(), peak.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(e.pool_stats().used, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let t0 = Instant::now();
    let sampled = SamplingParams {
        temperature: 1.0,
        seed: Some(1),
        ..SamplingParams::default()
    };
    let firsts: Vec<Instant> = if one_request {
        let rx = e
            .submit_n(req(prompt.to_vec(), sampled, 8), STREAMS)
            .unwrap();
        arrivals(rx, STREAMS).iter().map(|a| a[0]).collect()
    } else {
        let rxs: Vec<_> = (0..STREAMS)
            .map(|_| e.submit(req(prompt.to_vec(), sampled.clone(), 8)).unwrap())
            .collect();
        let ts: Vec<_> = rxs
            .into_iter()
            .map(|rx| std::thread::spawn(move || arrivals(rx, 1).remove(0)[0]))
            .collect();
        ts.into_iter().map(|t| t.join().unwrap()).collect()
    };
    stop.store(true, Ordering::Relaxed);
    watch.join().unwrap();
    let last_first = firsts.iter().max().unwrap().duration_since(t0);
    let computed = e.pool_stats().misses - before.misses;
    (
        last_first.as_secs_f64(),
        computed,
        peak.load(Ordering::Relaxed),
    )
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    let l = Arc::new(generate::load(&fetch::pull(&fetch::SMOLLM2).unwrap()).unwrap());
    let cfg = EngineConfig {
        max_num_seqs: 16,
        ..EngineConfig::default()
    };
    let e = Arc::new(Engine::start(l.clone(), cfg).unwrap());
    batch(&e, &l, true); // warm-up
    let (mut none, mut half) = (Vec::new(), Vec::new());
    let mut min_tokens = usize::MAX;
    let (mut n8, mut sep) = (Vec::new(), Vec::new());
    let t0 = Instant::now();
    for round in 0..rounds {
        for scored in [false, true] {
            let a = batch(&e, &l, scored);
            min_tokens = min_tokens.min(a.iter().map(Vec::len).min().unwrap());
            let r = common::half_rate(&a, STREAMS / 2);
            if scored {
                half.push(r)
            } else {
                none.push(r)
            }
        }
        // A prompt no earlier round cached (each round its own).
        let text = format!("Round {round}. ")
            + &"Summarize the following notes about lighthouses, tides and weather. ".repeat(36);
        let prompt = l.codec.encode(&text).unwrap();
        sep.push(eight(&e, &prompt, false));
        let text = format!("Round {round} again. ")
            + &"Summarize the following notes about lighthouses, tides and weather. ".repeat(36);
        let prompt = l.codec.encode(&text).unwrap();
        n8.push(eight(&e, &prompt, true));
        if t0.elapsed() > Duration::from_secs(900) {
            break;
        }
    }
    let prompt_len = l
        .codec
        .encode(
            &("Round 0. ".to_string()
                + &"Summarize the following notes about lighthouses, tides and weather. "
                    .repeat(36)),
        )
        .unwrap()
        .len();
    let (rn, rh) = (median(none.clone()), median(half.clone()));
    let med = |v: &[(f64, u64, usize)], f: fn(&(f64, u64, usize)) -> f64| {
        median(v.iter().map(f).collect())
    };
    let (n8s, seps) = (med(&n8, |r| r.0), med(&sep, |r| r.0));
    println!(
        "{}",
        json!({"cpu": common::cpu_model(), "rounds": none.len(),
            "top_logprobs": {"streams": STREAMS, "max_tokens": MAX_TOKENS,
                "fewest_tokens_of_a_stream": min_tokens,
                "plain_half_tok_s": {"all_plain": rn, "half_scored": rh,
                    "runs_all_plain": none, "runs_half_scored": half},
                "ratio": rh / rn},
            "n8": {"prompt_tokens": prompt_len, "block_size": e.block_size(),
                "prefill_s": {"n8": n8s, "eight_requests": seps, "ratio": n8s / seps},
                "blocks_computed": {"n8": med(&n8, |r| r.1 as f64), "eight_requests": med(&sep, |r| r.1 as f64)},
                "peak_blocks_used": {"n8": med(&n8, |r| r.2 as f64), "eight_requests": med(&sep, |r| r.2 as f64)},
                "runs_n8": n8, "runs_eight_requests": sep}})
    );
}
