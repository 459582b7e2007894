//! The admission stage of an inference request, after parsing: choose the
//! lane, then hold the request against its lane's time-to-first-token
//! target with the backend's latency model. Three outcomes: admitted (with
//! a ledger ticket and the prediction), refused at once because the
//! backend is too busy now (503 `slo` with a `Retry-After` from the
//! prediction), or refused because even an idle backend could not meet the
//! target (422 `slo_unattainable`, or moved to the next lower lane where
//! the lane says `on_miss = "downgrade"`).
//!
//! Rate limits, API keys and token budgets run before this stage (they do
//! not need the prompt's tokens); the lane gate's bounded wait after it.

use super::delivery::Failure;
use super::predict::{Cost, Latency, Ticket, Verdict};
pub use super::targets::Asked;
use crate::admission::queue::{LaneSpec, OnMiss, Reason};
use crate::admission::{refusal, select_lane};
use std::sync::Arc;
use std::time::Duration;
use ultrafast_engine::api::{BackendError, Prompt, PromptBound};
use ultrafast_engine::fair::Tenant;

/// The lane of a request: the `X-Request-Priority` header, else the body's
/// `priority`, else the route's default.
pub fn lane(
    lanes: &[LaneSpec],
    header: Option<&[u8]>,
    body: Option<&str>,
    default: usize,
) -> Result<usize, BackendError> {
    let pick = header.or(body.map(str::as_bytes));
    select_lane(lanes, pick, default)
        .map_err(|why| BackendError::invalid("invalid_priority", Some("priority"), why))
}

/// The lane a request may use: `lane` itself when `granted` (the lane
/// names its API key lists, or the route's anonymous lanes for a request
/// without a key) allows it or is None (everything granted); else, when
/// the lane says `on_forbidden = "downgrade"`, the next lower lane that is
/// granted; else 403 `lane_not_allowed`.
pub fn grant(
    lanes: &[LaneSpec],
    lane: usize,
    granted: Option<&[bool]>,
    who: impl FnOnce() -> String,
) -> Result<usize, BackendError> {
    let ok = |l: usize| is_granted(granted, l);
    if ok(lane) {
        return Ok(lane);
    }
    if lanes[lane].on_forbidden == OnMiss::Downgrade {
        if let Some(l) = (lane + 1..lanes.len()).find(|&l| ok(l)) {
            return Ok(l);
        }
    }
    Err(BackendError {
        status: 403,
        kind: "invalid_request_error",
        code: "lane_not_allowed",
        param: Some("priority"),
        message: format!("{} may not use the lane `{}`.", who(), lanes[lane].name),
    })
}

/// Whether lane `l` is among `granted` (None: every lane is).
pub(super) fn is_granted(granted: Option<&[bool]>, l: usize) -> bool {
    granted.is_none_or(|g| g.get(l).copied().unwrap_or(false))
}

/// A request that passed the SLO check.
#[derive(Debug)]
pub struct Passed {
    /// The lane it runs in (lower than asked if downgraded).
    pub lane: usize,
    /// Whether it was moved down.
    pub downgraded: bool,
    /// Its place in the backend's ledger.
    pub ticket: Option<Ticket>,
    /// Predicted time to first token from now.
    pub predicted: Option<Duration>,
    /// The pool member the fleet placed it on (`lb = "predicted_latency"`).
    pub member: Option<std::net::SocketAddr>,
}

/// Why the SLO check refused a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Missed {
    /// Too busy now: retry after the given time.
    Busy {
        /// The lane.
        lane: usize,
        /// The prediction.
        predicted: Duration,
        /// When to retry.
        retry_after: Duration,
    },
    /// Not even an idle backend meets the lane's target.
    Unattainable {
        /// The lane.
        lane: usize,
        /// Its target.
        target: Duration,
        /// The prediction on an idle backend.
        predicted: Duration,
    },
}

impl Missed {
    /// The lane the refusal is counted in.
    pub fn lane(&self) -> usize {
        match self {
            Missed::Busy { lane, .. } | Missed::Unattainable { lane, .. } => *lane,
        }
    }

    /// The response.
    pub fn failure(&self, lanes: &[LaneSpec]) -> Failure {
        match self {
            Missed::Busy {
                predicted,
                retry_after,
                ..
            } => {
                let (status, headers, body) = refusal(Reason::Slo, *retry_after, Some(*predicted));
                Failure {
                    status,
                    headers,
                    body,
                }
            }
            Missed::Unattainable {
                lane,
                target,
                predicted,
            } => {
                let name = lanes.get(*lane).map(|l| l.name.as_str()).unwrap_or("");
                let message = format!(
                    "lane `{name}` targets a first token within {} ms; this request needs about {} ms even on an idle server (shorten the prompt, or use a lane with a longer target)",
                    target.as_millis(),
                    predicted.as_millis()
                );
                let body = serde_json::json!({
                    "error": {"message": message, "type": "invalid_request_error",
                        "param": "messages", "code": "slo_unattainable"},
                    "lane": name,
                    "ttft_slo_ms": target.as_millis() as u64,
                    "predicted_ttft_ms": predicted.as_millis() as u64,
                });
                Failure {
                    status: 422,
                    headers: vec![("x-ultrafast-lane", name.to_string())],
                    body: bytes::Bytes::from(body.to_string()),
                }
            }
        }
    }
}

/// The lane's better lanes with their reserved shares.
pub(super) fn reserved_above(lanes: &[LaneSpec], l: usize) -> Vec<(u32, f64)> {
    lanes[..l]
        .iter()
        .map(|b| (b.rank, b.reserved_share))
        .collect()
}

/// Refuse at once, before the prompt is tokenized, a request that would
/// miss its lane's target even with a one-token prompt (the backend is
/// too busy whatever the prompt). Otherwise hold its place in the ledger
/// while it is tokenized (see [`Latency::claim`]); `slo` settles it.
/// `asked`: the request's own targets (they only tighten the lane's).
#[allow(clippy::too_many_arguments)]
pub fn precheck(
    lanes: &[LaneSpec],
    lane: usize,
    latency: &Arc<Latency>,
    live: Option<Cost>,
    estimate: usize,
    max_out: usize,
    tenant: &Tenant,
    asked: Asked,
) -> Result<Option<Ticket>, Missed> {
    let Some(target) = asked.ttft_for(&lanes[lane]) else {
        return Ok(None);
    };
    let reserved = reserved_above(lanes, lane);
    let rank = lanes[lane].rank;
    let estimate = within_target(latency, live, estimate, target);
    match latency.claim(live, rank, estimate, max_out, target, &reserved, tenant) {
        Ok(claim) => Ok(Some(claim)),
        Err(predicted) => Err(Missed::Busy {
            lane,
            predicted,
            retry_after: predicted.saturating_sub(target).max(Duration::from_secs(1)),
        }),
    }
}

/// The claim of an estimated `estimate` tokens, bounded by the longest
/// prompt that meets `target` on an idle backend: a longer one never runs
/// in this lane (refused as unattainable, or moved to a lower lane, where
/// it is not ahead of this lane's requests), so an unconfirmed claim never
/// holds more of the lane than a request can really cost it. A binary
/// search over idle predictions (a dozen replays of an empty ledger).
fn within_target(
    latency: &Latency,
    live: Option<Cost>,
    estimate: usize,
    target: Duration,
) -> usize {
    if latency.idle(live, estimate) <= target {
        return estimate;
    }
    let (mut lo, mut hi) = (1usize, estimate);
    while lo + 1 < hi {
        let mid = lo + (hi - lo) / 2;
        if latency.idle(live, mid) <= target {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// A prompt's likely token count before it is tokenized: English runs
/// about four characters a token, and a chat template adds a few tokens a
/// message. Only sizes a claim (see [`precheck`]); `slo` uses the real
/// count. Never more than the model's context (`bound`): a claim stands
/// for what the request can really cost, and no request that fits costs
/// more, so an oversized prompt cannot push later arrivals behind a claim
/// it will never use.
pub fn estimate_tokens(prompt: &Prompt, bound: Option<PromptBound>) -> usize {
    let e = match prompt {
        Prompt::Text(t) => t.len() / 4 + 1,
        Prompt::Tokens(t) => t.len(),
        Prompt::Chat(m) => m.iter().map(|m| m.content.len() / 4 + 8).sum::<usize>() + 2,
    };
    bound.map_or(e, |b| e.min(b.context.max(1)))
}

/// The prompt's bytes as tokenizing reads them (roles too).
pub fn prompt_bytes(prompt: &Prompt) -> usize {
    let roles = match prompt {
        Prompt::Chat(m) => m.iter().map(|m| m.role.len()).sum(),
        Prompt::Text(_) | Prompt::Tokens(_) => 0,
    };
    prompt.text_bytes() + roles
}

/// Refuse, before any claim or tokenization, a prompt whose byte count
/// alone proves it cannot fit the model's context: every token covers at
/// most `max_token_bytes` bytes of the text, so `bytes / max_token_bytes`
/// tokens is a lower bound of the prompt (and its template only adds).
pub fn prove_too_long(prompt: &Prompt, bound: Option<PromptBound>) -> Result<(), BackendError> {
    let Some(PromptBound {
        context,
        max_token_bytes: Some(per),
    }) = bound
    else {
        return Ok(());
    };
    let bytes = prompt.text_bytes();
    let least = bytes.div_ceil(per.max(1));
    if least < context {
        return Ok(());
    }
    Err(BackendError::invalid(
        "context_length_exceeded",
        Some(prompt.param()),
        format!("This model's maximum context length is {context} tokens. However, your prompt of {bytes} bytes has at least {least} tokens."),
    ))
}

/// Hold a request of `prompt` tokens (at most `max_out` more) against the
/// target of `lane`, moving down lanes that say so. `live` is the
/// backend's own cost model, if it has one. `spent`: the time since the
/// request arrived (parsing, tokenizing), already gone from its target.
/// `granted`: the lanes the request may use (None: all); a move down skips
/// the others.
#[allow(clippy::too_many_arguments)]
pub fn slo(
    lanes: &[LaneSpec],
    lane: usize,
    latency: &Arc<Latency>,
    live: Option<Cost>,
    prompt: usize,
    max_out: usize,
    claim: Option<Ticket>,
    spent: Duration,
    granted: Option<&[bool]>,
    tenant: &Tenant,
    asked: Asked,
) -> Result<Passed, Missed> {
    let mut claim = claim;
    let mut l = lane;
    loop {
        let spec = &lanes[l];
        let target = asked.ttft_for(spec);
        if let Some(target) = target {
            let idle = latency.idle(live, prompt);
            if idle > target {
                let lower = (l + 1..lanes.len()).find(|&m| is_granted(granted, m));
                if let (OnMiss::Downgrade, Some(m)) = (spec.on_miss, lower) {
                    l = m;
                    continue;
                }
                return Err(Missed::Unattainable {
                    lane: l,
                    target,
                    predicted: idle,
                });
            }
        }
        // Slots that active better lanes keep for themselves are not this
        // lane's.
        let reserved = reserved_above(lanes, l);
        let claim = claim.take();
        let left = target.map(|t| t.saturating_sub(spent));
        if let Some(t) = asked.tpot {
            // Its own inter-token target: the step it would join now.
            let tpot = latency.tpot(live);
            if tpot > t {
                return Err(Missed::Busy {
                    lane: l,
                    predicted: tpot,
                    retry_after: Duration::from_secs(1),
                });
            }
        }
        return match latency.admit(
            live, spec.rank, prompt, max_out, left, &reserved, claim, tenant,
        ) {
            (Verdict::Admit(p), ticket) => Ok(Passed {
                lane: l,
                downgraded: l != lane,
                ticket,
                predicted: Some(p),
                member: None,
            }),
            (Verdict::Busy(p), _) => {
                // The excess drains at the backend's pace: retry once the
                // prediction would be back within the target.
                let target = left.unwrap_or_default();
                Err(Missed::Busy {
                    lane: l,
                    predicted: p,
                    retry_after: p.saturating_sub(target).max(Duration::from_secs(1)),
                })
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::default_lanes;
    use crate::inference::predict::tests::cpu;

    /// `slo` on the CPU-like cost model, nothing spent yet, every lane
    /// granted.
    fn slo_now(
        lanes: &[LaneSpec],
        lane: usize,
        m: &Arc<Latency>,
        prompt: usize,
        max_out: usize,
        claim: Option<Ticket>,
    ) -> Result<Passed, Missed> {
        slo(
            lanes,
            lane,
            m,
            Some(cpu()),
            prompt,
            max_out,
            claim,
            Duration::ZERO,
            None,
            &Tenant::anonymous(),
            Asked::default(),
        )
    }

    #[test]
    fn lane_header_then_body_then_default() {
        let lanes = default_lanes();
        assert_eq!(lane(&lanes, None, None, 1), Ok(1));
        assert_eq!(lane(&lanes, None, Some("ultra"), 1), Ok(0));
        assert_eq!(lane(&lanes, Some(b"batch"), Some("ultra"), 1), Ok(2));
        let e = lane(&lanes, None, Some("urgent"), 1).unwrap_err();
        assert_eq!((e.status, e.code), (400, "invalid_priority"));
    }

    #[test]
    fn busy_backend_is_refused_at_once_with_the_prediction() {
        let lanes = default_lanes();
        let m = Arc::new(Latency::new(false, 2, Some(32), 1.0, 1.0));
        let mut held = Vec::new();
        let refused = loop {
            match slo_now(&lanes, 1, &m, 40, 128, None) {
                Ok(p) => {
                    assert!(p.predicted.unwrap() <= lanes[1].ttft_slo.unwrap());
                    held.push(p.ticket.unwrap());
                    held.last().unwrap().dispatched();
                }
                Err(e) => break e,
            }
            assert!(held.len() < 100, "never refused");
        };
        let Missed::Busy {
            predicted,
            retry_after,
            lane,
        } = refused.clone()
        else {
            panic!("{refused:?}")
        };
        assert_eq!(lane, 1);
        assert!(predicted > lanes[1].ttft_slo.unwrap());
        assert!(retry_after >= Duration::from_secs(1));
        let f = refused.failure(&lanes);
        assert_eq!(f.status, 503);
        assert!(f.headers.contains(&("x-ultrafast-shed", "slo".into())));
        let v: serde_json::Value = serde_json::from_slice(&f.body).unwrap();
        assert_eq!(v["predicted_ttft_ms"], predicted.as_millis() as u64);
        // Before tokenizing: too busy even for a one-token prompt.
        let pre = precheck(
            &lanes,
            1,
            &m,
            Some(cpu()),
            40,
            128,
            &Tenant::anonymous(),
            Asked::default(),
        )
        .unwrap_err();
        assert!(matches!(pre, Missed::Busy { lane: 1, .. }), "{pre:?}");
        // Better lanes do not count the standard backlog.
        assert!(precheck(
            &lanes,
            0,
            &m,
            Some(cpu()),
            40,
            16,
            &Tenant::anonymous(),
            Asked::default()
        )
        .is_ok());
        let ultra = slo_now(&lanes, 0, &m, 40, 16, None).unwrap();
        assert_eq!(ultra.lane, 0);
    }

    #[test]
    fn claims_before_tokenizing_count_for_later_arrivals_and_settle() {
        let lanes = default_lanes();
        let m = Arc::new(Latency::new(false, 16, Some(24), 1.0, 1.0));
        // A flood arrives before any of it is tokenized: each claim counts
        // for the next arrival, so the check refuses once the claims fill
        // the target, without a single prompt tokenized.
        let mut claims = Vec::new();
        let refused = loop {
            match precheck(
                &lanes,
                1,
                &m,
                Some(cpu()),
                110,
                128,
                &Tenant::anonymous(),
                Asked::default(),
            ) {
                Ok(c) => claims.push(c.expect("standard has a target")),
                Err(e) => break e,
            }
            assert!(claims.len() < 200, "never refused");
        };
        assert!(matches!(refused, Missed::Busy { lane: 1, .. }));
        let n = claims.len();
        assert!(n >= 2, "{n}");
        assert_eq!(m.in_ledger(), n);
        // Tokenized as estimated: the claims settle into their own places
        // (its own entry is not work ahead of a request). The check used a
        // one-token prompt, so the last claims may not fit with their real
        // prompts: refused, they leave the ledger.
        let passed: Vec<Passed> = claims
            .into_iter()
            .filter_map(|c| slo_now(&lanes, 1, &m, 110, 128, Some(c)).ok())
            .collect();
        assert!(
            passed.len() + 2 >= n && !passed.is_empty(),
            "{} of {n}",
            passed.len()
        );
        // The later claims queue behind the first: it is predicted as if
        // alone.
        // (with nothing ahead and no calibration samples yet, the raw one)
        let first = passed[0].predicted.unwrap().as_secs_f64();
        let alone = m.idle(Some(cpu()), 110).as_secs_f64();
        assert!((first - alone).abs() < 1e-6, "{first} vs {alone}");
        assert_eq!(m.in_ledger(), passed.len());
        // A claim whose request fails before `slo` (tokenizing, budgets)
        // leaves the ledger when dropped.
        drop(passed);
        assert_eq!(m.in_ledger(), 0);
        let c = precheck(
            &lanes,
            1,
            &m,
            Some(cpu()),
            110,
            128,
            &Tenant::anonymous(),
            Asked::default(),
        )
        .unwrap();
        assert_eq!(m.in_ledger(), 1);
        drop(c);
        assert_eq!(m.in_ledger(), 0);
    }

    #[test]
    fn too_long_for_the_lane_downgrades_or_is_unprocessable() {
        let mut lanes = default_lanes();
        let m = Arc::new(Latency::new(false, 8, Some(32), 1.0, 1.0));
        // 400 prompt tokens: ~2.4 s idle, over ultra's 1.5 s target.
        let p = slo_now(&lanes, 0, &m, 400, 16, None).unwrap();
        assert_eq!((p.lane, p.downgraded), (1, true));
        lanes[0].on_miss = OnMiss::Reject;
        let e = slo_now(&lanes, 0, &m, 400, 16, None).unwrap_err();
        let f = e.failure(&lanes);
        assert_eq!(f.status, 422);
        let v: serde_json::Value = serde_json::from_slice(&f.body).unwrap();
        assert_eq!(v["error"]["code"], "slo_unattainable");
        assert_eq!(v["lane"], "ultra");
        assert!(v["error"]["message"].as_str().unwrap().contains("1500 ms"));
    }

    #[test]
    fn moves_down_skip_lanes_not_granted() {
        let mut lanes = default_lanes();
        let m = Arc::new(Latency::new(false, 8, Some(32), 1.0, 1.0));
        // Standard is not granted: a prompt too long for ultra's target
        // moves past it to batch.
        let granted = [true, false, true];
        let g = Some(&granted[..]);
        let p = slo(
            &lanes,
            0,
            &m,
            Some(cpu()),
            400,
            16,
            None,
            Duration::ZERO,
            g,
            &Tenant::anonymous(),
            Asked::default(),
        )
        .unwrap();
        assert_eq!((p.lane, p.downgraded), (2, true));
        // A lane not granted: refused, or moved to the next granted one.
        let e = grant(&lanes, 1, g, || "The API key `k`".into()).unwrap_err();
        assert_eq!(
            (e.status, e.code, e.param),
            (403, "lane_not_allowed", Some("priority"))
        );
        assert!(e.message.contains("`standard`"), "{}", e.message);
        lanes[1].on_forbidden = OnMiss::Downgrade;
        assert_eq!(grant(&lanes, 1, g, String::new).unwrap(), 2);
        assert_eq!(grant(&lanes, 0, g, String::new).unwrap(), 0);
        assert_eq!(grant(&lanes, 1, None, String::new).unwrap(), 1);
    }
}
