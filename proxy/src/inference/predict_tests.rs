//! Tests of the latency model: the pure prediction (monotone, never
//! admitting beyond a target) and the ledger.
use super::*;
use proptest::prelude::*;

/// The anonymous tenant.
fn anon() -> Tenant {
    Tenant::anonymous()
}

/// A CPU-like step model for tests here and in `admit`.
pub(crate) fn cpu() -> Cost {
    Cost {
        step_fixed_s: 0.007,
        step_per_seq_s: 0.0058,
        prefill_per_token_s: 0.0058,
        chunk: Some(32),
    }
}

fn live(slots: usize) -> Arc<Latency> {
    Arc::new(Latency::new(false, slots, Some(32), 1.0, 1.0))
}

#[test]
fn idle_is_own_prefill() {
    let c = cpu();
    // One step with its 30 prompt tokens, no decodes.
    let t = predict(&c, 8, &[], 1, 30);
    assert!((t - (c.step(0) + 30.0 * 0.0058)).abs() < 1e-9, "{t}");
    // 100 tokens in chunks of 32: four steps.
    let t = predict(&c, 8, &[], 1, 100);
    assert!((t - (4.0 * c.step(0) + 100.0 * 0.0058)).abs() < 1e-9, "{t}");
}

#[test]
fn full_slots_wait_for_the_first_to_finish() {
    let c = cpu();
    let busy = |out: f64| Work {
        rank: 1,
        prefill: 0,
        output: out,
        running: true,
        count: 1,
    };
    let ahead = [busy(100.0), busy(10.0)];
    let t = predict(&c, 2, &ahead, 1, 10);
    // The step in flight, 10 steps of both decoding until the shorter one
    // ends, then one step of the other's decode beside this prompt.
    let expect = c.step(2) + 10.0 * c.step(2) + c.step(1) + 10.0 * 0.0058;
    assert!((t - expect).abs() < 1e-9, "{t} vs {expect}");
    // A better lane does not count the worse lane's work.
    let u = predict(&c, 2, &ahead, 0, 10);
    assert!(u < t);
}

#[test]
fn prompts_that_start_decoding_slow_the_prompts_behind_them() {
    // Twelve prompts of 100 tokens arrive together on a 24-token budget:
    // each one that finishes decodes beside the rest, so every later
    // prompt gets fewer tokens a step. A sum of idle prefill times (what
    // the model predicted before) is far too low for the last one.
    let c = Cost {
        chunk: Some(24),
        ..cpu()
    };
    let queued = Work {
        rank: 1,
        prefill: 100,
        output: 128.0,
        running: false,
        count: 1,
    };
    let ahead = vec![queued; 11];
    let t = predict(&c, 16, &ahead, 1, 100);
    let idle_sum = 12.0 * predict(&c, 16, &[], 1, 100);
    assert!(t > 1.25 * idle_sum, "{t} vs {idle_sum}");
    // Tokens per step: 24 while prompts remain, k decoders and 24 - k
    // prompt tokens; 1200 prompt tokens, 11 prompts turning into
    // decoders: between 1200 / 24 and 1200 / (24 - 11) steps.
    let steps = t / (c.step(0) + 24.0 * 0.0058);
    assert!(
        steps > 1200.0 / 24.0 && steps < 1200.0 / 13.0 + 1.0,
        "{steps}"
    );
}

#[test]
fn ledger_admits_until_the_target_then_refuses() {
    let m = live(2);
    let limit = Duration::from_millis(2000);
    let target = Some(limit);
    let mut held = Vec::new();
    let mut refused = 0;
    for _ in 0..10 {
        match m.admit(Some(cpu()), 1, 30, 128, target, &[], None, &anon()) {
            (Verdict::Admit(p), Some(t)) => {
                assert!(p <= limit);
                t.dispatched();
                held.push(t);
            }
            (Verdict::Busy(p), None) => {
                assert!(p > limit);
                refused += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(held.len() >= 2 && refused > 0, "{} {}", held.len(), refused);
    let n = held.len();
    assert_eq!(m.in_ledger(), n);
    drop(held);
    assert_eq!(m.in_ledger(), 0);
}

#[test]
fn a_better_lanes_reserve_counts_only_while_it_is_active() {
    let m = live(4);
    let reserve = [(0u32, 0.5)];
    let fill = |n: usize| -> Vec<Ticket> {
        (0..n)
            .map(|_| {
                let (_, t) = m.admit(Some(cpu()), 1, 30, 100, None, &reserve, None, &anon());
                let t = t.unwrap();
                t.dispatched();
                t
            })
            .collect()
    };
    let held = fill(2);
    let idle_ultra = m
        .admit(Some(cpu()), 1, 30, 100, None, &reserve, None, &anon())
        .0;
    // An ultra request marks its lane active: now two of the four
    // slots are its, and the standard request waits for a slot.
    drop(m.admit(Some(cpu()), 0, 10, 4, None, &[], None, &anon()));
    let busy_ultra = m
        .admit(Some(cpu()), 1, 30, 100, None, &reserve, None, &anon())
        .0;
    let p = |v: Verdict| match v {
        Verdict::Admit(p) | Verdict::Busy(p) => p,
    };
    assert!(
        p(busy_ultra) > p(idle_ultra) * 3,
        "{busy_ultra:?} vs {idle_ultra:?}"
    );
    drop(held);
}

#[test]
fn learned_upstream_follows_its_streams() {
    let m = Arc::new(Latency::new(true, 4, None, 1000.0, 10.0));
    assert!((m.cost(None).step(1) - 0.1).abs() < 0.01);
    let (_, t) = m.admit(None, 1, 100, 50, None, &[], None, &anon());
    let t = t.unwrap();
    t.dispatched();
    t.token(None, Some(Duration::from_millis(300)));
    for _ in 0..200 {
        t.token(Some(Duration::from_millis(20)), None);
    }
    let c = m.cost(None);
    assert!((c.step(1) - 0.02).abs() < 0.005, "{c:?}");
    // The first token, alone, measured 2 ms a prompt token against the
    // prior's 1 ms (a fifth of the way there) at the prior's 100 ms step;
    // the step then turned out five times shorter, and prefill with it.
    let measured = 0.8 * 0.001 + 0.2 * 0.002;
    let want = measured * c.step(1) / 0.1;
    assert!((c.prefill_per_token_s - want).abs() < want * 0.05, "{c:?}");
    t.finish(50);
}

#[test]
fn first_tokens_calibrate_their_lane() {
    let m = live(4);
    assert_eq!(m.correction(1), calibrate::PRIOR);
    for _ in 0..calibrate::MIN_SAMPLES + 5 {
        let (_, t) = m.admit(Some(cpu()), 1, 30, 8, None, &[], None, &anon());
        let t = t.unwrap();
        t.dispatched();
        // The first token at once: far sooner than predicted (which is
        // above the 50 ms floor of a lane without a target).
        t.token(None, None);
        t.token(Some(Duration::from_millis(1)), None);
    }
    assert!(m.correction(1) < 1.0, "{}", m.correction(1));
    assert_eq!(m.correction(0), calibrate::PRIOR);
    // A calibrated prediction is the raw one times the factor.
    let (v, _) = m.admit(Some(cpu()), 1, 30, 8, None, &[], None, &anon());
    let Verdict::Admit(p) = v else {
        panic!("{v:?}")
    };
    let raw = predict(&cpu(), 4, &[], 1, 30);
    assert!((p.as_secs_f64() - raw * m.correction(1)).abs() < 1e-6);
}

#[test]
fn thousands_of_streams_replay_as_a_bounded_view() {
    let m = Arc::new(Latency::new(true, 1 << 20, None, 2000.0, 30.0));
    let mut exact = Vec::new();
    let held: Vec<Ticket> = (0..5000usize)
        .map(|i| {
            let max_out = 100 + (i * 7919) % 900;
            let (_, t) = m.admit(Some(cpu()), 1, 50, max_out, None, &[], None, &anon());
            let t = t.unwrap();
            t.dispatched();
            t.token(None, None);
            exact.push(Work {
                rank: 1,
                prefill: 0,
                output: (max_out - 1) as f64,
                running: true,
                count: 1,
            });
            t
        })
        .collect();
    let view = m
        .ledger
        .lock()
        .books
        .view(super::book::Viewer::plain(1, u64::MAX, 1.0));
    assert!(view.len() < 100, "{}", view.len());
    assert_eq!(view.iter().map(|w| w.count).sum::<usize>(), 5000);
    // Decoders' output only rounded up (by at most a quarter).
    let out = |v: &[Work]| v.iter().map(|w| w.output * w.count as f64).sum::<f64>();
    assert!(out(&view) >= out(&exact) && out(&view) <= 1.25 * out(&exact));
    let c = cpu();
    let a = predict(&c, 1 << 20, &exact, 1, 200);
    let b = predict(&c, 1 << 20, &view, 1, 200);
    assert!(b + grain(&c, 1 << 20) >= a && b <= 1.25 * a, "{a} vs {b}");
    // Tokens keep the counts: running stays 5000, and leaving empties it.
    assert_eq!(m.ledger.lock().books.running(), 5000);
    drop(held);
    assert_eq!(m.in_ledger(), 0);
    assert_eq!(m.ledger.lock().books.running(), 0);
}

fn work() -> impl Strategy<Value = Work> {
    (0u32..3, 0usize..600, 0.0f64..300.0, any::<bool>()).prop_map(
        |(rank, prefill, output, running)| Work {
            rank,
            prefill,
            output,
            running,
            count: 1,
        },
    )
}

/// How much sooner more work may predict: two steps of a full budget. The
/// replay is continuous batching, and that has scheduling anomalies of its
/// own: a prompt ahead delays the prompts behind it, which then start
/// decoding later and take less of each step's budget while this request
/// prefills, and a short request can change which slot frees first. Over
/// 200,000 random cases with the engine's cost shape the largest gain was
/// 0.2% of the prediction (0.2 of a step), and 0.44 of a step in floods of
/// equal prompts; a running entry with nothing left to decode, inserted
/// among 27 others on 16 slots, once gained 1.37 steps (the case is kept
/// in `proptest-regressions/`). The bound is what the tests hold it to.
fn grain(c: &Cost, slots: usize) -> f64 {
    1e-9 + 2.0 * c.step(slots) + c.prefill_per_token_s * c.chunk.unwrap_or(0) as f64
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// More work ahead never makes the prediction shorter, beyond the
    /// replay's grain (see `grain`); a longer own prompt never does.
    #[test]
    fn monotone_in_the_work_ahead(
        ahead in proptest::collection::vec(work(), 0..40),
        extra in work(),
        at in 0usize..40,
        slots in 1usize..40,
        rank in 0u32..3,
        prompt in 1usize..600,
        fixed in 0.0f64..0.05, per_seq in 0.0f64..0.01, per_tok in 0.0f64..0.01,
        chunk in proptest::option::of(1usize..600),
    ) {
        let c = Cost { step_fixed_s: fixed, step_per_seq_s: per_seq, prefill_per_token_s: per_tok, chunk };
        let before = predict(&c, slots, &ahead, rank, prompt);
        let mut more = ahead.clone();
        more.insert(at.min(more.len()), extra);
        let after = predict(&c, slots, &more, rank, prompt);
        prop_assert!(after + grain(&c, slots) >= before, "{} < {}", after, before);
        // A longer own prompt never predicts sooner either.
        prop_assert!(predict(&c, slots, &ahead, rank, prompt + 1) + 1e-9 >= before);
    }

    /// A group of alike decoders replays exactly as that many single ones,
    /// also where it needs more slots than are free.
    #[test]
    fn a_group_of_decoders_is_its_members(
        n in 1usize..40,
        output in 1.0f64..200.0,
        slots in 1usize..40,
        prompt in 1usize..300,
        chunk in proptest::option::of(1usize..300),
        rest in proptest::collection::vec(work(), 0..10),
    ) {
        let c = Cost { chunk, ..cpu() };
        let one = Work { rank: 1, prefill: 0, output, running: true, count: 1 };
        let mut singles = vec![one; n];
        singles.extend(rest.iter().copied());
        let mut grouped = vec![Work { count: n, ..one }];
        grouped.extend(rest.iter().copied());
        let a = predict(&c, slots, &singles, 1, prompt);
        let b = predict(&c, slots, &grouped, 1, prompt);
        prop_assert!((a - b).abs() <= 1e-9 * a.max(1.0), "{} vs {}", a, b);
    }

    /// The ledger never admits a request whose prediction exceeds its target.
    #[test]
    fn never_admits_beyond_the_target(
        reqs in proptest::collection::vec((0u32..3, 1usize..400, 1usize..200, 50u64..5000, any::<bool>()), 1..60),
        slots in 1usize..16,
    ) {
        let m = live(slots);
        let mut held = Vec::new();
        for (rank, prompt, max_out, target_ms, dispatch) in reqs {
            let target = Duration::from_millis(target_ms);
            match m.admit(Some(cpu()), rank, prompt, max_out, Some(target), &[], None, &anon()) {
                (Verdict::Admit(p), Some(t)) => {
                    prop_assert!(p <= target);
                    if dispatch { t.dispatched(); }
                    held.push(t);
                }
                (Verdict::Busy(p), None) => prop_assert!(p > target),
                _ => prop_assert!(false, "verdict and ticket disagree"),
            }
        }
    }
}
