//! ultrafast: an edge server built on Pingora that replaces nginx for plain
//! HTTP proxying and fronts (and hosts) LLM inference.
//!
//! Module map: `config` (file -> validate -> runtime), `routing` (nginx-style
//! host and location matching), `upstream` (pools, balancing, health,
//! retries), `proxy` (the Pingora phases), `filters` (request-path helpers),
//! `admin` (metrics and health endpoints), `metrics`, `accesslog`, `server`
//! (process assembly).

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
pub mod inference;
pub mod metrics;
pub mod otel;
pub mod proxy;
pub mod reload;
pub mod reqid;
pub mod routing;
pub mod server;
pub mod upstream;
pub mod uri;
