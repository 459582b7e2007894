//! Small request-path helpers the proxy phases hand off to: downstream
//! limits, request ids, the consistent-hash key, request header rules, and
//! the JSON error body the edge itself sends. Writing a response, and the
//! response header rules, belong to the response policy
//! (`proxy::policy`), which every response passes.

use crate::hash::{hash_bytes, HashKey};
use bytes::Bytes;
use pingora::http::RequestHeader;
use pingora::proxy::Session;

/// Why a request was refused before routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Headers too large or too many.
    HeadersTooLarge,
    /// Declared body too large.
    BodyTooLarge,
    /// `Content-Length` repeated, comma-joined or not a plain number: the
    /// body's end is ambiguous (the request-smuggling class), so the
    /// request is refused, as nginx does.
    BadContentLength,
    /// `Transfer-Encoding` repeated: members that read the first header and
    /// those that read the last (as Pingora does) disagree on the framing.
    DuplicateTransferEncoding,
    /// A `Transfer-Encoding` other than exactly `chunked` (`gzip, chunked`,
    /// `identity`, ...): Pingora re-frames the body as chunked but forwards
    /// the header as sent, so a member that honours the other coding reads
    /// a different body. Refused with 501, as nginx does.
    UnsupportedTransferEncoding,
    /// `CONNECT`: the edge is not a forward proxy. Refused with 405 here
    /// rather than by Pingora, whose own 405 would skip the response policy.
    Connect,
}

/// Check the request head against the limits.
pub fn check_head(
    req: &RequestHeader,
    max_bytes: usize,
    max_headers: usize,
    max_body: u64,
) -> Option<Refusal> {
    if req.method == http::Method::CONNECT {
        return Some(Refusal::Connect);
    }
    if req.headers.len() > max_headers {
        return Some(Refusal::HeadersTooLarge);
    }
    let uri_len = req
        .uri
        .path_and_query()
        .map(|p| p.as_str().len())
        .unwrap_or(1)
        + req.uri.authority().map(|a| a.as_str().len()).unwrap_or(0);
    let mut size = req.method.as_str().len() + uri_len + 12;
    for (k, v) in req.headers.iter() {
        size += k.as_str().len() + v.len() + 4;
    }
    if size > max_bytes {
        return Some(Refusal::HeadersTooLarge);
    }
    let mut lengths = req.headers.get_all(http::header::CONTENT_LENGTH).iter();
    let mut declared = None;
    if let Some(v) = lengths.next() {
        let plain = !v.is_empty() && v.as_bytes().iter().all(u8::is_ascii_digit);
        if !plain || lengths.next().is_some() {
            return Some(Refusal::BadContentLength);
        }
        declared = v.to_str().ok().and_then(|s| s.parse::<u64>().ok());
    }
    let mut codings = req.headers.get_all(http::header::TRANSFER_ENCODING).iter();
    if let Some(v) = codings.next() {
        if codings.next().is_some() {
            return Some(Refusal::DuplicateTransferEncoding);
        }
        // Pingora has already refused a final coding other than chunked
        // and trimmed the value's surrounding whitespace.
        if !v.as_bytes().eq_ignore_ascii_case(b"chunked") {
            return Some(Refusal::UnsupportedTransferEncoding);
        }
    }
    if max_body > 0 && declared.is_some_and(|n| n > max_body) {
        return Some(Refusal::BodyTooLarge);
    }
    None
}

/// The host a request names: its `Host` header, else the target's
/// authority (HTTP/2, absolute-form), else empty. Routing and the cache
/// key read the same one.
pub fn request_host(req: &RequestHeader) -> &str {
    req.headers
        .get(http::header::HOST)
        .and_then(|h| h.to_str().ok())
        // The whole authority, port included, as a Host header carries it:
        // an HTTP/2 request keys as the same request over HTTP/1.1 does.
        .or_else(|| req.uri.authority().map(|a| a.as_str()))
        .unwrap_or("")
}

/// Whether a request names its host more than once, or twice differently:
/// two Host fields (RFC 9112 3.2: 400), or, over HTTP/2 and HTTP/3, a Host
/// that is not the `:authority` beside it (RFC 9113 8.3.1, RFC 9114
/// 4.3.1). An HTTP/1.1 absolute-form target overrides Host instead.
pub fn conflicting_host(req: &RequestHeader) -> bool {
    let mut hosts = req.headers.get_all(http::header::HOST).iter();
    let Some(first) = hosts.next() else {
        return false;
    };
    if hosts.next().is_some() {
        return true;
    }
    req.version >= http::Version::HTTP_2
        && req
            .uri
            .authority()
            .is_some_and(|a| !a.as_str().as_bytes().eq_ignore_ascii_case(first.as_bytes()))
}

/// Whether the comma-separated header value `v` lists `token` (ASCII
/// case-insensitive, as `Connection`, `Vary` and `Cache-Control` compare).
pub fn has_token(v: &[u8], token: &[u8]) -> bool {
    v.split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

/// Whether `headers` say the body is a server-sent event stream: its
/// `Content-Type` is `text/event-stream` (ASCII case-insensitive, any
/// parameters).
pub fn is_event_stream(headers: &http::HeaderMap) -> bool {
    const SSE: &[u8] = b"text/event-stream";
    headers
        .get(http::header::CONTENT_TYPE)
        .map(|v| v.as_bytes())
        .is_some_and(|v| v.len() >= SSE.len() && v[..SSE.len()].eq_ignore_ascii_case(SSE))
}

/// Whether the request may carry a body.
pub fn has_body(req: &RequestHeader) -> bool {
    req.headers.contains_key(http::header::TRANSFER_ENCODING)
        || req
            .headers
            .get(http::header::CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes() != b"0")
}

/// A fresh request id: a UUIDv7 (see `reqid`).
pub fn new_request_id() -> http::HeaderValue {
    crate::reqid::header_value(std::time::SystemTime::now())
}

/// `X-Request-Id`, the request id header the edge reads, forwards and answers with.
pub const X_REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");

/// The request id of a request that came at `at`: the client's
/// `X-Request-Id` if sane, else a new one (then `true`: the edge's own,
/// a UUID).
pub fn request_id(req: &RequestHeader, at: std::time::SystemTime) -> (http::HeaderValue, bool) {
    match req.headers.get(X_REQUEST_ID) {
        Some(v) if !v.is_empty() && v.len() <= 128 && v.to_str().is_ok() => (v.clone(), false),
        _ => (crate::reqid::header_value(at), true),
    }
}

/// The consistent-hash key of a request.
pub fn hash_key(session: &Session, key: &HashKey) -> u64 {
    match key {
        HashKey::ClientIp => match session.client_addr().and_then(|a| a.as_inet()) {
            Some(a) => match a.ip() {
                std::net::IpAddr::V4(v4) => hash_bytes(&v4.octets()),
                std::net::IpAddr::V6(v6) => hash_bytes(&v6.octets()),
            },
            None => 0,
        },
        HashKey::Header(h) => hash_bytes(
            session
                .req_header()
                .headers
                .get(h)
                .map(|v| v.as_bytes())
                .unwrap_or(b""),
        ),
        HashKey::Cookie(name) => {
            let value = session
                .req_header()
                .headers
                .get_all(http::header::COOKIE)
                .iter()
                .filter_map(|h| h.to_str().ok())
                .flat_map(|s| s.split(';'))
                .filter_map(|kv| kv.trim().split_once('='))
                .find(|(k, _)| k == name)
                .map(|(_, v)| v)
                .unwrap_or("");
            hash_bytes(value.as_bytes())
        }
    }
}

/// An OpenAI-style error body: `{"error": {"message", "type", "code"}}`.
pub fn error_body(message: &str, kind: &str, code: &str) -> Bytes {
    let v = serde_json::json!({"error": {"message": message, "type": kind, "param": null, "code": code}});
    Bytes::from(v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(headers: &[(&str, &str)]) -> RequestHeader {
        let mut req = RequestHeader::build("POST", b"/", None).unwrap();
        for (k, v) in headers {
            req.append_header(k.to_string(), *v).unwrap();
        }
        req
    }

    fn check(headers: &[(&str, &str)]) -> Option<Refusal> {
        check_head(&head(headers), 32 * 1024, 100, 1 << 20)
    }

    #[test]
    fn event_streams_are_told_by_media_type_in_any_case() {
        let sse = |ct: &str| is_event_stream(&head(&[("content-type", ct)]).headers);
        assert!(sse("text/event-stream"));
        assert!(sse("Text/Event-Stream; charset=utf-8"));
        assert!(!sse("text/plain"));
        assert!(!sse("text/event"));
        assert!(!is_event_stream(&head(&[]).headers));
    }

    #[test]
    fn only_one_plain_chunked_transfer_encoding_passes() {
        assert_eq!(check(&[("transfer-encoding", "chunked")]), None);
        assert_eq!(check(&[("transfer-encoding", "CHUNKED")]), None);
        assert_eq!(
            check(&[
                ("transfer-encoding", "identity"),
                ("transfer-encoding", "chunked")
            ]),
            Some(Refusal::DuplicateTransferEncoding)
        );
        for v in ["gzip, chunked", "identity", "xchunked", "chunked;q=1"] {
            assert_eq!(
                check(&[("transfer-encoding", v)]),
                Some(Refusal::UnsupportedTransferEncoding),
                "{v}"
            );
        }
    }

    #[test]
    fn content_length_must_be_one_plain_number() {
        assert_eq!(check(&[("content-length", "5")]), None);
        for v in ["5, 5", "+5", "", "0x5"] {
            assert_eq!(
                check(&[("content-length", v)]),
                Some(Refusal::BadContentLength),
                "{v:?}"
            );
        }
        assert_eq!(
            check(&[("content-length", "5"), ("content-length", "5")]),
            Some(Refusal::BadContentLength)
        );
        assert_eq!(
            check(&[("content-length", "2000000")]),
            Some(Refusal::BodyTooLarge)
        );
    }
}
