//! The admin listener: `/metrics` (Prometheus text), `/healthz` (the process
//! is up) and `/readyz` (it should get traffic). Served by its own Pingora
//! service on its own thread so a flood of traffic cannot starve a scrape,
//! and bound to loopback by default.

use crate::metrics::Metrics;
use async_trait::async_trait;
use http::Response;
use parking_lot::Mutex;
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Whether the process should receive traffic, and why not.
#[derive(Debug, Default)]
pub struct Readiness {
    ready: AtomicBool,
    reason: Mutex<String>,
}

impl Readiness {
    /// Not ready, with a reason.
    pub fn new(reason: &str) -> Self {
        Readiness {
            ready: AtomicBool::new(false),
            reason: Mutex::new(reason.to_string()),
        }
    }

    /// Mark ready.
    pub fn set_ready(&self) {
        self.reason.lock().clear();
        self.ready.store(true, Ordering::Release);
    }

    /// Mark not ready, with a reason.
    pub fn set_not_ready(&self, why: &str) {
        *self.reason.lock() = why.to_string();
        self.ready.store(false, Ordering::Release);
    }

    /// Ready now?
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Why not ready (empty when ready).
    pub fn reason(&self) -> String {
        self.reason.lock().clone()
    }
}

/// The admin HTTP app.
pub struct AdminApp {
    metrics: Arc<Metrics>,
    readiness: Arc<Readiness>,
}

impl AdminApp {
    /// An admin app over these metrics and readiness.
    pub fn new(metrics: Arc<Metrics>, readiness: Arc<Readiness>) -> Self {
        AdminApp { metrics, readiness }
    }
}

fn reply(status: u16, ctype: &str, body: Vec<u8>) -> Response<Vec<u8>> {
    let mut r = Response::new(body);
    *r.status_mut() = http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::OK);
    if let Ok(v) = http::HeaderValue::from_str(ctype) {
        r.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    let len = r.body().len();
    r.headers_mut()
        .insert(http::header::CONTENT_LENGTH, len.into());
    r
}

#[async_trait]
impl ServeHttp for AdminApp {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let path = session.req_header().uri.path();
        match path {
            "/metrics" => reply(200, "text/plain; version=0.0.4", self.metrics.render()),
            "/healthz" => reply(200, "text/plain", b"ok\n".to_vec()),
            "/readyz" if self.readiness.is_ready() => reply(200, "text/plain", b"ready\n".to_vec()),
            "/readyz" => reply(
                503,
                "text/plain",
                format!("not ready: {}\n", self.readiness.reason()).into_bytes(),
            ),
            _ => reply(404, "text/plain", b"not found\n".to_vec()),
        }
    }
}
