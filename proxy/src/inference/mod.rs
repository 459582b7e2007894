//! The inference front: the OpenAI-compatible API on inference routes,
//! served by the in-process engine or by upstream pools through one
//! backend seam (`ultrafast_engine::api::Backend`), with lanes, SSE, the
//! async (202) mode, cadence pacing and a latency breakdown.
//!
//! The request path itself lives with the other proxy phases
//! (`proxy::infer`); this module holds its parts: request parsing and
//! response shapes (`openai`), SSE framing and parsing (`sse`), the pacer,
//! the async job store, upstream pools and metrics.

pub mod jobs;
pub mod metrics;
pub mod openai;
pub mod pacer;
pub mod sse;
pub mod upstream;

use crate::admission::gate::Gate;
use crate::config::file::ModelSection;
use std::collections::HashMap;
use std::sync::Arc;
use ultrafast_engine::api::Backend;
use ultrafast_engine::service::{EngineService, ServiceSpec};

/// How a configured model is served.
#[derive(Debug, Clone)]
pub enum ModelBackend {
    /// By the in-process engine (started once, at `serve`).
    Engine(ServiceSpec),
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
    /// The section it was built from.
    pub def: ModelSection,
}

/// Engines started by this process, by model name.
#[derive(Debug, Default)]
pub struct Engines(pub HashMap<String, Arc<EngineService>>);

impl Engines {
    /// Start an engine for every engine model of `models` (loading runs in
    /// the background; readiness says when each is serving).
    pub fn start(
        models: &std::collections::BTreeMap<String, Arc<Model>>,
        metrics: &metrics::InferenceMetrics,
    ) -> Engines {
        let mut out = HashMap::new();
        for (name, m) in models {
            if let ModelBackend::Engine(spec) = &m.backend {
                let svc = EngineService::start(spec.clone(), Some(metrics.steps()));
                metrics.watch(name, svc.clone());
                out.insert(name.clone(), svc);
            }
        }
        Engines(out)
    }

    /// The backend serving `m`, if running.
    pub fn backend(&self, m: &Model) -> Option<Arc<dyn Backend>> {
        match &m.backend {
            ModelBackend::Engine(_) => self.0.get(&m.name).map(|s| s.clone() as Arc<dyn Backend>),
            ModelBackend::Upstream(u) => Some(u.clone() as Arc<dyn Backend>),
        }
    }

    /// Models that are not ready, with the reason (for `/readyz`).
    pub fn not_ready(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = self
            .0
            .iter()
            .filter_map(|(n, s)| match s.readiness() {
                ultrafast_engine::api::Readiness::Ready => None,
                ultrafast_engine::api::Readiness::Starting(p) => Some((n.clone(), p)),
                ultrafast_engine::api::Readiness::Failed(w) => Some((n.clone(), w)),
            })
            .collect();
        out.sort();
        out
    }
}
