//! Per-request state of the proxy: the config snapshot, the route, the
//! members tried, held slots and timings. Everything that must be released
//! (in-flight count, member outstanding count, admission slot) is held as a
//! guard, so every exit path releases it exactly once.

use super::*;

/// Counts requests in flight, for draining at shutdown.
#[derive(Debug)]
pub struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    pub(super) fn new(c: &Arc<AtomicUsize>) -> Self {
        c.fetch_add(1, Ordering::Relaxed);
        crate::alloc::note_busy();
        InFlight(c.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Members already tried by a request (at most 10 tries, never allocates).
#[derive(Debug, Default)]
pub(super) struct Tried {
    ids: [usize; 10],
    n: usize,
}

impl Tried {
    pub(super) fn push(&mut self, i: usize) {
        if self.n < self.ids.len() {
            self.ids[self.n] = i;
            self.n += 1;
        }
    }
    pub(super) fn as_slice(&self) -> &[usize] {
        &self.ids[..self.n]
    }
    pub(super) fn len(&self) -> usize {
        self.n
    }
}

/// Per-request state.
pub struct Ctx {
    pub(super) cfg: Arc<Config>,
    pub(super) started: Instant,
    pub(super) started_wall: SystemTime,
    pub(super) request_id: http::HeaderValue,
    /// The request id is the edge's own (a UUID), not the client's.
    pub(super) own_id: bool,
    pub(super) route: Option<Arc<Route>>,
    /// The normalized path (`crate::uri`), where it differs from the
    /// target's: what the route was matched on and the cache keys.
    pub(super) path: Option<String>,
    pub(super) lane: usize,
    pub(super) permit: Option<Permit>,
    pub(super) queue_wait: Option<Duration>,
    pub(super) hash: u64,
    pub(super) tried: Tried,
    pub(super) membership: Option<Arc<Membership>>,
    pub(super) member: Option<usize>,
    pub(super) outstanding: Option<Outstanding>,
    pub(super) upstream_start: Option<Instant>,
    pub(super) upstream_time: Option<Duration>,
    pub(super) body_bytes: u64,
    /// The edge buffers the request body (`buffering`) and has answered
    /// any `Expect: 100-continue` itself.
    pub(super) body_buffered: bool,
    /// A gRPC call (`grpc`): the edge's own answers are gRPC statuses.
    pub(super) grpc: bool,
    /// Its `grpc-timeout`, from the request's start.
    pub(super) grpc_deadline: Option<Instant>,
    /// The `max_upgraded` slot of a request that asks to upgrade.
    pub(super) upgrade: Option<super::upgrade::Slot>,
    /// What the route's cache did with the request.
    pub(super) cache: super::cache::CacheCtx,
    /// The response body's encoder, when the route compresses it.
    pub(super) encoder: Option<crate::compress::Encoder>,
    pub(super) error_status: u16,
    /// HSTS of the listener, sent only when `tls` (see `policy`).
    pub(super) hsts: Option<http::HeaderValue>,
    /// `Alt-Svc` for this listener's TCP responses (none over HTTP/3).
    pub(super) alt_svc: Option<http::HeaderValue>,
    /// The request came over HTTP/3 (`edge::h3`).
    pub(super) h3: bool,
    /// Deadlines of the listener the request came in on.
    pub(super) deadlines: crate::config::Deadlines,
    /// The request came over TLS: `X-Forwarded-Proto: https`, and HSTS.
    pub(super) tls: bool,
    /// The trace of a proxied request, when tracing is on.
    pub(super) trace: Option<crate::otel::ReqTrace>,
    pub(super) _inflight: InFlight,
}

impl Ctx {
    pub(super) fn pool(&self) -> Option<&Arc<Pool>> {
        match &self.route.as_ref()?.action {
            Action::Proxy(p) => Some(p),
            _ => None,
        }
    }

    pub(super) fn member(&self) -> Option<&Member> {
        self.membership.as_ref()?.members.get(self.member?)
    }

    /// Whether one more try is allowed for this request.
    pub(super) fn may_retry(&self, session: &Session) -> bool {
        let Some(pool) = self.pool() else {
            return false;
        };
        if self.tried.len() as u32 >= pool.settings.attempts
            || self
                .membership
                .as_ref()
                .is_some_and(|m| self.tried.len() >= m.members.len())
            || session.response_written().is_some()
        {
            return false;
        }
        if pool.budget.try_withdraw() {
            pool.metrics.retries.inc();
            true
        } else {
            pool.metrics.retries_denied.inc();
            false
        }
    }
}

#[cfg(test)]
mod tests {
    /// Every phase of Pingora's proxy carries the context inside its
    /// future and moves it (`memcpy` is the largest difference from a bare
    /// Pingora proxy per request, benches/RESULTS.md section 13): a field
    /// that is large and rarely used belongs in a `Box`.
    #[test]
    fn the_request_context_stays_small() {
        let size = std::mem::size_of::<super::Ctx>();
        assert!(size <= 640, "Ctx is {size} bytes");
        assert!(std::mem::size_of::<super::super::cache::CacheCtx>() <= 32);
        assert!(std::mem::size_of::<Option<crate::otel::ReqTrace>>() <= 64);
    }
}
