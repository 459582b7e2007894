//! A request's own latency targets: `x-slo-ttft-ms` and `x-slo-tpot-ms`
//! (or llm-d's `x-llm-d-slo-ttft-ms` and `x-llm-d-slo-tpot-ms`), in
//! milliseconds. They only tighten: the target a request is held to is the
//! tighter of its lane's and its own, and its own is never tighter than
//! its API key allows (`min_ttft_ms`, `min_tpot_ms` in the key file), so a
//! client cannot buy the `ultra` promise by asking for it in a header.

use crate::admission::queue::LaneSpec;
use std::time::Duration;
use ultrafast_engine::api::BackendError;

/// The time-to-first-token headers, the first one ours.
pub const TTFT_HEADERS: [&str; 2] = ["x-slo-ttft-ms", "x-llm-d-slo-ttft-ms"];
/// The inter-token headers.
pub const TPOT_HEADERS: [&str; 2] = ["x-slo-tpot-ms", "x-llm-d-slo-tpot-ms"];

/// Longest target a header may name (a day).
const MAX_MS: u64 = 86_400_000;

/// A request's own targets, held to its key's floors.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Asked {
    /// Its time-to-first-token target.
    pub ttft: Option<Duration>,
    /// Its inter-token target.
    pub tpot: Option<Duration>,
}

impl Asked {
    /// The TTFT target a request of this lane is held to.
    pub fn ttft_for(&self, lane: &LaneSpec) -> Option<Duration> {
        match (lane.ttft_slo, self.ttft) {
            (Some(l), Some(a)) => Some(l.min(a)),
            (l, a) => l.or(a),
        }
    }
}

/// Read the headers (`get` answers a header's value); `floors` are the
/// key's `min_ttft_ms` and `min_tpot_ms`. A malformed value is a 400 that
/// names the header.
pub fn asked<'a>(
    get: impl Fn(&str) -> Option<&'a [u8]>,
    floors: (Option<u64>, Option<u64>),
) -> Result<Asked, BackendError> {
    let one = |names: [&'static str; 2], floor: Option<u64>| {
        for name in names {
            let Some(v) = get(name) else {
                continue;
            };
            let ms = std::str::from_utf8(v)
                .ok()
                .filter(|s| !s.is_empty() && s.len() <= 9 && s.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|s| s.parse::<u64>().ok())
                .filter(|ms| (1..=MAX_MS).contains(ms));
            let Some(ms) = ms else {
                return Err(BackendError::invalid(
                    "invalid_slo_header",
                    Some(name),
                    format!("`{name}` must be a whole number of milliseconds from 1 to {MAX_MS}."),
                ));
            };
            return Ok(Some(Duration::from_millis(ms.max(floor.unwrap_or(0)))));
        }
        Ok(None)
    };
    Ok(Asked {
        ttft: one(TTFT_HEADERS, floors.0)?,
        tpot: one(TPOT_HEADERS, floors.1)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::default_lanes;

    fn from(
        h: &[(&str, &'static str)],
        floors: (Option<u64>, Option<u64>),
    ) -> Result<Asked, BackendError> {
        let h: Vec<(String, &'static [u8])> = h
            .iter()
            .map(|(k, v)| (k.to_string(), v.as_bytes()))
            .collect();
        asked(|n| h.iter().find(|(k, _)| k == n).map(|(_, v)| *v), floors)
    }

    #[test]
    fn headers_tighten_and_never_loosen() {
        let lanes = default_lanes();
        let standard = lanes[1].ttft_slo.unwrap();
        let a = from(&[("x-slo-ttft-ms", "300")], (None, None)).unwrap();
        assert_eq!(a.ttft_for(&lanes[1]), Some(Duration::from_millis(300)));
        let a = from(&[("x-slo-ttft-ms", "86400000")], (None, None)).unwrap();
        assert_eq!(a.ttft_for(&lanes[1]), Some(standard));
        // llm-d's names are aliases; ours wins when both come.
        let a = from(
            &[
                ("x-llm-d-slo-ttft-ms", "700"),
                ("x-llm-d-slo-tpot-ms", "40"),
            ],
            (None, None),
        )
        .unwrap();
        assert_eq!(a.ttft, Some(Duration::from_millis(700)));
        assert_eq!(a.tpot, Some(Duration::from_millis(40)));
        let a = from(
            &[("x-llm-d-slo-ttft-ms", "700"), ("x-slo-ttft-ms", "600")],
            (None, None),
        )
        .unwrap();
        assert_eq!(a.ttft, Some(Duration::from_millis(600)));
        // A lane without a target takes the request's.
        assert_eq!(a.ttft_for(&lanes[2]), Some(Duration::from_millis(600)));
        assert_eq!(Asked::default().ttft_for(&lanes[2]), None);
    }

    #[test]
    fn a_key_floor_bounds_what_a_header_may_ask() {
        let a = from(
            &[("x-slo-ttft-ms", "50"), ("x-slo-tpot-ms", "1")],
            (Some(500), Some(20)),
        )
        .unwrap();
        assert_eq!(a.ttft, Some(Duration::from_millis(500)));
        assert_eq!(a.tpot, Some(Duration::from_millis(20)));
    }

    #[test]
    fn malformed_values_are_refused_by_name() {
        for v in ["", "0", "-5", "1.5", "abc", "99999999999", " 10"] {
            let e = from(&[("x-slo-tpot-ms", v)], (None, None)).unwrap_err();
            assert_eq!(e.status, 400, "{v:?}");
            assert_eq!(e.param, Some("x-slo-tpot-ms"));
        }
    }
}
