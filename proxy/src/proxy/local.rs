//! The answers the edge makes itself in `request_filter`, without an
//! upstream: who the listener is, refusals of the request head, the
//! HTTPS-redirect listener's 301, and the routes that answer locally
//! (`return`, `redirect`). Each is written through `policy`, so it gets the
//! same request id, HSTS and route rules as a proxied response.

use super::*;

impl EdgeProxy {
    /// Note what the connection and its listener say about this request
    /// (its id, TLS, HSTS); returns the listener's HTTPS-redirect port.
    pub(super) fn identify(&self, session: &Session, ctx: &mut Ctx, cfg: &Config) -> Option<u16> {
        (ctx.request_id, ctx.own_id) = filters::request_id(session.req_header(), ctx.started_wall);
        ctx.tls = policy::is_tls(session);
        ctx.h3 = crate::edge::h3::is_h3(session.digest());
        let local = session.server_addr().and_then(|a| a.as_inet()).copied();
        let rule = cfg.listener_rule(local);
        ctx.deadlines = rule.map_or(cfg.limits.deadlines, |r| r.deadlines);
        let rule = rule?;
        ctx.hsts = rule.hsts.clone();
        if !ctx.h3 {
            ctx.alt_svc = rule.alt_svc.clone();
        }
        rule.redirect_https_port
    }

    /// Refuse a request whose head breaks the limits (the connection is
    /// not kept: its body, if any, is not read).
    pub(super) async fn refuse_head(
        &self,
        session: &mut Session,
        ctx: &Ctx,
        r: Refusal,
    ) -> Result<bool> {
        let (status, msg, code) = match r {
            Refusal::HeadersTooLarge => (431, "request headers too large", "headers_too_large"),
            Refusal::BodyTooLarge => (413, "request body too large", "body_too_large"),
            Refusal::BadContentLength => {
                (400, "invalid Content-Length header", "bad_content_length")
            }
            Refusal::DuplicateTransferEncoding => (
                400,
                "repeated Transfer-Encoding header",
                "bad_transfer_encoding",
            ),
            Refusal::UnsupportedTransferEncoding => (
                501,
                "only Transfer-Encoding: chunked is supported",
                "unsupported_transfer_encoding",
            ),
            Refusal::Connect => (405, "CONNECT is not supported", "method_not_allowed"),
        };
        self.metrics.edge.rejected.with_label_values(&[code]).inc();
        session.set_keepalive(None);
        policy::respond_error(session, &ctx.policy(), status, msg, code).await?;
        Ok(true)
    }

    /// Answer an ACME HTTP-01 validation (`GET
    /// /.well-known/acme-challenge/TOKEN`) for a token of an open order;
    /// Ok(false) for every other request.
    pub(super) async fn acme_http01(&self, session: &mut Session, ctx: &Ctx) -> Result<bool> {
        use crate::edge::acme;
        let req = session.req_header();
        let Some(token) = req.uri.path().strip_prefix(acme::HTTP01_PREFIX) else {
            return Ok(false);
        };
        if req.method != http::Method::GET && req.method != http::Method::HEAD {
            return Ok(false);
        }
        // Only for a name some listener orders by HTTP-01: elsewhere a
        // probe is an ordinary request (and costs no store lookup).
        if !acme::serves_http01(filters::request_host(req)) {
            return Ok(false);
        }
        let Some(key_auth) = acme::http_answer(token).await else {
            return Ok(false);
        };
        policy::respond(
            session,
            &ctx.policy(),
            200,
            "application/octet-stream",
            Bytes::from(key_auth),
            &[],
        )
        .await?;
        Ok(true)
    }

    /// The 301 of a listener with `redirect_https_port`: same host (without
    /// its port) and URI, on HTTPS.
    pub(super) async fn redirect_to_https(
        &self,
        session: &mut Session,
        ctx: &Ctx,
        port: u16,
    ) -> Result<bool> {
        let req = session.req_header();
        let host = req
            .headers
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("localhost");
        let host = host
            .rsplit_once(':')
            .filter(|(_, p)| p.bytes().all(|b| b.is_ascii_digit()))
            .map(|(h, _)| h)
            .unwrap_or(host);
        let uri = req.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
        let loc = if port == 443 {
            format!("https://{host}{uri}")
        } else {
            format!("https://{host}:{port}{uri}")
        };
        let extra = [("location", loc.as_str())];
        policy::respond(
            session,
            &ctx.policy(),
            301,
            "text/plain",
            Bytes::new(),
            &extra,
        )
        .await?;
        Ok(true)
    }

    /// An admitted request on a plain route: set it up for proxying
    /// (Ok(false)), or answer it here (Ok(true)).
    pub(super) async fn answer(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        route: &Arc<Route>,
    ) -> Result<bool> {
        match &route.action {
            Action::Proxy(pool) => {
                pool.record_request();
                if let LbSpec::ConsistentHash(key, _) = &pool.lb {
                    ctx.hash = filters::hash_key(session, key);
                }
                if super::upgrade::asks_upgrade(session.req_header()) {
                    let up = &self.metrics.upgrades;
                    match up.take(ctx.cfg.limits.max_upgraded) {
                        Some(slot) => ctx.upgrade = Some(slot),
                        None => {
                            up.refused_cap.inc();
                            let msg = "too many upgraded connections (max_upgraded)";
                            session.set_keepalive(None);
                            policy::respond_error(
                                session,
                                &ctx.policy(),
                                503,
                                msg,
                                "too_many_upgrades",
                            )
                            .await?;
                            return Ok(true);
                        }
                    }
                }
                // An HTTP/2 body need not be declared: a head without
                // END_STREAM has one.
                if filters::has_body(session.req_header()) || !session.is_body_empty() {
                    session.enable_retry_buffering();
                    // A gRPC body streams both ways (a bidirectional
                    // call would wait on itself), as nginx's grpc_pass.
                    if route.request_buffering && !ctx.grpc {
                        return self.buffer_body(session, ctx).await;
                    }
                }
                Ok(false)
            }
            Action::Fixed {
                status,
                body,
                content_type,
            } => {
                let p = ctx.policy();
                policy::respond(session, &p, *status, content_type, body.clone(), &[]).await?;
                Ok(true)
            }
            Action::Redirect { status, location } => {
                let uri = session
                    .req_header()
                    .uri
                    .path_and_query()
                    .map(|p| p.as_str())
                    .unwrap_or("/");
                let loc = location.replace("$request_uri", uri);
                let extra = [("location", loc.as_str())];
                let p = ctx.policy();
                policy::respond(session, &p, *status, "text/plain", Bytes::new(), &extra).await?;
                Ok(true)
            }
            // Served by `inference` before admission; never reaches here.
            Action::Inference => Ok(true),
        }
    }
}
