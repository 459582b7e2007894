//! Route matching with nginx's precedence.
//!
//! Host first, as nginx picks a `server` block: an exact name, then the
//! longest matching `*.suffix` wildcard, then the routes that name no host.
//! Then the path, as nginx picks a `location` inside that server: an exact
//! match wins outright; otherwise the longest matching prefix is remembered
//! and wins at once if it is a `priority_prefix` (nginx `^~`); otherwise the
//! regexes are tried in config order and the first match wins; failing that,
//! the longest prefix.

use crate::upstream::Pool;
use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use prometheus::IntCounter;
use regex::Regex;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

/// How a route's path is matched.
#[derive(Debug, Clone)]
pub enum PathMatch {
    /// nginx `location = /x`.
    Exact(String),
    /// nginx `location /x`.
    Prefix(String),
    /// nginx `location ^~ /x`: beats regexes when it is the longest prefix.
    PriorityPrefix(String),
    /// nginx `location ~ re`.
    Regex(Regex),
}

/// What a route does with a request.
#[derive(Debug, Clone)]
pub enum Action {
    /// Proxy to a pool.
    Proxy(Arc<Pool>),
    /// Answer with a fixed response.
    Fixed {
        /// Status code.
        status: u16,
        /// Body.
        body: Bytes,
        /// Content type.
        content_type: String,
    },
    /// Serve the OpenAI-compatible API from the configured models.
    Inference,
    /// Answer with a redirect.
    Redirect {
        /// 3xx status.
        status: u16,
        /// Location; `$request_uri` is substituted.
        location: String,
    },
}

/// The Host header sent upstream.
#[derive(Debug, Clone)]
pub enum UpstreamHost {
    /// The client's Host.
    Passthrough,
    /// The chosen member's address.
    Member,
    /// A fixed value.
    Fixed(HeaderValue),
}

/// The target a proxied request asks its origin for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UpstreamPath {
    /// The normalized path the route matched (re-encoded), and the query.
    #[default]
    Normalized,
    /// The client's target as it came.
    Original,
}

/// Header rules: remove, then set, then add.
#[derive(Debug, Clone, Default)]
pub struct HeaderOps {
    /// Replace these.
    pub set: Vec<(HeaderName, HeaderValue)>,
    /// Append these.
    pub add: Vec<(HeaderName, HeaderValue)>,
    /// Remove these.
    pub remove: Vec<HeaderName>,
}

impl HeaderOps {
    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty() && self.add.is_empty() && self.remove.is_empty()
    }
}

/// A configured route.
#[derive(Debug)]
pub struct Route {
    /// Name for logs and metrics.
    pub name: String,
    /// Path pattern.
    pub path: PathMatch,
    /// What to do.
    pub action: Action,
    /// Rules for the upstream request.
    pub request_headers: HeaderOps,
    /// Rules for the downstream response.
    pub response_headers: HeaderOps,
    /// Host sent upstream.
    pub upstream_host: UpstreamHost,
    /// The target sent upstream (and named by the cache key and the log).
    pub upstream_path: UpstreamPath,
    /// `;` parameters on dot segments are let through.
    pub allow_dot_parameters: bool,
    /// Pre-resolved counters.
    pub metrics: RouteMetrics,
    /// Default lane (index in rank order).
    pub lane: usize,
    /// Lanes (indices) a request without an API key may use; None = all.
    pub anonymous_lanes: Option<Vec<usize>>,
    /// Rate limits checked for every request.
    pub limiters: Vec<Arc<crate::admission::ratelimit::Limiter>>,
    /// Token budgets of the route's rate limits (reserve before running an
    /// inference request, settle with its usage).
    pub budgets: Vec<Arc<crate::admission::budget::TokenBudget>>,
    /// Read a proxied body whole before taking an upstream connection.
    pub request_buffering: bool,
    /// Proxied responses are read from the origin into a buffer and the
    /// client served from it (`edge::spool`).
    pub response_buffering: bool,
    /// Compression of proxied responses, if the route asks for it.
    pub compress: Option<Arc<crate::compress::CompressSpec>>,
    /// The route's HTTP cache, if it has one.
    pub cache: Option<Arc<crate::cache::RouteCache>>,
}

/// Request counters of one route, one per status class.
#[derive(Clone)]
pub struct RouteMetrics {
    classes: [IntCounter; 6],
}

impl RouteMetrics {
    /// Over the counters of the classes 1xx to 5xx, then other statuses.
    pub fn new(classes: [IntCounter; 6]) -> Self {
        RouteMetrics { classes }
    }

    /// Counters registered nowhere (tests, routes built without metrics).
    #[allow(clippy::expect_used)]
    pub fn detached() -> Self {
        let c = |n: &str| IntCounter::new(n, "detached").expect("static metric");
        RouteMetrics::new([c("c1"), c("c2"), c("c3"), c("c4"), c("c5"), c("c6")])
    }

    /// Count a finished request with this status.
    pub fn observe(&self, status: u16) {
        let i = match status {
            100..=599 => (status / 100 - 1) as usize,
            _ => 5,
        };
        self.classes[i].inc();
    }
}

/// The request family, `ultrafast_requests_total`, defined and registered
/// here; each route takes its pre-resolved counters from it.
#[derive(Clone)]
pub struct RequestMetrics(prometheus::IntCounterVec);

impl RequestMetrics {
    /// Create and register the family.
    pub fn new(r: &prometheus::Registry) -> Self {
        RequestMetrics(crate::prom::registered(
            r,
            prometheus::IntCounterVec::new(
                prometheus::Opts::new(
                    "ultrafast_requests_total",
                    "Requests by route, pool and status class.",
                ),
                &["route", "pool", "class"],
            ),
        ))
    }

    /// Pre-resolved handles for one route.
    pub fn route(&self, route: &str, pool: &str) -> RouteMetrics {
        let c = |class: &str| self.0.with_label_values(&[route, pool, class]);
        RouteMetrics::new([c("1xx"), c("2xx"), c("3xx"), c("4xx"), c("5xx"), c("other")])
    }
}

impl fmt::Debug for RouteMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RouteMetrics")
    }
}

#[derive(Debug, Default)]
struct PathTable {
    exact: HashMap<String, usize>,
    /// (prefix, is priority, route), longest first.
    prefixes: Vec<(String, bool, usize)>,
    regexes: Vec<(Regex, usize)>,
}

impl PathTable {
    fn insert(&mut self, idx: usize, m: &PathMatch) {
        match m {
            PathMatch::Exact(p) => {
                self.exact.entry(p.clone()).or_insert(idx);
            }
            PathMatch::Prefix(p) => self.prefixes.push((p.clone(), false, idx)),
            PathMatch::PriorityPrefix(p) => self.prefixes.push((p.clone(), true, idx)),
            PathMatch::Regex(r) => self.regexes.push((r.clone(), idx)),
        }
    }

    fn finish(&mut self) {
        // Stable sort: for equal prefixes the first in the config wins.
        self.prefixes
            .sort_by_key(|(p, _, _)| std::cmp::Reverse(p.len()));
    }

    fn find(&self, path: &str) -> Option<usize> {
        if let Some(i) = self.exact.get(path) {
            return Some(*i);
        }
        let longest = self
            .prefixes
            .iter()
            .find(|(p, _, _)| path.starts_with(p.as_str()));
        if let Some((_, true, i)) = longest {
            return Some(*i);
        }
        if let Some((_, i)) = self.regexes.iter().find(|(r, _)| r.is_match(path)) {
            return Some(*i);
        }
        longest.map(|(_, _, i)| *i)
    }
}

/// All routes, indexed for matching.
#[derive(Debug, Default)]
pub struct Router {
    routes: Vec<Arc<Route>>,
    exact_hosts: HashMap<String, usize>,
    /// (".suffix", table), longest suffix first.
    wildcard_hosts: Vec<(String, usize)>,
    default_table: Option<usize>,
    tables: Vec<PathTable>,
}

impl Router {
    /// Index routes; `hosts[i]` are route i's host names (lowercase).
    pub fn new(routes: Vec<(Arc<Route>, Vec<String>)>) -> Self {
        let mut r = Router::default();
        for (idx, (route, hosts)) in routes.into_iter().enumerate() {
            let keys: Vec<Option<String>> = if hosts.is_empty() {
                vec![None]
            } else {
                hosts.into_iter().map(Some).collect()
            };
            for key in keys {
                let t = r.table_for(key);
                r.tables[t].insert(idx, &route.path);
            }
            r.routes.push(route);
        }
        for t in &mut r.tables {
            t.finish();
        }
        r.wildcard_hosts
            .sort_by_key(|(s, _)| std::cmp::Reverse(s.len()));
        r
    }

    fn table_for(&mut self, host: Option<String>) -> usize {
        let existing = match &host {
            None => self.default_table,
            Some(h) => match h.strip_prefix('*') {
                Some(suffix) => self
                    .wildcard_hosts
                    .iter()
                    .find(|(s, _)| s == suffix)
                    .map(|(_, t)| *t),
                None => self.exact_hosts.get(h).copied(),
            },
        };
        if let Some(t) = existing {
            return t;
        }
        let t = self.tables.len();
        self.tables.push(PathTable::default());
        match host {
            None => self.default_table = Some(t),
            Some(h) => match h.strip_prefix('*') {
                Some(suffix) => self.wildcard_hosts.push((suffix.to_string(), t)),
                None => {
                    self.exact_hosts.insert(h, t);
                }
            },
        }
        t
    }

    /// Every route, in config order.
    pub fn routes(&self) -> &[Arc<Route>] {
        &self.routes
    }

    /// The route for a host (may carry a port) and a path, if any.
    pub fn find(&self, host: &str, path: &str) -> Option<&Arc<Route>> {
        let host = crate::uri::strip_port(host);
        // `api.example.com.` is `api.example.com` (nginx strips the dot).
        let host = host.strip_suffix('.').unwrap_or(host);
        let lower;
        let host = if host.bytes().any(|b| b.is_ascii_uppercase()) {
            lower = host.to_ascii_lowercase();
            lower.as_str()
        } else {
            host
        };
        let table = self
            .exact_hosts
            .get(host)
            .copied()
            .or_else(|| {
                self.wildcard_hosts
                    .iter()
                    .find(|(suffix, _)| {
                        host.len() > suffix.len() && host.ends_with(suffix.as_str())
                    })
                    .map(|(_, t)| *t)
            })
            .or(self.default_table)?;
        self.tables[table].find(path).map(|i| &self.routes[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(name: &str, path: PathMatch) -> Arc<Route> {
        Arc::new(Route {
            name: name.into(),
            path,
            action: Action::Fixed {
                status: 200,
                body: Bytes::new(),
                content_type: String::new(),
            },
            request_headers: HeaderOps::default(),
            response_headers: HeaderOps::default(),
            upstream_host: UpstreamHost::Passthrough,
            upstream_path: UpstreamPath::Normalized,
            allow_dot_parameters: false,
            metrics: RouteMetrics::detached(),
            lane: 0,
            anonymous_lanes: None,
            limiters: Vec::new(),
            budgets: Vec::new(),
            request_buffering: true,
            response_buffering: true,
            compress: None,
            cache: None,
        })
    }

    fn names(r: &Router, host: &str, path: &str) -> Option<String> {
        r.find(host, path).map(|r| r.name.clone())
    }

    #[test]
    fn nginx_location_precedence() {
        let r = Router::new(vec![
            (route("root", PathMatch::Prefix("/".into())), vec![]),
            (
                route(
                    "img_re",
                    PathMatch::Regex(Regex::new(r"\.(png|jpg)$").unwrap()),
                ),
                vec![],
            ),
            (
                route("static", PathMatch::Prefix("/static/".into())),
                vec![],
            ),
            (
                route("assets", PathMatch::PriorityPrefix("/assets/".into())),
                vec![],
            ),
            (
                route("exact", PathMatch::Exact("/static/x.png".into())),
                vec![],
            ),
        ]);
        // Exact beats everything.
        assert_eq!(names(&r, "a", "/static/x.png").unwrap(), "exact");
        // A regex beats a plain longest prefix.
        assert_eq!(names(&r, "a", "/static/y.png").unwrap(), "img_re");
        // ^~ beats the regex.
        assert_eq!(names(&r, "a", "/assets/y.png").unwrap(), "assets");
        // Longest prefix when no regex matches.
        assert_eq!(names(&r, "a", "/static/y.css").unwrap(), "static");
        assert_eq!(names(&r, "a", "/other").unwrap(), "root");
    }

    #[test]
    fn host_precedence() {
        let r = Router::new(vec![
            (route("any", PathMatch::Prefix("/".into())), vec![]),
            (
                route("wild", PathMatch::Prefix("/".into())),
                vec!["*.example.com".into()],
            ),
            (
                route("deep", PathMatch::Prefix("/".into())),
                vec!["*.api.example.com".into()],
            ),
            (
                route("exact", PathMatch::Prefix("/".into())),
                vec!["www.example.com".into()],
            ),
        ]);
        assert_eq!(names(&r, "www.example.com:8080", "/").unwrap(), "exact");
        assert_eq!(names(&r, "WWW.Example.com", "/").unwrap(), "exact");
        assert_eq!(names(&r, "x.api.example.com", "/").unwrap(), "deep");
        assert_eq!(names(&r, "foo.example.com", "/").unwrap(), "wild");
        assert_eq!(names(&r, "example.com", "/").unwrap(), "any");
        assert_eq!(names(&r, "[::1]:80", "/").unwrap(), "any");
    }

    #[test]
    fn no_match_is_none() {
        let r = Router::new(vec![(
            route("api", PathMatch::Prefix("/api".into())),
            vec!["h".into()],
        )]);
        assert!(r.find("h", "/x").is_none());
        assert!(r.find("other", "/api").is_none());
    }
}
