//! Pingora's own answer to a request head it cannot parse, put through the
//! response policy.
//!
//! Pingora refuses an unparseable HTTP/1 head (a bad request line, a header
//! without a colon, bytes httparse rejects, an ambiguous authority...) with
//! a bare `400` written inside its `read_request`, before any of our
//! phases runs: no request id, no HSTS, not our JSON error. The connection
//! guard sees every byte written ([`super::conn::HeadDeadline`]) and knows
//! whether our request filter has seen the request; a `400` status line
//! for a request it has not seen can only be that one, and is replaced here
//! by the edge's own: the OpenAI-style JSON error, a fresh `x-request-id`,
//! HSTS on a TLS listener that sends it, `connection: close` (Pingora closes
//! the connection after it anyway). A head past the configured size limits
//! (Pingora's parser stops at 256 headers or 1 MiB, above ours) gets the
//! `431` the edge gives every other oversized head. A refusal before routing has no route
//! rules to apply, as for the edge's other refusals before routing.

use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::AsyncWrite;

/// Whether `bytes` begin a `400` response head.
pub(super) fn is_400(bytes: &[u8]) -> bool {
    bytes.starts_with(b"HTTP/1.1 400 ") || bytes.starts_with(b"HTTP/1.0 400 ")
}

/// Why the edge answers a head itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Bare {
    /// It could not be parsed: `400`.
    Unparsed,
    /// It was past the configured size limits: `431`.
    TooLarge,
    /// It did not arrive whole by `client_header_timeout_ms`: `408`.
    TimedOut,
}

/// The edge's own answer to a head our filter never saw.
pub(super) fn response(hsts: Option<&http::HeaderValue>, why: Bare) -> Vec<u8> {
    let (status, message, code) = match why {
        Bare::TooLarge => (
            "431 Request Header Fields Too Large",
            "request headers too large",
            "headers_too_large",
        ),
        Bare::Unparsed => (
            "400 Bad Request",
            "the request head could not be parsed",
            "bad_request",
        ),
        Bare::TimedOut => (
            "408 Request Timeout",
            "the request head did not arrive in time",
            "request_timeout",
        ),
    };
    let body = crate::filters::error_body(message, "invalid_request_error", code);
    let id = crate::filters::new_request_id();
    let mut out = Vec::with_capacity(256 + body.len());
    out.extend_from_slice(format!("HTTP/1.1 {status}\r\n").as_bytes());
    out.extend_from_slice(b"content-type: application/json\r\n");
    out.extend_from_slice(format!("content-length: {}\r\n", body.len()).as_bytes());
    out.extend_from_slice(b"connection: close\r\ncache-control: private, no-store\r\n");
    out.extend_from_slice(b"x-request-id: ");
    out.extend_from_slice(id.as_bytes());
    out.extend_from_slice(b"\r\n");
    if let Some(h) = hsts {
        out.extend_from_slice(b"strict-transport-security: ");
        out.extend_from_slice(h.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&body);
    out
}

/// Where a replacement stands.
#[derive(Debug, Default)]
pub(super) enum Rewrite {
    /// Nothing replaced: writes pass through.
    #[default]
    Idle,
    /// Writing our response in place of the write that began Pingora's.
    Writing {
        /// Our response.
        bytes: Vec<u8>,
        /// How much of it is written.
        pos: usize,
    },
    /// Ours is written: the rest of Pingora's response is dropped.
    Swallow,
}

impl Rewrite {
    /// Whether writes are being replaced.
    pub(super) fn active(&self) -> bool {
        !matches!(self, Rewrite::Idle)
    }

    /// Start replacing with `bytes`.
    pub(super) fn start(&mut self, bytes: Vec<u8>) {
        *self = Rewrite::Writing { bytes, pos: 0 };
    }

    /// Stand in for a write of `len` bytes of Pingora's response: write
    /// ours to `inner` until it is all out, then report `len` as written.
    pub(super) fn poll<W: AsyncWrite + Unpin + ?Sized>(
        &mut self,
        inner: &mut W,
        cx: &mut Context<'_>,
        len: usize,
    ) -> Poll<std::io::Result<usize>> {
        if let Rewrite::Writing { bytes, pos } = self {
            while *pos < bytes.len() {
                match Pin::new(&mut *inner).poll_write(cx, &bytes[*pos..]) {
                    Poll::Ready(Ok(0)) => {
                        return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()))
                    }
                    Poll::Ready(Ok(n)) => *pos += n,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => return Poll::Pending,
                }
            }
            *self = Rewrite::Swallow;
        }
        Poll::Ready(Ok(len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_replacement_is_a_complete_json_error_with_the_policy_headers() {
        let hsts = http::HeaderValue::from_static("max-age=600");
        let r = String::from_utf8(response(Some(&hsts), Bare::Unparsed)).unwrap();
        let (head, body) = r.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 400 Bad Request\r\n"));
        assert!(head.contains("\r\nstrict-transport-security: max-age=600"));
        assert!(head.contains("\r\nx-request-id: "));
        assert!(head.contains(&format!("\r\ncontent-length: {}", body.len())));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "bad_request");
        let big = String::from_utf8(response(None, Bare::TooLarge)).unwrap();
        assert!(!big.contains("strict-transport-security"));
        assert!(big.starts_with("HTTP/1.1 431 "));
        assert!(big.contains("headers_too_large"));
        assert!(is_400(b"HTTP/1.1 400 Bad Request\r\n"));
        assert!(!is_400(b"HTTP/1.1 404 Not Found\r\n"));
    }

    #[test]
    fn ours_is_written_whole_in_place_of_the_first_write_then_the_rest_is_dropped() {
        let mut out = Vec::new();
        let mut rw = Rewrite::default();
        rw.start(b"ours".to_vec());
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        let r = rw.poll(&mut out, &mut cx, 99);
        assert!(matches!(r, Poll::Ready(Ok(99))));
        assert_eq!(out, b"ours");
        assert!(matches!(rw, Rewrite::Swallow));
        assert!(rw.active());
    }
}
