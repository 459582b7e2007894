//! Engine throughput on the real model through the scheduler (the path the
//! proxy uses): prefill tokens/s on a 512-token prompt, TTFT of a 128-token
//! prompt, single-stream decode tokens/s and aggregate decode tokens/s at 4
//! and 16 concurrent streams. Prints one JSON object.
//! `cargo run --release -p ultrafast-engine --example bench [-- REPEATS]`
//!
//! `-- steps [CTX]`: step time against tokens per step instead (decode
//! steps of 1 to 32 streams at about CTX tokens of context, default 48, and
//! prefill chunks of as many tokens), with the engine's fitted step cost.
//!
//! `-- logits`: the engine's kernels' first-step logits for one chat
//! prompt, with its token ids, as JSON (what `engine_vs_llamacpp.py` holds
//! against llama.cpp's logits for the same ids).
#![allow(clippy::unwrap_used)]
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use ultrafast_engine::api::Event;
use ultrafast_engine::backend::cpu::simd::Q8Block;
use ultrafast_engine::generate::Loaded;
use ultrafast_engine::sampling::SamplingParams;
use ultrafast_engine::scheduler::GenerateRequest;
use ultrafast_engine::scheduler::{Engine, EngineConfig, StepObserver, StepWork};
use ultrafast_engine::{fetch, generate};

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| {
            1 + i
                .wrapping_mul(7919)
                .wrapping_add(salt.wrapping_mul(104_729))
                % 49_000
        })
        .collect()
}

/// Requests sample at temperature 0.8 / top-p 0.95 (seeded) instead of
/// greedily while this is set.
static SAMPLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn req(p: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    let sampled = SAMPLED.load(std::sync::atomic::Ordering::Relaxed);
    GenerateRequest {
        prompt: p,
        max_tokens,
        sampling: SamplingParams {
            temperature: if sampled { 0.8 } else { 0.0 },
            top_p: if sampled { 0.95 } else { 1.0 },
            seed: sampled.then_some(42),
            ..SamplingParams::default()
        },
        stop: Vec::new(),
        lane_rank: 1,
        tenant: None,
        guide: None,
    }
}

/// Run `n` streams at once; returns (time to first token of each, total
/// generated tokens, wall time from first token of the last to the end).
fn run(
    e: &Engine,
    n: usize,
    prompt_len: usize,
    max_tokens: usize,
    salt: u32,
) -> (Vec<Duration>, usize, Duration, Duration) {
    let t0 = Instant::now();
    let rxs: Vec<_> = (0..n)
        .map(|i| {
            e.submit(req(prompt(prompt_len, salt * 100 + i as u32), max_tokens))
                .unwrap()
        })
        .collect();
    // One receiver thread per stream, so arrival times are real.
    let handles: Vec<_> = rxs
        .into_iter()
        .map(|mut rx| {
            std::thread::spawn(move || {
                let mut first = None;
                let mut tokens = 0;
                while let Some(ev) = rx.blocking_recv() {
                    match ev {
                        Event::Token { .. } => {
                            first.get_or_insert_with(|| t0.elapsed());
                            tokens += 1;
                        }
                        Event::Done { .. } => break,
                        Event::Error(e) => panic!("{e}"),
                        Event::Raw { .. } => panic!("the engine sent a raw event"),
                        Event::Prompt(_) | Event::Logprob(_) | Event::Indexed(..) => {
                            panic!("nothing asked for reports or choices")
                        }
                    }
                }
                (first.unwrap_or_default(), tokens)
            })
        })
        .collect();
    let res: Vec<(Duration, usize)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let ttft: Vec<Duration> = res.iter().map(|r| r.0).collect();
    let tokens = res.iter().map(|r| r.1).sum();
    let first_all = *ttft.iter().max().unwrap();
    (ttft, tokens, first_all, t0.elapsed())
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// One step: wall time, process CPU time since the previous step, work.
struct Step {
    wall: f64,
    cpu: f64,
    work: Vec<StepWork>,
}

/// Every step, with the process CPU time it used (robust to other load on
/// the machine, which inflates wall time).
#[derive(Default)]
struct Log {
    steps: Mutex<Vec<Step>>,
    last_cpu: Mutex<f64>,
}

/// User plus system CPU seconds of this process (Linux; 0 elsewhere).
fn process_cpu_s() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // utime and stime (fields 14 and 15, the 12th and 13th after the
    // command name) in clock ticks of 1/100 s.
    let f: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

impl StepObserver for Log {
    fn step(&self, _: Duration, _: usize, _: usize) {}
    fn step_work(&self, elapsed: Duration, work: &[StepWork]) {
        let now = process_cpu_s();
        let cpu = now - std::mem::replace(&mut *self.last_cpu.lock().unwrap(), now);
        self.steps.lock().unwrap().push(Step {
            wall: elapsed.as_secs_f64(),
            cpu,
            work: work.to_vec(),
        });
    }
}

impl Log {
    /// Wall median / min and mean CPU per step (ms) of the steps so far
    /// that `pick` selects; clears the log.
    fn take(&self, pick: impl Fn(&[StepWork]) -> bool) -> String {
        let steps: Vec<Step> = std::mem::take(&mut *self.steps.lock().unwrap());
        let chosen: Vec<&Step> = steps.iter().filter(|s| pick(&s.work)).collect();
        let wall: Vec<f64> = chosen.iter().map(|s| s.wall).collect();
        let min = wall.iter().copied().fold(f64::INFINITY, f64::min);
        let cpu = chosen.iter().map(|s| s.cpu).sum::<f64>() / chosen.len().max(1) as f64;
        format!(
            "{:>6.1} {:>6.1} {:>6.1}",
            median(wall) * 1000.0,
            min * 1000.0,
            cpu * 1000.0
        )
    }
}

/// Step time against tokens per step: decode steps `n` sequences wide, and
/// steps of one `n`-token prompt.
fn steps_mode(l: Arc<Loaded>, ctx: usize) {
    let log = Arc::new(Log::default());
    let e = Engine::start_observed(
        l,
        EngineConfig {
            num_blocks: 2048,
            max_num_seqs: 32,
            max_batched_tokens: 512,
            ..EngineConfig::default()
        },
        Some(log.clone() as Arc<dyn StepObserver>),
    )
    .unwrap();
    run(&e, 1, 64, 8, 999); // warm-up
    println!("context ~{ctx} tokens; ms: wall median, wall min, process CPU per step");
    println!("tokens  decode (med    min    cpu)  prefill (med    min    cpu)");
    for (k, n) in [1usize, 8, 16, 24, 32].into_iter().enumerate() {
        log.take(|_| false);
        run(&e, n, ctx, 24, 500 + k as u32);
        let decode = log.take(|w| w.len() == n && w.iter().all(|w| !w.prefill));
        for r in 0..5 {
            run(&e, 1, n, 1, 700 + (k * 10 + r) as u32);
        }
        let prefill = log.take(|w| w.len() == 1 && w[0].tokens == n);
        println!("{n:>6}  {decode:>26}  {prefill:>27}");
    }
    let c = e.step_cost();
    println!(
        "fitted: {:.2} ms + {:.3} ms/decode + {:.3} ms/prompt token over {} steps; {} threads",
        c.fixed_s * 1000.0,
        c.per_decode_s * 1000.0,
        c.per_prompt_token_s * 1000.0,
        c.samples,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
}

/// Wall time per phase of the CPU runner: a 512-token prefill step and
/// decode steps of one stream and of 16 (ms per step).
fn phases_mode(l: Arc<Loaded>) {
    use ultrafast_engine::backend::cpu::profile;
    profile::enable(true);
    let e = Engine::start(l, EngineConfig::default()).unwrap();
    run(&e, 1, 64, 4, 999);
    profile::take();
    let n_pre = 3;
    for r in 0..n_pre {
        run(&e, 1, 512, 1, 800 + r);
    }
    let pre = profile::take();
    // Steps of a stream: one per token (the first comes from the prompt's
    // step, counted with the decode steps; a stream may end early at EOS).
    let mut n_dec = 0;
    let mut salt = 900;
    while n_dec < 128 && salt < 920 {
        n_dec += run(&e, 1, 32, 129, salt).1;
        salt += 1;
    }
    let dec = profile::take();
    // The 16 streams' first step is their prompts' (512 tokens): timed
    // alone on other prompts of the same shape and taken out, so that the
    // column is decode steps only.
    run(&e, 16, 32, 1, 940);
    let pre16 = profile::take();
    let (_, tokens16, _, _) = run(&e, 16, 32, 65, 950);
    let mut dec16 = profile::take();
    for (d, p) in dec16.iter_mut().zip(pre16) {
        *d = d.saturating_sub(p);
    }
    let steps16 = (tokens16 / 16).saturating_sub(1).max(1) as u32;
    let ms = |ns: u64, n: u32| ns as f64 / 1e6 / n as f64;
    println!("| phase | prefill 512 (ms/step) | decode 1 stream (ms/step, {n_dec} steps) | 16 streams (ms/step, {steps16} decode steps) |");
    println!("|---|---|---|---|");
    for (i, name) in profile::NAMES.iter().enumerate() {
        println!(
            "| {name} | {:.2} | {:.3} | {:.3} |",
            ms(pre[i], n_pre),
            ms(dec[i], n_dec as u32),
            ms(dec16[i], steps16)
        );
    }
    let total = |a: &[u64; 12], n: u32| ms(a.iter().sum(), n);
    println!(
        "| total | {:.2} | {:.3} | {:.3} |",
        total(&pre, n_pre),
        total(&dec, n_dec as u32),
        total(&dec16, steps16)
    );
}

/// The integer kernels alone, one thread: GB/s of weights streamed for
/// one token (decode) from a matrix larger than the caches and from one
/// that fits in L2, GMAC/s for 16 tokens (a step of 16 decodes) from
/// each, and for 64 tokens (prefill), per format and kernel set.
fn kernels_mode() {
    use ultrafast_engine::backend::cpu::simd::{tile, Format, Isa, MAX_T, PANEL};
    let cols = 576;
    let nb = cols / 32;
    println!("| kernels | format | decode, 96 MB (GB/s) | decode, 1 MB (GB/s) | 16 tokens, 96 MB (GMAC/s) | 16 tokens, 1 MB (GMAC/s) | 64 tokens, 1 MB (GMAC/s) |");
    println!("|---|---|---|---|---|---|---|");
    for isa in Isa::available() {
        for fmt in [Format::Q4_1, Format::Q8_0, Format::Q5] {
            let gb = fmt.panel_bytes() * nb;
            let run = |bytes: usize, tokens: usize, reps: usize| -> (f64, f64) {
                let panels = bytes / gb;
                let (raw, x) = kernel_data(panels * gb, tokens * nb);
                let w = aligned(&raw);
                let mut o = [[0f32; PANEL]; MAX_T];
                let mut sink = 0f32;
                let t0 = Instant::now();
                for _ in 0..reps {
                    for g in 0..panels {
                        let wg = &w[g * gb..(g + 1) * gb];
                        let mut t = 0;
                        while t < tokens {
                            let n = (tokens - t).min(MAX_T);
                            tile(isa, fmt, wg, nb, &x[t * nb..], nb, n, &mut o);
                            sink += o[0][0];
                            t += n;
                        }
                    }
                }
                let s = t0.elapsed().as_secs_f64();
                std::hint::black_box(sink);
                let macs = (panels * PANEL * cols * tokens * reps) as f64;
                ((panels * gb * reps) as f64 / s / 1e9, macs / s / 1e9)
            };
            let (big, _) = run(96 << 20, 1, 3);
            let (small, _) = run(1 << 20, 1, 200);
            let (_, big16) = run(96 << 20, 16, 1);
            let (_, small16) = run(1 << 20, 16, 16);
            let (_, gmac) = run(1 << 20, 64, 4);
            println!(
                "| {} | {fmt:?} | {big:.1} | {small:.1} | {big16:.1} | {small16:.1} | {gmac:.1} |",
                isa.name()
            );
        }
    }
    if ultrafast_engine::backend::cpu::amx::supported() {
        amx_kernels(cols);
    }
}

/// Weight bytes (64 spare, see [`aligned`]) and activation blocks for
/// the kernel tables.
fn kernel_data(bytes: usize, blocks: usize) -> (Vec<u8>, Vec<Q8Block>) {
    let w = (0..bytes + 64)
        .map(|i| (i * 7 % 251) as u8 & 0x7e)
        .collect();
    let x = (0..blocks)
        .map(|i| Q8Block {
            d: 0.01,
            s: 0.1,
            q: [(i % 100) as i8; 32],
            n: 32 * (i % 100) as i32,
        })
        .collect();
    (w, x)
}

/// `raw` from its first 64-byte boundary, as `QMat` keeps its panels.
fn aligned(raw: &[u8]) -> &[u8] {
    &raw[(64 - raw.as_ptr() as usize % 64) % 64..]
}

/// `kernels_mode`'s table for the AMX BF16 tiles (eight 16-row panels
/// per call), with the 8-bit kernels' weights and `bf16` activations.
fn amx_kernels(cols: usize) {
    use ultrafast_engine::backend::cpu::amx::{bf16, gemm, Scratch, PAD_ROWS};
    use ultrafast_engine::backend::cpu::simd::Format;
    const PANELS: usize = 8;
    let nb = cols / 32;
    println!("| kernels | format | 16 tokens, 96 MB (GB/s; GMAC/s) | 16 tokens, 1 MB (GMAC/s) | 64 tokens, 1 MB (GMAC/s) | 128 tokens, 1 MB (GMAC/s) | 512 tokens, 1 MB (GMAC/s) |");
    println!("|---|---|---|---|---|---|---|");
    for fmt in [Format::Q4_1, Format::Q8_0, Format::Q5] {
        let gb = fmt.panel_bytes() * nb;
        let mut s = Scratch::default();
        let mut run = |bytes: usize, tokens: usize, reps: usize| -> (f64, f64) {
            let panels = bytes / gb / PANELS * PANELS;
            let (raw, _) = kernel_data(panels * gb, 0);
            let w = aligned(&raw);
            let x: Vec<u16> = (0..(tokens + PAD_ROWS) * cols)
                .map(|i| bf16((i % 100) as f32 / 50.0 - 1.0))
                .collect();
            let mut sink = 0f32;
            let t0 = Instant::now();
            for _ in 0..reps {
                for c in 0..panels / PANELS {
                    let gs: [&[u8]; PANELS] = std::array::from_fn(|i| {
                        let g = c * PANELS + i;
                        &w[g * gb..(g + 1) * gb]
                    });
                    gemm(fmt, &gs, nb, &x, cols, tokens, &mut s, &mut |_, _, t| {
                        sink += t[0][0]
                    });
                }
            }
            let el = t0.elapsed().as_secs_f64();
            std::hint::black_box(sink);
            let macs = (panels * 16 * cols * tokens * reps) as f64;
            ((panels * gb * reps) as f64 / el / 1e9, macs / el / 1e9)
        };
        let (big, bigm) = run(96 << 20, 16, 2);
        let (_, g16) = run(1 << 20, 16, 50);
        let (_, g64) = run(1 << 20, 64, 10);
        let (_, g128) = run(1 << 20, 128, 6);
        let (_, g512) = run(1 << 20, 512, 2);
        println!(
            "| amx-bf16 | {fmt:?} | {big:.1}; {bigm:.1} | {g16:.1} | {g64:.1} | {g128:.1} | {g512:.1} |"
        );
    }
}

/// First-step logits of the engine's CPU runner (the scheduler's path,
/// f16 KV) for one chat prompt.
fn logits_mode(l: &Loaded) {
    use ultrafast_engine::backend::cpu::CpuRunner;
    use ultrafast_engine::backend::KvDtype;
    use ultrafast_engine::kv::BlockPool;
    use ultrafast_engine::model::paged::SeqStep;
    use ultrafast_engine::tokenizer::ChatMessage;
    let text = l
        .codec
        .render_chat(&[ChatMessage::new(
            "user",
            "Explain in two sentences why the sky is blue.",
        )])
        .unwrap();
    let ids = l.codec.encode(&text).unwrap();
    let pool = BlockPool::new(64, 16);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut r = CpuRunner::new(
        l.fast.as_ref().unwrap().clone(),
        64,
        16,
        KvDtype::F16,
        threads,
        || {},
    )
    .unwrap();
    let seq = pool.allocate(&ids).unwrap();
    let s = SeqStep {
        tokens: &ids,
        start: 0,
        blocks: seq.blocks(),
    };
    let mut logits = Vec::new();
    assert!(r.step(&[s], &|_| false, &mut logits).unwrap());
    println!("{}", serde_json::json!({"ids": ids, "logits": logits}));
}

/// The model measured: `ULTRAFAST_BENCH_MODEL` (a known name such as
/// `qwen2.5-coder-0.5b-instruct`, or a path to a GGUF), else SmolLM2.
fn model_path() -> std::path::PathBuf {
    match std::env::var("ULTRAFAST_BENCH_MODEL") {
        Ok(m) => fetch::Source::parse(&m).unwrap().resolve(None).unwrap(),
        Err(_) => fetch::pull(&fetch::SMOLLM2).unwrap(),
    }
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some("kernels") {
        return kernels_mode();
    }
    if std::env::args().nth(1).as_deref() == Some("logits") {
        return logits_mode(&generate::load(&model_path()).unwrap());
    }
    if std::env::args().nth(1).as_deref() == Some("phases") {
        let l = Arc::new(generate::load(&model_path()).unwrap());
        return phases_mode(l);
    }
    if std::env::args().nth(1).as_deref() == Some("steps") {
        let ctx = std::env::args()
            .nth(2)
            .and_then(|s| s.parse().ok())
            .unwrap_or(48);
        let l = Arc::new(generate::load(&model_path()).unwrap());
        return steps_mode(l, ctx);
    }
    let repeats: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let quick = std::env::args().any(|a| a == "quick");
    // Resolved once: a known model's resolution hashes the whole file.
    let path = model_path();
    let l = Arc::new(generate::load(&path).unwrap());
    let e = Engine::start(
        l,
        EngineConfig {
            num_blocks: 1024,
            max_num_seqs: 32,
            max_batched_tokens: 512,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    run(&e, 1, 64, 8, 999); // warm-up
    if std::env::args().any(|a| a == "agg16") {
        let (_, tokens, first, total) = run(&e, 16, 32, 64, 7);
        println!(
            "agg16 decode {:.1} tok/s",
            (tokens - 16) as f64 / (total - first).as_secs_f64()
        );
        return;
    }
    if quick {
        let (t, _, _, _) = run(&e, 1, 128, 1, 5);
        let (_, tokens, first, total) = run(&e, 1, 32, 32, 6);
        println!(
            "ttft128 {:?} decode {:.1} tok/s",
            t[0],
            (tokens - 1) as f64 / (total - first).as_secs_f64()
        );
        return;
    }
    let mut prefill = Vec::new();
    let mut ttft128 = Vec::new();
    let mut single = Vec::new();
    let mut agg4 = Vec::new();
    let mut agg16 = Vec::new();
    let mut sampled = Vec::new();
    for r in 0..repeats as u32 {
        let (t, _, _, _) = run(&e, 1, 512, 1, r * 10 + 1);
        prefill.push(512.0 / t[0].as_secs_f64());
        let (t, _, _, _) = run(&e, 1, 128, 1, r * 10 + 2);
        ttft128.push(t[0].as_secs_f64() * 1000.0);
        // Greedy and sampled single streams back to back, so that the
        // machine's drift between them is as small as it can be.
        for (n, out, s) in [
            (1, &mut single, false),
            (1, &mut sampled, true),
            (4, &mut agg4, false),
            (16, &mut agg16, false),
        ] {
            SAMPLED.store(s, std::sync::atomic::Ordering::Relaxed);
            let (_, tokens, first, total) = run(&e, n, 32, 128, r * 10 + 3 + n as u32);
            // Decode rate: tokens after each stream's first, over the time
            // after the last first token (prefill excluded).
            let decode_tokens = tokens - n;
            out.push(decode_tokens as f64 / (total - first).as_secs_f64());
        }
        SAMPLED.store(false, std::sync::atomic::Ordering::Relaxed);
    }
    println!(
        "{{\"model\": {:?}, \"threads\": {}, \"prefill_512_tok_s\": {:.1}, \"ttft_128_ms\": {:.1}, \"decode_1_tok_s\": {:.1}, \"decode_4_tok_s\": {:.1}, \"decode_16_tok_s\": {:.1}, \"decode_1_sampled_tok_s\": {:.1}}}",
        path.display().to_string(),
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        median(prefill),
        median(ttft128),
        median(single),
        median(agg4),
        median(agg16),
        median(sampled)
    );
}
