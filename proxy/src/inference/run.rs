//! Gate, dispatch and drive: the stages of a completion after its SLO
//! check, the same for every sink. The lane gate's bounded wait (with
//! heartbeats, and a refusal if it times out), the backend's `generate`,
//! the drive loop, and the accounting at the end: metrics, the ledger's
//! ticket, and the token budget settled to the real usage.

use super::context::{Call, Incoming};
use super::delivery::{Failure, Finished, Gone, Sink, Timing};
use super::drive::{self, Delivery, OnText};
use super::metrics::InferenceMetrics;
use super::pacer::PaceSpec;
use super::pipeline::error;
use crate::admission::gate::{Denied, Permit};
use crate::admission::queue::Who;
use crate::admission::refusal;
use std::time::Instant;
use ultrafast_engine::api::{Prepared, Usage};
use ultrafast_engine::fair::Tenant;

/// How a stage ended the request early (the sink has been told).
enum Stop {
    /// The consumer left.
    Gone,
    /// Refused or failed; the response is sent.
    Answered(Result<(), Gone>),
}

/// Gate, dispatch and drive one admitted completion into `sink`, and
/// account for it.
pub(super) async fn run<S: Sink + ?Sized>(
    metrics: &InferenceMetrics,
    inc: &Incoming,
    call: Call,
    sink: &mut S,
) -> Result<(), Gone> {
    let lane = inc.cfg.lanes()[call.lane].name.as_str();
    let outcome = |o: &str| {
        metrics
            .requests
            .with_label_values(&[&call.model.name, lane, o])
            .inc();
        if o != "ok" {
            if let Some(t) = &inc.trace {
                t.fail(o);
            }
        }
    };
    let mut timing = Timing::new(inc.arrived, inc.network);
    timing.predicted = call.passed.predicted;
    let queued_at = Instant::now();
    let permit = gate(metrics, inc, &call, sink).await;
    let permit = match permit {
        Ok(p) => p,
        Err(Stop::Gone) => {
            outcome("client_gone");
            return Err(Gone);
        }
        Err(Stop::Answered(r)) => {
            outcome("shed");
            return r;
        }
    };
    let admitted_at = Instant::now();
    timing.queue = admitted_at - queued_at;
    sink.admitted();
    let backend_span = inc
        .trace
        .as_ref()
        .and_then(|t| t.backend(super::trace::backend_attrs(&call)));
    let mut req = call.req.clone();
    if let Some(b) = &backend_span {
        // The upstream's spans become children of the backend span.
        req.traceparent = Some(b.traceparent());
    }
    let dispatched = Instant::now();
    let gen = call.backend.generate(req, call.prepared.clone());
    let events = match drive::wait(sink, inc.heartbeat(), gen).await {
        Err(Gone) => {
            outcome("client_gone");
            return Err(Gone);
        }
        Ok(Err(e)) => {
            outcome("error");
            return sink.fail(&error(&e)).await;
        }
        Ok(Ok(rx)) => rx,
    };
    let traced = inc
        .trace
        .as_ref()
        .map(|_| super::trace::request_attrs(&call, lane));
    let ticket = call.passed.ticket;
    if let Some(t) = &ticket {
        t.dispatched();
    }
    let pace = inc
        .cfg
        .pacing()
        .get(call.lane)
        .copied()
        .unwrap_or(PaceSpec::OFF);
    let labels = [call.model.name.as_str(), lane, call.backend.kind()];
    let mut delivery = Delivery {
        choices: call.req.n,
        ..Delivery::default()
    };
    // Engine models are also reported under vLLM's names.
    let vllm = matches!(call.model.backend, super::ModelBackend::Engine(_))
        .then(|| metrics.vllm.request(&call.model.name));
    let observe = observer(
        metrics,
        inc,
        labels,
        call.passed.predicted,
        call.watch.as_deref(),
    );
    let result = drive::drive(
        sink,
        events,
        pace,
        inc.beats(),
        ticket.as_ref(),
        &mut timing,
        &mut delivery,
        observe,
        produced(inc, vllm.as_ref(), permit.as_ref()),
    )
    .await;
    let so_far = (call.prepared.prompt_tokens + delivery.tokens) as u64;
    let end = match result {
        Err(Gone) => {
            outcome("client_gone");
            call.budget.settle(so_far);
            return Err(Gone);
        }
        Ok(None) => {
            outcome("error");
            call.budget.settle(so_far);
            return Ok(());
        }
        Ok(Some(end)) => Finished {
            usage: usage(&call.prepared, end.usage),
            ..end
        },
    };
    let backend_done = Instant::now();
    if let Some(t) = ticket {
        t.finish(end.usage.completion_tokens);
    }
    let u = end.usage;
    call.budget
        .settle((u.prompt_tokens + u.completion_tokens) as u64);
    let r = sink.done(&end, &mut timing).await;
    outcome(if r.is_ok() { "ok" } else { "client_gone" });
    if let (Some(t), Some((name, mut attrs)), true) = (&inc.trace, traced, r.is_ok()) {
        let phases = crate::otel::Phases {
            gate: queued_at,
            admitted: admitted_at,
            dispatched,
            first_token: delivery.first_text,
            backend_done,
            end: Instant::now(),
        };
        attrs.extend(super::trace::end_attrs(&end, &timing));
        t.finish(backend_span.as_ref(), &phases, &name, attrs);
    }
    account(metrics, labels, &u, &timing);
    if let Some(v) = &vllm {
        v.done(
            timing.total,
            u.prompt_tokens as u64,
            u.completion_tokens as u64,
        );
    }
    r
}

/// The lane gate's bounded wait, with heartbeats on a stream.
async fn gate<S: Sink + ?Sized>(
    metrics: &InferenceMetrics,
    inc: &Incoming,
    call: &Call,
    sink: &mut S,
) -> Result<Option<Permit>, Stop> {
    let Some(gate) = &call.model.gate else {
        return Ok(None);
    };
    let work = (call.prepared.prompt_tokens + call.prepared.max_tokens * call.req.n) as u64;
    let who = Who {
        tenant: call.req.tenant.clone().unwrap_or_else(Tenant::anonymous),
        prompt: call.prepared.prompt_tokens,
    };
    let acquire = gate.acquire_as(&who, call.lane, Some(work), std::future::pending());
    match drive::wait(sink, inc.heartbeat(), acquire).await {
        Err(Gone) | Ok(Err(Denied::Gone)) => Err(Stop::Gone),
        Ok(Ok((p, _))) => Ok(Some(p)),
        Ok(Err(Denied::Shed(reason, retry_after))) => {
            metrics
                .admission
                .shed(&inc.cfg.lanes()[call.lane].name, reason.as_str());
            let (status, headers, body) = refusal(reason, retry_after, None);
            let f = Failure {
                status,
                headers,
                body,
            };
            Err(Stop::Answered(sink.fail(&f).await))
        }
    }
}

/// What each delivered text tells the metrics: the first one the TTFT
/// from arrival and the prediction's error, later ones the inter-token
/// interval (at the socket write for streams; as produced for whole
/// responses and async jobs, whose texts are collected as they come).
fn observer<'a>(
    metrics: &'a InferenceMetrics,
    inc: &'a Incoming,
    labels: [&'a str; 3],
    predicted: Option<std::time::Duration>,
    watch: Option<&'a parking_lot::Mutex<super::watchdog::LaneWatch>>,
) -> impl OnText + 'a {
    let im = metrics;
    // Resolved once: every token of a stream observes these.
    let ttft_h = im.ttft.with_label_values(&labels);
    let itl_h = im.itl.with_label_values(&labels);
    move |at: Instant, prev: Option<Instant>| match prev {
        None => {
            let ttft = at.saturating_duration_since(inc.arrived);
            ttft_h.observe(ttft.as_secs_f64());
            if let Some(w) = watch {
                w.lock().ttft(ttft);
            }
            if let Some(p) = predicted {
                let (dir, err) = if p >= ttft {
                    ("over", p - ttft)
                } else {
                    ("under", ttft - p)
                };
                im.prediction_error
                    .with_label_values(&[labels[1], dir])
                    .observe(err.as_secs_f64());
            }
        }
        Some(prev) => {
            let d = at.saturating_duration_since(prev);
            itl_h.observe(d.as_secs_f64());
            if let Some(w) = watch {
                w.lock().itl(d);
            }
        }
    }
}

/// What each token the backend produced tells vLLM's histograms (as vLLM
/// measures them, in the engine's own time, before cadence pacing; the
/// `ultrafast_*` families above time delivery) and the gate's fair shares
/// (the tenant's counter).
fn produced<'a>(
    inc: &'a Incoming,
    vllm: Option<&'a super::vllm::VllmRequest>,
    permit: Option<&'a Permit>,
) -> impl OnText + 'a {
    move |at: Instant, prev: Option<Instant>| {
        if let Some(p) = permit {
            p.produced();
        }
        let Some(v) = vllm else { return };
        match prev {
            None => v.ttft(at.saturating_duration_since(inc.arrived)),
            Some(p) => v.itl(at.saturating_duration_since(p)),
        }
    }
}

/// Tokens, end to end, queue and the latency breakdown of a finished one.
fn account(metrics: &InferenceMetrics, labels: [&str; 3], u: &Usage, t: &Timing) {
    let model = labels[0];
    let im = metrics;
    im.tokens
        .with_label_values(&[model, "prompt"])
        .inc_by(u.prompt_tokens as u64);
    im.tokens
        .with_label_values(&[model, "completion"])
        .inc_by(u.completion_tokens as u64);
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
            .with_label_values(&[phase, labels[1]])
            .observe(d.as_secs_f64());
    }
}

/// The backend's counts, with the prompt size measured here when the
/// backend did not report one (an upstream without usage).
fn usage(p: &Prepared, u: Usage) -> Usage {
    Usage {
        prompt_tokens: if u.prompt_tokens == 0 {
            p.prompt_tokens
        } else {
            u.prompt_tokens
        },
        ..u
    }
}
