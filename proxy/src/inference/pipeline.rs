//! The inference pipeline of one completion, as stages that know nothing of
//! Pingora: parse and validate into a typed request; admit (the lane, the
//! model and the key's right to it, the backend's sizing of the prompt, the
//! token budgets, the SLO check, then the lane gate's bounded wait);
//! dispatch to the backend; and `drive` its events through the pacer into a
//! sink. The caller (the Pingora adapter in `proxy::infer`, or a test) has
//! already run the limits that need no body (`Front::limits`), read the
//! body, and hands in a `Downstream` to write to.

use super::context::{Api, Call, Incoming};
use super::delivery::{Downstream, Failure, Gone, Sink};
use super::dialect::{anthropic, responses, Dialect, DialectSink, To, Writer};
use super::metrics::InferenceMetrics;
use super::openai::{self, Endpoint, Ident, Parsed};
use super::sinks::{backend_failure, Headers, JobSink, JsonSink, SseSink};
use super::slo::{self};
use super::{Front, Model};
use crate::admission::PRIORITY_HEADER;
use serde_json::json;
use ultrafast_engine::api::Prompt;

/// Output a request without `max_tokens` is taken to want while its place
/// is claimed before tokenizing (the backend sizes it for real after).
const CLAIM_MAX_TOKENS: usize = 256;
use std::sync::Arc;
use ultrafast_engine::api::{BackendError, InferenceRequest, RawSse};

pub(super) fn error(e: &BackendError) -> Failure {
    backend_failure(e)
}

/// The 404 of an unknown model (or one the caller may not see).
pub(super) fn not_found_model(model: &str) -> BackendError {
    BackendError {
        status: 404,
        kind: "invalid_request_error",
        code: "model_not_found",
        param: Some("model"),
        message: format!("The model `{model}` does not exist or you do not have access to it."),
    }
}

impl Front {
    /// Serve one completion end to end.
    pub async fn completion(
        &self,
        metrics: &Arc<InferenceMetrics>,
        inc: &Incoming,
        api: Api,
        body: &[u8],
        down: &mut dyn Downstream,
    ) -> Result<(), Gone> {
        // The request id, HSTS and route rules are the response policy's,
        // applied by the downstream: only this pipeline's own headers here.
        let base: Headers = Vec::new();
        let ep = match api {
            Api::OpenAi(ep) => ep,
            Api::Messages | Api::Responses => Endpoint::Chat,
        };
        let call = match self.prepare(metrics, inc, api, body).await {
            Ok(c) => c,
            Err(f) => {
                if let Some(t) = &inc.trace {
                    t.end_http(f.status, Vec::new());
                }
                let mut sink = JsonSink::new(down, Ident::new(ep, "", ""), base);
                return sink.fail(&f).await;
            }
        };
        let lane_name = inc.cfg.lanes()[call.lane].name.clone();
        let mut headers = base;
        headers.push(("x-ultrafast-lane", lane_name));
        if let Some(p) = call.passed.predicted {
            headers.push(("x-ultrafast-predicted-ttft-ms", p.as_millis().to_string()));
        }
        if let Some(f) = &call.fallback {
            headers.push(("x-ultrafast-fallback", f.clone()));
        }
        // Boxed: the async and dialect paths' states would otherwise size
        // (and be copied with) every completion's future.
        if inc.prefers_async() || call.parsed.background {
            let s = &call.req.sampling;
            let several = call.req.n > 1;
            if let Some(field) = [
                (s.logprobs.is_some(), "logprobs"),
                (s.echo, "echo"),
                (several, "n"),
            ]
            .iter()
            .find_map(|(on, f)| on.then_some(*f))
            {
                // The job store keeps one choice's text; a report or a
                // choice it dropped would be a field silently ignored.
                let e = BackendError::invalid(
                    "invalid_request_error",
                    Some(field),
                    format!("'{field}' is not available for async requests; ask synchronously."),
                );
                let mut sink = JsonSink::new(down, Ident::new(ep, "", ""), headers);
                return sink.fail(&error(&e)).await;
            }
            return Box::pin(self.start_job(metrics, inc, call, headers, down)).await;
        }
        if call.parsed.dialect != Dialect::OpenAi {
            return Box::pin(self.dialect(metrics, inc, call, headers, down)).await;
        }
        let ident = Ident::new(ep, &call.parsed.model, &inc.request_id);
        let tools = call.parsed.tools();
        if call.parsed.stream {
            let usage = call.parsed.include_usage;
            let mut call = call;
            if passes_through(inc, &call) {
                call.req.raw_sse = Some(RawSse { usage });
            }
            let scored = call.req.sampling.logprobs.is_some();
            let mut sink = SseSink::new(down, ident, headers, usage)
                .with_tools(tools)
                .with_choices(call.req.n, scored);
            super::run::run(metrics, inc, call, &mut sink).await
        } else {
            let scored = call.req.sampling.logprobs.is_some();
            let mut sink = JsonSink::new(down, ident, headers)
                .with_tools(tools)
                .with_choices(call.req.n, scored);
            super::run::run(metrics, inc, call, &mut sink).await
        }
    }

    /// A completion in the Messages or Responses dialect, streamed or
    /// whole; a stored response is kept in the async store as well.
    async fn dialect(
        &self,
        metrics: &Arc<InferenceMetrics>,
        inc: &Incoming,
        call: Call,
        headers: Headers,
        down: &mut dyn Downstream,
    ) -> Result<(), Gone> {
        let (stream, tools) = (call.parsed.stream, call.parsed.tools());
        let (w, stored): (Box<dyn Writer>, _) = match &call.parsed.dialect {
            Dialect::Responses(o) => {
                // A stored response is an entry of the async store under a
                // random id; a full store only means it is not kept.
                let job = o
                    .store
                    .then(|| {
                        self.jobs
                            .create_for(super::jobs::random_id(), inc.tenant())
                            .ok()
                    })
                    .flatten();
                let id = job
                    .as_ref()
                    .map_or_else(super::jobs::random_id, |j| j.id.clone());
                if let Some(j) = &job {
                    self.export_store(metrics);
                    mirror_created(self, j).await;
                }
                (
                    Box::new(responses::ResponsesWriter::new(
                        responses::response_id(&id),
                        &call.parsed,
                    )),
                    job,
                )
            }
            _ => (
                Box::new(anthropic::MessagesWriter::new(
                    &inc.request_id,
                    &call.parsed,
                    call.prepared.prompt_tokens,
                )),
                None,
            ),
        };
        let to = if stream {
            To::Sse(down)
        } else {
            To::Whole(down)
        };
        let kept = stored.clone();
        let mut sink = DialectSink::new(to, w, headers, tools).storing(stored);
        let r = super::run::run(metrics, inc, call, &mut sink).await;
        // A client that left mid-way leaves no running entry behind (the
        // store evicts only finished ones).
        if let Some(j) = kept.filter(|j| !j.status().finished()) {
            j.cancel();
        }
        r
    }

    /// The conversation of `previous_response_id` before this request's
    /// input: the tenant's own stored response, while the store keeps it.
    async fn previous(&self, inc: &Incoming, parsed: &mut Parsed) -> Result<(), BackendError> {
        let Dialect::Responses(o) = &parsed.dialect else {
            return Ok(());
        };
        let Some(prev) = o.previous.clone() else {
            return Ok(());
        };
        let gone = || {
            BackendError::invalid(
                "previous_response_not_found",
                Some("previous_response_id"),
                format!("Previous response with id '{}' not found: it was not stored, has expired from the response store, or belongs to another key.", prev.chars().take(64).collect::<String>()),
            )
        };
        let view = match self.job(inc, &responses::job_id(&prev)).await {
            Ok(super::endpoints::Found::Here(j)) => j.view(),
            Ok(super::endpoints::Found::Elsewhere(_, r)) => r.view,
            Err(_) => return Err(gone()),
        };
        if view["status"] != "completed" {
            return Err(BackendError::invalid(
                "previous_response_not_completed",
                Some("previous_response_id"),
                format!(
                    "Previous response '{prev}' is {}, not completed.",
                    view["status"].as_str().unwrap_or("unknown")
                ),
            ));
        }
        let before = view
            .get("result")
            .and_then(responses::conversation)
            .ok_or_else(gone)?;
        if let Prompt::Chat(m) = &mut parsed.prompt {
            // New instructions first, then the earlier turns, then the input.
            let split = m.iter().take_while(|x| x.role == "system").count();
            let tail = m.split_off(split);
            m.extend(before);
            m.extend(tail);
        }
        Ok(())
    }

    /// Parse, choose the lane, find the model, size the request, reserve
    /// its tokens and check it against the lane's target.
    async fn prepare(
        &self,
        metrics: &InferenceMetrics,
        inc: &Incoming,
        api: Api,
        body: &[u8],
    ) -> Result<Call, Failure> {
        let reject = |e: BackendError| {
            metrics.rejected.with_label_values(&[e.code]).inc();
            error(&e)
        };
        let mut parsed = match api {
            Api::OpenAi(ep) => openai::parse(ep, body),
            Api::Messages => anthropic::parse(body),
            Api::Responses => responses::parse(body),
        }
        .map_err(reject)?;
        if matches!(parsed.dialect, Dialect::Responses(_)) {
            Box::pin(self.previous(inc, &mut parsed))
                .await
                .map_err(reject)?;
        }
        let header = inc.headers.get(PRIORITY_HEADER).map(|v| v.as_bytes());
        let lanes = inc.cfg.lanes();
        let lane =
            slo::lane(lanes, header, parsed.priority.as_deref(), inc.route.lane).map_err(reject)?;
        let granted = self.granted_lanes(inc);
        let lane = self
            .granted_lane(inc, lane, granted.as_deref())
            .map_err(reject)?;
        let Some(model) = inc.cfg.models().get(&parsed.model).cloned() else {
            return Err(reject(not_found_model(&parsed.model)));
        };
        self.allowed(inc, &model.name).map_err(reject)?;
        let (model, fallback) = self.fallback(metrics, inc, model, &lanes[lane].name);
        let Some(backend) = self.engines.backend(&model) else {
            return Err(reject(BackendError::unavailable(format!(
                "model `{}` has no running engine",
                model.name
            ))));
        };
        let tenant = super::tenant::tenant_of(inc, parsed.user.as_deref());
        // The request's own targets, within what its key allows.
        let floors = inc.key.as_ref().map_or((None, None), |k| {
            (k.limits.min_ttft_ms, k.limits.min_tpot_ms)
        });
        let asked = super::targets::asked(|n| inc.headers.get(n).map(|v| v.as_bytes()), floors)
            .map_err(reject)?;
        // A pool placed by predicted latency admits on its members' own
        // models (`fleet`), not the model's.
        let fleet = match &model.backend {
            super::ModelBackend::Upstream(u) => u
                .fleet_now()
                .filter(|(f, _, _)| f.spec().policy == super::fleet::Policy::PredictedLatency)
                .map(|f| (u.stale_ms(), f)),
            super::ModelBackend::Engine(_) => None,
        };
        // The model's defaults for what the request left out.
        let mut sampling = parsed.sampling.clone();
        parsed.given.apply(&mut sampling, &model.def.sampling);
        let req = InferenceRequest {
            tenant: Some(tenant.clone()),
            model: parsed.model.clone(),
            prompt: parsed.prompt.clone(),
            max_tokens: parsed.max_tokens,
            n: parsed.n,
            sampling,
            stop: parsed.stop.clone(),
            lane: lanes[lane].name.clone(),
            lane_rank: lanes[lane].rank,
            request_id: inc.request_id.clone(),
            user: parsed.user.clone(),
            structure: parsed.structure.clone(),
            passthrough: parsed.passthrough.clone(),
            raw_sse: None,
            // Tracing off: the caller's own, passed on as a proxy would.
            traceparent: inc
                .header("traceparent")
                .filter(|v| crate::otel::parse_traceparent(v).is_some())
                .map(str::to_string),
        };
        // A backend too busy for even a one-token prompt refuses before
        // the prompt is tokenized: a flood is shed at the cost of parsing.
        // A prompt whose bytes alone prove it too long for the context is
        // refused before it claims anything or is tokenized.
        let bound = backend.prompt_bound();
        slo::prove_too_long(&req.prompt, bound).map_err(reject)?;
        let live = backend.step_cost().map(super::live_cost);
        let estimate = slo::estimate_tokens(&req.prompt, bound);
        // Every choice's output is work to admit and budget.
        let max_out = req.max_tokens.unwrap_or(CLAIM_MAX_TOKENS) * req.n;
        let claim = match fleet {
            Some(_) => None,
            None => slo::precheck(
                lanes,
                lane,
                &model.latency,
                live,
                estimate,
                max_out,
                &tenant,
                asked,
            )
            .map_err(|m| {
                metrics.admission.shed(&lanes[m.lane()].name, "slo");
                m.failure(lanes)
            })?,
        };
        // The engine tokenizes and renders the template here: off the
        // request runtime, so a long prompt never stalls other requests,
        // and bounded in bytes and threads (see `tokenize`).
        let prepared = if backend.kind() == "engine" {
            let cap = inc.cfg.file().inference.tokenize_max_bytes;
            let bytes = slo::prompt_bytes(&req.prompt);
            self.tokenizing
                .prepare(backend.clone(), req.clone(), bytes, cap)
                .await
        } else {
            backend.prepare(&req)
        };
        let mut prepared = prepared.map_err(|e| {
            if e.code != "tokenizer_overloaded" {
                return reject(e);
            }
            metrics.admission.shed(&lanes[lane].name, "tokenizer");
            let mut f = error(&e);
            f.headers.push(("retry-after", "1".into()));
            f.headers.push(("x-ultrafast-shed", "tokenizer".into()));
            f
        })?;
        let tokens = (prepared.prompt_tokens + prepared.max_tokens * req.n) as u64;
        let budget = self
            .reserve(metrics, inc, &lanes[lane].name, tokens)
            .await?;
        let passed = match &fleet {
            Some((stale, (fleet, members, aligned))) => {
                let now = crate::upstream::now_ms();
                let report = |i: usize| super::fleet::report(&members.members[i], now, *stale);
                let blocks = super::fleet::prompt_blocks(&req.prompt, fleet.spec().block_tokens);
                let r = super::fleet::admit::Request {
                    prompt: prepared.prompt_tokens,
                    max_out: prepared.max_tokens * req.n,
                    spent: inc.arrived.elapsed(),
                    granted: granted.as_deref(),
                    tenant: &tenant,
                    asked,
                    blocks: &blocks,
                };
                super::fleet::admit::admit(lanes, lane, fleet, aligned, &report, r)
            }
            None => slo::slo(
                lanes,
                lane,
                &model.latency,
                live,
                prepared.prompt_tokens,
                prepared.max_tokens * req.n,
                claim,
                inc.arrived.elapsed(),
                granted.as_deref(),
                &tenant,
                asked,
            ),
        }
        .map_err(|m| {
            let reason = match m {
                slo::Missed::Busy { .. } => "slo",
                slo::Missed::Unattainable { .. } => "slo_unattainable",
            };
            metrics.admission.shed(&lanes[m.lane()].name, reason);
            m.failure(lanes)
        })?;
        let lane = passed.lane;
        prepared.member = passed.member;
        let watch = model
            .def
            .watchdog
            .is_some()
            .then(|| self.watchdog.lane(&model.name, &lanes[lane].name));
        let mut req = req;
        req.lane = lanes[lane].name.clone();
        req.lane_rank = lanes[lane].rank;
        Ok(Call {
            backend,
            model,
            req,
            prepared,
            parsed,
            lane,
            passed,
            budget,
            watch,
            fallback,
        })
    }

    /// The model that serves `model`'s `lane` now: its fallback while the
    /// watchdog holds the lane `violated`, else itself.
    fn fallback(
        &self,
        metrics: &InferenceMetrics,
        inc: &Incoming,
        model: Arc<Model>,
        lane: &str,
    ) -> (Arc<Model>, Option<String>) {
        let name = &model.def.fallback;
        if name.is_empty()
            || self.watchdog.state(&model.name, lane) != super::watchdog::State::Violated
        {
            return (model, None);
        }
        let Some(other) = inc.cfg.models().get(name) else {
            return (model, None);
        };
        // A key limited to some models is never served another one, not
        // even as a fallback: it keeps its own model, late or not.
        if inc.key.as_ref().is_some_and(|k| !k.allows_model(name)) {
            return (model, None);
        }
        metrics
            .fallback_requests
            .with_label_values(&[&model.name, lane, name])
            .inc();
        (other.clone(), Some(name.clone()))
    }

    /// Answer 202 now and run the completion into the job store.
    async fn start_job(
        &self,
        metrics: &Arc<InferenceMetrics>,
        inc: &Incoming,
        call: Call,
        headers: Headers,
        down: &mut dyn Downstream,
    ) -> Result<(), Gone> {
        let id = super::jobs::random_id();
        let job = match self.jobs.create_for(id.clone(), inc.tenant()) {
            Ok(j) => j,
            Err(super::jobs::Full) => {
                let e = BackendError::unavailable(
                    "the async request store is full; retry later".into(),
                );
                let mut f = error(&e);
                f.headers.push(("retry-after", "1".into()));
                let mut sink =
                    JsonSink::new(down, Ident::new(call.parsed.endpoint, "", ""), headers);
                return sink.fail(&f).await;
            }
        };
        self.export_store(metrics);
        mirror_created(self, &job).await;
        let ident = Ident::new(call.parsed.endpoint, &call.parsed.model, &id);
        let (inc2, metrics2) = (inc.clone(), metrics.clone());
        let work = crate::drain::Work::start(crate::drain::Kind::AsyncJob);
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mut body =
            json!({"id": id, "object": "request", "status": "queued", "created": created});
        let writer: Option<Box<dyn Writer>> = match &call.parsed.dialect {
            Dialect::OpenAi => None,
            Dialect::Anthropic => Some(Box::new(anthropic::MessagesWriter::new(
                &id,
                &call.parsed,
                call.prepared.prompt_tokens,
            ))),
            Dialect::Responses(_) => {
                // The Responses API's own background answer: the response,
                // queued, under its response id.
                let rid = responses::response_id(&id);
                body = responses::view(
                    &json!({"id": id, "created": created, "status": "queued"}),
                    &call.parsed.model,
                );
                body["background"] = json!(true);
                Some(Box::new(responses::ResponsesWriter::new(rid, &call.parsed)))
            }
        };
        tokio::spawn(async move {
            let _work = work;
            let tools = call.parsed.tools();
            match writer {
                None => {
                    let mut sink = JobSink::new(job, ident).with_tools(tools);
                    let _ = super::run::run(&metrics2, &inc2, call, &mut sink).await;
                }
                Some(w) => {
                    let cancelled = job.cancelled();
                    let mut sink = DialectSink::new(To::Job(job, cancelled), w, Vec::new(), tools);
                    let _ = super::run::run(&metrics2, &inc2, call, &mut sink).await;
                }
            }
        });
        let loc = format!("/v1/requests/{id}/events");
        let body = body.to_string();
        let len = body.len().to_string();
        let mut h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        h.extend([
            ("content-type", "application/json"),
            ("content-length", len.as_str()),
            ("location", loc.as_str()),
        ]);
        down.head(202, &h).await?;
        down.body(bytes::Bytes::from(body), true).await
    }
}

/// Whether an OpenAI stream takes its upstream server's events as they are
/// (the SSE pass-through): nothing to rewrite (the pool serves the model
/// under the name the client asked for, there are no tool calls to read:
/// each dialect's calls come from one reader, and a usage chunk asked for
/// comes from the server) and nothing to pace on its lane.
fn passes_through(inc: &Incoming, call: &Call) -> bool {
    let super::ModelBackend::Upstream(up) = &call.model.backend else {
        return false;
    };
    let pace = inc.cfg.pacing().get(call.lane).copied();
    // A server that takes no `stream_options` sends no usage chunk: a
    // client that asked for one gets the edge's, from the parsing path.
    let usage =
        !call.parsed.include_usage || up.spec().pool.settings.server_kind.caps().stream_options;
    usage
        && up.spec().upstream_model == call.parsed.model
        && !call.parsed.tools()
        && pace.is_none_or(|p| p.mode == super::pacer::PaceMode::Off)
}

/// With `[cluster]`, write a new job's creation to the shared store (so any
/// instance finds it); one the store did not take stays this instance's.
async fn mirror_created(front: &Front, job: &Arc<super::jobs::Job>) {
    if let Some(c) = crate::cluster::get() {
        let ttl = front.jobs.ttl();
        let taken = c
            .job_created(&job.id, job.owner.as_deref(), job.created, ttl)
            .await;
        job.set_mirrored(taken);
    }
}
