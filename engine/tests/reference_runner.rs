//! The CUDA runner's host side on the CPU (`backend::reference`): the
//! scheduler drives it like any runner, concurrent sequences (decode steps
//! padded to their bucket, prompt chunks beside decodes) give the same
//! greedy tokens as each sequence alone, and its logits agree with the CPU
//! runner's on the real model within the tolerance the golden test gives
//! the int8 kernels.

#![allow(clippy::unwrap_used)]
use std::sync::Arc;
use ultrafast_engine::api::Event;
use ultrafast_engine::backend::reference::ReferenceRunner;
use ultrafast_engine::backend::{cpu_runner, KvDtype, ModelRunner};
use ultrafast_engine::fetch::{self, SMOLLM2};
use ultrafast_engine::generate;
use ultrafast_engine::model::paged::SeqStep;
use ultrafast_engine::sampling::SamplingParams;
use ultrafast_engine::scheduler::GenerateRequest;
use ultrafast_engine::scheduler::{Engine, EngineConfig};
use ultrafast_engine::tokenizer::ChatMessage;

const BLOCKS: usize = 64;

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt,
        max_tokens,
        sampling: SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        stop: vec![],
        lane_rank: 1,
        tenant: None,
        guide: None,
    }
}

fn tokens(mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> Vec<u32> {
    let mut out = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token { id, .. } => out.push(id),
            Event::Done { .. } => break,
            Event::Error(e) => panic!("{e}"),
            Event::Raw { .. } => panic!("raw event from the engine"),
            Event::Prompt(_) | Event::Logprob(_) | Event::Indexed(..) => {
                panic!("nothing asked for reports or choices")
            }
        }
    }
    out
}

/// The real model, loaded, and the engine's config for these tests.
fn setup() -> (std::path::PathBuf, Arc<generate::Loaded>, EngineConfig) {
    let path = fetch::pull(&SMOLLM2).unwrap();
    let loaded = Arc::new(generate::load(&path).unwrap());
    let cfg = EngineConfig {
        num_blocks: BLOCKS,
        max_num_seqs: 8,
        ..EngineConfig::default()
    };
    (path, loaded, cfg)
}

#[test]
fn the_reference_runner_batches_like_it_runs_alone_and_agrees_with_the_cpu_runner() {
    let (path, loaded, cfg) = setup();
    let runner = ReferenceRunner::load(&path, BLOCKS, cfg.block_size).unwrap();
    assert!(runner.describe().contains("reference"));
    let engine = Engine::start_with(loaded.clone(), cfg.clone(), Box::new(runner), None).unwrap();
    let prompts: Vec<Vec<u32>> = ["What is 2+2?", "Name a colour.", "Say hello."]
        .iter()
        .map(|q| {
            let t = loaded
                .codec
                .render_chat(&[ChatMessage::new("user", *q)])
                .unwrap();
            loaded.codec.encode(&t).unwrap()
        })
        .collect();
    // Together: three decodes share steps (a bucket of 4 with one padding
    // row), and a late prompt's chunk runs beside them.
    let rxs: Vec<_> = prompts
        .iter()
        .map(|p| engine.submit(greedy(p.clone(), 5)).unwrap())
        .collect();
    let together: Vec<Vec<u32>> = rxs.into_iter().map(tokens).collect();
    for (p, want) in prompts.iter().zip(&together) {
        let alone = tokens(engine.submit(greedy(p.clone(), 5)).unwrap());
        assert_eq!(&alone, want, "batched and alone differ");
        assert_eq!(alone.len(), 5);
    }

    // One prompt's last logits from both runners.
    let mut reference = ReferenceRunner::load(&path, 8, cfg.block_size).unwrap();
    let mut cpu = cpu_runner(&loaded, 8, cfg.block_size, KvDtype::F16, || {}).unwrap();
    let blocks: Vec<u32> = (0..8).collect();
    let seq = [SeqStep {
        tokens: &prompts[0],
        start: 0,
        blocks: &blocks,
    }];
    let (mut a, mut b) = (Vec::new(), Vec::new());
    assert!(reference.step(&seq, &|_| false, &mut a).unwrap());
    assert!(cpu.step(&seq, &|_| false, &mut b).unwrap());
    assert_eq!(a.len(), b.len());
    let err = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    eprintln!("reference vs CPU runner, first-step logits: max |diff| {err:.3}");
    assert!(err < 1.5, "max |diff| {err}");
    let top = |v: &[f32]| ultrafast_engine::sampling::argmax(v);
    let mut sorted = a.clone();
    sorted.sort_by(|x, y| y.total_cmp(x));
    if sorted[0] - sorted[1] >= 0.5 {
        assert_eq!(
            top(&a),
            top(&b),
            "the same greedy token where the margin is clear"
        );
    }
    assert_eq!(
        together[0][0],
        top(&a),
        "the engine's first token is the step's argmax"
    );
}

/// The reference runner with every row whole, as a CPU runner returns them.
struct WholeRows(ReferenceRunner);

impl ModelRunner for WholeRows {
    fn describe(&self) -> String {
        self.0.describe()
    }
    fn step(
        &mut self,
        seqs: &[SeqStep],
        stop: &(dyn Fn(usize) -> bool + Sync),
        logits: &mut Vec<f32>,
    ) -> ultrafast_engine::error::Result<bool> {
        self.0.step(seqs, stop, logits)
    }
    fn kv_bytes(&self) -> usize {
        self.0.kv_bytes()
    }
}

/// Seeded samplers that need only candidates (greedy, top-k) get them as
/// a device runner returns them, the rest whole rows; the tokens are those
/// of the same engine given every row whole.
#[test]
fn candidates_from_the_step_sample_the_tokens_of_whole_rows() {
    let (path, loaded, cfg) = setup();
    let prompt = loaded.codec.encode("The capital of France is").unwrap();
    let sampled = |temperature: f32, top_k: usize, top_p: f32| GenerateRequest {
        sampling: SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: Some(42),
            ..SamplingParams::default()
        },
        ..greedy(prompt.clone(), 6)
    };
    let requests = [
        sampled(0.9, 20, 1.0),
        sampled(1.2, 50, 0.8),
        sampled(0.8, 0, 0.95),
        greedy(prompt.clone(), 6),
    ];
    let run = |runner: Box<dyn ModelRunner>| -> Vec<Vec<u32>> {
        let engine = Engine::start_with(loaded.clone(), cfg.clone(), runner, None).unwrap();
        let rxs: Vec<_> = requests
            .iter()
            .map(|r| engine.submit(r.clone()).unwrap())
            .collect();
        rxs.into_iter().map(tokens).collect()
    };
    let runner = || ReferenceRunner::load(&path, BLOCKS, cfg.block_size).unwrap();
    let candidates = run(Box::new(runner()));
    let whole = run(Box::new(WholeRows(runner())));
    assert_eq!(candidates, whole);
    assert!(candidates.iter().all(|t| t.len() == 6));
}

/// The GPU check's synthetic model (SmolLM2's shapes, random blocks) runs
/// through the reference runner with finite logits of a realistic spread,
/// so a parity failure there is the GPU's, not the weights'.
#[test]
fn synthetic_weights_with_smollm2_shapes_give_usable_logits() {
    use ultrafast_engine::backend::blocks::{smollm2_shapes, FileWeights};
    let cfg = smollm2_shapes();
    let mut r = ReferenceRunner::new(Arc::new(FileWeights::synthetic(cfg, 7)), 8, 16);
    let blocks = [3u32];
    let toks = [11u32, 7930, 15_849, 23_768];
    let mut logits = Vec::new();
    assert!(r
        .step(
            &[SeqStep {
                tokens: &toks,
                start: 0,
                blocks: &blocks,
            }],
            &|_| false,
            &mut logits,
        )
        .unwrap());
    assert_eq!(logits.len(), 49_152);
    assert!(logits.iter().all(|v| v.is_finite()));
    let (lo, hi) = logits
        .iter()
        .fold((f32::MAX, f32::MIN), |(a, b), v| (a.min(*v), b.max(*v)));
    eprintln!("synthetic logits span {lo:.2} .. {hi:.2}");
    assert!(hi - lo > 2.0 && hi - lo < 200.0, "{lo} .. {hi}");
}

/// Sequences that report log-probabilities and sample from candidates get
/// them from a device runner's candidates and row normaliser
/// (`Need::Scored`: no whole row leaves the device); their tokens and
/// reports are those of the same engine given every row whole (scored on
/// the host), within the two log-normalisers' rounding.
#[test]
fn scored_candidates_report_what_whole_rows_report() {
    let (path, loaded, cfg) = setup();
    let prompt = loaded.codec.encode("The capital of France is").unwrap();
    let scored = |temperature: f32, top_k: usize, k: usize| GenerateRequest {
        sampling: SamplingParams {
            temperature,
            top_k,
            seed: Some(7),
            logprobs: Some(k),
            ..SamplingParams::default()
        },
        ..greedy(prompt.clone(), 5)
    };
    let requests = [scored(0.0, 0, 3), scored(0.9, 20, 5), scored(0.7, 4, 10)];
    type Reports = Vec<(u32, f32, Vec<(u32, f32)>)>;
    let run = |runner: Box<dyn ModelRunner>| -> Vec<(Vec<u32>, Reports)> {
        let engine = Engine::start_with(loaded.clone(), cfg.clone(), runner, None).unwrap();
        let rxs: Vec<_> = requests
            .iter()
            .map(|r| engine.submit(r.clone()).unwrap())
            .collect();
        rxs.into_iter()
            .map(|mut rx| {
                let (mut ids, mut reps) = (Vec::new(), Vec::new());
                while let Some(ev) = rx.blocking_recv() {
                    match ev {
                        Event::Token { id, .. } => ids.push(id),
                        Event::Logprob(r) => reps.push((
                            r.id,
                            r.logprob.unwrap(),
                            r.top.iter().map(|a| (a.id, a.logprob)).collect(),
                        )),
                        Event::Done { .. } => break,
                        Event::Error(e) => panic!("{e}"),
                        _ => {}
                    }
                }
                (ids, reps)
            })
            .collect()
    };
    let runner = || ReferenceRunner::load(&path, BLOCKS, cfg.block_size).unwrap();
    let device = run(Box::new(runner()));
    let whole = run(Box::new(WholeRows(runner())));
    for ((di, dr), (wi, wr)) in device.iter().zip(&whole) {
        assert_eq!(di, wi);
        assert_eq!(dr.len(), wr.len());
        for ((dt, dl, da), (wt, wl, wa)) in dr.iter().zip(wr) {
            assert_eq!(dt, wt);
            assert!((dl - wl).abs() < 1e-4, "{dl} vs {wl}");
            assert_eq!(da.len(), wa.len());
            for ((x, xl), (y, yl)) in da.iter().zip(wa) {
                assert_eq!(x, y);
                assert!((xl - yl).abs() < 1e-4);
            }
        }
    }
    assert_eq!(
        whole[2].1[0].2.len(),
        10,
        "the report's k, beyond the sampler's 4"
    );
}
