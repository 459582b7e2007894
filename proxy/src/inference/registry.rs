//! The engines of the process, by model name, behind their own `ArcSwap`
//! and reconciled on reload in two steps: `stage` starts every new or
//! changed engine model beside the running ones and waits until each is
//! loaded and warmed up (a model that fails leaves everything as it was,
//! and the reload fails naming it); `commit`, called as the new config is
//! swapped in, swaps the map. An old engine is dropped by the map, and
//! lives on only in the requests that hold it: its worker finishes their
//! sequences, then exits when the last of them lets go.

use super::metrics::InferenceMetrics;
use super::{Model, ModelBackend};
use arc_swap::ArcSwap;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;
use ultrafast_engine::api::{Backend, Readiness};
use ultrafast_engine::service::EngineService;

type Map = HashMap<String, Arc<EngineService>>;

/// Engines started by this process, by model name.
#[derive(Debug, Default)]
pub struct Engines(ArcSwap<Map>);

/// Engines loaded by `stage`, waiting for `commit`.
#[derive(Debug)]
pub struct Staged {
    next: Map,
    /// What changed, by model: `added`, `reloaded` (a new engine),
    /// `removed`, `settings` (same engine, other settings).
    pub changes: BTreeMap<String, String>,
}

/// Share the fair-share counters of engine `svc` of model `name` with the
/// other instances (when `[cluster]` is set) while it runs.
fn share_counters(name: &str, svc: &Arc<EngineService>) {
    let weak = Arc::downgrade(svc);
    crate::cluster::fair::register(name, weak);
}

/// How long a reload waits for a new engine to load and warm up.
const LOAD_LIMIT: Duration = Duration::from_secs(600);

impl Engines {
    /// Start an engine for every engine model of `models` (loading runs in
    /// the background; readiness says when each is serving).
    pub fn start(models: &BTreeMap<String, Arc<Model>>, metrics: &InferenceMetrics) -> Engines {
        let mut out = HashMap::new();
        for (name, m) in models {
            if let ModelBackend::Engine(spec) = &m.backend {
                let svc = EngineService::start((**spec).clone(), Some(metrics.steps()));
                metrics.watch(name, svc.clone());
                share_counters(name, &svc);
                out.insert(name.clone(), svc);
            }
        }
        Engines(ArcSwap::from_pointee(out))
    }

    /// The backend serving `m`, if running.
    pub fn backend(&self, m: &Model) -> Option<Arc<dyn Backend>> {
        match &m.backend {
            ModelBackend::Engine(_) => self
                .0
                .load()
                .get(&m.name)
                .map(|s| s.clone() as Arc<dyn Backend>),
            ModelBackend::Upstream(u) => Some(u.clone() as Arc<dyn Backend>),
        }
    }

    /// The engine of model `name`.
    pub fn get(&self, name: &str) -> Option<Arc<EngineService>> {
        self.0.load().get(name).cloned()
    }

    /// Ready in-process models with their device and runner (for
    /// `/readyz` and `/v1/models`).
    pub fn devices(&self) -> Vec<(String, String, String)> {
        let mut out: Vec<_> = self
            .0
            .load()
            .iter()
            .filter_map(|(n, s)| {
                let (d, r) = s.device()?;
                Some((n.clone(), d, r))
            })
            .collect();
        out.sort();
        out
    }

    /// Models that are not ready, with the reason (for `/readyz`).
    pub fn not_ready(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = self
            .0
            .load()
            .iter()
            .filter_map(|(n, s)| match s.readiness() {
                Readiness::Ready => None,
                Readiness::Starting(p) => Some((n.clone(), p)),
                Readiness::Failed(w) => Some((n.clone(), w)),
            })
            .collect();
        out.sort();
        out
    }

    /// Load the engines `next` needs beside the running ones. Err names
    /// the model that failed and why; nothing running is touched then.
    pub async fn stage(
        &self,
        prev: &BTreeMap<String, Arc<Model>>,
        next: &BTreeMap<String, Arc<Model>>,
        metrics: &InferenceMetrics,
    ) -> Result<Staged, (String, String)> {
        let live = self.0.load_full();
        let mut map = Map::new();
        let mut changes = BTreeMap::new();
        let mut started = Vec::new();
        for (name, m) in next {
            let old = prev.get(name);
            if old.is_some_and(|o| Arc::ptr_eq(o, m)) {
                if let Some(s) = live.get(name) {
                    map.insert(name.clone(), s.clone());
                }
                continue;
            }
            let ModelBackend::Engine(spec) = &m.backend else {
                changes.insert(
                    name.clone(),
                    if old.is_some() { "settings" } else { "added" }.into(),
                );
                continue;
            };
            match live.get(name) {
                Some(s) if s.spec() == &**spec => {
                    map.insert(name.clone(), s.clone());
                    changes.insert(name.clone(), "settings".into());
                }
                running => {
                    let what = if running.is_some() {
                        "reloaded"
                    } else {
                        "added"
                    };
                    let svc = EngineService::start((**spec).clone(), Some(metrics.steps()));
                    share_counters(name, &svc);
                    started.push((name.clone(), svc.clone()));
                    map.insert(name.clone(), svc);
                    changes.insert(name.clone(), what.into());
                }
            }
        }
        for name in prev.keys().filter(|n| !next.contains_key(*n)) {
            changes.insert(name.clone(), "removed".into());
        }
        for (name, svc) in started {
            let s = svc.clone();
            let state = tokio::task::spawn_blocking(move || s.wait(LOAD_LIMIT))
                .await
                .unwrap_or_else(|e| Readiness::Failed(e.to_string()));
            match state {
                Readiness::Ready => {}
                Readiness::Failed(why) => return Err((name, why)),
                Readiness::Starting(at) => {
                    return Err((name, format!("not ready after {LOAD_LIMIT:?} ({at})")))
                }
            }
        }
        Ok(Staged { next: map, changes })
    }

    /// Swap in what `stage` loaded.
    pub fn commit(&self, staged: Staged, metrics: &InferenceMetrics) {
        let old = self.0.load_full();
        for (name, svc) in &staged.next {
            if !old.get(name).is_some_and(|o| Arc::ptr_eq(o, svc)) {
                metrics.watch(name, svc.clone());
            }
        }
        for name in old.keys().filter(|n| !staged.next.contains_key(*n)) {
            metrics.unwatch(name);
        }
        self.0.store(Arc::new(staged.next));
    }
}
