//! Tests of the latency model: the pure prediction (monotone, never
//! admitting beyond a target) and the ledger.
use super::*;
use proptest::prelude::*;

fn cpu() -> Cost {
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
    let t = predict(&c, 8, &[], 1, 30);
    assert!((t - (0.007 + 30.0 * 0.0058)).abs() < 1e-9, "{t}");
    // 100 tokens in chunks of 32: four steps.
    let t = predict(&c, 8, &[], 1, 100);
    assert!((t - (4.0 * 0.007 + 100.0 * 0.0058)).abs() < 1e-9, "{t}");
}

#[test]
fn full_slots_wait_for_the_first_to_finish() {
    let c = cpu();
    let busy = |out: f64| Work {
        rank: 1,
        prefill: 0,
        output: out,
        running: true,
    };
    let ahead = [busy(100.0), busy(10.0)];
    let t = predict(&c, 2, &ahead, 1, 10);
    // Starts when the 10-token one ends: 10 steps at b = 2, after the
    // step in flight.
    let step = c.step(2);
    let expect = c.step(2) + 10.0 * step + c.prefill(10, 1);
    assert!((t - expect).abs() < 1e-9, "{t} vs {expect}");
    // A better lane does not count the worse lane's work.
    let u = predict(&c, 2, &ahead, 0, 10);
    assert!(u < t);
}

#[test]
fn ledger_admits_until_the_target_then_refuses() {
    let m = live(2);
    let limit = Duration::from_millis(2000);
    let target = Some(limit);
    let mut held = Vec::new();
    let mut refused = 0;
    for _ in 0..10 {
        match m.admit(Some(cpu()), 1, 30, 128, target, &[]) {
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
                let (_, t) = m.admit(Some(cpu()), 1, 30, 100, None, &reserve);
                let t = t.unwrap();
                t.dispatched();
                t
            })
            .collect()
    };
    let held = fill(2);
    let idle_ultra = m.admit(Some(cpu()), 1, 30, 100, None, &reserve).0;
    // An ultra request marks its lane active: now two of the four
    // slots are its, and the standard request waits for a slot.
    drop(m.admit(Some(cpu()), 0, 10, 4, None, &[]));
    let busy_ultra = m.admit(Some(cpu()), 1, 30, 100, None, &reserve).0;
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
    let (_, t) = m.admit(None, 1, 100, 50, None, &[]);
    let t = t.unwrap();
    t.dispatched();
    t.token(None, Some(Duration::from_millis(300)));
    for _ in 0..200 {
        t.token(Some(Duration::from_millis(20)), None);
    }
    let c = m.cost(None);
    assert!((c.step(1) - 0.02).abs() < 0.005, "{c:?}");
    assert!(c.prefill_per_token_s > 0.001, "{c:?}");
    t.finish(50);
}

fn work() -> impl Strategy<Value = Work> {
    (0u32..3, 0usize..600, 0.0f64..300.0, any::<bool>()).prop_map(
        |(rank, prefill, output, running)| Work {
            rank,
            prefill,
            output,
            running,
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    /// More work ahead never makes the prediction shorter.
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
        prop_assert!(after + 1e-9 >= before, "{} < {}", after, before);
        // A longer own prompt never predicts sooner either.
        prop_assert!(predict(&c, slots, &ahead, rank, prompt + 1) + 1e-9 >= before);
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
            match m.admit(Some(cpu()), rank, prompt, max_out, Some(target), &[]) {
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
