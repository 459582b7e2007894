//! Batching invariance on the real model over the paged KV cache: a greedy
//! request gives the same tokens alone, inside a batch of 8 mixed requests
//! (prefill chunks and decodes in the same steps), and through the simple
//! contiguous-cache path; every block returns to the pool at the end.

#![allow(clippy::unwrap_used)]
use std::sync::Arc;
use ultrafast_engine::backend::cpu::CpuRunner;
use ultrafast_engine::backend::KvDtype;
use ultrafast_engine::backend::{CandleRunner, ModelRunner};
use ultrafast_engine::fetch::{self, SMOLLM2};
use ultrafast_engine::generate;
use ultrafast_engine::generate::Loaded;
use ultrafast_engine::kv::BlockPool;
use ultrafast_engine::model::paged::SeqStep;
use ultrafast_engine::sampling::argmax;
use ultrafast_engine::tokenizer::ChatMessage;

const NEW: usize = 12;

fn run(r: &mut dyn ModelRunner, seqs: &[SeqStep]) -> Vec<Vec<f32>> {
    let mut logits = Vec::new();
    assert!(r.step(seqs, &|_| false, &mut logits).unwrap());
    let vocab = logits.len() / seqs.len();
    logits.chunks(vocab).map(|c| c.to_vec()).collect()
}

/// The engine's own kernels, with either KV cache precision: the same
/// tokens, and bit-for-bit the same logits, alone and in any batch.
#[test]
fn greedy_tokens_are_the_same_alone_and_in_a_mixed_batch() {
    let l = Arc::new(generate::load(&fetch::pull(&SMOLLM2).unwrap()).unwrap());
    for kv in [KvDtype::F16, KvDtype::F32] {
        let w = l.fast.as_ref().unwrap().clone();
        let mut r = CpuRunner::new(w, 128, 16, kv, 2, || {}).unwrap();
        check(&l, &mut r, false);
    }
}

/// The candle forward pass, which the contiguous-cache path must agree with.
#[test]
fn the_candle_runner_batches_the_same_and_agrees_with_the_contiguous_path() {
    let l = Arc::new(generate::load(&fetch::pull(&SMOLLM2).unwrap()).unwrap());
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let mut r = CandleRunner::new(l.clone(), 128, 16, pool);
    check(&l, &mut r, true);
}

fn check(l: &Loaded, runner: &mut dyn ModelRunner, contiguous: bool) {
    let qs = [
        "What is the capital of France? Answer in one sentence.",
        "Name a prime number larger than ten.",
        "Say hello in Spanish.",
        "What color is the sky on a clear day?",
        "Write one word that rhymes with cat.",
        "How many legs does a spider have?",
        "What is 2 + 2?",
        "Give me a synonym for happy.",
    ];
    let prompts: Vec<Vec<u32>> = qs
        .iter()
        .map(|q| {
            let t = l
                .codec
                .render_chat(&[ChatMessage::new("user", q.to_string())])
                .unwrap();
            l.codec.encode(&t).unwrap()
        })
        .collect();
    let pool = BlockPool::new(128, 16);

    // Alone, through the paged path.
    let alone = |i: usize, kv: &mut dyn ModelRunner| -> Vec<u32> {
        let p = &prompts[i];
        let mut seq = pool.allocate(p).unwrap();
        let mut logits = run(
            kv,
            &[SeqStep {
                tokens: p,
                start: 0,
                blocks: seq.blocks(),
            }],
        );
        let mut out = Vec::new();
        for _ in 0..NEW {
            let t = argmax(&logits[0]);
            out.push(t);
            let pos = p.len() + out.len() - 1;
            assert!(pool.grow(&mut seq, pos + 1));
            logits = run(
                kv,
                &[SeqStep {
                    tokens: &[t],
                    start: pos,
                    blocks: seq.blocks(),
                }],
            );
        }
        out
    };
    let solo: Vec<Vec<u32>> = (0..prompts.len()).map(|i| alone(i, runner)).collect();
    assert_eq!(pool.stats().used, 0);

    // The contiguous single-sequence path agrees.
    for (i, p) in prompts
        .iter()
        .enumerate()
        .take(if contiguous { 2 } else { 0 })
    {
        let mut cache = l.model.new_cache();
        let mut logits = l
            .model
            .forward(p, &mut cache)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let mut out = Vec::new();
        for _ in 0..NEW {
            let t = argmax(&logits);
            out.push(t);
            logits = l
                .model
                .forward(&[t], &mut cache)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
        }
        assert_eq!(
            out, solo[i],
            "prompt {i}: paged and contiguous paths differ"
        );
    }

    // Mixed batch: the first half prefills in step 1; step 2 decodes them
    // while the second half prefills; then all decode together.
    let mut seqs: Vec<_> = prompts.iter().map(|p| pool.allocate(p).unwrap()).collect();
    let mut outs: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut pending: Vec<Option<u32>> = vec![None; prompts.len()];
    let half = prompts.len() / 2;
    let first: Vec<SeqStep> = (0..half)
        .map(|i| SeqStep {
            tokens: &prompts[i],
            start: 0,
            blocks: seqs[i].blocks(),
        })
        .collect();
    let logits = run(runner, &first);
    for i in 0..half {
        pending[i] = Some(argmax(&logits[i]));
    }
    let mut step = 0;
    while outs.iter().any(|o| o.len() < NEW) {
        step += 1;
        let mut plan: Vec<(usize, Vec<u32>, usize)> = Vec::new();
        for i in 0..prompts.len() {
            if outs[i].len() >= NEW {
                continue;
            }
            match pending[i] {
                Some(t) => {
                    outs[i].push(t);
                    if outs[i].len() < NEW {
                        let pos = prompts[i].len() + outs[i].len() - 1;
                        assert!(pool.grow(&mut seqs[i], pos + 1));
                        plan.push((i, vec![t], pos));
                    }
                }
                None if step == 1 => plan.push((i, prompts[i].clone(), 0)),
                None => unreachable!(),
            }
        }
        if plan.is_empty() {
            break;
        }
        let steps: Vec<SeqStep> = plan
            .iter()
            .map(|(i, toks, start)| SeqStep {
                tokens: toks,
                start: *start,
                blocks: seqs[*i].blocks(),
            })
            .collect();
        let logits = run(runner, &steps);
        for (k, (i, _, _)) in plan.iter().enumerate() {
            pending[*i] = Some(argmax(&logits[k]));
        }
    }
    for i in 0..prompts.len() {
        assert_eq!(
            outs[i], solo[i],
            "prompt {i} ({:?}) differs inside the batch",
            qs[i]
        );
    }
    drop(seqs);
    if !contiguous {
        // Bit for bit: prompt 0's logits alone and beside prompt 1.
        let a = pool.allocate(&prompts[0]).unwrap();
        let one = run(
            runner,
            &[SeqStep {
                tokens: &prompts[0],
                start: 0,
                blocks: a.blocks(),
            }],
        );
        drop(a);
        let a = pool.allocate(&prompts[0]).unwrap();
        let b = pool.allocate(&prompts[1]).unwrap();
        let two = run(
            runner,
            &[
                SeqStep {
                    tokens: &prompts[1],
                    start: 0,
                    blocks: b.blocks(),
                },
                SeqStep {
                    tokens: &prompts[0],
                    start: 0,
                    blocks: a.blocks(),
                },
            ],
        );
        assert!(one[0] == two[1], "logits depend on the batch");
    }
    let s = pool.stats();
    assert_eq!((s.used, s.free + s.cached), (0, 128), "blocks leaked");
}
