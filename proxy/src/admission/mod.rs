//! Admission control: who goes first, who waits (and how long at most), and
//! who is told at once to come back later.
//!
//! Order of checks on a request: lane selection (`X-Request-Priority`, else
//! the route's default; unknown is a 400), the route's rate limits (429 with
//! a `Retry-After` computed from the limiter), then, for pools with a
//! concurrency limit, the pool's lane queue (`gate`, over the pure
//! `queue` data structure): a slot at once, a bounded wait, or an immediate
//! 503 when the wait could not end in time. Refusals carry `Retry-After`,
//! `x-ultrafast-shed: <reason>` and an OpenAI-style JSON body with
//! `retry_after_ms`.
//!
//! Beside those: token budgets per key (`budget`, reserved before a request
//! runs and settled with its usage) and API keys (`keys`, from the key file
//! parsed by `keyfile`), each with its own limits.

pub mod budget;
pub mod clock;
pub mod gate;
pub mod keyfile;
pub mod keys;
pub mod keystore;
pub mod metrics;
pub mod queue;
pub mod ratelimit;
pub mod shared;

use bytes::Bytes;
use queue::{LaneSpec, Reason};
use std::time::Duration;

/// The header that selects a lane.
pub const PRIORITY_HEADER: &str = "x-request-priority";

/// The lane index for a request: the header's lane, else `default`.
pub fn select_lane(
    lanes: &[LaneSpec],
    header: Option<&[u8]>,
    default: usize,
) -> Result<usize, String> {
    let Some(v) = header else { return Ok(default) };
    let name = std::str::from_utf8(v).map_err(|_| "X-Request-Priority is not text".to_string())?;
    let name = name.trim();
    lanes
        .iter()
        .position(|l| l.name.eq_ignore_ascii_case(name))
        .ok_or_else(|| {
            let known: Vec<&str> = lanes.iter().map(|l| l.name.as_str()).collect();
            let shown: String = name.chars().take(64).collect();
            format!(
                "unknown priority lane `{shown}` (known: {})",
                known.join(", ")
            )
        })
}

/// The one admission entry point for request-rate limits, shared by
/// proxied and inference requests: every limiter of the route, in order.
/// Err is the first verdict that is not `Allow`.
pub fn check_limits(
    limiters: &[std::sync::Arc<ratelimit::Limiter>],
    input: &ratelimit::KeyInput,
) -> Result<(), ratelimit::Verdict> {
    for l in limiters {
        match l.check(input) {
            ratelimit::Verdict::Allow => {}
            other => return Err(other),
        }
    }
    Ok(())
}

/// Status, headers and body of a refusal; `predicted` is the predicted
/// time to first token of an SLO refusal.
pub fn refusal(
    reason: Reason,
    retry_after: Duration,
    predicted: Option<Duration>,
) -> (u16, Vec<(&'static str, String)>, Bytes) {
    let status = if matches!(reason, Reason::RateLimit | Reason::TokenBudget) {
        429
    } else {
        503
    };
    let ms = retry_after.as_millis().max(1) as u64;
    let secs = ms.div_ceil(1000).max(1);
    let (message, kind) = match reason {
        Reason::RateLimit => ("rate limit exceeded for this client", "rate_limit_exceeded"),
        Reason::TokenBudget => (
            "token budget exhausted for this client: prompt plus max_tokens cannot be covered now",
            "rate_limit_exceeded",
        ),
        Reason::QueueFull => ("server is saturated: queue is full", "server_overloaded"),
        Reason::MaxWait => (
            "server is saturated: request could not be served within its lane's max wait",
            "server_overloaded",
        ),
        Reason::Watermark => (
            "server is saturated: request shed early",
            "server_overloaded",
        ),
        Reason::Preempted => (
            "request was displaced by higher-priority work",
            "server_overloaded",
        ),
        Reason::Slo => (
            "server is saturated: the predicted time to first token exceeds this lane's target",
            "server_overloaded",
        ),
        Reason::StoreDown => (
            "the shared limit store is unreachable and this limit fails closed; retry shortly",
            "server_overloaded",
        ),
    };
    let mut body = serde_json::json!({
        "error": {"message": message, "type": kind, "param": null, "code": reason.as_str()},
        "retry_after_ms": ms,
    });
    if let Some(p) = predicted {
        body["predicted_ttft_ms"] = serde_json::json!(p.as_millis() as u64);
    }
    (
        status,
        vec![
            ("retry-after", secs.to_string()),
            ("x-ultrafast-shed", reason.as_str().to_string()),
        ],
        Bytes::from(body.to_string()),
    )
}

pub use crate::config::spec::{default_lanes, DEFAULT_SLO_MS};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_selection() {
        let lanes = default_lanes();
        assert_eq!(select_lane(&lanes, None, 1), Ok(1));
        assert_eq!(select_lane(&lanes, Some(b"Ultra"), 1), Ok(0));
        assert!(select_lane(&lanes, Some(b"urgent"), 1)
            .unwrap_err()
            .contains("unknown priority lane"));
        assert!(select_lane(&lanes, Some(&[0xff, 0xfe]), 1).is_err());
    }

    #[test]
    fn refusal_shape() {
        let (status, headers, body) = refusal(Reason::RateLimit, Duration::from_millis(1500), None);
        assert_eq!(status, 429);
        assert!(headers.contains(&("retry-after", "2".into())));
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["retry_after_ms"], 1500);
        assert_eq!(v["error"]["code"], "rate_limit");
        assert_eq!(refusal(Reason::MaxWait, Duration::ZERO, None).0, 503);
        let (status, headers, body) = refusal(
            Reason::Slo,
            Duration::from_millis(2500),
            Some(Duration::from_millis(12_345)),
        );
        assert_eq!(status, 503);
        assert!(headers.contains(&("x-ultrafast-shed", "slo".into())));
        assert!(headers.contains(&("retry-after", "3".into())));
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["predicted_ttft_ms"], 12_345);
        assert_eq!(v["error"]["code"], "slo");
    }
}
