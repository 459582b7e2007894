//! The Pingora adapter of the inference front: the session as an `Incoming`
//! and a `Downstream`; the limits that need no body on every `/v1/`
//! endpoint; the body of completions; the rest is `crate::inference`.

use super::policy::{self, Policy};
use super::*;
use crate::inference::context::Api;
use crate::inference::context::Incoming;
use crate::inference::delivery::{Downstream, Failure, Gone};
use crate::inference::endpoints::{send, Reply};
use crate::inference::openai::Endpoint;
use bytes::BytesMut;
use ultrafast_engine::api::BackendError;

pub use crate::inference::Front;

/// A Pingora session as the pipeline's downstream. Its `head` is where
/// every inference response (JSON, SSE, 202, models, jobs, errors) meets
/// the response policy, so the pipeline sends only its own headers.
struct Down<'a> {
    session: &'a mut Session,
    policy: Policy<'a>,
    watching: bool,
    /// The request came to `/v1/messages`: errors in Anthropic's shape.
    anthropic: bool,
    /// The next head's body bytes follow at once (`Downstream::body_follows`).
    body_follows: bool,
    /// When to look at the socket's TCP state next, once a pipelined byte
    /// ended the idle read (`gone`).
    next_look: Option<tokio::time::Instant>,
    /// Most body bytes read (`[limits] client_max_body_bytes`, 16 MiB
    /// where unlimited).
    max_body: usize,
}

/// How often a connection whose client pipelined a byte is looked at.
const LOOK_EVERY: Duration = Duration::from_millis(500);

impl Down<'_> {
    /// Whether `resp`, a head with a body of no stated length, goes out
    /// chunked: only to an HTTP/1.1 client (HTTP/2 frames its own bodies;
    /// HTTP/1.0 knows no chunks), and never for a head without a body.
    fn chunks_unsized(&self, resp: &ResponseHeader) -> bool {
        let req = self.session.as_downstream().req_header();
        !super::framed(self.session)
            && req.version == http::Version::HTTP_11
            && req.method != http::Method::HEAD
            && !matches!(resp.status.as_u16(), 100..=199 | 204 | 304)
            && !resp.headers.contains_key(http::header::CONTENT_LENGTH)
            && !resp.headers.contains_key(http::header::TRANSFER_ENCODING)
    }
}

#[async_trait]
impl Downstream for Down<'_> {
    async fn head(&mut self, status: u16, headers: &[(&str, &str)]) -> Result<(), Gone> {
        let mut resp = ResponseHeader::build(status, Some(headers.len() + 3)).map_err(|_| Gone)?;
        for (k, v) in headers {
            resp.insert_header(k.to_string(), *v).map_err(|_| Gone)?;
        }
        // A body of unknown length (a stream) is chunked for an HTTP/1.1
        // client, as nginx sends it: delimited by the close instead, the
        // connection could not be kept, and a client that reuses its
        // connections (the OpenAI SDKs) would pay a new handshake for every
        // streamed request.
        if self.chunks_unsized(&resp) {
            resp.insert_header(http::header::TRANSFER_ENCODING, "chunked")
                .map_err(|_| Gone)?;
        }
        // A stream's head whose first bytes are ready waits for them over
        // HTTP/1 (Pingora flushes a head without `Content-Length` at once):
        // only the flush inside this write is held, never a later one.
        let join = std::mem::take(&mut self.body_follows) && !super::framed(self.session);
        if join {
            crate::edge::conn::join_head_to_body(self.session.as_downstream().stream(), true);
        }
        let r = policy::write_head(self.session, &self.policy, resp, false).await;
        if join {
            crate::edge::conn::join_head_to_body(self.session.as_downstream().stream(), false);
        }
        r.map_err(|_| Gone)
    }

    fn body_follows(&mut self) {
        self.body_follows = true;
    }

    async fn body(&mut self, bytes: Bytes, end: bool) -> Result<(), Gone> {
        self.session
            .write_response_body(Some(bytes), end)
            .await
            .map_err(|_| Gone)
    }

    async fn gone(&mut self) {
        // With the body read, an idle read returns only when the client
        // closes (an error) or pipelines its next request (bytes), after
        // which it cannot be told any more.
        if self.watching {
            if self.session.read_body_or_idle(true).await.is_err() {
                return;
            }
            self.watching = false;
        }
        // Bytes came (Pingora keeps them for the next request and reads
        // no more): a client that sent one byte and left is still seen,
        // in its socket's TCP state (past ESTABLISHED once its FIN or RST
        // came), twice a second. The deadline is kept across calls, as the
        // drive loop polls this anew on every turn.
        let socket = self
            .session
            .as_downstream()
            .digest()
            .and_then(|d| d.socket_digest.clone());
        let Some(socket) = socket else {
            return std::future::pending::<()>().await;
        };
        loop {
            let at = *self
                .next_look
                .get_or_insert_with(|| tokio::time::Instant::now() + LOOK_EVERY);
            tokio::time::sleep_until(at).await;
            self.next_look = Some(at + LOOK_EVERY);
            match socket.tcp_info() {
                // 1 = TCP_ESTABLISHED.
                Some(i) if i.tcpi_state != 1 => return,
                Some(_) => {}
                None => return std::future::pending::<()>().await,
            }
        }
    }

    fn anthropic(&self) -> bool {
        self.anthropic
    }
}

impl EdgeProxy {
    /// Serve an inference route. Always answers (Ok(true)).
    pub(super) async fn inference(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        route: &Arc<Route>,
    ) -> Result<bool> {
        let req = session.req_header();
        let method = req.method.clone();
        // The path the route was matched on (`crate::uri`).
        let path = ctx
            .path
            .clone()
            .unwrap_or_else(|| req.uri.path().to_string());
        let mut inc = Incoming {
            cfg: ctx.cfg.clone(),
            route: route.clone(),
            headers: req.headers.clone(),
            client_ip: session
                .client_addr()
                .and_then(|a| a.as_inet())
                .map(|a| a.ip()),
            request_id: ctx.request_id.to_str().unwrap_or("").to_string(),
            arrived: ctx.started,
            network: Duration::ZERO,
            key: None,
            // The name is built only when tracing is on.
            trace: crate::otel::enabled()
                .then(|| {
                    crate::otel::ReqTrace::begin(
                        &req.headers,
                        ctx.started,
                        &format!("{method} {path}"),
                    )
                })
                .flatten(),
        };
        let mut down = Down {
            session,
            policy: ctx.policy(),
            watching: true,
            anthropic: path.trim_end_matches('/') == "/v1/messages",
            body_follows: false,
            next_look: None,
            max_body: match ctx.cfg.limits.client_max_body_bytes {
                0 => 16 << 20,
                n => n as usize,
            },
        };
        let front = &self.front;
        let lane = ctx.cfg.lanes.get(route.lane).map(|l| l.name.clone());
        let done = match front
            .limits(&self.metrics.inference, &inc, lane.as_deref().unwrap_or(""))
            .await
        {
            // Refused before the body was read: close rather than drain it.
            Err(f) => {
                down.session.set_keepalive(None);
                if let Some(t) = &inc.trace {
                    t.end_http(f.status, Vec::new());
                }
                fail(&mut down, &f).await
            }
            Ok(key) => {
                inc.key = key;
                self.endpoint(&mut down, &mut inc, &method, &path).await
            }
        };
        done.map(|()| true)
            .map_err(|Gone| Error::new_down(ErrorType::ConnectionClosed))
    }

    async fn endpoint(
        &self,
        down: &mut Down<'_>,
        inc: &mut Incoming,
        method: &http::Method,
        path: &str,
    ) -> std::result::Result<(), Gone> {
        let front = &self.front;
        // The endpoints other than completions are boxed: their states would
        // otherwise size every request's future (and its copies).
        let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
        let reply = match (method, segs.as_slice()) {
            (&http::Method::POST, ["v1", "chat", "completions"]) => {
                return self.completion(down, inc, Endpoint::Chat).await
            }
            (&http::Method::POST, ["v1", "completions"]) => {
                return self.completion(down, inc, Endpoint::Completions).await
            }
            (&http::Method::POST, ["v1", "messages"]) => {
                return self.completion(down, inc, Api::Messages).await
            }
            (&http::Method::POST, ["v1", "responses"]) => {
                return self.completion(down, inc, Api::Responses).await
            }
            (&http::Method::GET, ["v1", "responses", id]) => {
                Box::pin(front.response_status(inc, id)).await
            }
            (&http::Method::DELETE, ["v1", "responses", id])
            | (&http::Method::POST, ["v1", "responses", id, "cancel"]) => {
                Box::pin(front.response_cancel(inc, id)).await
            }
            (&http::Method::GET, ["v1", "requests", id, "events"]) => {
                return Box::pin(front.job_events(inc, id, down)).await
            }
            (&http::Method::POST, ["tokenize"] | ["v1", "tokenize"]) => {
                let Some(body) = self.body(down, inc).await? else {
                    return Ok(());
                };
                Box::pin(front.tokenize(inc, &body)).await
            }
            (&http::Method::POST, ["detokenize"] | ["v1", "detokenize"]) => {
                let Some(body) = self.body(down, inc).await? else {
                    return Ok(());
                };
                Box::pin(front.detokenize(inc, &body)).await
            }
            (&http::Method::GET, ["tokenizer_info"] | ["v1", "tokenizer_info"]) => {
                front.tokenizer_info(inc)
            }
            (&http::Method::GET, ["v1", "models"]) => front.models(inc),
            (&http::Method::GET, ["v1", "models", id]) => front.model(inc, id),
            (&http::Method::GET, ["v1", "requests", id]) => {
                Box::pin(front.job_status(inc, id)).await
            }
            (&http::Method::DELETE, ["v1", "requests", id]) => {
                Box::pin(front.job_cancel(inc, id)).await
            }
            (
                _,
                ["v1", "chat", "completions"]
                | ["v1", "completions"]
                | ["v1", "models"]
                | ["v1", "messages"]
                | ["v1", "responses"],
            ) => Reply::error(&BackendError::request(
                405,
                "method_not_allowed",
                format!("{method} is not allowed on {path}"),
            )),
            _ => Reply::error(&BackendError::request(
                404,
                "unknown_url",
                format!("Unknown request URL: {method} {path}."),
            )),
        };
        if reply.status >= 400 {
            self.metrics
                .edge
                .rejected
                .with_label_values(&["bad_request"])
                .inc();
        }
        if let Some(t) = &inc.trace {
            t.end_http(reply.status, Vec::new());
        }
        send(down, &[], reply).await
    }

    async fn completion(
        &self,
        down: &mut Down<'_>,
        inc: &mut Incoming,
        api: impl Into<Api>,
    ) -> std::result::Result<(), Gone> {
        let api = api.into();
        let Some(body) = self.body(down, inc).await? else {
            return Ok(());
        };
        self.front
            .completion(&self.metrics.inference, inc, api, &body, down)
            .await
    }

    /// The request body, bounded: None when it was too large (the 413 is
    /// sent).
    async fn body(
        &self,
        down: &mut Down<'_>,
        inc: &mut Incoming,
    ) -> std::result::Result<Option<BytesMut>, Gone> {
        let max = down.max_body;
        let mut body = BytesMut::new();
        loop {
            match down.session.read_request_body().await {
                Ok(Some(b)) => {
                    body.extend_from_slice(&b);
                    if body.len() > max {
                        down.session.set_keepalive(None);
                        let e = BackendError::request(
                            413,
                            "body_too_large",
                            "request body too large".into(),
                        );
                        let f = crate::inference::sinks::backend_failure(&e);
                        return fail(down, &f).await.map(|()| None);
                    }
                }
                Ok(None) => break,
                Err(_) => return Err(Gone),
            }
        }
        inc.network = inc.arrived.elapsed();
        Ok(Some(body))
    }
}

async fn fail(down: &mut Down<'_>, f: &Failure) -> std::result::Result<(), Gone> {
    crate::inference::sinks::send_failure(down, &Vec::new(), f).await
}
