//! The fleet simulator's discrete-event mode with ultrafast's placement
//! (`inference::fleet`) deciding: per-member calibration re-converges
//! after a slowdown, nothing is admitted that no member can serve in
//! time, a drained member gets no new requests and finishes its streams.
#![allow(clippy::unwrap_used)]

use std::time::Duration;
use ultrafast_benches::fleet_sim::des::{self, Change, Policy};
use ultrafast_benches::fleet_sim::replica::StepModel;
use ultrafast_benches::fleet_sim::trace;

fn setup(speeds: &[f64], changes: Vec<(f64, Change)>) -> des::Setup {
    des::Setup {
        speeds: speeds.to_vec(),
        model: StepModel::default(),
        ttft: Duration::from_millis(1000),
        k: 4,
        scrape_every: 0.2,
        changes,
        pool_admission: false,
    }
}

/// A trace at `load` of an ideal router's capacity (system prompts
/// cached), as `fleet-sim` states loads.
fn trace_at(speeds: &[f64], load: f64, seconds: f64) -> Vec<trace::Req> {
    let mut s = trace::Shape {
        seconds,
        ..trace::Shape::default()
    };
    let (p, o) = s.means();
    let cap =
        speeds.iter().sum::<f64>() * StepModel::default().capacity(p - s.system_tokens as f64, o);
    s.rate = load * cap;
    trace::generate(&s)
}

fn within(outs: &[&des::Outcome], target: f64) -> f64 {
    let ok = outs
        .iter()
        .filter(|o| o.ttft.is_some_and(|t| t <= target))
        .count();
    ok as f64 / outs.len().max(1) as f64
}

#[test]
fn a_member_turning_slow_loses_its_traffic_and_the_promise_holds_again() {
    let speeds = [1.0, 1.0, 1.0, 1.0];
    let t = trace_at(&speeds, 0.6, 90.0);
    let run = des::run(
        &setup(&speeds, vec![(30.0, Change::Speed(0, 1.0 / 3.0))]),
        &t,
        Policy::PredictedLatency,
    );
    let share = |lo: f64, hi: f64| {
        let adm: Vec<_> = run
            .outcomes
            .iter()
            .filter(|o| o.admitted && o.at >= lo && o.at < hi)
            .collect();
        adm.iter().filter(|o| o.replica == 0).count() as f64 / adm.len().max(1) as f64
    };
    let before = share(0.0, 30.0);
    let after = share(40.0, 90.0);
    assert!(before > 0.15, "{before}");
    assert!(
        after < before * 0.6,
        "traffic did not move off the slowed member: {before} -> {after}"
    );
    // Within 30 s of the change, the admitted meet the target again.
    let late: Vec<_> = run
        .outcomes
        .iter()
        .filter(|o| o.admitted && o.at >= 60.0)
        .collect();
    assert!(within(&late, 1.0) >= 0.99, "{}", within(&late, 1.0));
}

#[test]
fn nothing_is_admitted_that_no_member_can_serve_in_time() {
    let speeds = [1.0, 1.0, 0.5, 2.0];
    let t = trace_at(&speeds, 1.5, 40.0);
    let run = des::run(&setup(&speeds, vec![]), &t, Policy::PredictedLatency);
    let adm: Vec<_> = run.outcomes.iter().filter(|o| o.admitted).collect();
    assert!(
        adm.len() < run.outcomes.len(),
        "an overload was admitted whole"
    );
    assert!(
        adm.len() * 2 > run.outcomes.len(),
        "{} of {}",
        adm.len(),
        run.outcomes.len()
    );
    assert!(within(&adm, 1.0) >= 0.99, "{}", within(&adm, 1.0));
    // The baseline that admits everything misses the target badly.
    let base = des::run(&setup(&speeds, vec![]), &t, Policy::LoadPrefix);
    let all: Vec<_> = base.outcomes.iter().collect();
    assert!(within(&all, 1.0) < 0.9, "{}", within(&all, 1.0));
}

#[test]
fn a_drained_member_gets_no_new_requests_and_finishes_its_streams() {
    let speeds = [1.0, 1.0, 1.0];
    let t = trace_at(&speeds, 0.5, 30.0);
    let run = des::run(
        &setup(&speeds, vec![(10.0, Change::Drain(1))]),
        &t,
        Policy::PredictedLatency,
    );
    let on1: Vec<_> = run
        .outcomes
        .iter()
        .filter(|o| o.admitted && o.replica == 1)
        .collect();
    assert!(!on1.is_empty());
    assert!(
        on1.iter().all(|o| o.at <= 10.0),
        "a drained member got a request"
    );
    assert!(
        on1.iter().all(|o| o.e2e.is_some()),
        "a stream on the drained member did not finish"
    );
}

#[test]
fn a_decision_at_a_thousand_members_scores_a_bounded_few() {
    let speeds: Vec<f64> = (0..1000).map(|i| [1.0, 1.0, 0.5, 2.0][i % 4]).collect();
    let t = trace_at(&speeds, 0.5, 6.0);
    let run = des::run(&setup(&speeds, vec![]), &t, Policy::PredictedLatency);
    // Once each member has a few samples of its own (a cold member is
    // judged on the prior's conservative factor), half the capacity is
    // admitted whole, within the target.
    let warm: Vec<_> = run.outcomes.iter().filter(|o| o.at >= 4.0).collect();
    let adm: Vec<_> = warm.iter().copied().filter(|o| o.admitted).collect();
    assert!(
        adm.len() * 100 >= warm.len() * 97,
        "{} of {}",
        adm.len(),
        warm.len()
    );
    assert!(within(&adm, 1.0) >= 0.99, "{}", within(&adm, 1.0));
    assert_eq!(run.decide_us.len(), run.outcomes.len());
}
