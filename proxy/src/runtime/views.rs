//! The narrow views the subsystems own, implemented by the snapshot: each
//! subsystem names the trait it reads through, never the snapshot, so it
//! ranks below this layer.

use super::Snapshot;
use crate::admission::keys::ApiKeys;
use crate::admission::queue::LaneSpec;
use crate::config::file::FileConfig;
use crate::inference::pacer::PaceSpec;
use crate::inference::tenant::TenantSource;
use crate::inference::Model;
use std::collections::BTreeMap;
use std::sync::Arc;

impl crate::inference::live::Live for Snapshot {
    fn file(&self) -> &FileConfig {
        &self.file
    }
    fn lanes(&self) -> &[LaneSpec] {
        &self.lanes
    }
    fn models(&self) -> &BTreeMap<String, Arc<Model>> {
        &self.models
    }
    fn pacing(&self) -> &[PaceSpec] {
        &self.pacing
    }
    fn tenant_source(&self) -> &TenantSource {
        &self.tenant_source
    }
    fn api_keys(&self) -> Option<&Arc<ApiKeys>> {
        self.api_keys.as_ref()
    }
    fn fair_closed(&self) -> bool {
        self.fair_closed
    }
}

impl crate::edge::conn::Rules for arc_swap::ArcSwap<Snapshot> {
    fn terms(&self, local: Option<std::net::SocketAddr>, tls: bool) -> crate::edge::conn::Terms {
        let cfg = self.load();
        let l = &cfg.limits;
        let hsts = if tls && !cfg.listener_rules.is_empty() {
            cfg.listener_rule(local).and_then(|r| r.hsts.clone())
        } else {
            None
        };
        crate::edge::conn::Terms {
            max_connections: l.max_connections,
            deadlines: *cfg.deadlines(local),
            head_limits: (l.max_header_bytes, l.max_headers),
            hsts,
        }
    }
}
