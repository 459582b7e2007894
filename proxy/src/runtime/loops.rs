//! The loops that walk the live snapshot: health checks, load scrapes,
//! the key-file watch and the watchdog's probes (the DNS refresh lives
//! beside reload). Each round loads the snapshot afresh, so what a reload
//! adds is walked without a restart, and hands each item to its owner
//! (`upstream::health`, `upstream::load`, `admission::keys`,
//! `inference::probe`). Loops with nothing to walk sleep until a reload
//! (`next_round`).

use super::Shared;
use crate::inference::{probe, watchdog, Front};
use crate::metrics::Metrics;
use crate::upstream::{self, health, load};
use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often the watchdog looks at its windows.
const TICK: Duration = Duration::from_millis(100);

/// The health-check background service.
pub struct HealthChecker {
    config: Shared,
}

impl HealthChecker {
    /// A checker over the live config.
    pub fn new(config: Shared) -> Self {
        HealthChecker { config }
    }
}

#[async_trait]
impl BackgroundService for HealthChecker {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut streaks: health::Streaks = HashMap::new();
        loop {
            let seen = super::reloads();
            let cfg = self.config.load_full();
            let mut busy = false;
            for pool in cfg.pools.values() {
                let Some(h) = &pool.health else { continue };
                busy = true;
                if upstream::take_due(&pool.health_due_ms, h.interval) {
                    health::check_pool(pool.clone(), &mut streaks).await;
                }
            }
            drop(cfg);
            if !super::next_round(busy, Duration::from_millis(50), seen, &mut shutdown).await {
                return;
            }
        }
    }
}

/// The scraping background service.
pub struct LoadScraper {
    config: Shared,
}

impl LoadScraper {
    /// A scraper over the live config.
    pub fn new(config: Shared) -> Self {
        LoadScraper { config }
    }
}

#[async_trait]
impl BackgroundService for LoadScraper {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        loop {
            let seen = super::reloads();
            let cfg = self.config.load_full();
            let mut busy = false;
            for pool in cfg.pools.values() {
                let Some(spec) = pool.lb.scrape() else {
                    continue;
                };
                busy = true;
                if upstream::take_due(&pool.scrape_due_ms, spec.interval) {
                    // Off this loop: a slow member must not delay other pools.
                    tokio::spawn(load::scrape_pool(pool.clone(), spec.clone()));
                }
            }
            drop(cfg);
            if !super::next_round(busy, Duration::from_millis(50), seen, &mut shutdown).await {
                return;
            }
        }
    }
}

/// Re-reads the live config's key file when it changes (every
/// `[api_keys] watch_interval_ms`).
pub struct KeyWatchService(pub Shared);

#[async_trait]
impl BackgroundService for KeyWatchService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        loop {
            let interval = self
                .0
                .load()
                .api_keys
                .as_ref()
                .and_then(|k| k.watch_every());
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tokio::time::sleep(interval.unwrap_or(Duration::from_secs(1))) => {}
            }
            let Some(keys) = self.0.load().api_keys.clone() else {
                continue;
            };
            if keys.watch_every().is_none() {
                continue;
            }
            // Errors are logged by `reload`.
            let _ = tokio::task::spawn_blocking(move || keys.reload_if_changed()).await;
        }
    }
}

/// Judges the watched lanes every tick and sends the probes they need.
pub struct WatchdogService {
    /// Live config.
    pub shared: Shared,
    /// The inference front (backends, watchdog).
    pub front: Arc<Front>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
}

#[async_trait]
impl BackgroundService for WatchdogService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        loop {
            let seen = super::reloads();
            let cfg = self.shared.load_full();
            let busy = watchdog::watches(&*cfg);
            drop(cfg);
            if !super::next_round(busy, TICK, seen, &mut shutdown).await {
                return;
            }
            let cfg = self.shared.load_full();
            let probes = self
                .front
                .watchdog
                .tick(&*cfg, &self.metrics.inference, Instant::now());
            for p in probes {
                let (front, cfg) = (self.front.clone(), cfg.clone());
                tokio::spawn(async move {
                    let watch = p.watch.clone();
                    probe::send(&front, &*cfg, &p).await;
                    watch.lock().probe_done();
                });
            }
        }
    }
}
