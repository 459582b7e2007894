//! The file format users write: plain serde structs mirroring `ultrafast.toml`.
//!
//! Every section has defaults (`#[serde(default)]`) and rejects unknown keys
//! (`deny_unknown_fields`) so a typo is an error with a line number, not a
//! silently ignored setting. Nothing here is interpreted: `validate` turns
//! these structs into the typed runtime config.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The whole configuration file.
#[derive(Debug, Default, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct FileConfig {
    /// Process-wide settings (threads, shutdown, pid file).
    pub server: ServerSection,
    /// The admin listener (metrics, health).
    pub admin: AdminSection,
    /// Access logging.
    pub log: LogSection,
    /// Downstream request limits and timeouts.
    pub limits: LimitsSection,
    /// Traffic listeners.
    pub listeners: Vec<ListenerSection>,
    /// Routes, matched by host then path.
    pub routes: Vec<RouteSection>,
    /// Upstream pools by name.
    pub pools: BTreeMap<String, PoolSection>,
    /// Priority lanes by name (default: ultra, standard, batch).
    pub lanes: BTreeMap<String, LaneSection>,
    /// Named rate limits and token budgets, referenced by routes.
    pub rate_limits: BTreeMap<String, RateLimitSection>,
    /// API keys (absent: no key file).
    pub api_keys: Option<ApiKeysSection>,
    /// Resolver for upstream names.
    pub dns: DnsSection,
    /// Reload behaviour.
    pub reload: ReloadSection,
    /// Served models by the name clients use (`/v1/models`).
    pub models: BTreeMap<String, ModelSection>,
    /// Inference front settings (async mode store, heartbeats).
    pub inference: InferenceSection,
    /// Traces over OTLP/HTTP (off unless an endpoint is set).
    pub tracing: TracingSection,
    /// State shared by several instances through Redis (absent: none).
    pub cluster: Option<ClusterSection>,
}

/// `[cluster]`: rate limits, token budgets, async requests and membership
/// shared by every instance that names the same Redis. Read at start: a
/// change takes effect at the next start or graceful upgrade.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterSection {
    /// `redis://[user:password@]host:port/db`, or `rediss://` for TLS.
    pub redis: String,
    /// The most any request waits on the store, in ms; past it the limit's
    /// `on_store_error` decides.
    pub timeout_ms: u64,
    /// Prefix of every key and channel (several clusters on one Redis).
    pub prefix: String,
    /// How often this instance renews its membership, in ms; it counts as
    /// gone after three missed beats.
    pub heartbeat_ms: u64,
    /// This instance's id (default: host name, pid and a random suffix).
    pub instance: String,
    /// Connections to the store, each multiplexed (requests pipeline on
    /// it); operations spread over them round robin.
    pub pool_size: usize,
    /// Fair shares while the store is down: `local` (and `open`): each
    /// instance's own counters; `closed`: inference requests are refused
    /// (503 `store_unavailable`) until it returns.
    pub fair_on_store_error: String,
}

impl Default for ClusterSection {
    fn default() -> Self {
        Self {
            redis: String::new(),
            timeout_ms: 50,
            prefix: "ultrafast:".into(),
            heartbeat_ms: 1000,
            instance: String::new(),
            pool_size: 4,
            fair_on_store_error: "local".into(),
        }
    }
}

/// `[tracing]`: OpenTelemetry traces of inference requests. Read at
/// start: a change takes effect at the next start or graceful upgrade.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct TracingSection {
    /// The collector's OTLP/HTTP URL (`http://host:4318`, or a full
    /// `.../v1/traces` URL); empty: no traces.
    pub otlp_endpoint: String,
    /// `service.name` of the spans.
    pub service_name: String,
}

impl Default for TracingSection {
    fn default() -> Self {
        Self {
            otlp_endpoint: String::new(),
            service_name: "ultrafast".into(),
        }
    }
}

/// `[models.NAME]`: a model served on inference routes, by the in-process
/// engine or by a pool of OpenAI-compatible upstream servers.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSection {
    /// `engine` (in-process) or `upstream` (a pool of OpenAI-compatible servers).
    pub backend: String,
    /// Engine: a known model name, `hf:owner/repo/file.gguf`, or a path to a GGUF file.
    pub source: String,
    /// Engine: expected sha256 of the GGUF (hf and path sources).
    pub sha256: String,
    /// Engine: KV cache blocks.
    pub kv_blocks: usize,
    /// Engine: tokens per KV block.
    pub block_size: usize,
    /// Engine: KV cache precision, `f16` (default) or `f32`.
    pub kv_cache: String,
    /// Engine: where it runs, `auto` (default: a CUDA GPU when one can
    /// run it, else the CPU), `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// Engine: sequences per step at most.
    pub max_num_seqs: usize,
    /// Engine: tokens per step at most (decodes plus prefill chunks).
    pub max_batched_tokens: usize,
    /// Engine: warm-up prompt lengths in tokens, run before `/readyz` turns ready.
    pub warmup_prompt_lens: Vec<usize>,
    /// `max_tokens` when a request gives none (0 = what fits in the context).
    pub default_max_tokens: usize,
    /// Upstream: the pool of servers.
    pub pool: String,
    /// Upstream: model name sent upstream (default: this model's name).
    pub upstream_model: String,
    /// Upstream: `least_outstanding` (default) or `prefix_affinity`.
    pub lb: String,
    /// Upstream: prefix affinity's bounded-load factor.
    pub affinity_load_factor: f64,
    /// Upstream: send the lane as the server's priority field: `vllm` or `none`.
    pub priority_field: String,
    /// Upstream: tries (members) before the first token; never after it.
    pub attempts: u32,
    /// Upstream: longest silence (ms) before the first token or between tokens.
    pub stall_timeout_ms: u64,
    /// Requests generating at once (admission gate; 0 = no gate).
    pub max_concurrency: usize,
    /// Requests waiting at most, all lanes (0 = sum of lane queue lengths).
    pub max_queued: usize,
    /// Upstream: prior prompt throughput (tokens/s) of the latency model
    /// before it has learned from the upstream's own streams.
    pub prefill_tokens_per_s: f64,
    /// Upstream: prior single-stream decode speed (tokens/s), likewise.
    pub decode_tokens_per_s: f64,
    /// Seconds of recent first tokens the latency model calibrates its
    /// predictions by (see the README's "How the model corrects itself").
    pub calibration_window_s: u64,
    /// Another `[models.*]` that takes a lane's new requests while the
    /// watchdog holds this model's lane `violated` (empty: none).
    pub fallback: String,
    /// The SLA watchdog of this model (absent: not watched).
    pub watchdog: Option<WatchdogSection>,
    /// Upstream: first-token hedging (absent: off).
    pub hedge: Option<HedgeSection>,
    /// Upstream: the model's context length in tokens (0 = unknown): a
    /// request that cannot fit is refused with `context_length_exceeded`.
    pub max_model_len: usize,
    /// Sampling defaults for the fields a request omits (as vLLM applies
    /// a model's `generation_config`).
    pub sampling: SamplingSection,
}

/// `sampling = { ... }` of a model: what a request that omits a field
/// gets (unset: the API's own default).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingSection {
    /// 0 to 2 (0: greedy).
    pub temperature: Option<f64>,
    /// 0 to 1.
    pub top_p: Option<f64>,
    /// 0 = off.
    pub top_k: Option<u64>,
    /// 0 to 1.
    pub min_p: Option<f64>,
    /// Above 0, at most 10 (1 = off).
    pub repetition_penalty: Option<f64>,
    /// -2 to 2.
    pub frequency_penalty: Option<f64>,
    /// -2 to 2.
    pub presence_penalty: Option<f64>,
}

/// `watchdog = { ... }` of a model: rolling TTFT and inter-token latency
/// percentiles per lane against the lane's targets, with hysteresis.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct WatchdogSection {
    /// Length of one judged window (ms).
    pub window_ms: u64,
    /// Consecutive bad windows that turn a lane `violated`.
    pub enter_after: u32,
    /// Consecutive good windows that return it to `ok`.
    pub leave_after: u32,
    /// Samples a window needs to be judged; fewer, and probes are sent.
    pub min_samples: usize,
    /// Interval between synthetic probes while real traffic is too thin
    /// (or the lane is on its fallback).
    pub probe_interval_ms: u64,
    /// Tokens a probe asks for.
    pub probe_max_tokens: usize,
    /// The percentile judged against the targets: `p50`, `p90` or `p99`.
    pub percentile: String,
    /// TTFT target (ms) for every lane of this model (0: each lane's
    /// `ttft_slo_ms`).
    pub ttft_ms: u64,
    /// Inter-token target (ms) for every lane (0: each lane's `itl_slo_ms`).
    pub itl_ms: u64,
}

impl Default for WatchdogSection {
    fn default() -> Self {
        Self {
            window_ms: 10_000,
            enter_after: 3,
            leave_after: 3,
            min_samples: 5,
            probe_interval_ms: 1_000,
            probe_max_tokens: 2,
            percentile: "p99".into(),
            ttft_ms: 0,
            itl_ms: 0,
        }
    }
}

/// `hedge = { after_ms = N }` or `{ after = "p90" }` of an upstream model.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct HedgeSection {
    /// A fixed delay before the hedge (ms; 0 = use `after`).
    pub after_ms: u64,
    /// A percentile of the model's live TTFT (`p50` .. `p99.9`).
    pub after: String,
    /// Hedges at most this fraction of requests (sliding 10 s window).
    pub max_ratio: f64,
}

impl Default for HedgeSection {
    fn default() -> Self {
        Self {
            after_ms: 0,
            after: String::new(),
            max_ratio: 0.1,
        }
    }
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            backend: "engine".into(),
            source: String::new(),
            sha256: String::new(),
            kv_blocks: 512,
            block_size: 16,
            kv_cache: "f16".into(),
            device: "auto".into(),
            max_num_seqs: 16,
            max_batched_tokens: 24,
            warmup_prompt_lens: vec![16, 128],
            default_max_tokens: 0,
            pool: String::new(),
            upstream_model: String::new(),
            lb: "least_outstanding".into(),
            affinity_load_factor: 1.25,
            priority_field: "none".into(),
            attempts: 2,
            stall_timeout_ms: 30_000,
            max_concurrency: 64,
            max_queued: 0,
            prefill_tokens_per_s: 2000.0,
            decode_tokens_per_s: 30.0,
            calibration_window_s: 60,
            fallback: String::new(),
            watchdog: None,
            hedge: None,
            max_model_len: 0,
            sampling: SamplingSection::default(),
        }
    }
}

/// `[inference]`: the inference front.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct InferenceSection {
    /// How long finished async results are kept (seconds).
    pub async_ttl_s: u64,
    /// Async requests kept at most (queued, running and finished).
    pub async_max_entries: usize,
    /// Bytes of async events and results kept at most.
    pub async_max_bytes: usize,
    /// SSE comment heartbeat interval while a stream waits (ms).
    pub heartbeat_ms: u64,
    /// SSE comment interval on a stream idle between tokens (ms): a
    /// keepalive for intermediaries, never below `heartbeat_ms`.
    pub keepalive_ms: u64,
    /// Prompt bytes tokenized at once, at most; a request over it is
    /// refused with 503 `tokenizer_overloaded`.
    pub tokenize_max_bytes: usize,
    /// Who a request without an API key is served for, for fair shares
    /// inside a lane (a key's request is its key's): `client_ip`, `user`
    /// (the body's end-user field) or `header:NAME`.
    pub tenant: String,
    /// What a prompt token costs a tenant (fair shares).
    pub fair_input_cost: f64,
    /// What an output token costs a tenant (fair shares).
    pub fair_output_cost: f64,
}

impl Default for InferenceSection {
    fn default() -> Self {
        Self {
            async_ttl_s: 600,
            async_max_entries: 1024,
            async_max_bytes: 64 << 20,
            heartbeat_ms: 1000,
            keepalive_ms: 15_000,
            tokenize_max_bytes: 4 << 20,
            tenant: "client_ip".into(),
            fair_input_cost: 1.0,
            fair_output_cost: 2.0,
        }
    }
}

/// `[dns]`: how upstream host names are resolved and refreshed.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct DnsSection {
    /// Nameservers as `ip:port`; empty = the system's (`/etc/resolv.conf`).
    pub nameservers: Vec<String>,
    /// Refresh a name when this fraction of its TTL has passed.
    pub prefetch_fraction: f64,
    /// TTL floor in seconds.
    pub min_ttl_s: u64,
    /// TTL ceiling in seconds.
    pub max_ttl_s: u64,
    /// Seconds past its TTL that a last good answer is served while the resolver fails.
    pub stale_max_s: u64,
    /// Per-query timeout in ms.
    pub timeout_ms: u64,
    /// Consult `/etc/hosts` before DNS.
    pub use_hosts_file: bool,
}

impl Default for DnsSection {
    fn default() -> Self {
        Self {
            nameservers: Vec::new(),
            prefetch_fraction: 0.8,
            min_ttl_s: 1,
            max_ttl_s: 3600,
            stale_max_s: 300,
            timeout_ms: 2000,
            use_hosts_file: true,
        }
    }
}

/// `[reload]`: optional file watching.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReloadSection {
    /// Reload when the config file changes.
    pub watch: bool,
    /// How often to look, in ms.
    pub watch_interval_ms: u64,
}

impl Default for ReloadSection {
    fn default() -> Self {
        Self {
            watch: false,
            watch_interval_ms: 1000,
        }
    }
}

/// `[lanes.NAME]`: a priority lane.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct LaneSection {
    /// Lower ranks are served first.
    pub rank: u32,
    /// Most requests waiting in this lane, per pool.
    pub queue_len: usize,
    /// Longest wait in ms; a request that cannot be served in time is refused at once.
    pub max_wait_ms: u64,
    /// Fraction of each pool's concurrency reserved for this lane.
    pub reserved_share: f64,
    /// May evict queued lower-lane requests when a pool's queue is full.
    pub preempt: bool,
    /// Fraction of `queue_len` above which requests are shed with rising probability.
    pub high_watermark: f64,
    /// Shortest-work-first weight: microseconds of queue position per unit of work.
    pub sjf_us_per_unit: u64,
    /// Token cadence smoothing of streams: `off`, `fixed` or `adaptive`
    /// (default: `adaptive` for the lane named `ultra`, else `off`).
    pub pace: String,
    /// Pacing interval in ms (`fixed`), or the shortest interval (`adaptive`).
    pub pace_interval_ms: u64,
    /// Tokens the pacer may hold back at most; beyond that it catches up.
    pub pace_max_lead: usize,
    /// Time-to-first-token target (p99, ms) of inference requests in this
    /// lane: a request predicted to miss it is refused at once (0 = no
    /// target; only `max_wait_ms` applies).
    pub ttft_slo_ms: u64,
    /// A request that cannot meet the target even on an idle backend:
    /// `reject` (422) or `downgrade` (to the next lower lane).
    pub on_miss: String,
    /// The lane's inter-token latency target for the watchdog (ms; 0 = not judged).
    pub itl_slo_ms: u64,
    /// A request for this lane from a key (or an anonymous request on a
    /// route) not granted it: `reject` (403 `lane_not_allowed`) or
    /// `downgrade` (to the next lower lane it is granted).
    pub on_forbidden: String,
}

impl Default for LaneSection {
    fn default() -> Self {
        Self {
            rank: 1,
            queue_len: 1024,
            max_wait_ms: 10_000,
            reserved_share: 0.0,
            preempt: false,
            high_watermark: 1.0,
            sjf_us_per_unit: 0,
            pace: String::new(),
            pace_interval_ms: 0,
            pace_max_lead: 8,
            ttft_slo_ms: 0,
            on_miss: "reject".into(),
            itl_slo_ms: 0,
            on_forbidden: "reject".into(),
        }
    }
}

/// `[rate_limits.NAME]`: a request rate (GCRA), a token budget, or both,
/// keyed the same way.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RateLimitSection {
    /// `client_ip`, `api_key` (Authorization: Bearer), `api_key:HEADER`,
    /// `header:NAME`, `route` or `pool`.
    pub key: String,
    /// Sustained requests per second. Unset: 10, unless the section sets
    /// `tokens_per_min`, in which case it limits tokens only.
    pub rate_per_s: Option<f64>,
    /// Requests allowed at once above the sustained rate.
    pub burst: u32,
    /// Sustained LLM tokens per minute (prompt plus completion); unset: no
    /// token budget.
    pub tokens_per_min: Option<f64>,
    /// Tokens a key may spend at once, and the most one request may reserve
    /// (default: one minute's worth, `tokens_per_min`).
    pub burst_tokens: Option<u64>,
    /// Most keys tracked; idle keys are evicted first.
    pub max_keys: usize,
    /// With `[cluster]`, what a decision does while Redis is unreachable:
    /// `local` (per-instance limits divided by the live instances last
    /// seen), `open` (allow) or `closed` (refuse with 503).
    pub on_store_error: String,
}

impl RateLimitSection {
    /// Request rate used when neither a rate nor a token budget is set.
    pub const DEFAULT_RATE_PER_S: f64 = 10.0;
}

impl Default for RateLimitSection {
    fn default() -> Self {
        Self {
            key: "client_ip".into(),
            rate_per_s: None,
            burst: 20,
            tokens_per_min: None,
            burst_tokens: None,
            max_keys: 100_000,
            on_store_error: "local".into(),
        }
    }
}

/// `[api_keys]`: API keys from a separate file, re-read when it changes.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApiKeysSection {
    /// The key file (TOML, `[[keys]]`), relative to this config file's
    /// directory unless absolute.
    pub file: String,
    /// How often to look for changes to the key file, in ms (0 = only on
    /// config reload).
    pub watch_interval_ms: u64,
    /// With `[cluster]`, what the keys' own rates and budgets do while Redis
    /// is unreachable: `local`, `open` or `closed` (as `[rate_limits]`).
    pub on_store_error: String,
}

impl Default for ApiKeysSection {
    fn default() -> Self {
        Self {
            file: String::new(),
            watch_interval_ms: 2000,
            on_store_error: "local".into(),
        }
    }
}

/// `[server]`: process-wide settings.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerSection {
    /// Worker threads for the traffic service (0 = one per CPU).
    pub threads: usize,
    /// Let idle worker threads steal tasks from busy ones.
    pub work_stealing: bool,
    /// Seconds a SIGTERM waits for in-flight requests before exiting.
    pub shutdown_grace_period_s: u64,
    /// Seconds given to runtimes to stop after the grace period.
    pub shutdown_timeout_s: u64,
    /// Pid file; empty = derived from the config file path.
    pub pid_file: String,
    /// Unix socket used to hand listening sockets to a new binary on upgrade;
    /// empty = derived from the config file path.
    pub upgrade_sock: String,
    /// Idle upstream connections kept for reuse, across all pools.
    pub upstream_keepalive_pool_size: usize,
    /// Merge runs of slashes in a path before matching routes and keying
    /// the cache (nginx's `merge_slashes`, on by default there too).
    pub merge_slashes: bool,
}

impl Default for ServerSection {
    fn default() -> Self {
        Self {
            threads: 0,
            work_stealing: true,
            shutdown_grace_period_s: 30,
            shutdown_timeout_s: 5,
            pid_file: String::new(),
            upgrade_sock: String::new(),
            upstream_keepalive_pool_size: 1024,
            merge_slashes: true,
        }
    }
}

/// `[admin]`: the admin listener.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminSection {
    /// Address of the admin listener; empty disables it.
    pub listen: String,
    /// Bearer token every admin endpoint but `/healthz` and `/readyz`
    /// needs; required when `listen` is not a loopback address.
    pub token: String,
    /// A file holding the token (first line), instead of `token`.
    pub token_file: String,
}

impl AdminSection {
    /// The token from `token` or `token_file` (a path relative to the
    /// config file's folder); on error the field at fault and why.
    pub fn resolve_token(
        &self,
        config: &std::path::Path,
    ) -> Result<Option<String>, (&'static str, String)> {
        match (self.token.trim(), self.token_file.trim()) {
            ("", "") => Ok(None),
            (t, "") => Ok(Some(t.to_string())),
            ("", file) => {
                let p = config
                    .parent()
                    .unwrap_or(std::path::Path::new("."))
                    .join(file);
                let s = std::fs::read_to_string(&p)
                    .map_err(|e| ("token_file", format!("{}: {e}", p.display())))?;
                Ok(s.lines().next().map(|l| l.trim().to_string()))
            }
            _ => Err(("token", "set `token` or `token_file`, not both".into())),
        }
    }
}

impl Default for AdminSection {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:9090".into(),
            token: String::new(),
            token_file: String::new(),
        }
    }
}

/// `[log]`: access logging.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogSection {
    /// `"stdout"`, `"off"`, or a file path.
    pub access_log: String,
    /// `"json"` (one object per line) or `"combined"` (nginx's format).
    pub format: String,
}

impl Default for LogSection {
    fn default() -> Self {
        Self {
            access_log: "stdout".into(),
            format: "json".into(),
        }
    }
}

/// `[limits]`: downstream request limits.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsSection {
    /// Largest accepted request body in bytes (413 above it), like
    /// nginx's `client_max_body_size`.
    pub client_max_body_bytes: u64,
    /// Largest accepted request head (request line + headers) in bytes (431 above it).
    pub max_header_bytes: usize,
    /// Most request headers accepted (431 above it).
    pub max_headers: usize,
    /// Seconds an idle downstream keepalive connection is kept open.
    pub keepalive_timeout_s: u64,
    /// Milliseconds a client has to send a whole request head, from the
    /// accept (first request) or its first byte (later ones), like
    /// nginx's `client_header_timeout`; 0 = no deadline.
    pub client_header_timeout_ms: u64,
    /// Open traffic connections at most (all listeners); more are closed at
    /// once, like nginx's `worker_connections`; 0 = no cap.
    pub max_connections: usize,
    /// Most ms between two reads of a request body before the connection
    /// is closed (nginx `client_body_timeout`); 0 = no limit.
    pub client_body_timeout_ms: u64,
    /// Most ms one write to a client may wait (a client that stops
    /// reading) before the connection is closed (nginx `send_timeout`);
    /// 0 = no limit.
    pub send_timeout_ms: u64,
    /// On an `h2c` listener, ms a new connection has to show whether it
    /// speaks HTTP/2 (its 24-byte preface) or HTTP/1; 0 = the head deadline
    /// (`client_header_timeout_ms`, as nginx times the preface).
    pub h2c_preface_timeout_ms: u64,
    /// Read a proxied request body whole before an upstream connection is
    /// taken (nginx `proxy_request_buffering on`), so a slow client holds
    /// no upstream connection; a route can turn it off.
    pub request_buffering: bool,
    /// KiB of a buffered body held in memory (nginx
    /// `client_body_buffer_size`); the rest, up to `client_max_body_bytes`,
    /// goes to an unlinked temporary file. At most 64.
    pub client_body_buffer_kb: usize,
    /// Directory of those temporary files (nginx
    /// `client_body_temp_path`); empty = the system's temporary directory.
    pub client_body_temp_path: String,
    /// Read a proxied response from the origin as fast as it sends and
    /// give its connection back, serving a slow client from a buffer
    /// (nginx `proxy_buffering on`); a route can turn it off.
    pub response_buffering: bool,
    /// KiB of a buffered response held in memory per connection (nginx
    /// `proxy_buffers`); the rest goes to an unlinked temporary file.
    pub response_buffer_kb: usize,
    /// MiB of buffered responses in memory, all connections together;
    /// past it, bytes go to the temporary files.
    pub response_buffers_total_mb: u64,
    /// Most bytes of one response's temporary file (nginx
    /// `proxy_max_temp_file_size`); 0 = memory only. Past it, and past the
    /// totals, the response streams unbuffered.
    pub max_temp_file_bytes: u64,
    /// MiB of temporary files of buffered responses, all together.
    pub temp_files_total_mb: u64,
    /// Directory of those temporary files (nginx `proxy_temp_path`);
    /// empty = the system's temporary directory.
    pub proxy_temp_path: String,
    /// Upgraded (WebSocket) connections open at most, all listeners
    /// together; one more gets a 503; 0 = no cap.
    pub max_upgraded: usize,
    /// Seconds an upgraded connection's client may stay silent before it
    /// is closed (nginx `proxy_read_timeout` on a tunnel); 0 = no limit.
    pub upgraded_idle_timeout_s: u64,
}

impl Default for LimitsSection {
    fn default() -> Self {
        Self {
            client_max_body_bytes: 1 << 20,
            max_header_bytes: 32 * 1024,
            max_headers: 100,
            keepalive_timeout_s: 75,
            client_header_timeout_ms: 60_000,
            max_connections: 16_384,
            client_body_timeout_ms: 60_000,
            send_timeout_ms: 60_000,
            h2c_preface_timeout_ms: 0,
            request_buffering: true,
            client_body_buffer_kb: 16,
            client_body_temp_path: String::new(),
            response_buffering: true,
            response_buffer_kb: 32,
            response_buffers_total_mb: 256,
            max_temp_file_bytes: 1 << 30,
            temp_files_total_mb: 16 * 1024,
            proxy_temp_path: String::new(),
            max_upgraded: 1024,
            upgraded_idle_timeout_s: 60,
        }
    }
}

/// `[[listeners]]`: one traffic listener.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ListenerSection {
    /// Name used in logs and metrics.
    pub name: String,
    /// `ip:port` to listen on.
    pub address: String,
    /// TLS termination on this listener.
    pub tls: Option<TlsSection>,
    /// Accept HTTP/2 without TLS (prior knowledge) on a plain listener.
    pub h2c: bool,
    /// Answer every request with a 301 to `https://HOST:PORT/...` (0 = off).
    pub redirect_https_port: u16,
    /// This listener's `client_header_timeout_ms` (default: `[limits]`'s).
    pub client_header_timeout_ms: Option<u64>,
    /// This listener's `client_body_timeout_ms` (default: `[limits]`'s).
    pub client_body_timeout_ms: Option<u64>,
    /// This listener's `send_timeout_ms` (default: `[limits]`'s).
    pub send_timeout_ms: Option<u64>,
    /// This listener's `keepalive_timeout_s` (default: `[limits]`'s).
    pub keepalive_timeout_s: Option<u64>,
    /// This listener's `h2c_preface_timeout_ms` (default: `[limits]`'s).
    pub h2c_preface_timeout_ms: Option<u64>,
    /// Every connection opens with a PROXY protocol header (v1 or v2),
    /// whose client address is then the connection's (nginx `listen ...
    /// proxy_protocol` with `set_real_ip_from`).
    pub proxy_protocol: bool,
    /// The load balancers allowed to send it (addresses or CIDR blocks);
    /// connections from elsewhere are closed. Required with
    /// `proxy_protocol`.
    pub proxy_protocol_from: Vec<String>,
    /// Most time to receive the header, ms (default 5000; nginx
    /// `proxy_protocol_timeout`).
    pub proxy_protocol_timeout_ms: Option<u64>,
}

/// `tls = { ... }` of a listener.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsSection {
    /// Certificates, chosen by SNI.
    pub certs: Vec<CertSection>,
    /// Offer HTTP/2 in ALPN.
    pub h2: bool,
    /// Issue session tickets (TLS 1.3 and 1.2).
    pub session_tickets: bool,
    /// Seconds between ticket key rotations; a key is accepted for two periods.
    pub ticket_rotation_s: u64,
    /// Hex secret shared by instances behind one address (mode 0600).
    pub ticket_key_file: String,
    /// Sessions kept for stateful resumption (0 = off).
    pub session_cache_size: usize,
    /// A handshake that takes longer is closed.
    pub handshake_timeout_ms: u64,
    /// Send `Strict-Transport-Security: max-age=N` (0 = off).
    pub hsts_max_age_s: u64,
    /// Certificates ordered and renewed through ACME (RFC 8555).
    pub acme: Option<AcmeSection>,
    /// Also serve HTTP/3 (QUIC) on UDP at this listener's address.
    pub http3: bool,
    /// Concurrent request streams per HTTP/3 connection (nginx
    /// `http3_max_concurrent_streams`).
    pub http3_max_streams: u32,
    /// An HTTP/3 connection silent this long is closed (nginx
    /// `keepalive_timeout` for QUIC).
    pub http3_idle_timeout_ms: u64,
    /// HTTP/3 connections at most; more are refused at once.
    pub http3_max_connections: usize,
    /// Address validation with a QUIC Retry: `auto` (under load: many
    /// handshakes at once, or half the connection cap), `always`, `never`
    /// (nginx `quic_retry`).
    pub http3_retry: String,
    /// Accept 0-RTT data (nginx `ssl_early_data`); off: replayable. When
    /// on, only GET, HEAD and OPTIONS are forwarded before the handshake
    /// completes; other methods wait for it.
    pub http3_early_data: bool,
    /// `Alt-Svc: h3=":PORT"; ma=N` on this listener's TCP responses.
    pub http3_alt_svc_max_age_s: u64,
}

/// `acme = { ... }` of a listener's `tls`: a certificate for `domains`,
/// issued and renewed by an ACME directory (nginx-acme's `acme_issuer` and
/// `acme_certificate`).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct AcmeSection {
    /// The directory URL (`https://...`), e.g. Let's Encrypt's
    /// `https://acme-v02.api.letsencrypt.org/directory`.
    pub directory: String,
    /// The names the certificate is for (no wildcards: they need DNS-01).
    pub domains: Vec<String>,
    /// Account contacts, e.g. `["mailto:ops@example.com"]`.
    pub contact: Vec<String>,
    /// `http-01` (answered on the plain listeners) or `tls-alpn-01`
    /// (answered on this listener).
    pub challenge: String,
    /// PEM file of the CA that signs the directory's own HTTPS certificate
    /// (private CAs, tests); empty: the public web roots.
    pub trust_roots: String,
    /// Where the account key and the certificate are kept (mode 0700).
    pub state_dir: String,
    /// PEM file of the roots the directory issues under (Pebble's
    /// `/roots/0`, a private CA's root); empty: the web's roots. A
    /// certificate another instance shared is installed only if its chain
    /// verifies up to one of them for every domain.
    pub issuer_roots: String,
    /// A hex secret of at least 32 bytes (mode 0600), the same on every
    /// instance of a `[cluster]`: the issued chain and its key are sealed
    /// with it (ChaCha20-Poly1305) before they go to the cluster's store,
    /// and only what it opens is installed. Empty: nothing is shared, and
    /// each instance orders its own certificate (one at a time, under the
    /// cluster's lock).
    pub shared_key_file: String,
}

impl Default for AcmeSection {
    fn default() -> Self {
        Self {
            directory: String::new(),
            domains: Vec::new(),
            contact: Vec::new(),
            challenge: "http-01".into(),
            trust_roots: String::new(),
            state_dir: String::new(),
            issuer_roots: String::new(),
            shared_key_file: String::new(),
        }
    }
}

impl Default for TlsSection {
    fn default() -> Self {
        Self {
            certs: Vec::new(),
            h2: true,
            session_tickets: true,
            ticket_rotation_s: 12 * 3600,
            ticket_key_file: String::new(),
            session_cache_size: 20_480,
            handshake_timeout_ms: 10_000,
            hsts_max_age_s: 0,
            acme: None,
            http3: false,
            http3_max_streams: 128,
            http3_idle_timeout_ms: 60_000,
            http3_max_connections: 10_000,
            http3_retry: "auto".into(),
            http3_early_data: false,
            http3_alt_svc_max_age_s: 86_400,
        }
    }
}

/// One certificate of a TLS listener.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct CertSection {
    /// PEM chain, leaf first.
    pub cert: String,
    /// PEM private key.
    pub key: String,
    /// DER OCSP response to staple.
    pub ocsp: String,
    /// SNI names: exact or `*.suffix`.
    pub names: Vec<String>,
    /// Serve when no name matches.
    pub default: bool,
}

/// `[[routes]]`: one route.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouteSection {
    /// Name used in logs and metrics (defaults to `route<N>`).
    pub name: String,
    /// Host names this route serves: exact or `*.suffix`; empty = any host.
    pub hosts: Vec<String>,
    /// The path pattern.
    pub path: String,
    /// `prefix` (default), `exact`, `priority_prefix` (nginx `^~`) or `regex`.
    #[serde(rename = "match")]
    pub match_kind: String,
    /// Pool to proxy to.
    pub pool: Option<String>,
    /// A fixed response instead of proxying.
    #[serde(rename = "return")]
    pub fixed: Option<FixedSection>,
    /// A redirect instead of proxying.
    pub redirect: Option<RedirectSection>,
    /// Header rules for this route.
    pub headers: HeadersSection,
    /// `passthrough` (default: the client's Host), `upstream` (the member's
    /// address) or any other value, sent as the Host.
    pub upstream_host: String,
    /// What the origin is asked for: `normalized` (default: the path the
    /// route matched, dot segments resolved and `%XX` decoded, re-encoded
    /// where a target needs it, as nginx's `proxy_pass` with a URI sends
    /// it) or `original` (the client's target byte for byte, as
    /// `proxy_pass` without a URI). The cache key and the access log name
    /// the same target the origin is sent.
    pub upstream_path: String,
    /// Let `;` parameters ride on dot segments (`/a/..;/b`, which Tomcat
    /// and Spring resolve as `..`); refused with 400 by default.
    pub allow_dot_parameters: bool,
    /// Lane of requests without `X-Request-Priority` (default `standard`).
    pub lane: String,
    /// Lanes an inference request without an API key may use on this
    /// route (absent: all, as before keys existed).
    pub anonymous_lanes: Option<Vec<String>>,
    /// Names of `[rate_limits.*]` applied to this route.
    pub rate_limits: Vec<String>,
    /// Serve the OpenAI-compatible API (`/v1/chat/completions`,
    /// `/v1/completions`, `/v1/models`, async requests) from `[models]`.
    pub inference: bool,
    /// `false` streams a request body upstream as it arrives (nginx
    /// `proxy_request_buffering off`); default: `[limits]`'s.
    pub request_buffering: Option<bool>,
    /// `false` streams this route's responses to the client as the origin
    /// sends them (nginx `proxy_buffering off`); default: `[limits]`'s.
    pub response_buffering: Option<bool>,
    /// Compress proxied responses (nginx `gzip on`, plus br and zstd).
    pub compress: Option<CompressSection>,
    /// Cache proxied responses (nginx `proxy_cache`).
    pub cache: Option<CacheSection>,
}

/// `cache = { size_mb, max_object_kb, default_ttl_s, lock_timeout_ms }` of
/// a route.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheSection {
    /// The zone's memory bound, MiB (nginx `keys_zone` + `max_size`).
    pub size_mb: u64,
    /// Largest body stored, KiB; larger responses pass uncached.
    pub max_object_kb: u64,
    /// Freshness of responses that state none (nginx `proxy_cache_valid`);
    /// 0: only what `Cache-Control`/`Expires` allow.
    pub default_ttl_s: u64,
    /// How long concurrent misses wait for the first fill (nginx
    /// `proxy_cache_lock_timeout`).
    pub lock_timeout_ms: u64,
}

impl Default for CacheSection {
    fn default() -> Self {
        Self {
            size_mb: 64,
            max_object_kb: 1024,
            default_ttl_s: 0,
            lock_timeout_ms: 5000,
        }
    }
}

/// `compress = { gzip, br, zstd, min_bytes, types }` of a route.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct CompressSection {
    /// gzip level 1-9 (nginx `gzip_comp_level`); 0 = not offered.
    pub gzip: u32,
    /// brotli quality 1-11; 0 = not offered.
    pub br: u32,
    /// zstd level 1-19; 0 = not offered.
    pub zstd: u32,
    /// Smallest `Content-Length` compressed (nginx `gzip_min_length`).
    pub min_bytes: u64,
    /// Media types compressed, exact or `type/*` (nginx `gzip_types`).
    pub types: Vec<String>,
}

/// The types nginx users usually list, beside `text/html` (nginx's only
/// default).
pub const DEFAULT_TYPES: &[&str] = &[
    "text/*",
    "application/json",
    "application/javascript",
    "application/xml",
    "application/wasm",
    "image/svg+xml",
];

impl Default for CompressSection {
    fn default() -> Self {
        Self {
            gzip: 6,
            br: 5,
            zstd: 3,
            min_bytes: 256,
            types: DEFAULT_TYPES.iter().map(|s| s.to_string()).collect(),
        }
    }
}

/// `return = { status, body }`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct FixedSection {
    /// Status code.
    pub status: u16,
    /// Response body.
    pub body: String,
    /// Content type of the body.
    pub content_type: String,
}

/// `redirect = { status, location }`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedirectSection {
    /// 301, 302, 303, 307 or 308.
    pub status: u16,
    /// Target; `$request_uri` is replaced by the request's path and query.
    pub location: String,
}

/// `headers.request` / `headers.response` rules.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct HeadersSection {
    /// Rules applied to the request sent upstream.
    pub request: HeaderRules,
    /// Rules applied to the response sent downstream.
    pub response: HeaderRules,
}

/// Set, add and remove rules, applied in that order: remove, set, add.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct HeaderRules {
    /// Replace (or create) these headers.
    pub set: BTreeMap<String, String>,
    /// Append these headers.
    pub add: BTreeMap<String, String>,
    /// Remove these headers.
    pub remove: Vec<String>,
}

/// `[pools.NAME]`: an upstream pool.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct PoolSection {
    /// Members.
    pub members: Vec<MemberSection>,
    /// `round_robin`, `least_outstanding`, `consistent_hash`, `peak_ewma`,
    /// `queue_aware`; for inference pools also `predicted_latency` (a
    /// prediction per member, placement by headroom) and `load_prefix`
    /// (llm-d's default scoring, the baseline).
    pub lb: String,
    /// For `consistent_hash`: `client_ip`, `header:NAME` or `cookie:NAME`.
    pub hash_key: String,
    /// For `consistent_hash`: a member takes at most this factor times the
    /// average outstanding load before keys spill to the next member.
    pub hash_load_factor: f64,
    /// Seconds an idle upstream connection is kept in the keepalive pool (0 = no keepalive).
    pub keepalive_idle_s: u64,
    /// Timeouts in milliseconds (0 = none).
    pub connect_timeout_ms: u64,
    /// Read timeout per read, in ms.
    pub read_timeout_ms: u64,
    /// Write timeout per write, in ms.
    pub write_timeout_ms: u64,
    /// Connect plus TLS handshake, in ms.
    pub total_connect_timeout_ms: u64,
    /// Active health checks.
    pub health_check: Option<HealthSection>,
    /// Passive ejection.
    pub passive: PassiveSection,
    /// Retries.
    pub retry: RetrySection,
    /// Requests in flight to this pool at most; more wait in lane queues (0 = no limit, no queue).
    pub max_concurrency: usize,
    /// Requests waiting in all lanes together (0 = the sum of the lanes' queue_len).
    pub max_queued: usize,
    /// Connect to members over TLS.
    pub tls: Option<UpstreamTlsSection>,
    /// What members speak: `http1`, `h2` (HTTP/2 over TLS, ALPN `h2`; needs
    /// `tls`) or `h2c` (HTTP/2 over TCP, prior knowledge). gRPC needs one
    /// of the last two (nginx `grpc_pass`, `proxy_http_version 2`).
    pub protocol: String,
    /// HTTP/2: concurrent requests on one connection at most (less if the
    /// member says less); more open another connection.
    pub max_streams_per_connection: usize,
    /// Inference: how a broken chat stream continues on another member:
    /// `vllm` (`continue_final_message`), `none` (it ends with an error), or
    /// empty (what the dialect supports).
    pub resume: String,
    /// Inference: the kind of server (`openai`, `vllm`, `sglang`, `tgi`,
    /// `ollama`, `llamacpp`): which optional fields it is sent, its health
    /// path. Empty: `openai` for inference, `/` health for proxying.
    pub dialect: String,
    /// What members are sent as `X-Request-Id`: `forward` (the request's id
    /// when it is a UUID, else a fresh UUID), `uuid` (always a fresh one) or
    /// `none`.
    pub request_id: String,
    /// For `queue_aware`: how often each member's metrics are read (ms).
    pub scrape_interval_ms: u64,
    /// For `queue_aware`: the members' Prometheus path.
    pub metrics_path: String,
    /// For `predicted_latency`: members drawn at random and scored per
    /// decision, beside the prefix-hit holders (power of k choices).
    pub predict_k: usize,
    /// For `predicted_latency` and `load_prefix`: sequences one member
    /// runs at once (its `max_num_seqs`).
    pub member_slots: usize,
    /// For `predicted_latency` and `load_prefix`: tokens one member's step
    /// takes at most (its `max_num_batched_tokens`; 0 = whole prompts).
    pub member_chunk_tokens: usize,
    /// For `predicted_latency` and `load_prefix`: tokens per block of the
    /// prefix index (the members' KV block size).
    pub prefix_block_tokens: usize,
    /// For `predicted_latency` and `load_prefix`: prompt tokens one
    /// member's prefix cache holds (its KV capacity; 0 = no index).
    pub prefix_capacity_tokens: usize,
}

/// `tls = { ... }` of a pool: HTTPS to the members.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct UpstreamTlsSection {
    /// SNI and the name verified (default: the member's host name).
    pub sni: String,
    /// Verify the member's certificate and name.
    pub verify: bool,
    /// PEM CA bundle to verify against (default: the system roots).
    pub ca_file: String,
    /// PEM client certificate chain for mTLS.
    pub client_cert: String,
    /// PEM client key for mTLS.
    pub client_key: String,
}

impl Default for UpstreamTlsSection {
    fn default() -> Self {
        Self {
            sni: String::new(),
            verify: true,
            ca_file: String::new(),
            client_cert: String::new(),
            client_key: String::new(),
        }
    }
}

impl Default for PoolSection {
    fn default() -> Self {
        Self {
            members: Vec::new(),
            lb: "round_robin".into(),
            hash_key: "client_ip".into(),
            hash_load_factor: 1.25,
            keepalive_idle_s: 60,
            connect_timeout_ms: 1000,
            read_timeout_ms: 60_000,
            write_timeout_ms: 60_000,
            total_connect_timeout_ms: 0,
            health_check: None,
            passive: PassiveSection::default(),
            retry: RetrySection::default(),
            max_concurrency: 0,
            max_queued: 0,
            tls: None,
            protocol: "http1".into(),
            max_streams_per_connection: 100,
            resume: String::new(),
            dialect: String::new(),
            request_id: "forward".into(),
            scrape_interval_ms: 1000,
            metrics_path: "/metrics".into(),
            predict_k: 4,
            member_slots: 256,
            member_chunk_tokens: 0,
            prefix_block_tokens: 16,
            prefix_capacity_tokens: 262_144,
        }
    }
}

/// A pool member: `{ addr = "host:port", weight = 1 }`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemberSection {
    /// `ip:port`.
    pub addr: String,
    /// Relative share of traffic (1..=1000).
    pub weight: u32,
}

impl Default for MemberSection {
    fn default() -> Self {
        Self {
            addr: String::new(),
            weight: 1,
        }
    }
}

/// `health_check = { ... }`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthSection {
    /// Path requested with GET (empty: the pool dialect's health path, else `/`).
    pub path: String,
    /// Milliseconds between rounds.
    pub interval_ms: u64,
    /// Milliseconds a probe may take.
    pub timeout_ms: u64,
    /// Consecutive successes that make a down member up.
    pub rise: u32,
    /// Consecutive failures that make an up member down.
    pub fall: u32,
    /// Host header sent with the probe (default: the member address).
    pub host: String,
    /// Probe with the gRPC health protocol (`grpc.health.v1.Health/Check`)
    /// for this service ("" = the server as a whole) instead of a GET;
    /// SERVING is up. Needs `protocol = "h2"` or `"h2c"`.
    pub grpc: Option<String>,
}

impl Default for HealthSection {
    fn default() -> Self {
        Self {
            path: String::new(),
            interval_ms: 2000,
            timeout_ms: 1000,
            rise: 2,
            fall: 3,
            host: String::new(),
            grpc: None,
        }
    }
}

/// `passive = { ... }`: like nginx's `max_fails`/`fail_timeout`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct PassiveSection {
    /// Consecutive failures that eject a member (0 = never eject).
    pub max_fails: u32,
    /// Milliseconds an ejected member is skipped.
    pub cooldown_ms: u64,
}

impl Default for PassiveSection {
    fn default() -> Self {
        Self {
            max_fails: 3,
            cooldown_ms: 10_000,
        }
    }
}

/// `retry = { ... }`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetrySection {
    /// Total tries per request, the first one included (1 = no retry).
    pub attempts: u32,
    /// Retries allowed as a fraction of recent requests (the retry budget).
    pub budget_ratio: f64,
    /// Retries always allowed per second, whatever the ratio.
    pub budget_min_per_s: u32,
}

impl Default for RetrySection {
    fn default() -> Self {
        Self {
            attempts: 2,
            budget_ratio: 0.2,
            budget_min_per_s: 10,
        }
    }
}
