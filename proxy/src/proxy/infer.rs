//! The inference request path: OpenAI API on inference routes.
//!
//! Order for a completion: read the body (its time is the "network" part of
//! the breakdown), parse and type-check, choose the lane (header, then the
//! body's `priority`, then the route's default), find the model and let its
//! backend tokenize and size the request, rate limits, then either the async
//! mode (202 now, a job runs in the background) or admission into the
//! model's lane queue and generation. Streams send SSE comment heartbeats
//! while nothing else is ready, watch the client's connection so a
//! disconnect cancels the backend at once, and pass tokens through the
//! lane's pacer. Every response ends with the latency breakdown:
//! `Server-Timing` on whole responses; on streams an `ultrafast_timing`
//! object in the finishing chunk and a trailing `: server-timing` comment,
//! both invisible to OpenAI clients.

use super::*;
use crate::admission::select_lane;
use crate::inference::jobs::{self, Job};
use crate::inference::openai::{self, Endpoint, Ident, Parsed};
use crate::inference::pacer::Pacer;
use crate::inference::{sse, Engines, Model};
use bytes::BytesMut;
use serde_json::{json, Value};
use ultrafast_engine::api::{
    Backend, BackendError, Event, EventStream, InferenceRequest, Prepared, Usage,
};

/// Inference state of the process: started engines and the async store.
pub struct Front {
    /// Engines by model name.
    pub engines: Engines,
    /// Async jobs.
    pub jobs: jobs::Store,
}

impl std::fmt::Debug for Front {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Front({:?})", self.engines)
    }
}

/// Where the time of one request went.
#[derive(Debug, Default, Clone, Copy)]
struct Timing {
    network: Duration,
    queue: Duration,
    ttft: Option<Duration>,
    compute: Duration,
    total: Duration,
}

impl Timing {
    fn output(&self) -> Duration {
        self.total
            .saturating_sub(self.network + self.queue + self.compute)
    }

    fn header(&self) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        format!(
            "network;dur={:.3}, queue;dur={:.3}, ttft;dur={:.3}, compute;dur={:.3}, output;dur={:.3}, total;dur={:.3}",
            ms(self.network),
            ms(self.queue),
            ms(self.ttft.unwrap_or_default()),
            ms(self.compute),
            ms(self.output()),
            ms(self.total)
        )
    }

    fn json(&self) -> Value {
        let ms = |d: Duration| (d.as_secs_f64() * 1e6).round() / 1000.0;
        json!({"network_ms": ms(self.network), "queue_ms": ms(self.queue),
            "ttft_ms": ms(self.ttft.unwrap_or_default()), "compute_ms": ms(self.compute),
            "output_ms": ms(self.output()), "total_ms": ms(self.total)})
    }
}

/// What woke a waiting loop.
enum Wake<T> {
    Ready(T),
    Heartbeat,
    Gone,
    Pace,
}

/// The response side of one completion.
struct Out {
    stream: bool,
    sent_head: bool,
    watch_gone: bool,
    last_write: Instant,
}

impl Out {
    async fn head(&mut self, session: &mut Session, rid: &str) -> Result<()> {
        if self.sent_head {
            return Ok(());
        }
        let mut resp = ResponseHeader::build(200, Some(6))?;
        resp.insert_header(http::header::CONTENT_TYPE, "text/event-stream")?;
        resp.insert_header(http::header::CACHE_CONTROL, "no-cache")?;
        resp.insert_header("x-accel-buffering", "no")?;
        resp.insert_header("x-request-id", rid)?;
        session.write_response_header(Box::new(resp), false).await?;
        self.sent_head = true;
        Ok(())
    }

    async fn write(&mut self, session: &mut Session, b: Bytes) -> Result<()> {
        session.write_response_body(Some(b), false).await?;
        self.last_write = Instant::now();
        Ok(())
    }

    /// End a stream whose headers are sent with an error event and `[DONE]`.
    async fn end_with_error(&mut self, session: &mut Session, body: &[u8]) -> Result<()> {
        self.write(session, sse::data(&String::from_utf8_lossy(body)))
            .await?;
        session
            .write_response_body(Some(Bytes::from_static(sse::DONE)), true)
            .await
    }

    /// Wait for `fut`, sending heartbeats on a stream and watching for the
    /// client going away.
    async fn wait<T>(
        &mut self,
        session: &mut Session,
        rid: &str,
        heartbeat: Duration,
        fut: impl std::future::Future<Output = T>,
    ) -> Result<Option<T>> {
        tokio::pin!(fut);
        loop {
            let hb_at = tokio::time::Instant::from_std(self.last_write + heartbeat);
            let watch = self.watch_gone;
            let w = tokio::select! {
                v = &mut fut => Wake::Ready(v),
                _ = tokio::time::sleep_until(hb_at), if self.stream => Wake::Heartbeat,
                r = session.read_body_or_idle(true), if watch => match r {
                    Err(_) => Wake::Gone,
                    Ok(_) => Wake::Pace,
                },
            };
            match w {
                Wake::Ready(v) => return Ok(Some(v)),
                Wake::Heartbeat => {
                    self.head(session, rid).await?;
                    self.write(session, sse::comment("waiting")).await?;
                }
                Wake::Gone => return Ok(None),
                Wake::Pace => self.watch_gone = false,
            }
        }
    }
}

fn header_str<'a>(session: &'a Session, name: &str) -> Option<&'a str> {
    session
        .req_header()
        .headers
        .get(name)
        .and_then(|v| v.to_str().ok())
}

fn not_found_model(model: &str) -> BackendError {
    BackendError {
        status: 404,
        kind: "invalid_request_error",
        code: "model_not_found",
        param: Some("model"),
        message: format!("The model `{model}` does not exist or you do not have access to it."),
    }
}

impl EdgeProxy {
    async fn send_json(
        &self,
        session: &mut Session,
        ctx: &Ctx,
        status: u16,
        body: Bytes,
        extra: &[(&str, &str)],
    ) -> Result<bool> {
        let rid = ctx.request_id.clone();
        let mut h: Vec<(&str, &str)> = vec![("x-request-id", rid.to_str().unwrap_or(""))];
        h.extend_from_slice(extra);
        filters::respond(session, status, "application/json", body, &h).await?;
        Ok(true)
    }

    async fn send_err(&self, session: &mut Session, ctx: &Ctx, e: &BackendError) -> Result<bool> {
        self.metrics.rejected.with_label_values(&[e.code]).inc();
        self.send_json(session, ctx, e.status, openai::error_json(e), &[])
            .await
    }

    /// Serve an inference route. Always answers (Ok(true)).
    pub(super) async fn inference(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        route: &Arc<Route>,
    ) -> Result<bool> {
        let method = session.req_header().method.clone();
        let path = session.req_header().uri.path().to_string();
        let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
        match (&method, segs.as_slice()) {
            (&http::Method::POST, ["v1", "chat", "completions"]) => {
                self.completion(session, ctx, route, Endpoint::Chat).await
            }
            (&http::Method::POST, ["v1", "completions"]) => {
                self.completion(session, ctx, route, Endpoint::Completions)
                    .await
            }
            (&http::Method::GET, ["v1", "models"]) => {
                let data: Vec<Value> = ctx.cfg.models.keys().map(|m| model_json(m)).collect();
                let body = json!({"object": "list", "data": data}).to_string();
                self.send_json(session, ctx, 200, Bytes::from(body), &[])
                    .await
            }
            (&http::Method::GET, ["v1", "models", id]) => match ctx.cfg.models.get(*id) {
                Some(_) => {
                    let body = Bytes::from(model_json(id).to_string());
                    self.send_json(session, ctx, 200, body, &[]).await
                }
                None => self.send_err(session, ctx, &not_found_model(id)).await,
            },
            (&http::Method::GET, ["v1", "requests", id, "events"]) => {
                let id = id.to_string();
                self.job_events(session, ctx, &id).await
            }
            (&http::Method::GET, ["v1", "requests", id]) => match self.front.jobs.get(id) {
                Some(j) => {
                    let body = Bytes::from(j.view().to_string());
                    self.send_json(session, ctx, 200, body, &[]).await
                }
                None => self.send_err(session, ctx, &no_job(id)).await,
            },
            (&http::Method::DELETE, ["v1", "requests", id]) => match self.front.jobs.get(id) {
                Some(j) => {
                    j.cancel();
                    let body = Bytes::from(j.view().to_string());
                    self.send_json(session, ctx, 200, body, &[]).await
                }
                None => self.send_err(session, ctx, &no_job(id)).await,
            },
            (_, ["v1", "chat", "completions"] | ["v1", "completions"] | ["v1", "models"]) => {
                let e = BackendError::request(
                    405,
                    "method_not_allowed",
                    format!("{method} is not allowed on {path}"),
                );
                self.send_err(session, ctx, &e).await
            }
            _ => {
                let e = BackendError::request(
                    404,
                    "unknown_url",
                    format!("Unknown request URL: {method} {path}."),
                );
                self.send_err(session, ctx, &e).await
            }
        }
    }

    async fn read_body(&self, session: &mut Session, ctx: &Ctx) -> Result<Option<BytesMut>> {
        let max = match ctx.cfg.limits.client_max_body_bytes {
            0 => 16 << 20,
            n => n as usize,
        };
        let mut body = BytesMut::new();
        while let Some(b) = session.read_request_body().await? {
            body.extend_from_slice(&b);
            if body.len() > max {
                return Ok(None);
            }
        }
        Ok(Some(body))
    }

    async fn completion(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        route: &Arc<Route>,
        ep: Endpoint,
    ) -> Result<bool> {
        let Some(body) = self.read_body(session, ctx).await? else {
            session.set_keepalive(None);
            let e = BackendError::request(413, "body_too_large", "request body too large".into());
            return self.send_err(session, ctx, &e).await;
        };
        let network = ctx.started.elapsed();
        let parsed = match openai::parse(ep, &body) {
            Ok(p) => p,
            Err(e) => return self.send_err(session, ctx, &e).await,
        };
        let lane_pick = match header_str(session, PRIORITY_HEADER) {
            Some(h) => select_lane(&ctx.cfg.lanes, Some(h.as_bytes()), route.lane),
            None => select_lane(
                &ctx.cfg.lanes,
                parsed.priority.as_deref().map(str::as_bytes),
                route.lane,
            ),
        };
        ctx.lane = match lane_pick {
            Ok(l) => l,
            Err(why) => {
                let e = BackendError::invalid("invalid_priority", Some("priority"), why);
                return self.send_err(session, ctx, &e).await;
            }
        };
        let Some(model) = ctx.cfg.models.get(&parsed.model).cloned() else {
            return self
                .send_err(session, ctx, &not_found_model(&parsed.model))
                .await;
        };
        let Some(backend) = self.front.engines.backend(&model) else {
            let e = BackendError::unavailable(format!(
                "model `{}` was added by a reload and starts with the next graceful upgrade",
                model.name
            ));
            return self.send_err(session, ctx, &e).await;
        };
        let lane = &ctx.cfg.lanes[ctx.lane];
        let req = InferenceRequest {
            model: parsed.model.clone(),
            prompt: parsed.prompt.clone(),
            max_tokens: parsed.max_tokens,
            sampling: parsed.sampling.clone(),
            stop: parsed.stop.clone(),
            lane: lane.name.clone(),
            lane_rank: lane.rank,
            request_id: ctx.request_id.to_str().unwrap_or("").to_string(),
            user: parsed.user.clone(),
        };
        // The engine tokenizes and renders the template here: off the
        // request runtime, so a long prompt never stalls other requests.
        let prepared = if backend.kind() == "engine" {
            let (b, r) = (backend.clone(), req.clone());
            match tokio::task::spawn_blocking(move || b.prepare(&r)).await {
                Ok(p) => p,
                Err(_) => Err(BackendError::unavailable("tokenization failed".into())),
            }
        } else {
            backend.prepare(&req)
        };
        let prepared = match prepared {
            Ok(p) => p,
            Err(e) => return self.send_err(session, ctx, &e).await,
        };
        if self.rate_limited(session, ctx, route, None).await? {
            return Ok(true);
        }
        let prefer_async = header_str(session, "prefer")
            .is_some_and(|p| p.to_ascii_lowercase().contains("respond-async"));
        let call = Call {
            backend,
            model,
            req,
            prepared,
            parsed,
            lane: ctx.lane,
            network,
        };
        if prefer_async || call.parsed.background {
            return self.start_job(session, ctx, call).await;
        }
        self.run_sync(session, ctx, call).await
    }

    async fn run_sync(&self, session: &mut Session, ctx: &mut Ctx, call: Call) -> Result<bool> {
        let rid = ctx.request_id.to_str().unwrap_or("").to_string();
        let heartbeat = Duration::from_millis(ctx.cfg.file.inference.heartbeat_ms.max(1));
        let mut out = Out {
            stream: call.parsed.stream,
            sent_head: false,
            watch_gone: true,
            last_write: Instant::now(),
        };
        let lane_name = ctx.cfg.lanes[call.lane].name.clone();
        let im = &self.metrics.inference;
        let outcome = |o: &str| {
            im.requests
                .with_label_values(&[&call.model.name, &lane_name, o])
                .inc()
        };
        let queued_at = Instant::now();
        let _permit = match &call.model.gate {
            None => None,
            Some(gate) => {
                let work = (call.prepared.prompt_tokens + call.prepared.max_tokens) as u64;
                let acquire = gate.acquire(call.lane, Some(work), std::future::pending());
                match out.wait(session, &rid, heartbeat, acquire).await? {
                    None => {
                        outcome("client_gone");
                        return Err(Error::new_down(ErrorType::ConnectionClosed));
                    }
                    Some(Ok((p, _))) => Some(p),
                    Some(Err(Denied::Shed(reason, retry_after))) => {
                        outcome("shed");
                        if out.sent_head {
                            let (_, _, body) = admission::refusal(reason, retry_after);
                            out.end_with_error(session, &body).await?;
                            return Ok(true);
                        }
                        return self.shed(session, ctx, reason, retry_after).await;
                    }
                    Some(Err(Denied::Gone)) => {
                        outcome("client_gone");
                        return Err(Error::new_down(ErrorType::ConnectionClosed));
                    }
                }
            }
        };
        let gate_wait = queued_at.elapsed();
        let dispatched = Instant::now();
        let backend_kind = call.backend.kind();
        let gen = call
            .backend
            .generate(call.req.clone(), call.prepared.clone());
        let rx = match out.wait(session, &rid, heartbeat, gen).await? {
            None => {
                outcome("client_gone");
                return Err(Error::new_down(ErrorType::ConnectionClosed));
            }
            Some(Err(e)) => {
                outcome("error");
                if out.sent_head {
                    out.end_with_error(session, &openai::error_json(&e)).await?;
                    return Ok(true);
                }
                return self.send_err(session, ctx, &e).await;
            }
            Some(Ok(rx)) => rx,
        };
        let ident = Ident::new(call.parsed.endpoint, &call.parsed.model, &rid);
        let pace = if call.parsed.stream {
            ctx.cfg
                .pacing
                .get(call.lane)
                .copied()
                .unwrap_or(crate::inference::pacer::PaceSpec::OFF)
        } else {
            crate::inference::pacer::PaceSpec::OFF
        };
        let run = Run {
            rx,
            pacer: Pacer::new(pace),
            ident,
            dispatched,
            first_token: None,
            last_token_write: None,
            text: String::new(),
            first_chunk: true,
        };
        let labels = [lane_name.as_str(), backend_kind];
        let result = self
            .pump(
                session, ctx, &mut out, run, &rid, heartbeat, &call, gate_wait, &labels,
            )
            .await;
        match &result {
            Ok(Some(t)) => {
                outcome("ok");
                im.e2e
                    .with_label_values(&labels)
                    .observe(t.total.as_secs_f64());
                im.queue
                    .with_label_values(&labels)
                    .observe(t.queue.as_secs_f64());
                for (phase, d) in [
                    ("network", t.network),
                    ("queue", t.queue),
                    ("compute", t.compute),
                    ("output", t.output()),
                ] {
                    im.phase
                        .with_label_values(&[phase, &lane_name])
                        .observe(d.as_secs_f64());
                }
            }
            Ok(None) => outcome("error"),
            Err(_) => outcome("client_gone"),
        }
        result.map(|_| true)
    }

    /// Move events from the backend to the client. Ok(Some(timing)) on a
    /// finished generation, Ok(None) when it ended with an error event.
    #[allow(clippy::too_many_arguments)]
    async fn pump(
        &self,
        session: &mut Session,
        ctx: &Ctx,
        out: &mut Out,
        mut run: Run,
        rid: &str,
        heartbeat: Duration,
        call: &Call,
        gate_wait: Duration,
        labels: &[&str; 2],
    ) -> Result<Option<Timing>> {
        let im = &self.metrics.inference;
        let stream = call.parsed.stream;
        if stream {
            out.head(session, rid).await?;
        }
        let mut end: Option<Event> = None;
        let mut backend_done_at = None;
        loop {
            // Release what the pacer lets go.
            let now = Instant::now();
            while let Some(text) = run.pacer.pop_due(now) {
                self.emit(session, out, &mut run, &text, labels).await?;
            }
            if end.is_some() {
                let rest: Vec<String> = run.pacer.drain().collect();
                for text in rest {
                    self.emit(session, out, &mut run, &text, labels).await?;
                }
                break;
            }
            let deadline = run.pacer.deadline(now).map(tokio::time::Instant::from_std);
            let hb_at = tokio::time::Instant::from_std(out.last_write + heartbeat);
            let watch = out.watch_gone;
            let w = tokio::select! {
                ev = run.rx.recv() => Wake::Ready(ev),
                _ = tokio::time::sleep_until(deadline.unwrap_or(hb_at)), if deadline.is_some() => Wake::Pace,
                _ = tokio::time::sleep_until(hb_at), if stream && deadline.is_none() => Wake::Heartbeat,
                r = session.read_body_or_idle(true), if watch => match r {
                    Err(_) => Wake::Gone,
                    Ok(_) => Wake::Pace,
                },
            };
            match w {
                Wake::Ready(Some(Event::Token { text, .. })) => {
                    run.first_token.get_or_insert_with(Instant::now);
                    if !text.is_empty() {
                        run.pacer.push(text, Instant::now());
                    }
                }
                Wake::Ready(Some(ev @ Event::Done { .. })) => {
                    if let Event::Done { text, .. } = &ev {
                        if !text.is_empty() {
                            run.pacer.push(text.clone(), Instant::now());
                        }
                    }
                    backend_done_at = Some(Instant::now());
                    end = Some(ev);
                }
                Wake::Ready(Some(ev @ Event::Error(_))) => {
                    backend_done_at = Some(Instant::now());
                    end = Some(ev);
                }
                Wake::Ready(None) => {
                    backend_done_at = Some(Instant::now());
                    end = Some(Event::Error("the backend stopped".into()));
                }
                Wake::Heartbeat => out.write(session, sse::comment("waiting")).await?,
                Wake::Pace => {
                    if !watch {
                        continue;
                    }
                    out.watch_gone = false;
                }
                Wake::Gone => return Err(Error::new_down(ErrorType::ConnectionClosed)),
            }
        }
        let done_at = backend_done_at.unwrap_or_else(Instant::now);
        match end {
            Some(Event::Done {
                finish,
                usage,
                queue,
                compute,
                ..
            }) => {
                let backend_queue = queue;
                let compute = if compute.is_zero() {
                    done_at.saturating_duration_since(run.dispatched)
                } else {
                    compute
                };
                let usage = call.usage(usage);
                im.tokens
                    .with_label_values(&[&call.model.name, "prompt"])
                    .inc_by(usage.prompt_tokens as u64);
                im.tokens
                    .with_label_values(&[&call.model.name, "completion"])
                    .inc_by(usage.completion_tokens as u64);
                let mut t = Timing {
                    network: call.network,
                    queue: gate_wait + backend_queue,
                    ttft: run
                        .first_token
                        .map(|f| f.saturating_duration_since(run.dispatched)),
                    compute,
                    total: Duration::ZERO,
                };
                if stream {
                    t.total = ctx.started.elapsed();
                    let mut last = run.ident.chunk("", false, Some(finish));
                    last["ultrafast_timing"] = t.json();
                    out.write(session, sse::data(&last.to_string())).await?;
                    if call.parsed.include_usage {
                        let u = run.ident.usage_chunk(&usage);
                        out.write(session, sse::data(&u.to_string())).await?;
                    }
                    t.total = ctx.started.elapsed();
                    out.write(
                        session,
                        sse::comment(&format!("server-timing {}", t.header())),
                    )
                    .await?;
                    session
                        .write_response_body(Some(Bytes::from_static(sse::DONE)), true)
                        .await?;
                } else {
                    let body = run.ident.full(&run.text, finish, &usage).to_string();
                    t.total = ctx.started.elapsed();
                    let st = t.header();
                    let rid = ctx.request_id.clone();
                    filters::respond(
                        session,
                        200,
                        "application/json",
                        Bytes::from(body),
                        &[
                            ("x-request-id", rid.to_str().unwrap_or("")),
                            ("server-timing", &st),
                        ],
                    )
                    .await?;
                }
                Ok(Some(t))
            }
            Some(other) => {
                let msg = match other {
                    Event::Error(m) => m,
                    _ => "the backend ended the stream unexpectedly".into(),
                };
                let e = BackendError::request(502, "backend_error", msg);
                if stream {
                    out.end_with_error(session, &openai::error_json(&e)).await?;
                } else {
                    self.send_err(session, ctx, &e).await?;
                }
                Ok(None)
            }
            None => Ok(None),
        }
    }

    /// Write one piece of text (stream) or keep it (whole response).
    async fn emit(
        &self,
        session: &mut Session,
        out: &mut Out,
        run: &mut Run,
        text: &str,
        labels: &[&str; 2],
    ) -> Result<()> {
        if !out.stream {
            run.text.push_str(text);
            return Ok(());
        }
        let chunk = run.ident.chunk(text, run.first_chunk, None);
        run.first_chunk = false;
        out.write(session, sse::data(&chunk.to_string())).await?;
        let now = out.last_write;
        let im = &self.metrics.inference;
        match run.last_token_write {
            None => im
                .ttft
                .with_label_values(labels)
                .observe(now.saturating_duration_since(run.dispatched).as_secs_f64()),
            Some(prev) => im
                .itl
                .with_label_values(labels)
                .observe(now.saturating_duration_since(prev).as_secs_f64()),
        }
        run.last_token_write = Some(now);
        Ok(())
    }

    async fn start_job(&self, session: &mut Session, ctx: &mut Ctx, call: Call) -> Result<bool> {
        let rid = ctx.request_id.to_str().unwrap_or("").to_string();
        let id = format!("req_{rid}");
        let job = match self.front.jobs.create(id.clone()) {
            Ok(j) => j,
            Err(jobs::Full) => {
                let e = BackendError::unavailable(
                    "the async request store is full; retry later".into(),
                );
                return self
                    .send_json(
                        session,
                        ctx,
                        503,
                        openai::error_json(&e),
                        &[("retry-after", "1")],
                    )
                    .await;
            }
        };
        let (n, b) = self.front.jobs.usage();
        self.metrics
            .inference
            .async_store
            .with_label_values(&["entries"])
            .set(n as i64);
        self.metrics
            .inference
            .async_store
            .with_label_values(&["bytes"])
            .set(b as i64);
        let ident = Ident::new(call.parsed.endpoint, &call.parsed.model, &rid);
        tokio::spawn(run_job(job.clone(), call, ident));
        let loc = format!("/v1/requests/{id}/events");
        let body =
            json!({"id": id, "object": "request", "status": "queued", "created": job.created});
        self.send_json(
            session,
            ctx,
            202,
            Bytes::from(body.to_string()),
            &[("location", &loc)],
        )
        .await
    }

    async fn job_events(&self, session: &mut Session, ctx: &Ctx, id: &str) -> Result<bool> {
        let Some(job) = self.front.jobs.get(id) else {
            return self.send_err(session, ctx, &no_job(id)).await;
        };
        let mut from = match header_str(session, "last-event-id") {
            None => 0,
            Some(v) => match v.trim().parse::<usize>() {
                Ok(n) => n + 1,
                Err(_) => {
                    let e = BackendError::invalid(
                        "invalid_last_event_id",
                        None,
                        format!("Last-Event-ID `{v}` is not an event id of this stream"),
                    );
                    return self.send_err(session, ctx, &e).await;
                }
            },
        };
        let rid = ctx.request_id.to_str().unwrap_or("").to_string();
        let heartbeat = Duration::from_millis(ctx.cfg.file.inference.heartbeat_ms.max(1));
        let mut out = Out {
            stream: true,
            sent_head: false,
            watch_gone: true,
            last_write: Instant::now(),
        };
        out.head(session, &rid).await?;
        let mut changes = job.subscribe();
        loop {
            let (evs, finished) = job.events_from(from);
            for (i, payload) in evs {
                out.write(session, sse::data_with_id(i, &payload)).await?;
                from = i + 1;
            }
            if finished {
                // Events pushed between the snapshot and the finish.
                let (rest, _) = job.events_from(from);
                for (i, payload) in rest {
                    out.write(session, sse::data_with_id(i, &payload)).await?;
                }
                session
                    .write_response_body(Some(Bytes::from_static(sse::DONE)), true)
                    .await?;
                return Ok(true);
            }
            match out
                .wait(session, &rid, heartbeat, changes.changed())
                .await?
            {
                None => return Err(Error::new_down(ErrorType::ConnectionClosed)),
                Some(Ok(())) => {}
                Some(Err(_)) => {
                    session
                        .write_response_body(Some(Bytes::from_static(sse::DONE)), true)
                        .await?;
                    return Ok(true);
                }
            }
        }
    }

    /// Rate limits of the route. Ok(true): refused and answered.
    pub(super) async fn rate_limited(
        &self,
        session: &mut Session,
        ctx: &Ctx,
        route: &Arc<Route>,
        pool: Option<&str>,
    ) -> Result<bool> {
        if route.limiters.is_empty() {
            return Ok(false);
        }
        let input = KeyInput {
            client_ip: session
                .client_addr()
                .and_then(|a| a.as_inet())
                .map(|a| a.ip()),
            headers: &session.req_header().headers,
            route: &route.name,
            pool,
        };
        for l in &route.limiters {
            match l.check(&input) {
                Verdict::Allow => {}
                Verdict::Limited(wait) => {
                    return self.shed(session, ctx, Reason::RateLimit, wait).await
                }
                Verdict::BadKey(why) => {
                    return self.bad_request(session, ctx, why, "invalid_api_key").await
                }
            }
        }
        Ok(false)
    }
}

/// A prepared completion.
struct Call {
    backend: Arc<dyn Backend>,
    model: Arc<Model>,
    req: InferenceRequest,
    prepared: Prepared,
    parsed: Parsed,
    lane: usize,
    network: Duration,
}

impl Call {
    /// The backend's counts, with the prompt size we measured when the
    /// backend did not report one (an upstream without usage).
    fn usage(&self, u: Usage) -> Usage {
        Usage {
            prompt_tokens: if u.prompt_tokens == 0 {
                self.prepared.prompt_tokens
            } else {
                u.prompt_tokens
            },
            ..u
        }
    }
}

/// The generation side of one completion.
struct Run {
    rx: EventStream,
    pacer: Pacer<String>,
    ident: Ident,
    dispatched: Instant,
    first_token: Option<Instant>,
    last_token_write: Option<Instant>,
    text: String,
    first_chunk: bool,
}

fn model_json(id: &str) -> Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "ultrafast"})
}

fn no_job(id: &str) -> BackendError {
    BackendError::request(
        404,
        "request_not_found",
        format!("No async request `{id}` (unknown, or its results expired)."),
    )
}

/// Run an async job to its end: admission, generation, events into the
/// store. A `DELETE` cancels it at any point.
async fn run_job(job: Arc<Job>, call: Call, ident: Ident) {
    let mut cancelled = job.cancelled();
    let work = async {
        let _permit = match &call.model.gate {
            None => None,
            Some(gate) => {
                let work = (call.prepared.prompt_tokens + call.prepared.max_tokens) as u64;
                match gate
                    .acquire(call.lane, Some(work), std::future::pending())
                    .await
                {
                    Ok((p, _)) => Some(p),
                    Err(Denied::Shed(reason, retry_after)) => {
                        let (_, _, body) = admission::refusal(reason, retry_after);
                        let err: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                        job.push(err.to_string());
                        job.finish(jobs::Status::Failed, None, Some(err["error"].clone()));
                        return;
                    }
                    Err(Denied::Gone) => return,
                }
            }
        };
        job.start();
        let mut rx = match call
            .backend
            .generate(call.req.clone(), call.prepared.clone())
            .await
        {
            Ok(rx) => rx,
            Err(e) => {
                let err: Value =
                    serde_json::from_slice(&openai::error_json(&e)).unwrap_or(Value::Null);
                job.push(err.to_string());
                job.finish(jobs::Status::Failed, None, Some(err["error"].clone()));
                return;
            }
        };
        let mut text = String::new();
        let mut first = true;
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Token { text: t, .. } => {
                    if t.is_empty() {
                        continue;
                    }
                    text.push_str(&t);
                    if !job.push(ident.chunk(&t, first, None).to_string()) {
                        return;
                    }
                    first = false;
                }
                Event::Done {
                    text: t,
                    finish,
                    usage,
                    ..
                } => {
                    if !t.is_empty() {
                        text.push_str(&t);
                        job.push(ident.chunk(&t, first, None).to_string());
                    }
                    let usage = call.usage(usage);
                    job.push(ident.chunk("", false, Some(finish)).to_string());
                    job.push(ident.usage_chunk(&usage).to_string());
                    job.finish(
                        jobs::Status::Completed,
                        Some(ident.full(&text, finish, &usage)),
                        None,
                    );
                    return;
                }
                Event::Error(msg) => {
                    let err =
                        json!({"message": msg, "type": "server_error", "code": "backend_error"});
                    job.push(json!({"error": err}).to_string());
                    job.finish(jobs::Status::Failed, None, Some(err));
                    return;
                }
            }
        }
    };
    tokio::select! {
        _ = work => {}
        _ = cancelled.wait_for(|c| *c) => {}
    }
}
