//! Batching invariance on the real model over the paged KV cache: a greedy
//! request gives the same tokens alone, inside a batch of 8 mixed requests
//! (prefill chunks and decodes in the same steps), and through the simple
//! contiguous-cache path; every block returns to the pool at the end.

#![allow(clippy::unwrap_used)]
use ultrafast_engine::fetch::{self, SMOLLM2};
use ultrafast_engine::generate;
use ultrafast_engine::kv::BlockPool;
use ultrafast_engine::model::paged::{PagedKv, SeqStep};
use ultrafast_engine::sampling::argmax;
use ultrafast_engine::tokenizer::ChatMessage;

const NEW: usize = 12;

#[test]
fn greedy_tokens_are_the_same_alone_and_in_a_mixed_batch() {
    let l = generate::load(&fetch::pull(&SMOLLM2).unwrap()).unwrap();
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
    let mut kv = PagedKv::new(&l.model, 128, 16);

    // Alone, through the paged path.
    let alone = |i: usize, kv: &mut PagedKv| -> Vec<u32> {
        let p = &prompts[i];
        let mut seq = pool.allocate(p).unwrap();
        let mut logits = l
            .model
            .forward_paged(
                kv,
                &[SeqStep {
                    tokens: p,
                    start: 0,
                    blocks: seq.blocks(),
                }],
            )
            .unwrap();
        let mut out = Vec::new();
        for _ in 0..NEW {
            let t = argmax(&logits[0]);
            out.push(t);
            let pos = p.len() + out.len() - 1;
            assert!(pool.grow(&mut seq, pos + 1));
            logits = l
                .model
                .forward_paged(
                    kv,
                    &[SeqStep {
                        tokens: &[t],
                        start: pos,
                        blocks: seq.blocks(),
                    }],
                )
                .unwrap();
        }
        out
    };
    let solo: Vec<Vec<u32>> = (0..prompts.len()).map(|i| alone(i, &mut kv)).collect();
    assert_eq!(pool.stats().used, 0);

    // The contiguous single-sequence path agrees.
    for (i, p) in prompts.iter().enumerate().take(2) {
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
    let logits = l.model.forward_paged(&mut kv, &first).unwrap();
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
        let logits = l.model.forward_paged(&mut kv, &steps).unwrap();
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
    let s = pool.stats();
    assert_eq!((s.used, s.free + s.cached), (0, 128), "blocks leaked");
}
