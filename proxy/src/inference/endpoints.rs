//! The small endpoints of the inference front: the model list and the
//! async requests (`GET`, `DELETE`, and the resumable SSE event stream).
//! A job is visible only to the tenant (API key) that created it; to anyone
//! else it does not exist.

use super::context::Incoming;
use super::delivery;
use super::delivery::{Downstream, Gone};
use super::drive;
use super::jobs::Job;
use super::sse;
use super::Front;
use crate::cluster::jobs::RemoteJob;
use crate::cluster::Cluster;
use bytes::Bytes;
use serde_json::{json, Value};
use std::sync::Arc;
use ultrafast_engine::api::BackendError;

/// A whole response: status and JSON body.
#[derive(Debug)]
pub struct Reply {
    /// HTTP status.
    pub status: u16,
    /// JSON body.
    pub body: Bytes,
}

impl Reply {
    /// A 200 with this JSON body.
    pub fn json(v: Value) -> Self {
        Self::ok(v)
    }

    fn ok(v: Value) -> Self {
        Reply {
            status: 200,
            body: Bytes::from(v.to_string()),
        }
    }

    /// An OpenAI-style error.
    pub fn error(e: &BackendError) -> Self {
        Reply {
            status: e.status,
            body: super::openai::error_json(e),
        }
    }
}

/// A model object; in-process models that are serving add where they
/// run (`device`, `runner`: fields the OpenAI clients ignore).
fn model_json(
    id: &str,
    device: Option<&(String, String, String)>,
    sampling: Option<&crate::config::file::SamplingSection>,
) -> Value {
    let mut v = json!({"id": id, "object": "model", "created": 0, "owned_by": "ultrafast"});
    // The defaults a request that omits these fields gets.
    if let Some(s) = sampling.filter(|s| **s != Default::default()) {
        v["sampling"] = serde_json::to_value(s).unwrap_or(Value::Null);
        if let Some(o) = v["sampling"].as_object_mut() {
            o.retain(|_, x| !x.is_null());
        }
    }
    if let Some((_, d, r)) = device {
        v["device"] = json!(d);
        v["runner"] = json!(r);
    }
    v
}

fn no_job(id: &str) -> BackendError {
    let shown: String = id.chars().take(64).collect();
    BackendError::request(
        404,
        "request_not_found",
        format!("No async request `{shown}` (unknown, or its results expired)."),
    )
}

fn no_response(id: &str) -> BackendError {
    let shown: String = id.chars().take(64).collect();
    BackendError::request(
        404,
        "response_not_found",
        format!(
            "No response `{shown}` (not stored, expired from the response store, or not yours)."
        ),
    )
}

/// A job found here or, with `[cluster]`, in the shared store.
pub(super) enum Found {
    Here(Arc<Job>),
    Elsewhere(Arc<Cluster>, RemoteJob),
}

impl Front {
    /// The job `id` if the caller may see it: this instance's, else the
    /// shared store's (the same tenancy rule on both).
    pub(super) async fn job(&self, inc: &Incoming, id: &str) -> Result<Found, BackendError> {
        match self.jobs.get(id) {
            Some(j) if j.owner == inc.tenant() => return Ok(Found::Here(j)),
            Some(_) => return Err(no_job(id)),
            None => {}
        }
        let Some(c) = crate::cluster::get() else {
            return Err(no_job(id));
        };
        match c.remote_job(id).await {
            Some(r) if r.owner == inc.tenant() => Ok(Found::Elsewhere(c.clone(), r)),
            _ => Err(no_job(id)),
        }
    }

    /// `GET /v1/models` (the models this caller may use).
    pub fn models(&self, inc: &Incoming) -> Reply {
        let devices = self.engines.devices();
        let data: Vec<Value> = inc
            .cfg
            .models()
            .iter()
            .filter(|(m, _)| self.allowed(inc, m).is_ok())
            .map(|(m, model)| {
                model_json(
                    m,
                    devices.iter().find(|d| &d.0 == m),
                    Some(&model.def.sampling),
                )
            })
            .collect();
        Reply::ok(json!({"object": "list", "data": data}))
    }

    /// `GET /v1/models/{id}`.
    pub fn model(&self, inc: &Incoming, id: &str) -> Reply {
        match inc.cfg.models().get(id) {
            Some(model) if self.allowed(inc, id).is_ok() => {
                let devices = self.engines.devices();
                Reply::ok(model_json(
                    id,
                    devices.iter().find(|d| d.0 == id),
                    Some(&model.def.sampling),
                ))
            }
            _ => Reply::error(&super::pipeline::not_found_model(id)),
        }
    }

    /// `GET /v1/responses/{id}`: a stored response, finished or not.
    pub async fn response_status(&self, inc: &Incoming, id: &str) -> Reply {
        match self.job(inc, &super::dialect::responses::job_id(id)).await {
            Ok(Found::Here(j)) => Reply::ok(super::dialect::responses::view(&j.view(), "")),
            Ok(Found::Elsewhere(_, r)) => Reply::ok(super::dialect::responses::view(&r.view, "")),
            Err(_) => Reply::error(&no_response(id)),
        }
    }

    /// `DELETE /v1/responses/{id}`: cancel a response still running (as
    /// OpenAI's `cancel` does for a background response); a finished one
    /// is shown as it is.
    pub async fn response_cancel(&self, inc: &Incoming, id: &str) -> Reply {
        let job_id = super::dialect::responses::job_id(id);
        if self.job(inc, &job_id).await.is_err() {
            return Reply::error(&no_response(id));
        }
        let r = self.job_cancel(inc, &job_id).await;
        match serde_json::from_slice::<Value>(&r.body) {
            Ok(v) if r.status == 200 => Reply::ok(super::dialect::responses::view(&v, "")),
            _ => r,
        }
    }

    /// `GET /v1/requests/{id}` (a stored response's conversation is the
    /// store's own, not shown).
    pub async fn job_status(&self, inc: &Incoming, id: &str) -> Reply {
        let mut v = match self.job(inc, id).await {
            Ok(Found::Here(j)) => j.view(),
            Ok(Found::Elsewhere(_, r)) => r.view,
            Err(e) => return Reply::error(&e),
        };
        if let Some(Value::Object(r)) = v.get_mut("result") {
            r.remove(super::dialect::responses::CONVERSATION);
        }
        Reply::ok(v)
    }

    /// `DELETE /v1/requests/{id}`: cancel it (a finished one stays as is).
    /// A job run by another instance is cancelled there (through the
    /// store's `cancel` channel); the reply waits up to a second for it.
    pub async fn job_cancel(&self, inc: &Incoming, id: &str) -> Reply {
        match self.job(inc, id).await {
            Ok(Found::Here(j)) => {
                j.cancel();
                Reply::ok(j.view())
            }
            Ok(Found::Elsewhere(_, r)) if r.finished() => Reply::ok(r.view),
            Ok(Found::Elsewhere(c, mut r)) => {
                if c.cancel_remote(id).await {
                    let until = std::time::Instant::now() + std::time::Duration::from_secs(1);
                    while std::time::Instant::now() < until {
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                        match c.remote_job(id).await {
                            Some(now) if now.finished() => {
                                r = now;
                                break;
                            }
                            Some(now) => r = now,
                            None => break,
                        }
                    }
                }
                Reply::ok(r.view)
            }
            Err(e) => Reply::error(&e),
        }
    }

    /// `GET /v1/requests/{id}/events`: the job's events as SSE, from the
    /// one after `Last-Event-ID`, then live until it finishes.
    pub async fn job_events(
        &self,
        inc: &Incoming,
        id: &str,
        down: &mut dyn Downstream,
    ) -> Result<(), Gone> {
        let fail = |e: BackendError| Reply::error(&e);
        let job = self.job(inc, id).await.map_err(fail);
        let from = match inc.headers.get("last-event-id").map(|v| v.to_str()) {
            None => Ok(0),
            Some(Ok(v)) => v
                .trim()
                .parse::<usize>()
                .ok()
                .and_then(|n| n.checked_add(1))
                .ok_or(())
                .map_err(|_| {
                    fail(BackendError::invalid(
                        "invalid_last_event_id",
                        None,
                        format!("Last-Event-ID `{v}` is not an event id of this stream"),
                    ))
                }),
            Some(Err(_)) => Err(fail(BackendError::invalid(
                "invalid_last_event_id",
                None,
                "Last-Event-ID is not text".into(),
            ))),
        };
        let (job, mut from) = match (job, from) {
            (Ok(j), Ok(f)) => (j, f),
            (Err(r), _) | (_, Err(r)) => return send(down, &[], r).await,
        };
        let h = [
            ("content-type", "text/event-stream"),
            ("cache-control", "no-cache"),
            ("x-accel-buffering", "no"),
        ];
        down.head(200, &h).await?;
        let heartbeat =
            std::time::Duration::from_millis(inc.cfg.file().inference.heartbeat_ms.max(1));
        let mut sink = Beats(down);
        let job = match job {
            Found::Here(j) => j,
            Found::Elsewhere(c, _) => {
                return remote_events(&c, id, from, heartbeat, &mut sink).await
            }
        };
        let mut changes = job.subscribe();
        loop {
            let (evs, finished) = job.events_from(from);
            for (i, payload) in evs {
                sink.0.body(sse::data_with_id(i, &payload), false).await?;
                from = i + 1;
            }
            if finished {
                // Events pushed between the snapshot and the finish.
                let (rest, _) = job.events_from(from);
                for (i, payload) in rest {
                    sink.0.body(sse::data_with_id(i, &payload), false).await?;
                }
                return sink.0.body(Bytes::from_static(sse::DONE), true).await;
            }
            if drive::wait(&mut sink, heartbeat, changes.changed())
                .await?
                .is_err()
            {
                return sink.0.body(Bytes::from_static(sse::DONE), true).await;
            }
        }
    }
}

/// The end of a followed stream whose store stopped answering (or lost
/// writes): an SSE error event, without `[DONE]`.
const STORE_LOST: &[u8] = b"event: error\ndata: {\"error\":{\"message\":\"the shared store cannot give this request's events now; retry with Last-Event-ID\",\"type\":\"server_error\",\"param\":null,\"code\":\"events_unavailable\"}}\n\n";

/// The events of a job another instance runs, from the store: what is
/// there from `from` on, then what each announcement (or, if one is
/// missed, a poll every 250 ms) brings, until it finishes. A store that
/// stops answering ends the stream with an error event (`STORE_LOST`).
async fn remote_events(
    c: &Arc<Cluster>,
    id: &str,
    mut from: usize,
    heartbeat: std::time::Duration,
    sink: &mut Beats<'_>,
) -> Result<(), Gone> {
    let follow = c.follow(id);
    let poll = std::time::Duration::from_millis(250);
    let mut quiet = std::time::Duration::ZERO;
    loop {
        let woken = follow.notify.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        let Ok((evs, finished)) = c.remote_events(id, from).await else {
            // Not `[DONE]`: the job may not be over. An error event says
            // why, and a client may come back with its Last-Event-ID.
            return sink.0.body(Bytes::from_static(STORE_LOST), true).await;
        };
        for payload in evs {
            sink.0
                .body(sse::data_with_id(from, &payload), false)
                .await?;
            from += 1;
            quiet = std::time::Duration::ZERO;
        }
        if finished {
            return sink.0.body(Bytes::from_static(sse::DONE), true).await;
        }
        let wait = poll.min(heartbeat);
        tokio::select! {
            _ = woken => {}
            _ = tokio::time::sleep(wait) => {
                quiet += wait;
                if quiet >= heartbeat {
                    quiet = std::time::Duration::ZERO;
                    delivery::Sink::heartbeat(sink).await?;
                }
            }
        }
    }
}

/// Send a whole JSON reply.
pub async fn send(down: &mut dyn Downstream, base: &[(&str, &str)], r: Reply) -> Result<(), Gone> {
    delivery::respond(down, r.status, base, r.body).await
}

/// A job event stream as a sink: only heartbeats and the consumer.
struct Beats<'a>(&'a mut dyn Downstream);

#[async_trait::async_trait]
impl delivery::Sink for Beats<'_> {
    fn streaming(&self) -> bool {
        true
    }
    async fn gone(&mut self) {
        self.0.gone().await
    }
    async fn heartbeat(&mut self) -> Result<(), Gone> {
        self.0.body(sse::comment("waiting"), false).await
    }
    async fn text(&mut self, _: &str) -> Result<(), Gone> {
        Ok(())
    }
    async fn done(&mut self, _: &delivery::Finished, _: &mut delivery::Timing) -> Result<(), Gone> {
        Ok(())
    }
    async fn fail(&mut self, _: &delivery::Failure) -> Result<(), Gone> {
        Ok(())
    }
}
