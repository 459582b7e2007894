//! The one response policy. Every response the edge sends, whoever made
//! it, passes [`Policy::apply`] on its way out: the request id, HSTS on TLS
//! listeners, then the route's `headers.response` rules (remove, set, add),
//! in that order, so a route's rules have the last word, as they always had
//! on proxied responses.
//!
//! How a response gets here, by producer:
//! - proxied responses: Pingora's `response_filter` phase calls `apply`;
//! - everything the edge writes itself (fixed `return`, redirects, the
//!   HTTPS-redirect listener, 400/404/413/431, 429/503 sheds, the
//!   502/504 of `fail_to_proxy`): [`respond`] and [`respond_error`];
//! - the inference front (JSON, SSE heads, 202, `/v1/models`, jobs, its
//!   errors): the adapter's `Downstream::head`, which calls [`write_head`].
//!
//! [`write_head`] is the only caller of Pingora's `write_response_header`
//! in the crate; `clippy.toml` disallows the Pingora writers everywhere
//! else, so a new writer that bypasses the policy fails the lint rather
//! than silently dropping the route's headers.
//!
//! The policy is a borrowed view of the request context, not a copy: it
//! sees what is known when the head is written (a refusal before routing
//! has no route rules to apply, and says so by having none).
//!
//! The listener's scheme (for `X-Forwarded-Proto`) is read from the
//! connection itself: Pingora fills the session digest's `ssl_digest` on
//! every TLS stream (HTTP/1 and HTTP/2 alike), whatever accepted it.

use super::Ctx;
use crate::filters::X_REQUEST_ID;
use crate::routing::HeaderOps;
use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::proxy::Session;
use pingora::Result;

/// What every response of one request gets, as a view of its context.
#[derive(Debug, Clone, Copy)]
pub(super) struct Policy<'a> {
    request_id: &'a http::HeaderValue,
    hsts: Option<&'a http::HeaderValue>,
    alt_svc: Option<&'a http::HeaderValue>,
    rules: Option<&'a HeaderOps>,
    /// The request is a gRPC call: the edge's errors are gRPC statuses.
    grpc: bool,
}

impl Ctx {
    /// The response policy as far as this request is known now.
    pub(super) fn policy(&self) -> Policy<'_> {
        Policy {
            request_id: &self.request_id,
            // RFC 6797 7.2: never over plain HTTP, whatever the config says.
            hsts: self.hsts.as_ref().filter(|_| self.tls),
            alt_svc: self.alt_svc.as_ref().filter(|_| self.tls),
            rules: self
                .route
                .as_ref()
                .map(|r| &r.response_headers)
                .filter(|ops| !ops.is_empty()),
            grpc: self.grpc,
        }
    }
}

impl Policy<'_> {
    /// Apply the policy to a response head about to be sent.
    pub(super) fn apply(&self, resp: &mut ResponseHeader) -> Result<()> {
        // Exactly what may be added: a response parsed from an upstream has
        // a map sized to its headers, and room asked for and not used can
        // cost a rehash of every header.
        let extra = usize::from(!self.request_id.is_empty())
            + usize::from(self.hsts.is_some())
            + usize::from(self.alt_svc.is_some())
            + self.rules.map_or(0, |r| r.set.len() + r.add.len());
        super::heads::edit_response(resp, extra, |h| {
            if !self.request_id.is_empty() {
                h.set(&X_REQUEST_ID, self.request_id.clone())?;
            }
            if let Some(v) = self.hsts {
                h.set(&http::header::STRICT_TRANSPORT_SECURITY, v.clone())?;
            }
            if let Some(v) = self.alt_svc {
                h.set(&http::header::ALT_SVC, v.clone())?;
            }
            if let Some(ops) = self.rules {
                // The same rules, in the same order, as a request's.
                super::heads::apply_ops(ops, h)?;
            }
            Ok(())
        })
    }
}

/// Whether the request came over TLS: its connection has an SSL digest.
pub(super) fn is_tls(session: &Session) -> bool {
    session.digest().is_some_and(|d| d.ssl_digest.is_some())
}

/// Send a response head the edge made itself, after the policy.
#[allow(clippy::disallowed_methods)] // the one sanctioned writer
pub(super) async fn write_head(
    session: &mut Session,
    policy: &Policy<'_>,
    mut resp: ResponseHeader,
    end: bool,
) -> Result<()> {
    policy.apply(&mut resp)?;
    session.write_response_header(Box::new(resp), end).await
}

/// Send a complete response with a body.
pub(super) async fn respond(
    session: &mut Session,
    policy: &Policy<'_>,
    status: u16,
    content_type: &str,
    body: Bytes,
    extra: &[(&str, &str)],
) -> Result<()> {
    let mut resp = ResponseHeader::build(status, Some(4 + extra.len()))?;
    resp.insert_header(http::header::CONTENT_TYPE, content_type)?;
    resp.insert_header(http::header::CONTENT_LENGTH, body.len())?;
    for (k, v) in extra {
        resp.insert_header(k.to_string(), *v)?;
    }
    write_head(session, policy, resp, false).await?;
    session.write_response_body(Some(body), true).await
}

/// Answer a gRPC call with status `code` and `message`, trailers-only
/// (one HEADERS frame that ends the stream: HTTP 200, `grpc-status`,
/// `grpc-message`), as a gRPC server answers a call it fails at once.
#[allow(clippy::disallowed_methods)] // the policy is applied here
pub(super) async fn respond_grpc(
    session: &mut Session,
    policy: &Policy<'_>,
    code: u8,
    message: &str,
    extra: &[(&str, &str)],
) -> Result<()> {
    let mut resp = ResponseHeader::build(200, Some(4 + extra.len()))?;
    resp.insert_header(http::header::CONTENT_TYPE, "application/grpc")?;
    resp.insert_header("grpc-status", code.to_string())?;
    resp.insert_header("grpc-message", super::grpc::message(message))?;
    for (k, v) in extra {
        resp.insert_header(k.to_string(), *v)?;
    }
    policy.apply(&mut resp)?;
    if super::framed(session) {
        // Pingora's header writer ends an HTTP/2 stream with an empty DATA
        // frame, which gRPC clients read as a broken stream: the task
        // writer keeps the end on the HEADERS frame.
        let head = pingora::protocols::http::HttpTask::Header(Box::new(resp), true);
        session.write_response_tasks(vec![head]).await?;
        return Ok(());
    }
    resp.insert_header(http::header::CONTENT_LENGTH, "0")?;
    session.write_response_header(Box::new(resp), true).await
}

/// Send the edge's own OpenAI-style JSON error (a gRPC status to a gRPC
/// call).
pub(super) async fn respond_error(
    session: &mut Session,
    policy: &Policy<'_>,
    status: u16,
    message: &str,
    code: &str,
) -> Result<()> {
    if policy.grpc {
        let code = super::grpc::status_for(status);
        return respond_grpc(session, policy, code, message, &[]).await;
    }
    let kind = if status >= 500 {
        "server_error"
    } else {
        "invalid_request_error"
    };
    let body = crate::filters::error_body(message, kind, code);
    respond(session, policy, status, "application/json", body, &[]).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderName, HeaderValue};

    fn ops() -> HeaderOps {
        HeaderOps {
            set: vec![(
                HeaderName::from_static("x-set"),
                HeaderValue::from_static("1"),
            )],
            add: vec![(
                HeaderName::from_static("x-add"),
                HeaderValue::from_static("2"),
            )],
            remove: vec![HeaderName::from_static("x-gone")],
        }
    }

    fn head() -> ResponseHeader {
        let mut r = ResponseHeader::build(200, None).unwrap();
        r.insert_header("x-gone", "a").unwrap();
        r.insert_header("x-add", "1").unwrap();
        r.insert_header("x-request-id", "from-upstream").unwrap();
        r
    }

    #[test]
    fn request_id_then_hsts_then_the_route_rules() {
        let rid = HeaderValue::from_static("rid-1");
        let hsts = HeaderValue::from_static("max-age=600");
        let rules = ops();
        let p = Policy {
            request_id: &rid,
            hsts: Some(&hsts),
            alt_svc: None,
            rules: Some(&rules),
            grpc: false,
        };
        let mut r = head();
        p.apply(&mut r).unwrap();
        let h = &r.headers;
        assert_eq!(h["x-request-id"], "rid-1", "the edge's id replaces any");
        assert_eq!(h["strict-transport-security"], "max-age=600");
        assert_eq!(h["x-set"], "1");
        let added: Vec<_> = h.get_all("x-add").iter().collect();
        assert_eq!(added, ["1", "2"], "add appends");
        assert!(h.get("x-gone").is_none());
    }

    #[test]
    fn rules_can_override_what_the_policy_sets() {
        let rid = HeaderValue::from_static("rid-1");
        let rules = HeaderOps {
            remove: vec![HeaderName::from_static("x-request-id")],
            ..HeaderOps::default()
        };
        let p = Policy {
            request_id: &rid,
            hsts: None,
            alt_svc: None,
            rules: Some(&rules),
            grpc: false,
        };
        let mut r = head();
        p.apply(&mut r).unwrap();
        assert!(r.headers.get("x-request-id").is_none());
        assert!(r.headers.get("strict-transport-security").is_none());
    }
}
