//! The `ProxyHttp` implementation. Thin by design: each Pingora phase hands
//! off to routing, filters, upstream pools, metrics or the access log, and
//! every response, proxied or not, leaves through the response policy
//! (`policy`).
//!
//! Per request we take one `ArcSwap` snapshot of the config (in `new_ctx`)
//! and keep it to the end, so a reload never changes a request midway.

mod admit;
mod buffering;
mod cache;
mod ctx;
mod grpc;
mod heads;
mod infer;
mod local;
mod policy;
/// The upgrade tunnels' controls (in `edge`, where the metrics can use them).
pub use crate::edge::upgrade;

use crate::filters::X_REQUEST_ID;
use ctx::Tried;
pub use ctx::{Ctx, InFlight};
pub use infer::Front;

use crate::accesslog::{AccessLog, Entry};
use crate::admission::gate::{Denied, Permit};
use crate::admission::queue::Reason;
use crate::admission::ratelimit::{KeyInput, Verdict};
use crate::admission::{self, PRIORITY_HEADER};
use crate::filters::{self, Refusal};
use crate::metrics::Metrics;
use crate::routing::{Action, Route, UpstreamHost, UpstreamPath};
use crate::runtime::{Shared, Snapshot as Config};
use crate::upstream::{LbSpec, Member, Membership, Outstanding, Pool};
use async_trait::async_trait;
use bytes::Bytes;
use pingora::cache::key::HashBinary;
use pingora::cache::{CacheKey, CacheMeta, RespCacheable};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::*;
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use pingora::upstreams::peer::HttpPeer;
use pingora::{Error, ErrorSource, ErrorType};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// The edge proxy.
pub struct EdgeProxy {
    config: Shared,
    metrics: Arc<Metrics>,
    log: AccessLog,
    inflight: Arc<AtomicUsize>,
    front: Arc<Front>,
}

impl EdgeProxy {
    /// A proxy over the live config.
    pub fn new(
        config: Shared,
        metrics: Arc<Metrics>,
        log: AccessLog,
        inflight: Arc<AtomicUsize>,
        front: Arc<Front>,
    ) -> Self {
        EdgeProxy {
            config,
            metrics,
            log,
            inflight,
            front,
        }
    }
}

/// Whether the client's protocol frames its own messages (HTTP/2, and
/// HTTP/3 as Pingora's custom session): no chunked coding, no raw stream
/// underneath.
pub(super) fn framed(session: &Session) -> bool {
    let d = session.as_downstream();
    d.is_http2() || d.is_custom()
}

fn is_idempotent(m: &http::Method) -> bool {
    matches!(
        *m,
        http::Method::GET
            | http::Method::HEAD
            | http::Method::OPTIONS
            | http::Method::PUT
            | http::Method::DELETE
            | http::Method::TRACE
    )
}

/// Choose the response's coding (`compress`) and set its head for it.
fn compress_head(
    session: &Session,
    resp: &mut ResponseHeader,
    ctx: &mut Ctx,
    spec: &crate::compress::CompressSpec,
) {
    if !spec.eligible(resp) {
        return;
    }
    crate::compress::add_vary(resp);
    let req = session.req_header();
    let Some((coding, level)) = spec.choose(req.headers.get(http::header::ACCEPT_ENCODING)) else {
        return;
    };
    let http1 = !framed(session);
    if req.method == http::Method::HEAD {
        // The head a GET would get, and no body to encode.
        crate::compress::set_encoded(resp, coding, http1);
        return;
    }
    if let Some(enc) = crate::compress::Encoder::new(coding, level) {
        crate::compress::set_encoded(resp, coding, http1);
        ctx.encoder = Some(enc);
    }
}

fn status_for(e: &Error) -> u16 {
    match e.etype() {
        ErrorType::HTTPStatus(code) => *code,
        ErrorType::ConnectTimedout | ErrorType::ReadTimedout | ErrorType::WriteTimedout => {
            match e.esource() {
                ErrorSource::Upstream => 504,
                _ => 408,
            }
        }
        _ => match e.esource() {
            ErrorSource::Upstream => 502,
            ErrorSource::Downstream => match e.etype() {
                ErrorType::WriteError | ErrorType::ReadError | ErrorType::ConnectionClosed => 0,
                _ => 400,
            },
            ErrorSource::Internal | ErrorSource::Unset => 500,
        },
    }
}

const X_FORWARDED_FOR: http::HeaderName = http::HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: http::HeaderName = http::HeaderName::from_static("x-forwarded-proto");
const TRACEPARENT: http::HeaderName = http::HeaderName::from_static("traceparent");

thread_local! {
    /// The last client address and its `X-Forwarded-For` value: a kept-alive
    /// connection's requests, one after the other on one thread, share it.
    static XFF: std::cell::RefCell<Option<(std::net::IpAddr, http::HeaderValue)>> =
        const { std::cell::RefCell::new(None) };
}

/// `ip` as a `X-Forwarded-For` value of its own.
fn client_xff(ip: std::net::IpAddr) -> http::HeaderValue {
    XFF.with(|c| {
        let mut c = c.borrow_mut();
        match &*c {
            Some((last, v)) if *last == ip => v.clone(),
            _ => {
                let mut s = String::with_capacity(40);
                crate::accesslog::push_ip(&mut s, ip);
                // Digits, dots, colons and hex: always a valid value.
                let v = http::HeaderValue::try_from(s)
                    .unwrap_or_else(|_| http::HeaderValue::from_static("unknown"));
                *c = Some((ip, v.clone()));
                v
            }
        }
    })
}

/// The gRPC deadline header (`grpc`).
static GRPC_TIMEOUT: http::HeaderName = http::HeaderName::from_static("grpc-timeout");

/// What the upstream request gets: trace context, `X-Forwarded-For` and
/// `-Proto`, the request id, the upstream Host, the route's rules.
fn forward_headers(
    h: &mut dyn heads::HeadEdit,
    ctx: &Ctx,
    route: &Route,
    client: Option<std::net::IpAddr>,
) -> Result<()> {
    if let Some(t) = &ctx.trace {
        // The member's spans become children of this request's.
        if let Ok(v) = http::HeaderValue::try_from(t.traceparent()) {
            h.set(&TRACEPARENT, v)?;
        }
    }
    if let Some(ip) = client {
        match h.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok()) {
            Some(prev) => {
                let mut xff = String::with_capacity(prev.len() + 48);
                xff.push_str(prev);
                xff.push_str(", ");
                crate::accesslog::push_ip(&mut xff, ip);
                if let Ok(v) = http::HeaderValue::try_from(xff) {
                    h.set(&X_FORWARDED_FOR, v)?;
                }
            }
            None => h.set(&X_FORWARDED_FOR, client_xff(ip))?,
        }
    }
    let proto = if ctx.tls { "https" } else { "http" };
    h.set(&X_FORWARDED_PROTO, http::HeaderValue::from_static(proto))?;
    if ctx.body_buffered {
        // The edge answered the client's `Expect: 100-continue` itself
        // and has the body: the upstream is not to be asked again.
        h.remove(&http::header::EXPECT);
    }
    if let Some(deadline) = ctx.grpc_deadline {
        // The member gets what is left of the client's budget.
        let left = deadline.saturating_duration_since(Instant::now());
        h.set(&GRPC_TIMEOUT, grpc::timeout_value(left))?;
    }
    // HTTP/2 has no `Connection` header (a stream ends, not a connection).
    if ctx
        .pool()
        .is_some_and(|p| p.settings.keepalive_idle.is_none() && !p.settings.protocol.is_h2())
    {
        h.set(
            &http::header::CONNECTION,
            http::HeaderValue::from_static("close"),
        )?;
    }
    use crate::reqid::{Send, Upstream};
    let mode = ctx
        .pool()
        .map_or(Upstream::Forward, |p| p.settings.request_id);
    match mode.send(ctx.request_id.to_str().unwrap_or(""), ctx.own_id) {
        Send::Nothing => h.remove(&X_REQUEST_ID),
        // The common case shares the header value (no allocation).
        Send::Same => h.set(&X_REQUEST_ID, ctx.request_id.clone())?,
        Send::Fresh => {
            if let Ok(v) = http::HeaderValue::try_from(crate::reqid::new()) {
                h.set(&X_REQUEST_ID, v)?;
            }
        }
    }
    let member_host = || {
        ctx.member()
            .and_then(|m| http::HeaderValue::try_from(m.label.as_str()).ok())
    };
    match &route.upstream_host {
        UpstreamHost::Passthrough => {}
        UpstreamHost::Member => {
            if let Some(v) = member_host() {
                h.set(&http::header::HOST, v)?;
            }
        }
        UpstreamHost::Fixed(v) => h.set(&http::header::HOST, v.clone())?,
    }
    // An HTTP/1.0 request may come without Host; it goes upstream as
    // HTTP/1.1, which requires one: the member's address (nginx's
    // `$proxy_host`).
    if h.get(&http::header::HOST).is_none() {
        if let Some(v) = member_host() {
            h.set(&http::header::HOST, v)?;
        }
    }
    if !route.request_headers.is_empty() {
        heads::apply_ops(&route.request_headers, h)?;
    }
    Ok(())
}

/// `Host: api.example.com.` is `api.example.com` to routing and the cache
/// key: the origin is asked for that name too, or an origin that does not
/// strip the dot would answer for another site under this one's key.
fn without_host_dot(req: &mut RequestHeader) {
    let host = filters::request_host(req);
    let clean = crate::uri::host_without_dot(host);
    if clean.len() == host.len() {
        return;
    }
    if let Ok(v) = http::HeaderValue::try_from(clean.into_owned()) {
        let _ = req.insert_header(http::header::HOST, v);
    }
}

/// One name for one resource: a proxied route that asks its origin for
/// the normalized path (`upstream_path`, the default) has the request's
/// target rewritten to its normal form here (`uri::normalize_target`), so
/// the origin, the cache key and the access log all read the one target.
/// Only a target that normalizing changed (`ctx.path`) is rewritten.
fn ask_for_normalized(req: &mut RequestHeader, ctx: &Ctx) {
    let (Some(_), Some(route)) = (&ctx.path, &ctx.route) else {
        return;
    };
    if route.upstream_path != UpstreamPath::Normalized || !matches!(route.action, Action::Proxy(_))
    {
        return;
    }
    let Ok(encoded) =
        crate::uri::normalize_target(req.uri.path(), ctx.cfg.file.server.merge_slashes)
    else {
        return;
    };
    let target = match req.uri.query() {
        Some(q) => format!("{encoded}?{q}"),
        None => encoded,
    };
    let mut parts = req.uri.clone().into_parts();
    parts.path_and_query = http::uri::PathAndQuery::try_from(target).ok();
    if parts.path_and_query.is_none() {
        return;
    }
    if let Ok(uri) = http::Uri::from_parts(parts) {
        req.set_uri(uri);
    }
}

#[async_trait]
impl ProxyHttp for EdgeProxy {
    type CTX = Box<Ctx>;

    fn new_ctx(&self) -> Box<Ctx> {
        let cfg = self.config.load_full();
        // Boxed: Pingora keeps the context in every phase's future and
        // moves those futures (one `memcpy` per byte under callgrind).
        Box::new(Ctx {
            deadlines: cfg.limits.deadlines,
            cfg,
            started: Instant::now(),
            // The access log's time, and the request id's.
            started_wall: SystemTime::now(),
            request_id: http::HeaderValue::from_static(""),
            own_id: false,
            route: None,
            path: None,
            lane: 0,
            permit: None,
            queue_wait: None,
            hash: 0,
            tried: Tried::default(),
            membership: None,
            member: None,
            outstanding: None,
            upstream_start: None,
            upstream_time: None,
            body_bytes: 0,
            body_buffered: false,
            grpc: false,
            grpc_deadline: None,
            encoder: None,
            upgrade: None,
            error_status: 0,
            cache: Default::default(),
            hsts: None,
            alt_svc: None,
            h3: false,
            tls: false,
            trace: None,
            _inflight: InFlight::new(&self.inflight),
        })
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Box<Ctx>) -> Result<bool> {
        // From here every response to this request passes the policy.
        crate::edge::conn::mark_seen(session.as_downstream().stream());
        // Pipelined requests (RFC 9112 9.3.2) are answered in order, one
        // after the other, as nginx does; Pingora's default drops every
        // request after the first and closes. Not after a chunked body:
        // Pingora's chunk parser is lax (an empty chunk-size line ends the
        // body), so bytes a strict reader would call body must not become
        // a request: such a connection closes after its response.
        let chunked = session
            .req_header()
            .headers
            .contains_key(http::header::TRANSFER_ENCODING);
        session.as_downstream_mut().set_pipelining_enabled(!chunked);
        let cfg = ctx.cfg.clone();
        let redirect = self.identify(session, ctx, &cfg);
        // Our idle timeout, only where Pingora left keepalive on: it turns it
        // off for `Connection: close`, HTTP/1.0 and for a request with both
        // Content-Length and Transfer-Encoding (RFC 9112 6.1: close after
        // it, or what a front that trusted the Content-Length took for body
        // would be read here as the next request).
        if session.get_keepalive().is_some() {
            session.set_keepalive(Some(ctx.deadlines.keepalive_timeout_s));
        }
        // Pingora reads a body with no deadline of its own choosing (60 s
        // per read) and writes to a client with none: a client that trickles
        // its body or stops reading would hold the connection for ever.
        session.set_read_timeout(ctx.deadlines.client_body_timeout);
        session.set_write_timeout(ctx.deadlines.send_timeout);
        // Routed before the limits are checked, so that a refusal carries
        // the route's response rules too; a redirecting listener routes
        // nothing (it answers every request alike).
        let mut bad_path = None;
        if redirect.is_none() {
            let req = session.req_header();
            let host = filters::request_host(req);
            // Decided on the host already read: the plain path looks Host
            // up no second time.
            let dotted = crate::uri::host_without_dot(host).len() != host.len();
            // Matched as nginx matches locations: on the normalized path,
            // and only for a host that is a host.
            if !crate::uri::valid_host(host) || filters::conflicting_host(req) {
                bad_path = Some("invalid Host");
            } else if !req.raw_path_is_utf8() {
                // Raw bytes that are not UTF-8, in the path or the query,
                // are refused as the path's encoded form is: routing would
                // see U+FFFD, and two targets would share one cache key.
                bad_path = Some(crate::uri::BadPath::NotUtf8.reason());
            } else {
                match crate::uri::normalize(req.uri.path(), cfg.file.server.merge_slashes) {
                    Ok(path) => {
                        ctx.route = cfg.router.find(host, &path).cloned();
                        if let std::borrow::Cow::Owned(p) = path {
                            ctx.path = Some(p);
                        }
                    }
                    Err(e) => bad_path = Some(e.reason()),
                }
                let lenient = ctx.route.as_ref().is_some_and(|r| r.allow_dot_parameters);
                if bad_path.is_none() && !lenient && crate::uri::dot_parameter(req.uri.path()) {
                    bad_path = Some("a dot segment with `;` parameters in the path");
                }
            }
            if bad_path.is_none() {
                if dotted {
                    without_host_dot(session.req_header_mut());
                }
                ask_for_normalized(session.req_header_mut(), ctx);
            }
        }
        // gRPC is what the route serves, not what the client says: only an
        // HTTP/2 or HTTP/3 call routed to an HTTP/2 pool streams unbuffered
        // and is answered with gRPC statuses; elsewhere `application/grpc`
        // is an ordinary content type and buffering holds.
        ctx.grpc = grpc::is_grpc(session.req_header())
            && session.req_header().version >= http::Version::HTTP_2
            && ctx.route.as_ref().is_some_and(|r| match &r.action {
                Action::Proxy(p) => p.settings.protocol.is_h2(),
                _ => false,
            });
        if ctx.grpc {
            ctx.grpc_deadline = grpc::timeout(session.req_header()).map(|d| ctx.started + d);
        }
        let limits = &cfg.limits;
        let refusal = filters::check_head(
            session.req_header(),
            limits.max_header_bytes,
            limits.max_headers,
            limits.client_max_body_bytes,
        );
        if let Some(r) = refusal {
            return self.refuse_head(session, ctx, r).await;
        }
        if let Some(why) = bad_path {
            self.metrics
                .edge
                .rejected
                .with_label_values(&["bad_request"])
                .inc();
            session.set_keepalive(None);
            policy::respond_error(session, &ctx.policy(), 400, why, "bad_request").await?;
            return Ok(true);
        }
        // ACME HTTP-01 validations reach the plain listeners (port 80),
        // the redirecting one included, before any route or redirect.
        if !ctx.tls && self.acme_http01(session, ctx).await? {
            return Ok(true);
        }
        if let Some(port) = redirect {
            return self.redirect_to_https(session, ctx, port).await;
        }
        let Some(route) = ctx.route.clone() else {
            self.metrics
                .edge
                .rejected
                .with_label_values(&["no_route"])
                .inc();
            let msg = "no route matches this request";
            policy::respond_error(session, &ctx.policy(), 404, msg, "no_route").await?;
            return Ok(true);
        };
        if matches!(route.action, Action::Inference) {
            // Boxed: inline, the inference pipeline's state would make
            // every request's `request_filter` future (which async_trait
            // boxes, copying all of it) some 18 KB, proxied ones included.
            return Box::pin(self.inference(session, ctx, &route)).await;
        }
        if matches!(route.action, Action::Proxy(_)) && crate::otel::enabled() {
            let req = session.req_header();
            let name = format!("{} {}", req.method, route.name);
            ctx.trace = crate::otel::ReqTrace::begin(&req.headers, ctx.started, &name);
        }
        if self.admit(session, ctx, &route).await? {
            return Ok(true);
        }
        self.answer(session, ctx, &route).await
    }

    async fn request_body_filter(
        &self,
        session: &mut Session,
        body: &mut Option<Bytes>,
        _end_of_stream: bool,
        ctx: &mut Box<Ctx>,
    ) -> Result<()> {
        if let Some(b) = body {
            ctx.body_bytes += b.len() as u64;
            let max = ctx.cfg.limits.client_max_body_bytes;
            if max > 0 && ctx.body_bytes > max {
                self.metrics
                    .edge
                    .rejected
                    .with_label_values(&["body_too_large"])
                    .inc();
                let h2_pool = ctx.pool().is_some_and(|p| p.settings.protocol.is_h2());
                if h2_pool && session.response_written().is_none() {
                    // Pingora's HTTP/2 upstream path logs a body it could
                    // not send and waits on for the member's answer (until
                    // a timeout): the client is answered now.
                    ctx.error_status = 413;
                    let (msg, code) = ("request body too large", "body_too_large");
                    let _ = policy::respond_error(session, &ctx.policy(), 413, msg, code).await;
                }
                return Error::e_explain(ErrorType::HTTPStatus(413), "request body too large");
            }
        }
        Ok(())
    }

    fn request_cache_filter(&self, session: &mut Session, ctx: &mut Box<Ctx>) -> Result<()> {
        cache::enable(session, ctx);
        Ok(())
    }

    fn cache_key_callback(&self, session: &Session, ctx: &mut Box<Ctx>) -> Result<CacheKey> {
        cache::key(session, ctx)
    }

    fn response_cache_filter(
        &self,
        session: &Session,
        resp: &ResponseHeader,
        ctx: &mut Box<Ctx>,
    ) -> Result<RespCacheable> {
        Ok(cache::cacheable(session, resp, ctx))
    }

    fn cache_vary_filter(
        &self,
        meta: &CacheMeta,
        _ctx: &mut Box<Ctx>,
        req: &RequestHeader,
    ) -> Option<HashBinary> {
        cache::variance(meta, req)
    }

    fn should_serve_stale(
        &self,
        _session: &mut Session,
        _ctx: &mut Box<Ctx>,
        error: Option<&Error>,
    ) -> bool {
        // Pingora asks only within the stored response's own
        // stale-while-revalidate / stale-if-error windows; its default
        // refuses stale-while-revalidate (error `None`) outright.
        error.is_none_or(|e| e.esource() == &ErrorSource::Upstream)
    }

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        ctx: &mut Box<Ctx>,
    ) -> Result<Box<HttpPeer>> {
        let Some(pool) = ctx.pool().cloned() else {
            return Error::e_explain(ErrorType::InternalError, "route has no pool");
        };
        // One membership snapshot per request, so retries index the same set.
        let membership = ctx.membership.get_or_insert_with(|| pool.members()).clone();
        let now = crate::upstream::now_ms();
        let Some(idx) =
            membership
                .balancer
                .select(&membership.members, ctx.hash, ctx.tried.as_slice(), now)
        else {
            return Error::e_explain(ErrorType::HTTPStatus(502), "no upstream member available");
        };
        ctx.tried.push(idx);
        ctx.member = Some(idx);
        let m = &membership.members[idx];
        ctx.outstanding = Some(Outstanding::acquire(m));
        ctx.upstream_start = Some(Instant::now());
        let mut peer = pool.peer(m);
        if let Some(deadline) = ctx.grpc_deadline {
            // The call's deadline bounds every wait on the member.
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Error::e_explain(ErrorType::HTTPStatus(504), "gRPC deadline passed");
            }
            let o = &mut peer.options;
            for t in [
                &mut o.connection_timeout,
                &mut o.total_connection_timeout,
                &mut o.read_timeout,
                &mut o.write_timeout,
            ] {
                *t = Some(t.map_or(left, |t| t.min(left)));
            }
        }
        Ok(peer)
    }

    async fn connected_to_upstream(
        &self,
        _session: &mut Session,
        reused: bool,
        _peer: &HttpPeer,
        #[cfg(unix)] _fd: std::os::unix::io::RawFd,
        _digest: Option<&pingora::protocols::Digest>,
        ctx: &mut Box<Ctx>,
    ) -> Result<()> {
        if let Some(pool) = ctx.pool() {
            if reused {
                pool.metrics.conn_reused.inc();
            } else {
                pool.metrics.conn_new.inc();
            }
        }
        Ok(())
    }

    fn fail_to_connect(
        &self,
        session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut Box<Ctx>,
        mut e: Box<Error>,
    ) -> Box<Error> {
        if let (Some(pool), Some(m)) = (ctx.pool(), ctx.member()) {
            pool.record_failure(m);
        }
        // The upstream never saw the request: safe to retry any method.
        e.set_retry(ctx.may_retry(session));
        e
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut Box<Ctx>,
        _client_reused: bool,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("Peer: {peer}"));
        if e.esource() == &ErrorSource::Downstream {
            // The client hung up (or broke its request): no one is left to
            // answer, and the member did nothing wrong. Retrying would only
            // double the members' load exactly when clients time out.
            e.set_retry(false);
            return e;
        }
        if e.esource() == &ErrorSource::Upstream {
            if let (Some(pool), Some(m)) = (ctx.pool(), ctx.member()) {
                pool.record_failure(m);
            }
        }
        // The upstream may have acted on the request: retry only what is
        // idempotent, with the body still buffered, before any byte went out.
        let safe = is_idempotent(&session.req_header().method)
            && !session.as_ref().retry_buffer_truncated();
        e.set_retry(safe && ctx.may_retry(session));
        e
    }

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        req: &mut RequestHeader,
        ctx: &mut Box<Ctx>,
    ) -> Result<()> {
        let Some(route) = ctx.route.clone() else {
            return Ok(());
        };
        let client = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(|a| a.ip());
        let extra = 4 + route.request_headers.set.len() + route.request_headers.add.len();
        heads::edit_request(req, extra, |h| forward_headers(h, ctx, &route, client))
    }

    async fn upstream_response_filter(
        &self,
        _session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Box<Ctx>,
    ) -> Result<()> {
        let elapsed = ctx.upstream_start.map(|s| s.elapsed()).unwrap_or_default();
        ctx.upstream_time = Some(elapsed);
        if let (Some(pool), Some(m)) = (ctx.pool(), ctx.member()) {
            pool.metrics.latency.observe(elapsed.as_secs_f64());
            if resp.status.as_u16() < 500 {
                pool.record_success(m, elapsed);
            }
        }
        Ok(())
    }

    async fn response_filter(
        &self,
        session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Box<Ctx>,
    ) -> Result<()> {
        if let Some(slot) = ctx.upgrade.as_mut() {
            let up = &self.metrics.upgrades;
            if resp.status == http::StatusCode::SWITCHING_PROTOCOLS {
                slot.upgraded(&up.open);
                up.upgraded.inc();
                let idle = ctx.cfg.limits.upgraded_idle_timeout;
                session.set_read_timeout(idle);
            } else {
                // Refused: whatever the client sent behind its request was
                // meant for a tunnel, never to be read as a request.
                up.refused_upstream.inc();
                ctx.upgrade = None;
                session.set_keepalive(None);
            }
        }
        cache::status_header(session, resp, ctx);
        self.spool_response(session, resp, ctx);
        if let Some(spec) = ctx.route.as_ref().and_then(|r| r.compress.clone()) {
            compress_head(session, resp, ctx, &spec);
        }
        ctx.policy().apply(resp)
    }

    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Box<Ctx>,
    ) -> Result<Option<std::time::Duration>> {
        if let Some(enc) = ctx.encoder.as_mut() {
            if body.is_some() || end_of_stream {
                *body = Some(enc.encode(body.as_ref(), end_of_stream)?);
            }
            if end_of_stream {
                ctx.encoder = None;
            }
        }
        Ok(None)
    }

    fn suppress_error_log(&self, _session: &Session, _ctx: &Box<Ctx>, e: &Error) -> bool {
        // A client that hangs up is routine at an edge (nginx logs it at
        // info); it is counted in the access log with status 0.
        e.esource() == &ErrorSource::Downstream
            && matches!(
                e.etype(),
                ErrorType::ConnectionClosed | ErrorType::ReadError | ErrorType::WriteError
            )
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut Box<Ctx>,
    ) -> FailToProxy {
        let mut code = status_for(e);
        if code > 0 && ctx.grpc_deadline.is_some_and(|d| d <= Instant::now()) {
            // Whatever failed, the call's deadline has passed.
            code = 504;
        }
        ctx.error_status = code;
        if code > 0 && session.response_written().is_none() {
            let (msg, kind) = match code {
                413 => ("request body too large", "body_too_large"),
                502 => ("upstream failed", "bad_gateway"),
                504 => ("upstream timed out", "gateway_timeout"),
                400 => ("bad request", "bad_request"),
                _ => ("request failed", "proxy_error"),
            };
            if ctx.request_id.is_empty() {
                // The request never reached `request_filter`.
                let cfg = ctx.cfg.clone();
                self.identify(session, ctx, &cfg);
            }
            let _ = policy::respond_error(session, &ctx.policy(), code, msg, kind).await;
        }
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Box<Ctx>) {
        if let Some(e) = e.filter(|e| e.esource() == &ErrorSource::Downstream) {
            match e.etype() {
                ErrorType::ReadTimedout => self.metrics.edge.conns.body_timeout.inc(),
                ErrorType::WriteTimedout => self.metrics.edge.conns.send_timeout.inc(),
                _ => {}
            }
        }
        let status = session
            .response_written()
            .map(|r| r.status.as_u16())
            .unwrap_or(ctx.error_status);
        if let Some(route) = &ctx.route {
            route.metrics.observe(status);
            if let Some(rc) = &route.cache {
                rc.metrics.observe(rc.zone(), ctx.cache.outcome);
            }
        }
        ctx.outstanding = None;
        ctx.permit = None;
        let protocol = if ctx.h3 {
            "HTTP/3"
        } else if session.as_downstream().is_http2() {
            "HTTP/2"
        } else {
            "HTTP/1.1"
        };
        self.metrics
            .edge
            .protocols
            .with_label_values(&[protocol])
            .inc();
        if crate::edge::conn::end_response(session.as_downstream().stream()) {
            // The rest goes out after the request (`edge::spool`), the
            // connection closed after it.
            session.set_keepalive(None);
        }
        if let Some(t) = ctx.trace.take() {
            let req = session.req_header();
            let mut attrs = vec![
                opentelemetry::KeyValue::new("http.request.method", req.method.to_string()),
                opentelemetry::KeyValue::new("url.path", req.uri.path().to_string()),
            ];
            if let Some(m) = ctx.member() {
                attrs.push(opentelemetry::KeyValue::new(
                    "server.address",
                    m.label.clone(),
                ));
            }
            t.end_http(status, attrs);
        }
        if !self.log.enabled() {
            return;
        }
        let req = session.req_header();
        let lane = ctx.cfg.lanes.get(ctx.lane).map_or("", |l| l.name.as_str());
        self.log.log(&Entry {
            time: ctx.started_wall,
            request_id: ctx.request_id.to_str().unwrap_or(""),
            lane,
            queue: ctx.queue_wait,
            client: session
                .client_addr()
                .and_then(|a| a.as_inet())
                .map(|a| a.ip()),
            method: req.method.as_str(),
            uri: req.uri.path_and_query().map_or("", |p| p.as_str()),
            route: ctx.route.as_deref().map(|r| r.name.as_str()),
            upstream: ctx.member().map(|m| m.addr),
            status,
            bytes: session.body_bytes_sent(),
            total: ctx.started.elapsed(),
            upstream_time: ctx.upstream_time,
            tries: ctx.tried.len() as u32,
            user_agent: req
                .headers
                .get(http::header::USER_AGENT)
                .and_then(|v| v.to_str().ok())
                .unwrap_or(""),
            protocol,
        });
    }
}
