//! The fleet simulator the fleet benchmark and tests share: N simulated
//! OpenAI-compatible replicas, each a continuous-batching step model with
//! its own speed, slots, KV capacity and prefix cache (`replica`), driven
//! by a multi-tenant chat trace with shared system prompts (`trace`).
//!
//! Two modes run the same replicas:
//! - live (`live`): each replica listens on its own loopback port and
//!   streams real SSE (`/v1/chat/completions`, `/v1/completions`), with
//!   vLLM's metric names on `/metrics` and `POST /control` to change its
//!   speed mid-run; a load generator (`live::load`) replays the trace
//!   against an edge and times every request;
//! - discrete-event (`des`): virtual time, no sockets, with ultrafast's own
//!   routing and prediction code deciding, to plan past one machine (100
//!   and 1,000 replicas).

pub mod des;
pub mod live;
pub mod replica;
pub mod stats;
pub mod trace;
