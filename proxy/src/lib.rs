//! ultrafast: an edge server built on Pingora that replaces nginx for plain
//! HTTP proxying and fronts (and hosts) LLM inference.
//!
//! # Ranks
//!
//! Every top-level module has a rank; a module names (`crate::x`) only
//! modules of its rank or below, and no import cycle runs among them.
//! `tests/layers.rs` enforces both, with no exceptions listed.
//! ARCHITECTURE.md at the repository root gives the rules and draws the
//! request's life.
//!
//! | rank | modules | what they are |
//! |---|---|---|
//! | 0 | `alloc`, `drain`, `hash`, `uri`, `reqid`, `filters`, `prom` | leaf helpers: allocator, drain signal, hashes, paths and hosts as nginx sees them, ids, request-head checks, metric-family helpers |
//! | 1 | `config` | data: the file format, located errors, the typed settings |
//! | 2 | `otel`, `accesslog`, `edge`, `cache`, `compress`, `cluster` | tracing, the access log, listeners and TLS and the connection guard, the HTTP cache, compression, Redis-shared state |
//! | 3 | `admission` | rate limits, budgets, keys, lanes and gates |
//! | 4 | `upstream` | pools, balancing, health, retries, DNS |
//! | 5 | `routing` | nginx-style host and location matching |
//! | 6 | `inference` | the OpenAI/Anthropic front and its pipeline |
//! | 7 | `metrics` | the registry, assembled from the families each subsystem defines |
//! | 8 | `runtime` | the live snapshot: built from the config, swapped on reload, walked by the background loops; the narrow views the subsystems read it through |
//! | 9 | `proxy`, `admin` | the Pingora phases; the admin listener |
//! | 10 | `server`, `cli` | process assembly; the command line |
//! | 11 | `fuzzing` | the fuzz targets' entry points |

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
pub mod prom;
pub mod proxy;
pub mod reqid;
pub mod routing;
pub mod runtime;
pub mod server;
pub mod upstream;
pub mod uri;
