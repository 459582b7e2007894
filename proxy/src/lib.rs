//! ultrafast: an edge server built on Pingora that replaces nginx for plain
//! HTTP proxying and fronts (and hosts) LLM inference.
//!
//! # Ranks
//!
//! Every top-level module has a rank; a module names (`crate::x`) only
//! modules of its rank or below. `tests/layers.rs` enforces it, with the
//! upward arrows that remain listed there by name (the list only shrinks).
//! ARCHITECTURE.md at the repository root draws the request's life.
//!
//! | rank | modules | what they are |
//! |---|---|---|
//! | 0 | `alloc`, `drain`, `hash`, `uri`, `reqid`, `filters` | leaf helpers: allocator, drain signal, hashes, paths and hosts as nginx sees them, ids, request-head checks |
//! | 1 | `config` | the file format, validation, the specs |
//! | 2 | `otel`, `accesslog`, `edge`, `cache`, `compress`, `cluster` | tracing, the access log, listeners and TLS and the connection guard, the HTTP cache, compression, Redis-shared state |
//! | 3 | `admission` | rate limits, budgets, keys, lanes and gates |
//! | 4 | `upstream` | pools, balancing, health, retries |
//! | 5 | `routing` | nginx-style host and location matching |
//! | 6 | `inference` | the OpenAI/Anthropic front and its pipeline |
//! | 7 | `metrics`, `reload` | the runtime layer today: the metric families, the live config's swap |
//! | 8 | `proxy`, `admin` | the Pingora phases; the admin listener |
//! | 9 | `server`, `cli` | process assembly; the command line |
//! | 10 | `fuzzing` | the fuzz targets' entry points |

pub mod accesslog;
pub mod admin;
pub mod admission;
pub mod alloc;
pub mod cache;
pub mod cli;
pub mod cluster;
pub mod compress;
pub mod config;
pub mod drain;
pub mod edge;
pub mod filters;
#[doc(hidden)]
pub mod fuzzing;
pub mod hash;
pub mod inference;
pub mod metrics;
pub mod otel;
pub mod proxy;
pub mod reqid;
pub mod routing;
pub mod runtime;
pub mod server;
pub mod upstream;
pub mod uri;
