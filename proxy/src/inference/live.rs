//! The inference front's view of the live snapshot: what a request and
//! the watchdog read from it, as a trait the runtime implements. The front
//! sees only this, not the snapshot (its pools, router, listeners), so it
//! ranks below the layer that builds and swaps the snapshot.

use super::pacer::PaceSpec;
use super::tenant::TenantSource;
use super::Model;
use crate::admission::keys::ApiKeys;
use crate::admission::queue::LaneSpec;
use crate::config::file::FileConfig;
use std::collections::BTreeMap;
use std::sync::Arc;

/// What the inference front reads from one config snapshot.
pub trait Live: Send + Sync + std::fmt::Debug {
    /// The file sections it came from (`[inference]`, `[lanes]`,
    /// `[api_keys]`, a model's `[models.NAME.watchdog]`).
    fn file(&self) -> &FileConfig;
    /// Priority lanes in rank order.
    fn lanes(&self) -> &[LaneSpec];
    /// Models on inference routes, by name.
    fn models(&self) -> &BTreeMap<String, Arc<Model>>;
    /// Stream pacing per lane (same order as `lanes`).
    fn pacing(&self) -> &[PaceSpec];
    /// Where a request without an API key finds its tenant.
    fn tenant_source(&self) -> &TenantSource;
    /// API keys, when `[api_keys]` is configured.
    fn api_keys(&self) -> Option<&Arc<ApiKeys>>;
    /// Fair shares refuse inference while the cluster store is down.
    fn fair_closed(&self) -> bool;
}
