//! gRPC through the edge (nginx `grpc_pass`). A request whose content type
//! is `application/grpc` goes to an HTTP/2 pool (`protocol = "h2"` or
//! `"h2c"`) like any proxied request, Pingora relaying its messages both
//! ways as they come and the origin's trailers after them. What the edge
//! adds:
//! - the request's `grpc-timeout` is a deadline: a call past it is not
//!   sent, the pool's timeouts shrink to what is left, and the member is
//!   sent what is left (not the client's whole budget);
//! - the body streams both ways: neither request nor response buffering
//!   (a bidirectional call would wait on itself);
//! - every answer the edge makes itself (no member, a timeout, a shed, a
//!   rate limit) is a gRPC status in a trailers-only response (HTTP 200,
//!   `grpc-status`, `grpc-message`), which a gRPC client reads as the
//!   call's status instead of an unreadable HTTP error.
//!
//! gRPC-Web is not handled here: it is plain proxied HTTP.

use pingora::http::RequestHeader;
use std::time::Duration;

/// Whether a request is gRPC (over HTTP/2; gRPC-Web excluded).
pub(super) fn is_grpc(req: &RequestHeader) -> bool {
    let Some(ct) = req.headers.get(http::header::CONTENT_TYPE) else {
        return false;
    };
    let ct = ct.as_bytes();
    starts_with_ignore_case(ct, b"application/grpc")
        && !starts_with_ignore_case(ct, b"application/grpc-web")
}

/// Whether `s` begins with `p`, ASCII case ignored (media types).
pub(super) fn starts_with_ignore_case(s: &[u8], p: &[u8]) -> bool {
    s.len() >= p.len() && s[..p.len()].eq_ignore_ascii_case(p)
}

/// The request's `grpc-timeout` (at most 8 digits and a unit: `H`, `M`,
/// `S`, `m`, `u`, `n`); `None` when absent or malformed (no deadline, as a
/// gRPC server reads it).
pub(super) fn timeout(req: &RequestHeader) -> Option<Duration> {
    let v = req.headers.get("grpc-timeout")?.as_bytes();
    let (&unit, digits) = v.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b'H' => Duration::from_secs(n * 3600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

/// `grpc-timeout` for what is left, in milliseconds rounded up (at most 8
/// digits: past that, seconds).
pub(super) fn timeout_value(left: Duration) -> http::HeaderValue {
    let ms = left.as_nanos().div_ceil(1_000_000).max(1);
    let s = if ms < 100_000_000 {
        format!("{ms}m")
    } else {
        format!("{}S", left.as_secs().min(99_999_999))
    };
    http::HeaderValue::try_from(s).unwrap_or(http::HeaderValue::from_static("1m"))
}

/// The gRPC status of an answer the edge makes with HTTP status `code`
/// (gRPC's own HTTP mapping, where the edge knows better: a rate limit or
/// a body too large is RESOURCE_EXHAUSTED, a timeout DEADLINE_EXCEEDED, a
/// request the edge refused as malformed INVALID_ARGUMENT).
pub(super) fn status_for(code: u16) -> u8 {
    match code {
        400 | 431 => 3,  // INVALID_ARGUMENT
        401 => 16,       // UNAUTHENTICATED
        403 => 7,        // PERMISSION_DENIED
        404 | 405 => 12, // UNIMPLEMENTED
        408 | 504 => 4,  // DEADLINE_EXCEEDED
        413 | 429 => 8,  // RESOURCE_EXHAUSTED
        502 | 503 => 14, // UNAVAILABLE
        499 => 1,        // CANCELLED
        500 => 13,       // INTERNAL
        _ => 2,          // UNKNOWN
    }
}

/// `grpc-message`: percent-encoded UTF-8 (every byte outside printable
/// ASCII, and `%`).
pub(super) fn message(msg: &str) -> String {
    let mut out = String::with_capacity(msg.len());
    for &b in msg.as_bytes() {
        if (0x20..0x7f).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(headers: &[(&str, &str)]) -> RequestHeader {
        let mut r = RequestHeader::build("POST", b"/a.B/C", None).unwrap();
        for (k, v) in headers {
            r.insert_header(k.to_string(), *v).unwrap();
        }
        r
    }

    #[test]
    fn grpc_is_told_by_its_content_type() {
        assert!(is_grpc(&req(&[("content-type", "application/grpc")])));
        assert!(is_grpc(&req(&[("content-type", "application/grpc+proto")])));
        assert!(!is_grpc(&req(&[("content-type", "application/grpc-web")])));
        assert!(!is_grpc(&req(&[("content-type", "application/json")])));
        assert!(!is_grpc(&req(&[])));
    }

    #[test]
    fn grpc_timeout_reads_every_unit_and_refuses_the_malformed() {
        let t = |v: &str| timeout(&req(&[("grpc-timeout", v)]));
        assert_eq!(t("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(t("2M"), Some(Duration::from_secs(120)));
        assert_eq!(t("3S"), Some(Duration::from_secs(3)));
        assert_eq!(t("500m"), Some(Duration::from_millis(500)));
        assert_eq!(t("7u"), Some(Duration::from_micros(7)));
        assert_eq!(t("9n"), Some(Duration::from_nanos(9)));
        for bad in ["", "m", "123456789m", "5x", "-5m", "5 m", "1.5S"] {
            assert_eq!(t(bad), None, "{bad}");
        }
        assert_eq!(timeout(&req(&[])), None);
    }

    #[test]
    fn what_is_left_goes_upstream_in_milliseconds_rounded_up() {
        assert_eq!(timeout_value(Duration::from_micros(1500)), "2m");
        assert_eq!(timeout_value(Duration::ZERO), "1m");
        assert_eq!(timeout_value(Duration::from_secs(3600)), "3600000m");
        assert_eq!(timeout_value(Duration::from_secs(400_000)), "400000S");
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(message("no upstream: 100%"), "no upstream: 100%25");
        assert_eq!(message("caf\u{e9}\n"), "caf%C3%A9%0A");
    }

    #[test]
    fn the_edges_statuses_map_to_grpc_codes() {
        assert_eq!(status_for(429), 8);
        assert_eq!(status_for(503), 14);
        assert_eq!(status_for(502), 14);
        assert_eq!(status_for(504), 4);
        assert_eq!(status_for(413), 8);
        assert_eq!(status_for(418), 2);
    }
}
