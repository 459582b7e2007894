//! Metrics of the inference front (per lane and backend: TTFT, delivered
//! inter-token interval, end-to-end, queue wait, the latency breakdown,
//! tokens in and out) and of the in-process engine (step time, batch size,
//! KV blocks, prefix-cache hit rate, preemptions, queue depth per lane,
//! start-up and warm-up time, readiness). Engine gauges are read from the
//! engine's counters when `/metrics` is scraped.

use parking_lot::Mutex;
use prometheus::{
    GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry,
};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use ultrafast_engine::api::{Backend, Readiness};
use ultrafast_engine::scheduler::StepObserver;
use ultrafast_engine::service::EngineService;

use crate::prom::must;

/// Tenants per model and lane in the fair-share gauges.
pub const FAIR_TENANTS: usize = 32;

const LAT: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 30.0,
];

/// Handles of the inference families.
pub struct InferenceMetrics {
    /// The admission families (refusals are counted there), handed in by
    /// the assembly.
    pub admission: crate::admission::metrics::AdmissionMetrics,
    /// Requests refused by downstream limits, by reason (the edge's
    /// family, handed in).
    pub rejected: IntCounterVec,
    /// Time to first token, from the request's arrival to its first token
    /// (written to the socket for streams, produced for whole responses
    /// and async jobs), by lane and backend.
    pub ttft: HistogramVec,
    /// |predicted - actual| time to first token, by lane and direction
    /// (`over`: predicted more than it took; `under`: less).
    pub prediction_error: HistogramVec,
    /// The latency model's correction factor by model and lane: admission
    /// multiplies raw predictions by it (the recent p99 of actual over
    /// predicted time to first token; read at scrape time).
    pub ttft_correction: GaugeVec,
    /// Fair shares: each tenant's virtual token counter, by model, lane
    /// and tenant (the tenants served most, at most
    /// [`FAIR_TENANTS`] per model and lane; read at scrape time).
    pub fair_virtual: GaugeVec,
    /// Fair shares: tokens served (prompt and output) per tenant, same
    /// labels and bound.
    pub fair_served: GaugeVec,
    /// Delivered inter-token interval (at the socket write), by lane and backend.
    pub itl: HistogramVec,
    /// End to end, by lane and backend.
    pub e2e: HistogramVec,
    /// Queue wait (admission gate plus the backend's own queue), by lane
    /// and backend: its own histogram, no longer folded into TTFT.
    pub queue: HistogramVec,
    /// Latency breakdown, by phase (network, queue, compute, output) and lane.
    pub phase: HistogramVec,
    /// Prompt and completion tokens, by model and kind.
    pub tokens: IntCounterVec,
    /// Inference requests by model, lane and outcome.
    pub requests: IntCounterVec,
    /// Async store entries and bytes.
    pub async_store: IntGaugeVec,
    /// Watchdog state by model and lane (0 ok, 1 at_risk, 2 violated).
    pub slo_state: IntGaugeVec,
    /// Watchdog state changes, by model, lane, from and to.
    pub slo_transitions: IntCounterVec,
    /// Requests served by a lane's fallback model, by model, lane and fallback.
    pub fallback_requests: IntCounterVec,
    /// Upstream first-token hedges, by model and outcome (sent, won).
    pub hedges: IntCounterVec,
    /// Upstream mid-stream failovers, by model and outcome (ok, failed).
    pub failovers: IntCounterVec,
    step: Histogram,
    batch_seqs: Histogram,
    batch_tokens: Histogram,
    kv_blocks: IntGaugeVec,
    prefix_hit: GaugeVec,
    preemptions: IntCounterVec,
    interrupted: IntCounterVec,
    engine_queue: IntGaugeVec,
    startup: GaugeVec,
    ready: IntGaugeVec,
    /// 1 per engine, labelled with where it runs.
    device: IntGaugeVec,
    /// The labels of each model's `device` series.
    device_labels: Mutex<std::collections::HashMap<String, (String, String)>>,
    /// The same engine figures under vLLM's names.
    pub vllm: super::vllm::VllmMetrics,
    engines: Mutex<Vec<Watched>>,
}

/// An engine exported on scrape: the service, its model name, the
/// (preemption, interrupted step) counts and the vLLM prefix-cache (hit,
/// query) token counts already added to the counters.
type Watched = (Arc<EngineService>, String, [u64; 2], [u64; 2]);

/// Feeds engine steps into the histograms.
pub struct Steps {
    step: Histogram,
    seqs: Histogram,
    tokens: Histogram,
}

impl StepObserver for Steps {
    fn step(&self, elapsed: Duration, seqs: usize, tokens: usize) {
        self.step.observe(elapsed.as_secs_f64());
        self.seqs.observe(seqs as f64);
        self.tokens.observe(tokens as f64);
    }
}

impl InferenceMetrics {
    /// Create and register the families; `admission` and `rejected` are
    /// the admission's and the edge's, registered by their owners.
    pub fn new(
        r: &Registry,
        admission: crate::admission::metrics::AdmissionMetrics,
        rejected: IntCounterVec,
    ) -> Self {
        let hv = |name: &str, help: &str, labels: &[&str], buckets: &[f64]| {
            let h = must(HistogramVec::new(
                HistogramOpts::new(name, help).buckets(buckets.to_vec()),
                labels,
            ));
            must(r.register(Box::new(h.clone())));
            h
        };
        let h = |name: &str, help: &str, buckets: Vec<f64>| {
            let h = must(Histogram::with_opts(
                HistogramOpts::new(name, help).buckets(buckets),
            ));
            must(r.register(Box::new(h.clone())));
            h
        };
        let icv = |name: &str, help: &str, labels: &[&str]| {
            let c = must(IntCounterVec::new(Opts::new(name, help), labels));
            must(r.register(Box::new(c.clone())));
            c
        };
        let igv = |name: &str, help: &str, labels: &[&str]| {
            let g = must(IntGaugeVec::new(Opts::new(name, help), labels));
            must(r.register(Box::new(g.clone())));
            g
        };
        let gv = |name: &str, help: &str, labels: &[&str]| {
            let g = must(GaugeVec::new(Opts::new(name, help), labels));
            must(r.register(Box::new(g.clone())));
            g
        };
        let lb = &["model", "lane", "backend"];
        let batch: Vec<f64> = vec![
            1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
        ];
        InferenceMetrics {
            admission,
            rejected,
            ttft: hv(
                "ultrafast_inference_ttft_seconds",
                "Time to first token, from the request's arrival (streams: written; whole and async: produced).",
                lb,
                LAT,
            ),
            prediction_error: hv(
                "ultrafast_inference_ttft_prediction_error_seconds",
                "Admission's TTFT prediction error |predicted - actual|, by direction (over, under).",
                &["lane", "direction"],
                LAT,
            ),
            ttft_correction: gv(
                "ultrafast_inference_ttft_correction_factor",
                "The factor admission multiplies raw TTFT predictions by: the recent p99 of actual over predicted time to first token, by model and lane.",
                &["model", "lane"],
            ),
            fair_virtual: gv(
                "ultrafast_inference_fair_virtual_tokens",
                "Fair shares inside a lane: a tenant's virtual token counter (prompt and output tokens, weighted, divided by its weight), by model, lane and tenant; the tenants served most.",
                &["model", "lane", "tenant"],
            ),
            fair_served: gv(
                "ultrafast_inference_fair_served_tokens",
                "Fair shares inside a lane: prompt and output tokens served to a tenant since it was first seen, by model, lane and tenant; the tenants served most.",
                &["model", "lane", "tenant"],
            ),
            itl: hv(
                "ultrafast_inference_inter_token_seconds",
                "Delivered inter-token interval, measured at the socket write.",
                lb,
                LAT,
            ),
            e2e: hv(
                "ultrafast_inference_e2e_seconds",
                "End-to-end time of inference requests.",
                lb,
                LAT,
            ),
            queue: hv(
                "ultrafast_inference_queue_seconds",
                "Queue wait of inference requests (admission and backend).",
                lb,
                LAT,
            ),
            phase: hv(
                "ultrafast_inference_phase_seconds",
                "Latency breakdown by phase: network, queue, compute, output.",
                &["phase", "lane"],
                LAT,
            ),
            tokens: icv(
                "ultrafast_inference_tokens_total",
                "Tokens in (prompt) and out (completion).",
                &["model", "kind"],
            ),
            requests: icv(
                "ultrafast_inference_requests_total",
                "Inference requests by model, lane and outcome.",
                &["model", "lane", "outcome"],
            ),
            async_store: igv(
                "ultrafast_inference_async_store",
                "Async request store usage (entries, bytes).",
                &["what"],
            ),
            slo_state: igv(
                "ultrafast_slo_state",
                "SLA watchdog state of a model's lane: 0 ok, 1 at_risk, 2 violated.",
                &["model", "lane"],
            ),
            slo_transitions: icv(
                "ultrafast_slo_transitions_total",
                "SLA watchdog state changes.",
                &["model", "lane", "from", "to"],
            ),
            fallback_requests: icv(
                "ultrafast_fallback_requests_total",
                "Requests sent to a lane's fallback model while the primary is violated.",
                &["model", "lane", "fallback"],
            ),
            hedges: icv(
                "ultrafast_upstream_hedges_total",
                "First-token hedges to a second upstream member (sent, won).",
                &["model", "outcome"],
            ),
            failovers: icv(
                "ultrafast_upstream_failovers_total",
                "Streams broken after their first token: continued on another member (ok) or ended (failed).",
                &["model", "outcome"],
            ),
            step: h(
                "ultrafast_engine_step_seconds",
                "Engine step time.",
                vec![
                    0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.1, 0.25, 0.5, 1.0,
                ],
            ),
            batch_seqs: h(
                "ultrafast_engine_batch_sequences",
                "Sequences per engine step.",
                batch.clone(),
            ),
            batch_tokens: h(
                "ultrafast_engine_batch_tokens",
                "Tokens per engine step.",
                batch,
            ),
            kv_blocks: igv(
                "ultrafast_engine_kv_blocks",
                "KV cache blocks by state (used, free, cached).",
                &["model", "state"],
            ),
            prefix_hit: gv(
                "ultrafast_engine_prefix_cache_hit_ratio",
                "Full prompt blocks found in the prefix cache / all full prompt blocks.",
                &["model"],
            ),
            preemptions: icv(
                "ultrafast_engine_preemptions_total",
                "Sequences preempted (recomputed later).",
                &["model"],
            ),
            interrupted: icv(
                "ultrafast_engine_steps_interrupted_total",
                "Steps given up part way so that a better lane's new request starts at once.",
                &["model"],
            ),
            engine_queue: igv(
                "ultrafast_engine_queue_depth",
                "Sequences waiting in the engine, by lane rank.",
                &["model", "rank"],
            ),
            startup: gv(
                "ultrafast_engine_startup_seconds",
                "Model start-up time by phase (load includes fetch, warmup).",
                &["model", "phase"],
            ),
            device: igv(
                "ultrafast_engine_device_info",
                "An in-process model's device (auto resolved: cpu, cuda:N) and runner (kernels, threads, KV precision); always 1",
                &["model", "device", "runner"],
            ),
            ready: igv(
                "ultrafast_engine_ready",
                "1 when the model is loaded and warmed up.",
                &["model"],
            ),
            device_labels: Mutex::new(Default::default()),
            vllm: super::vllm::VllmMetrics::new(r),
            engines: Mutex::new(Vec::new()),
        }
    }

    /// The hedge and failover counters of upstream model `model`.
    pub fn upstream_counters(&self, model: &str) -> crate::inference::upstream::Counters {
        crate::inference::upstream::Counters {
            hedges_sent: self.hedges.with_label_values(&[model, "sent"]),
            hedges_won: self.hedges.with_label_values(&[model, "won"]),
            failovers: self.failovers.with_label_values(&[model, "ok"]),
            failovers_failed: self.failovers.with_label_values(&[model, "failed"]),
        }
    }

    /// Step observer for a new engine.
    pub fn steps(&self) -> Arc<Steps> {
        Arc::new(Steps {
            step: self.step.clone(),
            seqs: self.batch_seqs.clone(),
            tokens: self.batch_tokens.clone(),
        })
    }

    /// Export an engine's gauges on every scrape.
    pub fn watch(&self, name: &str, svc: Arc<EngineService>) {
        let mut g = self.engines.lock();
        // A model reloaded live replaces its old engine here.
        g.retain(|(_, n, _, _)| n != name);
        g.push((svc, name.to_string(), [0; 2], [0; 2]));
    }

    /// Stop exporting the engine of a removed model.
    pub fn unwatch(&self, name: &str) {
        self.engines.lock().retain(|(_, n, _, _)| n != name);
        let _ = self.ready.remove_label_values(&[name]);
        self.forget_device(name);
        self.vllm.remove(name);
    }

    /// Drop the device series of `model` (a reload may change it).
    fn forget_device(&self, model: &str) {
        if let Some((d, r)) = self.device_labels.lock().remove(model) {
            let _ = self
                .device
                .remove_label_values(&[model, d.as_str(), r.as_str()]);
        }
    }

    /// Fill the fair-share gauges from every model's gate and engine
    /// (called on scrape; rewritten whole, so a tenant no longer among
    /// the most served leaves the exposition).
    pub fn refresh_fair(&self, cfg: &dyn super::live::Live) {
        self.fair_virtual.reset();
        self.fair_served.reset();
        let lane_of = |rank: u32| {
            cfg.lanes()
                .iter()
                .find(|l| l.rank == rank)
                .map_or_else(|| rank.to_string(), |l| l.name.clone())
        };
        let set = |model: &str, lane: &str, s: &ultrafast_engine::fair::Share| {
            let labels = [model, lane, &*s.name];
            self.fair_virtual.with_label_values(&labels).set(s.counter);
            self.fair_served
                .with_label_values(&labels)
                .set(s.served as f64);
        };
        for (name, model) in cfg.models() {
            let Some(gate) = &model.gate else { continue };
            for (lane, shares) in gate.shares(FAIR_TENANTS) {
                for s in &shares {
                    set(name, &lane, s);
                }
            }
        }
        for (svc, name, _, _) in self.engines.lock().iter() {
            let Some(e) = svc.engine() else { continue };
            for (rank, s) in e.fair_shares() {
                set(name, &lane_of(rank), &s);
            }
        }
    }

    /// Read engine counters into the gauges (called on scrape).
    pub fn refresh(&self) {
        let mut engines = self.engines.lock();
        for (svc, name, seen, seen_prefix) in engines.iter_mut() {
            let name = name.as_str();
            let ready = svc.readiness() == Readiness::Ready;
            self.ready.with_label_values(&[name]).set(ready as i64);
            let t = svc.times();
            if let Some(d) = t.load {
                self.startup
                    .with_label_values(&[name, "load"])
                    .set(d.as_secs_f64());
            }
            if let Some(d) = t.warmup {
                self.startup
                    .with_label_values(&[name, "warmup"])
                    .set(d.as_secs_f64());
            }
            let Some(e) = svc.engine() else { continue };
            let device = e.device().to_string();
            let now = (device, e.runner().to_string());
            if self.device_labels.lock().get(name) != Some(&now) {
                self.forget_device(name);
                self.device
                    .with_label_values(&[name, now.0.as_str(), now.1.as_str()])
                    .set(1);
                self.device_labels.lock().insert(name.to_string(), now);
            }
            let p = e.pool_stats();
            self.kv_blocks
                .with_label_values(&[name, "used"])
                .set(p.used as i64);
            self.kv_blocks
                .with_label_values(&[name, "free"])
                .set(p.free as i64);
            self.kv_blocks
                .with_label_values(&[name, "cached"])
                .set(p.cached as i64);
            let lookups = p.hits + p.misses;
            let ratio = if lookups == 0 {
                0.0
            } else {
                p.hits as f64 / lookups as f64
            };
            self.prefix_hit.with_label_values(&[name]).set(ratio);
            let s = e.stats();
            let block = e.block_size() as u64;
            let now = super::vllm::EngineNow {
                running: s.running.load(Ordering::Relaxed),
                waiting: s.waiting.load(Ordering::Relaxed),
                used_blocks: p.used,
                total_blocks: p.used + p.free + p.cached,
                hit_tokens: p.hits * block,
                queried_tokens: lookups * block,
            };
            self.vllm.refresh(name, &now, seen_prefix);
            let counters = [
                (&self.preemptions, &s.preemptions),
                (&self.interrupted, &s.interrupted),
            ];
            for ((family, count), seen) in counters.into_iter().zip(seen.iter_mut()) {
                let now = count.load(Ordering::Relaxed);
                family
                    .with_label_values(&[name])
                    .inc_by(now.saturating_sub(*seen));
                *seen = now;
            }
            for (rank, n) in s.waiting_by_rank.iter().enumerate() {
                let r = rank.to_string();
                self.engine_queue
                    .with_label_values(&[name, &r])
                    .set(n.load(Ordering::Relaxed) as i64);
            }
        }
    }
}
