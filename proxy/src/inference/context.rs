//! The pipeline's context types: which API a completion came to, what
//! the pipeline knows of one request (`Incoming`, no sockets), and a
//! completion that passed admission up to the gate (`Call`).

use super::live::Live;
use super::openai::{Endpoint, Parsed};
use super::slo::Passed;
use super::Model;
use crate::routing::Route;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use ultrafast_engine::api::{Backend, InferenceRequest, Prepared};

impl From<Endpoint> for Api {
    fn from(ep: Endpoint) -> Self {
        Api::OpenAi(ep)
    }
}

/// Which API a completion came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// OpenAI's chat completions or completions.
    OpenAi(Endpoint),
    /// Anthropic's `/v1/messages`.
    Messages,
    /// OpenAI's `/v1/responses`.
    Responses,
}

/// What the pipeline needs to know of one request (no sockets).
#[derive(Debug, Clone)]
pub struct Incoming {
    /// The config snapshot of this request.
    pub cfg: Arc<dyn Live>,
    /// Its route.
    pub route: Arc<Route>,
    /// Request headers.
    pub headers: http::HeaderMap,
    /// Client address.
    pub client_ip: Option<IpAddr>,
    /// Request id.
    pub request_id: String,
    /// When its head was parsed.
    pub arrived: Instant,
    /// Time to read the body.
    pub network: Duration,
    /// The caller's API key, when keys are configured.
    pub key: Option<Arc<crate::admission::keys::KeyEntry>>,
    /// Its trace, when tracing is on.
    pub trace: Option<crate::otel::ReqTrace>,
}

impl Incoming {
    /// The tenant: the API key's name (None without keys).
    pub fn tenant(&self) -> Option<String> {
        self.key.as_ref().map(|k| k.name.clone())
    }

    pub(super) fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub(super) fn heartbeat(&self) -> Duration {
        Duration::from_millis(self.cfg.file().inference.heartbeat_ms.max(1))
    }

    /// The heartbeat while waiting and the keepalive once text flows.
    pub(super) fn beats(&self) -> super::drive::Beats {
        let i = &self.cfg.file().inference;
        super::drive::Beats {
            waiting: self.heartbeat(),
            flowing: Duration::from_millis(i.keepalive_ms.max(i.heartbeat_ms).max(1)),
        }
    }

    /// Whether the client asked for the async (202) mode by header.
    pub(super) fn prefers_async(&self) -> bool {
        self.header("prefer")
            .is_some_and(|p| p.to_ascii_lowercase().contains("respond-async"))
    }
}

/// A completion that passed admission up to the gate.
pub(super) struct Call {
    pub(super) backend: Arc<dyn Backend>,
    pub(super) model: Arc<Model>,
    pub(super) req: InferenceRequest,
    pub(super) prepared: Prepared,
    pub(super) parsed: Parsed,
    pub(super) lane: usize,
    pub(super) passed: Passed,
    pub(super) budget: super::limits::Held,
    /// The served model's watched lane, if it has a watchdog.
    pub(super) watch: Option<super::watchdog::Watched>,
    /// The fallback serving it, when the requested model's lane is violated.
    pub(super) fallback: Option<String>,
}
