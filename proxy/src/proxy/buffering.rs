//! Request buffering, nginx's `proxy_request_buffering on`: a proxied
//! body is read whole before an upstream connection is taken, so a client
//! that trickles its body holds a connection of ours, not an upstream's.
//!
//! Over HTTP/1 the connection guard holds the body below Pingora's reads
//! (`edge::hold`): `client_body_buffer_kb` in memory, the rest in an
//! unlinked temporary file, `client_max_body_bytes` at most. Over HTTP/2
//! the body is read here, in memory, up to `client_body_buffer_kb`: what
//! Pingora reads before the upstream is taken reaches it through the 64 KiB
//! it keeps for a retry, and a larger HTTP/2 body streams after that (its
//! flow control already bounds what a slow client makes us hold).
//!
//! Response buffering, nginx's `proxy_buffering on`: a proxied response to
//! an HTTP/1 client is written into a spool under the connection
//! (`edge::spool`), so the origin is read at its own pace and its
//! connection goes back to the pool while a slow client is still reading.
//! Never for what must reach the client as it is made: event streams,
//! gRPC, upgrades, and responses whose origin says `X-Accel-Buffering: no`.

use super::{policy, Ctx, EdgeProxy};
use crate::edge::conn;
use crate::edge::hold::{Framing, Outcome};
use crate::edge::spool;
use pingora::http::ResponseHeader;
use pingora::prelude::*;
use pingora::proxy::Session;

/// What Pingora may read before the upstream is taken and still send it:
/// its 64 KiB retry buffer, less one HTTP/2 DATA frame (16 KiB).
const H2_READ_MAX: usize = 48 * 1024;

impl EdgeProxy {
    /// Read the request body whole before the upstream is taken. True
    /// when a response was sent instead (408, 413).
    pub(super) async fn buffer_body(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        if session.is_body_empty() || session.is_body_done() {
            return Ok(false);
        }
        answer_continue(session).await?;
        ctx.body_buffered = true;
        let refusal = if super::framed(session) {
            self.buffer_h2(session, ctx).await?
        } else {
            self.hold_h1(session, ctx).await?
        };
        let Some((status, msg, code)) = refusal else {
            return Ok(false);
        };
        ctx.error_status = status;
        session.set_keepalive(None);
        policy::respond_error(session, &ctx.policy(), status, msg, code).await?;
        Ok(true)
    }

    /// HTTP/2: read up to the buffer size in memory, each read within
    /// `client_body_timeout` (Pingora times no HTTP/2 body read).
    async fn buffer_h2(&self, session: &mut Session, ctx: &Ctx) -> Result<Option<Refusal>> {
        let cap = ctx.cfg.limits.client_body_buffer_bytes.min(H2_READ_MAX);
        let idle = ctx.deadlines.client_body_timeout;
        let mut read = 0;
        while read < cap && !session.is_body_done() {
            let next = session.read_request_body();
            let got = match idle {
                Some(d) => match tokio::time::timeout(d, next).await {
                    Ok(r) => r?,
                    Err(_) => {
                        self.metrics.edge.conns.body_timeout.inc();
                        return Ok(Some(TIMED_OUT));
                    }
                },
                None => next.await?,
            };
            match got {
                Some(b) => read += b.len(),
                None => break,
            }
        }
        Ok(None)
    }

    /// HTTP/1: the connection guard holds the body until it is whole.
    async fn hold_h1(&self, session: &mut Session, ctx: &Ctx) -> Result<Option<Refusal>> {
        let limits = &ctx.cfg.limits;
        let idle = ctx.deadlines.client_body_timeout;
        let framing = framing(session.req_header());
        let held = conn::hold_body(
            session.as_downstream().stream(),
            framing,
            limits.client_body_buffer_bytes,
            limits.client_max_body_bytes,
            &limits.client_body_temp_path,
            idle,
        );
        if !held {
            return Ok(None);
        }
        if framing == Framing::Chunked {
            // Bytes after a chunked body are never read as a request (the
            // parser is lax about where such a body ends, see
            // `request_filter`); held bytes past it could be handed over
            // where Pingora no longer sees them as extra: close after.
            session.set_keepalive(None);
        }
        // The hold times the reads between them, as nginx does; Pingora's
        // timeout would time the whole body as one read.
        session.set_read_timeout(None);
        let read = self.wait_for_hold(session).await;
        session.set_read_timeout(idle);
        match conn::hold_outcome(session.as_downstream().stream()) {
            Some(Outcome::TimedOut) => {
                self.metrics.edge.conns.body_timeout.inc();
                Ok(Some(TIMED_OUT))
            }
            Some(Outcome::TooLarge) => {
                self.metrics
                    .edge
                    .rejected
                    .with_label_values(&["body_too_large"])
                    .inc();
                Ok(Some((413, "request body too large", "body_too_large")))
            }
            _ => read.map(|_| None),
        }
    }

    /// Let Pingora read until the guard has the whole body. Its first read
    /// may return what it read along with the head; the next waits in the
    /// guard until the body is whole. What it returns stays in its retry
    /// buffer, from which it is sent upstream first.
    async fn wait_for_hold(&self, session: &mut Session) -> Result<()> {
        loop {
            let outcome = conn::hold_outcome(session.as_downstream().stream());
            if outcome != Some(Outcome::Reading) || session.is_body_done() {
                return Ok(());
            }
            if session.read_request_body().await?.is_none() {
                return Ok(());
            }
        }
    }
}

impl EdgeProxy {
    /// Buffer this proxied response if its route and its kind allow
    /// (called before its head is written). The origin's
    /// `X-Accel-Buffering` is read and removed, as nginx does.
    pub(super) fn spool_response(&self, session: &Session, resp: &mut ResponseHeader, ctx: &Ctx) {
        let accel = resp.remove_header("x-accel-buffering");
        let on = ctx.route.as_ref().is_some_and(|r| r.response_buffering)
            // From the origin: not a cache hit, not an upgrade.
            && ctx.upstream_time.is_some()
            && ctx.upgrade.is_none()
            && !accel.is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"no"))
            && !streamed(resp)
            && has_body(session, resp);
        if !on {
            return;
        }
        let limits = &ctx.cfg.limits;
        let terms = spool::Terms {
            memory: limits.response_buffer_bytes,
            memory_total: clamp_i64(limits.response_buffers_total_bytes),
            file: limits.max_temp_file_bytes,
            disk_total: clamp_i64(limits.temp_files_total_bytes),
            dir: limits.proxy_temp_path.clone(),
            send_timeout: ctx.deadlines.send_timeout,
            metrics: self.metrics.edge.spool.clone(),
        };
        conn::spool_response(session.as_downstream().stream(), terms);
    }
}

fn clamp_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Whether a response is a stream its client reads as it is made.
fn streamed(resp: &ResponseHeader) -> bool {
    crate::filters::is_event_stream(&resp.headers)
        || resp
            .headers
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| {
                super::grpc::starts_with_ignore_case(v.as_bytes(), b"application/grpc")
            })
}

/// Whether a response has a body to buffer.
fn has_body(session: &Session, resp: &ResponseHeader) -> bool {
    let s = resp.status.as_u16();
    session.req_header().method != http::Method::HEAD && s >= 200 && s != 204 && s != 304
}

/// A refusal instead of the upstream: status, message, error code.
type Refusal = (u16, &'static str, &'static str);

const TIMED_OUT: Refusal = (408, "the request body stopped arriving", "request_timeout");

/// Answer `Expect: 100-continue` (HTTP/1.1 and later): the body is the
/// edge's to ask for, as nginx does (the `Expect` is dropped upstream).
async fn answer_continue(session: &mut Session) -> Result<()> {
    let req = session.req_header();
    let expects = req.version >= http::Version::HTTP_11
        && req
            .headers
            .get(http::header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if !expects {
        return Ok(());
    }
    // Pingora takes any head written before the body is read, a 1xx too,
    // for an early response, and closes the connection after it.
    let down = session.as_downstream_mut();
    down.set_close_on_response_before_downstream_finish(false);
    let sent = down.write_continue_response().await;
    down.set_close_on_response_before_downstream_finish(true);
    sent
}

/// How the request's body is delimited (chunked wins over a length, as
/// Pingora reads it).
fn framing(req: &pingora::http::RequestHeader) -> Framing {
    if req.headers.contains_key(http::header::TRANSFER_ENCODING) {
        return Framing::Chunked;
    }
    let len = req
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    Framing::Length(len)
}
