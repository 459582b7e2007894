//! The SLO stage of a request to a fleet: `slo::slo`'s outcomes, with the
//! member chosen by the placement (see the module above).

use super::{Aligned, Ask, Fleet, Reported};
use crate::admission::queue::{LaneSpec, OnMiss};
use crate::inference::slo::{is_granted, reserved_above, Asked, Missed, Passed};
use std::time::Duration;
use ultrafast_engine::fair::Tenant;

/// What the fleet stage is given beside the lanes.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// Prompt tokens (estimated for an upstream).
    pub prompt: usize,
    /// Most output tokens (all choices).
    pub max_out: usize,
    /// Time gone since arrival.
    pub spent: Duration,
    /// Lanes the request may use (None: all).
    pub granted: Option<&'a [bool]>,
    /// Who asks.
    pub tenant: &'a Tenant,
    /// Its own targets.
    pub asked: Asked,
    /// Its prompt's prefix blocks.
    pub blocks: &'a [u64],
}

/// Place a request of `lane` on the fleet: admitted on the member with
/// the most headroom; refused at once (503 `slo`, with `Retry-After`) when
/// no member meets its targets now; 422 `slo_unattainable` (or the next
/// lower lane, where the lane says so) when not even an idle member of
/// those scored would. With no member up the request passes unplaced:
/// the backend answers that no member can serve it.
pub fn admit(
    lanes: &[LaneSpec],
    lane: usize,
    fleet: &Fleet,
    aligned: &Aligned,
    report: &dyn Fn(usize) -> Reported,
    r: Request<'_>,
) -> Result<Passed, Missed> {
    let mut l = lane;
    loop {
        let spec = &lanes[l];
        let target = r.asked.ttft_for(spec);
        let reserved = reserved_above(lanes, l);
        let ask = Ask {
            rank: spec.rank,
            prompt: r.prompt,
            max_out: r.max_out,
            ttft: target.map(|t| t.saturating_sub(r.spent)),
            tpot: r.asked.tpot,
            reserved: &reserved,
            tenant: r.tenant,
            blocks: r.blocks,
        };
        let refused = match fleet.place(aligned, report, &ask) {
            Ok(p) => {
                return Ok(Passed {
                    lane: l,
                    downgraded: l != lane,
                    ticket: Some(p.ticket),
                    predicted: Some(p.predicted),
                    member: Some(p.addr),
                })
            }
            Err(e) => e,
        };
        if refused.scored == 0 {
            return Ok(Passed {
                lane: l,
                downgraded: l != lane,
                ticket: None,
                predicted: None,
                member: None,
            });
        }
        if let Some(t) = target.filter(|t| !refused.on_tpot && refused.idle > *t) {
            let lower = (l + 1..lanes.len()).find(|&m| is_granted(r.granted, m));
            if let (OnMiss::Downgrade, Some(m)) = (spec.on_miss, lower) {
                l = m;
                continue;
            }
            return Err(Missed::Unattainable {
                lane: l,
                target: t,
                predicted: refused.idle,
            });
        }
        let (predicted, over) = match refused.on_tpot {
            true => (refused.tpot, Duration::ZERO),
            false => (
                refused.predicted,
                refused
                    .predicted
                    .saturating_sub(ask.ttft.unwrap_or_default()),
            ),
        };
        return Err(Missed::Busy {
            lane: l,
            predicted,
            retry_after: over.max(Duration::from_secs(1)),
        });
    }
}
