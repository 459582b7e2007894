//! The inference front: the OpenAI-compatible API on inference routes,
//! served by the in-process engine or by upstream pools through one
//! backend seam (`ultrafast_engine::api::Backend`), with lanes, SSE, the
//! async (202) mode, cadence pacing and a latency breakdown.
//!
//! The request path is a pipeline of stages that know nothing of Pingora
//! (`pipeline`): `limits` (rate limits, API keys, token budgets), parsing
//! (`openai`), admission against the lane's TTFT target (`admit`, with the
//! latency model of `predict`) and the lane gate, dispatch to the backend,
//! and `drive` into one of three `sinks` (SSE, whole JSON, async job).
//! `endpoints` serves the model list and the async requests. The Pingora
//! adapter (`proxy::infer`) only reads the body, calls these and writes
//! what they yield through a `delivery::Downstream`.

pub mod choices;
pub mod context;
pub mod delivery;
pub mod dialect;
pub mod drive;
pub mod endpoints;
pub mod fields;
pub mod fleet;
pub mod jobs;
pub mod limits;
pub mod live;
pub mod logprobs;
pub mod metrics;
pub mod openai;
pub mod pacer;
pub mod pipeline;
pub mod predict;
pub mod probe;
pub mod registry;
pub mod request;
mod run;
pub mod shape;
pub mod sinks;
pub mod slo;
pub mod sse;
pub mod targets;
pub mod tenant;
pub mod tokenize;
pub mod tokens;
mod trace;
pub mod upstream;
pub mod vllm;
pub mod watchdog;

use crate::admission::gate::Gate;
use crate::config::file::ModelSection;
use std::sync::Arc;
use ultrafast_engine::service::ServiceSpec;

pub use registry::Engines;

/// How a configured model is served.
#[derive(Debug, Clone)]
pub enum ModelBackend {
    /// By the in-process engine (started at `serve`; a reload that changes
    /// its section starts a new one beside it, see `registry`).
    Engine(Box<ServiceSpec>),
    /// By an upstream pool.
    Upstream(Arc<upstream::UpstreamBackend>),
}

/// A model on inference routes.
#[derive(Debug)]
pub struct Model {
    /// Name clients use.
    pub name: String,
    /// Who serves it.
    pub backend: ModelBackend,
    /// Admission gate (lane queues), if configured.
    pub gate: Option<Arc<Gate>>,
    /// Latency model and ledger of admitted work (kept across reloads).
    pub latency: Arc<predict::Latency>,
    /// The section it was built from.
    pub def: ModelSection,
}

/// Inference state of the process: started engines, the async store and
/// the SLA watchdog (all kept across reloads).
pub struct Front {
    /// Engines by model name.
    pub engines: Engines,
    /// Async jobs.
    pub jobs: jobs::Store,
    /// Windows and states of the watched lanes.
    pub watchdog: watchdog::Watchdog,
    /// The tokenization gate (bytes and threads).
    pub tokenizing: tokenize::Tokenizing,
}

impl std::fmt::Debug for Front {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Front({:?})", self.engines)
    }
}

impl Front {
    /// Export the async store's usage.
    pub fn export_store(&self, metrics: &metrics::InferenceMetrics) {
        let (n, b) = self.jobs.usage();
        let g = &metrics.async_store;
        g.with_label_values(&["entries"]).set(n as i64);
        g.with_label_values(&["bytes"]).set(b as i64);
    }
}

/// The engine's own step-cost fit as the predictor's cost model: a prompt
/// token costs what a decoded token does (the model's chunking of prompts
/// comes from its config).
pub fn live_cost(c: ultrafast_engine::scheduler::StepCost) -> predict::Cost {
    predict::Cost {
        step_fixed_s: c.fixed_s,
        step_per_seq_s: c.per_decode_s,
        prefill_per_token_s: c.per_prompt_token_s,
        chunk: None,
    }
}
