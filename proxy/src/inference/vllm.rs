//! Engine metrics under vLLM's names (`vllm:*`, label `model_name`), with
//! vLLM's meanings and buckets, so that tools built for vLLM (the Gateway
//! API Inference Extension's endpoint picker, llm-d, vLLM's dashboards)
//! read an ultrafast instance that hosts a model like a vLLM server. They
//! exist beside the `ultrafast_*` families, never instead of them, and only
//! for in-process engine models.

use prometheus::{GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};
use std::time::Duration;

use crate::prom::must;

// vLLM v1's buckets (vllm/v1/metrics/loggers.py), so that a dashboard's
// histogram_quantile reads the same resolution from either server.
const TTFT: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const E2E: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// The `vllm:*` families.
pub struct VllmMetrics {
    running: GaugeVec,
    waiting: GaugeVec,
    kv_usage: GaugeVec,
    prefix_hits: IntCounterVec,
    prefix_queries: IntCounterVec,
    ttft: HistogramVec,
    itl: HistogramVec,
    e2e: HistogramVec,
    prompt: IntCounterVec,
    generation: IntCounterVec,
}

/// One engine model's request-side handles, resolved once per request.
pub struct VllmRequest {
    ttft: prometheus::Histogram,
    itl: prometheus::Histogram,
    e2e: prometheus::Histogram,
    prompt: prometheus::IntCounter,
    generation: prometheus::IntCounter,
}

impl VllmRequest {
    /// The first token, timed from the request's arrival.
    pub fn ttft(&self, d: Duration) {
        self.ttft.observe(d.as_secs_f64());
    }

    /// A later token, timed from the one before.
    pub fn itl(&self, d: Duration) {
        self.itl.observe(d.as_secs_f64());
    }

    /// A finished request.
    pub fn done(&self, e2e: Duration, prompt: u64, generated: u64) {
        self.e2e.observe(e2e.as_secs_f64());
        self.prompt.inc_by(prompt);
        self.generation.inc_by(generated);
    }
}

/// What an engine's scrape-time state is, for the gauges.
pub struct EngineNow {
    /// Sequences in the running batch.
    pub running: usize,
    /// Sequences waiting for their first step.
    pub waiting: usize,
    /// Blocks referenced by a sequence.
    pub used_blocks: usize,
    /// All blocks of the pool.
    pub total_blocks: usize,
    /// Prompt tokens found in the prefix cache, so far.
    pub hit_tokens: u64,
    /// Prompt tokens looked up in the prefix cache, so far.
    pub queried_tokens: u64,
}

impl VllmMetrics {
    /// Create and register the families.
    pub fn new(r: &Registry) -> Self {
        let l = &["model_name"];
        let reg = |c: Box<dyn prometheus::core::Collector>| must(r.register(c));
        let gauge = |name: &str, help: &str| {
            let g = must(GaugeVec::new(Opts::new(name, help), l));
            reg(Box::new(g.clone()));
            g
        };
        let counter = |name: &str, help: &str| {
            let c = must(IntCounterVec::new(Opts::new(name, help), l));
            reg(Box::new(c.clone()));
            c
        };
        let hist = |name: &str, help: &str, b: &[f64]| {
            let h = must(HistogramVec::new(
                HistogramOpts::new(name, help).buckets(b.to_vec()),
                l,
            ));
            reg(Box::new(h.clone()));
            h
        };
        VllmMetrics {
            running: gauge(
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
            ),
            waiting: gauge(
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
            ),
            kv_usage: gauge(
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
            ),
            prefix_hits: counter(
                "vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.",
            ),
            prefix_queries: counter(
                "vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.",
            ),
            ttft: hist(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                TTFT,
            ),
            itl: hist(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                ITL,
            ),
            e2e: hist(
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                E2E,
            ),
            prompt: counter(
                "vllm:prompt_tokens_total",
                "Number of prefill tokens processed.",
            ),
            generation: counter(
                "vllm:generation_tokens_total",
                "Number of generation tokens processed.",
            ),
        }
    }

    /// Handles for one request to engine model `model`.
    pub fn request(&self, model: &str) -> VllmRequest {
        let l = &[model];
        VllmRequest {
            ttft: self.ttft.with_label_values(l),
            itl: self.itl.with_label_values(l),
            e2e: self.e2e.with_label_values(l),
            prompt: self.prompt.with_label_values(l),
            generation: self.generation.with_label_values(l),
        }
    }

    /// Set the gauges of `model` and advance its prefix-cache counters to
    /// the engine's totals (`seen` holds what was already added).
    pub fn refresh(&self, model: &str, now: &EngineNow, seen: &mut [u64; 2]) {
        let l = &[model];
        self.running.with_label_values(l).set(now.running as f64);
        self.waiting.with_label_values(l).set(now.waiting as f64);
        let usage = if now.total_blocks == 0 {
            0.0
        } else {
            now.used_blocks as f64 / now.total_blocks as f64
        };
        self.kv_usage.with_label_values(l).set(usage);
        for (family, (total, seen)) in [&self.prefix_hits, &self.prefix_queries]
            .into_iter()
            .zip([now.hit_tokens, now.queried_tokens].into_iter().zip(seen))
        {
            family
                .with_label_values(l)
                .inc_by(total.saturating_sub(*seen));
            *seen = (*seen).max(total);
        }
    }

    /// Drop the series of a removed model.
    pub fn remove(&self, model: &str) {
        let l = &[model];
        for g in [&self.running, &self.waiting, &self.kv_usage] {
            let _ = g.remove_label_values(l);
        }
    }
}
