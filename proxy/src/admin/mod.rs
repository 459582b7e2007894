//! The admin listener: `/metrics` (Prometheus text), `/healthz` (the process
//! is up), `/readyz` (it should get traffic), `/admin/reload`,
//! `/admin/config`, `/admin/slo` (the watchdog's windows and states),
//! `/admin/cache` (zones; `/admin/cache/purge`), and the live status page
//! `/status` with its data, `/admin/stats`. Served by its own Pingora
//! service on its own thread so a flood of traffic cannot starve a scrape,
//! and bound to loopback by default.

mod cache;
mod stats;
mod stats_view;

/// The status page: one self-contained file, embedded so that nothing is
/// fetched from elsewhere.
const STATUS_PAGE: &str = include_str!("status.html");

use crate::metrics::Metrics;
use crate::runtime::reload::Manager;
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
    front: Mutex<Option<Arc<crate::proxy::Front>>>,
}

impl Readiness {
    /// Also require every in-process model to be loaded and warmed up.
    pub fn watch_models(&self, front: Arc<crate::proxy::Front>) {
        *self.front.lock() = Some(front);
    }

    fn models_not_ready(&self) -> Option<String> {
        let front = self.front.lock().clone()?;
        let pending = front.engines.not_ready();
        (!pending.is_empty()).then(|| {
            pending
                .iter()
                .map(|(m, why)| format!("model {m}: {why}"))
                .collect::<Vec<_>>()
                .join("; ")
        })
    }

    /// Not ready, with a reason.
    pub fn new(reason: &str) -> Self {
        Readiness {
            ready: AtomicBool::new(false),
            front: Mutex::new(None),
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
        if self.models_not_ready().is_some() {
            return false;
        }
        self.ready.load(Ordering::Acquire)
    }

    /// What `/readyz` says when ready: `ready`, then a line per
    /// in-process model naming its device and runner.
    pub fn ready_text(&self) -> String {
        let mut out = String::from("ready\n");
        if let Some(front) = self.front.lock().clone() {
            for (m, d, r) in front.engines.devices() {
                out.push_str(&format!("model {m}: device {d} ({r})\n"));
            }
        }
        out
    }

    /// Why not ready (empty when ready).
    pub fn reason(&self) -> String {
        if let Some(why) = self.models_not_ready() {
            return why;
        }
        self.reason.lock().clone()
    }
}

/// The admin HTTP app.
pub struct AdminApp {
    metrics: Arc<Metrics>,
    readiness: Arc<Readiness>,
    manager: Arc<Manager>,
    front: Option<Arc<crate::inference::Front>>,
    sampler: Option<Arc<stats::Sampler>>,
}

impl AdminApp {
    /// An admin app over these metrics, readiness and config manager.
    pub fn new(metrics: Arc<Metrics>, readiness: Arc<Readiness>, manager: Arc<Manager>) -> Self {
        AdminApp {
            metrics,
            readiness,
            manager,
            front: None,
            sampler: None,
        }
    }

    /// Also serve `/admin/slo` from `front`'s watchdog.
    pub fn with_front(mut self, front: Arc<crate::inference::Front>) -> Self {
        self.front = Some(front);
        self
    }

    /// Start the status page's sampler (a thread reading the registry once
    /// a second); without it `/status` and `/admin/stats` answer 404.
    pub fn with_status_page(mut self) -> Self {
        self.sampler = Some(stats::Sampler::start(
            self.metrics.clone(),
            self.manager.clone(),
            self.front.clone(),
        ));
        self
    }

    fn stats(&self) -> Response<Vec<u8>> {
        let Some(sampler) = &self.sampler else {
            return reply(404, "text/plain", b"no status page\n".to_vec());
        };
        let body = stats_view::stats(sampler, &self.manager, self.front.as_deref());
        let mut r = reply(200, "application/json", body.to_string().into_bytes());
        r.headers_mut().insert(
            http::header::CACHE_CONTROL,
            http::HeaderValue::from_static("no-store"),
        );
        r
    }

    fn status_page(&self) -> Response<Vec<u8>> {
        if self.sampler.is_none() {
            return reply(404, "text/plain", b"no status page\n".to_vec());
        }
        let mut r = reply(
            200,
            "text/html; charset=utf-8",
            STATUS_PAGE.as_bytes().to_vec(),
        );
        // The page holds no data (it reads `/admin/stats`, with the token
        // from its URL fragment), and runs nothing but its own script.
        r.headers_mut().insert(
            http::header::CONTENT_SECURITY_POLICY,
            http::HeaderValue::from_static(
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src data:",
            ),
        );
        r
    }

    fn slo(&self) -> Response<Vec<u8>> {
        let Some(front) = &self.front else {
            return reply(404, "text/plain", b"no inference front\n".to_vec());
        };
        let cfg = self.manager.shared().load_full();
        let body = front.watchdog.report(&*cfg);
        reply(200, "application/json", body.to_string().into_bytes())
    }

    async fn reload(&self) -> Response<Vec<u8>> {
        match self.manager.reload().await {
            Ok(report) => {
                let body =
                    serde_json::json!({"status": "ok", "hash": report.hash, "diff": report.diff});
                reply(200, "application/json", body.to_string().into_bytes())
            }
            Err(errs) => {
                let list: Vec<_> = errs
                    .iter()
                    .map(|e| serde_json::json!({"file": e.file, "line": e.line, "col": e.col, "field": e.field, "message": e.message, "text": e.to_string()}))
                    .collect();
                let body = serde_json::json!({"status": "error", "errors": list});
                reply(400, "application/json", body.to_string().into_bytes())
            }
        }
    }

    fn config_view(&self) -> Response<Vec<u8>> {
        let cfg = self.manager.shared().load_full();
        let mut file = serde_json::to_value(&cfg.file).unwrap_or_default();
        redact(&mut file);
        let loaded = cfg
            .loaded_at
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let body = serde_json::json!({
            "path": cfg.path.display().to_string(),
            "hash": cfg.hash,
            "loaded_at_unix": loaded,
            "config": file,
        });
        reply(200, "application/json", body.to_string().into_bytes())
    }
}

/// Field names whose value is shown although the name looks like a
/// secret's: what a value is, not a credential (a limit's key source, a
/// balancer's hash key, counts, and the paths of certificate keys, which
/// name a file and not its content).
const SHOWN: [&str; 6] = [
    "key",
    "hash_key",
    "max_keys",
    "max_tokens_per_key",
    "min_ttft_ms",
    "keys_file",
];

/// Field names that hold a secret or the path of one.
const SECRET: [&str; 7] = [
    "key",
    "secret",
    "password",
    "passwd",
    "token",
    "authorization",
    "credential",
];

/// Replace what is a secret by what it is, whatever the field is called:
/// every header rule's value (a `Cookie`, an `X-Auth` a route sets
/// upstream), every URL's userinfo and query (`?token=`), and every
/// secret-typed field (by name, with `SHOWN` let through).
pub fn redact(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, val) in m.iter_mut() {
                let k = k.to_ascii_lowercase();
                let secret = SECRET.iter().any(|s| k.contains(s)) && !SHOWN.contains(&k.as_str());
                if secret && !val.is_null() {
                    *val = serde_json::Value::String("<redacted>".into());
                } else if k == "headers" {
                    header_values(val);
                } else {
                    redact(val);
                }
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(redact),
        // Whatever the field is called (`[cluster] redis`, a member, an
        // exporter's endpoint), a URL's userinfo and query are credentials
        // as often as not.
        serde_json::Value::String(s) => {
            if let Some(clean) = url_redacted(s) {
                *s = clean;
            }
        }
        _ => {}
    }
}

/// A `headers` section's rules: the names are shown, every value set or
/// added is not.
fn header_values(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, val) in m.iter_mut() {
                if matches!(k.as_str(), "set" | "add") {
                    if let serde_json::Value::Object(rules) = val {
                        for r in rules.values_mut() {
                            *r = serde_json::Value::String("<redacted>".into());
                        }
                    }
                } else {
                    header_values(val);
                }
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(header_values),
        _ => {}
    }
}

/// `scheme://user:pass@host/path?query` with the userinfo and the query
/// redacted; None when `s` is no URL or has neither.
fn url_redacted(s: &str) -> Option<String> {
    let (scheme, rest) = s.split_once("://")?;
    if scheme.is_empty()
        || !scheme
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(&b))
    {
        return None;
    }
    let auth_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (auth, tail) = rest.split_at(auth_end);
    let user = auth.rfind('@');
    let query = tail.find('?');
    if user.is_none() && query.is_none() {
        return None;
    }
    let host = user.map_or(auth, |at| &auth[at + 1..]);
    let mut out = format!("{scheme}://");
    if user.is_some() {
        out.push_str("<redacted>@");
    }
    out.push_str(host);
    match query {
        Some(q) => {
            out.push_str(&tail[..q]);
            out.push_str("?<redacted>");
        }
        None => out.push_str(tail),
    }
    Some(out)
}

/// Whether a request to a tokenless admin listener may come from a browser
/// page: only with a loopback Host (a page on another name that resolves
/// to 127.0.0.1, DNS rebinding, sends its own name) and, when it says
/// where it comes from, from a loopback origin of its own (`Origin`,
/// `Sec-Fetch-Site`): so a page cannot POST `/admin/reload` or
/// `/admin/cache/purge`, nor read what the listener shows.
fn same_machine(req: &pingora::http::RequestHeader) -> Result<(), &'static str> {
    let header = |n: &str| req.headers.get(n).and_then(|v| v.to_str().ok());
    // The host routing reads (Host, else the target's authority).
    let host = crate::filters::request_host(req);
    if !host.is_empty() && !loopback_authority(host) {
        return Err("the admin listener without a token answers only a loopback Host\n");
    }
    if let Some(origin) = header("origin") {
        let authority = origin.split_once("://").map_or("", |(_, a)| a);
        if !loopback_authority(authority) {
            return Err("cross-origin requests to the admin listener are refused\n");
        }
    }
    if let Some(site) = header("sec-fetch-site") {
        if !matches!(site, "same-origin" | "none") {
            return Err("cross-site requests to the admin listener are refused\n");
        }
    }
    Ok(())
}

/// `localhost`, `127.x.x.x` or `[::1]`, with an optional port.
fn loopback_authority(a: &str) -> bool {
    let host = match a.strip_prefix('[') {
        Some(v6) => match v6.split_once(']') {
            Some((h, port)) if port.is_empty() || port.starts_with(':') => h,
            _ => return false,
        },
        None => a.rsplit_once(':').map_or(a, |(h, _)| h),
    };
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Whether the request carries the admin token (always, when none is set).
/// Both sides are hashed before comparing, so the time taken says nothing
/// about how much of a guess was right.
fn authorized(token: Option<&str>, req: &pingora::http::RequestHeader) -> bool {
    let Some(token) = token else {
        return true;
    };
    let given = req
        .headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        // The scheme is case-insensitive (RFC 9110 11.1).
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map_or("", |(_, t)| t);
    let h = |s: &str| ring::digest::digest(&ring::digest::SHA256, s.trim().as_bytes());
    h(given).as_ref() == h(token).as_ref()
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
        let path = session.req_header().uri.path().to_string();
        let post = session.req_header().method == http::Method::POST;
        // `/status` is the static page only: its data needs the token.
        let open = matches!(path.as_str(), "/healthz" | "/readyz" | "/status");
        let token = self.manager.shared().load().admin_token.clone();
        // Health probes reveal nothing and come from orchestrators by any
        // name; everything else of a tokenless listener is the machine's.
        let probe = matches!(path.as_str(), "/healthz" | "/readyz");
        if token.is_none() && !probe {
            if let Err(why) = same_machine(session.req_header()) {
                return reply(403, "text/plain", why.as_bytes().to_vec());
            }
        }
        if !open && !authorized(token.as_deref(), session.req_header()) {
            let mut r = reply(
                401,
                "text/plain",
                b"admin endpoints need Authorization: Bearer <admin.token>\n".to_vec(),
            );
            r.headers_mut().insert(
                http::header::WWW_AUTHENTICATE,
                http::HeaderValue::from_static("Bearer realm=\"ultrafast admin\""),
            );
            return r;
        }
        match path.as_str() {
            "/admin/reload" if post => self.reload().await,
            "/admin/reload" => reply(405, "text/plain", b"use POST\n".to_vec()),
            "/admin/config" => self.config_view(),
            "/admin/cache/purge" if post => {
                let cfg = self.manager.shared().load_full();
                cache::purge(session, &cfg).await
            }
            "/admin/cache/purge" => reply(405, "text/plain", b"use POST\n".to_vec()),
            "/admin/cache" => cache::list(),
            "/admin/slo" => self.slo(),
            "/admin/certs" => reply(
                200,
                "application/json",
                crate::edge::acme::view().to_string().into_bytes(),
            ),
            "/admin/cluster" => match crate::cluster::get() {
                Some(c) => reply(200, "application/json", c.view().to_string().into_bytes()),
                None => reply(
                    200,
                    "application/json",
                    br#"{"instance":null,"store":"none","live_instances":1,"members":[]}"#.to_vec(),
                ),
            },
            "/admin/stats" => self.stats(),
            "/status" => self.status_page(),
            "/metrics" => {
                let cfg = self.manager.shared().load();
                self.metrics.refresh_pools(&cfg.pools);
                self.metrics.refresh_latency(&**cfg);
                reply(200, "text/plain; version=0.0.4", self.metrics.render())
            }
            "/healthz" => reply(200, "text/plain", b"ok\n".to_vec()),
            "/readyz" if self.readiness.is_ready() => {
                reply(200, "text/plain", self.readiness.ready_text().into_bytes())
            }
            "/readyz" => reply(
                503,
                "text/plain",
                format!("not ready: {}\n", self.readiness.reason()).into_bytes(),
            ),
            _ => reply(404, "text/plain", b"not found\n".to_vec()),
        }
    }
}
