//! Opening an upstream stream up to its first token: members tried in
//! turn (retries only before the first token, within the pool's retry
//! budget), and first-token hedging: when the first try has no token after
//! the hedge delay, a second member is asked too; the first to produce a
//! token wins and the other try is dropped, which closes its connection and
//! so cancels its work upstream.

use super::stream::StreamState;
use super::{connector, HedgeAfter, UpstreamBackend};
use crate::upstream::{Member, Outstanding};
use bytes::Bytes;
use pingora::http::RequestHeader;
use pingora::protocols::http::client::HttpSession;
use pingora::protocols::http::v1::client::HttpSession as HttpSessionV1;
use pingora::upstreams::peer::HttpPeer;
use pingora::upstreams::peer::Peer;
use serde_json::Value;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use ultrafast_engine::api::{BackendError, Event};

/// What identifies a request to a member: its id and trace parent.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ids<'a> {
    /// Sent as `X-Request-Id` (as the pool's `request_id` says).
    pub request_id: &'a str,
    /// Sent as `traceparent`.
    pub traceparent: Option<&'a str>,
    /// The request's stop sequences (to name the one that ended it).
    pub stops: &'a [String],
    /// The pass-through, when the client takes the events as they are.
    pub raw: Option<ultrafast_engine::api::RawSse>,
}

impl<'a> Ids<'a> {
    /// The ids of `req`.
    pub fn of(req: &'a ultrafast_engine::api::InferenceRequest) -> Self {
        Ids {
            request_id: &req.request_id,
            traceparent: req.traceparent.as_deref(),
            stops: &req.stop,
            raw: req.raw_sse,
        }
    }
}

/// Recent times to first token (a ring), for a quantile hedge delay. A
/// sorted copy is refreshed every `RESORT` samples, so asking for the
/// quantile on every request neither allocates nor sorts.
#[derive(Debug, Default)]
pub(super) struct Recent {
    ring: Vec<Duration>,
    next: usize,
    sorted: Vec<Duration>,
    since_sort: usize,
}

/// Samples kept, the fewest before a quantile is trusted, and how many new
/// samples make the sorted copy stale.
const RECENT: usize = 512;
const RECENT_MIN: usize = 20;
const RESORT: usize = 16;

impl Recent {
    pub(super) fn push(&mut self, d: Duration) {
        if self.ring.len() < RECENT {
            self.ring.push(d);
        } else {
            self.ring[self.next] = d;
        }
        self.next = (self.next + 1) % RECENT;
        self.since_sort += 1;
        if self.since_sort >= RESORT || self.sorted.len() < RECENT_MIN {
            self.sorted.clone_from(&self.ring);
            self.sorted.sort_unstable();
            self.since_sort = 0;
        }
    }

    /// The `q` quantile, once there are enough samples.
    pub(super) fn quantile(&self, q: f64) -> Option<Duration> {
        if self.sorted.len() < RECENT_MIN {
            return None;
        }
        crate::inference::watchdog::quantile(&self.sorted, q)
    }
}

/// A stream whose first token has arrived.
pub(super) struct Opened {
    pub(super) session: HttpSession,
    pub(super) state: StreamState,
    /// Events parsed so far (at least one token).
    pub(super) first: Vec<Event>,
    /// The member it came from.
    pub(super) member: Member,
    pub(super) peer: Box<HttpPeer>,
    pub(super) _out: Outstanding,
}

/// How one try ended before any token.
enum TryError {
    /// Worth another member (connect failure, 5xx, reset, stall).
    Retry(String),
    /// The upstream refused the request itself (4xx): pass it on.
    Final(BackendError),
}

/// Which of the racing tries (or the hedge timer) finished.
enum Ev {
    A(Result<Opened, TryError>),
    B(Result<Opened, TryError>),
    Hedge,
}

async fn poll_slot(s: &mut Option<TryFuture<'_>>) -> Result<Opened, TryError> {
    match s {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

/// Which member a request tries first.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum First {
    /// The balancer's choice.
    Balancer,
    /// This member (placed by the fleet), if it is still in the pool and
    /// up; else the balancer's.
    Member(std::net::SocketAddr),
    /// llm-d's default scores over the members (`load_prefix`), with the
    /// prompt's prefix blocks.
    Scored(Vec<u64>),
}

type TryFuture<'a> = Pin<Box<dyn Future<Output = Result<Opened, TryError>> + Send + 'a>>;

fn unavailable(last: String) -> BackendError {
    BackendError {
        status: 502,
        kind: "server_error",
        code: "upstream_unavailable",
        param: None,
        message: format!("no upstream could serve the request: {last}"),
    }
}

impl UpstreamBackend {
    /// The hedge delay now (None: no hedging, or not enough history).
    fn hedge_delay(&self) -> Option<Duration> {
        match self.spec.hedge?.after {
            HedgeAfter::Fixed(d) => Some(d),
            HedgeAfter::Quantile(q) => self.ttfts.lock().quantile(q),
        }
    }

    /// Open a stream to its first token: members in the balancer's order
    /// (skipping `exclude`), one retry per failure within the budget, and
    /// (when `hedge`) one hedge to a second member after the delay.
    pub(super) async fn first_token(
        &self,
        path: &str,
        body: &Bytes,
        ids: Ids<'_>,
        key: u64,
        exclude: &[std::net::SocketAddr],
        hedge: bool,
        first: First,
    ) -> Result<Opened, BackendError> {
        let pool = &self.spec.pool;
        let membership = pool.members();
        let balancer = self.balancer(&membership);
        let members = &membership.members;
        let mut tried: Vec<usize> = (0..members.len())
            .filter(|&i| exclude.contains(&members[i].addr))
            .collect();
        let skipped = tried.len();
        let attempts = (self.spec.attempts.max(1) as usize).min(members.len() - skipped);
        let mut last = String::from("no upstream member available");
        let started = Instant::now();
        let delay = if hedge { self.hedge_delay() } else { None };
        let mut hedged = false;
        // At most two tries run at once: `a` (the first try, then retries)
        // and `b` (the hedge).
        let mut a: Option<TryFuture> = None;
        let mut b: Option<TryFuture> = None;
        let open =
            |i: usize| -> TryFuture { Box::pin(self.open(members[i].clone(), path, body, ids)) };
        loop {
            if a.is_none() && b.is_none() {
                if tried.len() - skipped >= attempts {
                    break;
                }
                let now = crate::upstream::now_ms();
                let chosen = match (&first, tried.len() == skipped) {
                    (First::Member(a), true) => members
                        .iter()
                        .position(|m| m.addr == *a && m.available(now) && !exclude.contains(a)),
                    (First::Scored(blocks), true) => self.scored(&membership, blocks, &tried, now),
                    _ => None,
                };
                let Some(i) = chosen.or_else(|| balancer.select(members, key, &tried, now)) else {
                    break;
                };
                if tried.len() > skipped {
                    if !pool.budget.try_withdraw() {
                        pool.metrics.retries_denied.inc();
                        break;
                    }
                    pool.metrics.retries.inc();
                }
                tried.push(i);
                a = Some(open(i));
            }
            let wait_hedge = !hedged && b.is_none() && delay.is_some();
            let until = started + delay.unwrap_or(Duration::ZERO);
            let ev = tokio::select! {
                r = poll_slot(&mut a), if a.is_some() => Ev::A(r),
                r = poll_slot(&mut b), if b.is_some() => Ev::B(r),
                _ = tokio::time::sleep_until(until.into()), if wait_hedge => Ev::Hedge,
            };
            let (r, from_hedge) = match ev {
                Ev::A(r) => {
                    a = None;
                    (r, false)
                }
                Ev::B(r) => {
                    b = None;
                    (r, true)
                }
                Ev::Hedge => {
                    hedged = true;
                    let now = crate::upstream::now_ms();
                    if let Some(j) = balancer.select(members, key, &tried, now) {
                        if self.hedges.try_withdraw() {
                            self.spec.counters.hedges_sent.inc();
                            tried.push(j);
                            b = Some(open(j));
                        }
                    }
                    continue;
                }
            };
            match r {
                Ok(o) => {
                    if from_hedge {
                        self.spec.counters.hedges_won.inc();
                    }
                    pool.record_success(&o.member, started.elapsed());
                    self.ttfts.lock().push(started.elapsed());
                    // Returning drops the other try, closing its connection.
                    return Ok(o);
                }
                Err(TryError::Final(e)) => return Err(e),
                // The other try (if any) runs on; a retry starts only when
                // neither is left.
                Err(TryError::Retry(why)) => {
                    log::warn!("inference pool {}: {why}", pool.name);
                    last = why;
                }
            }
        }
        Err(unavailable(last))
    }

    /// The member llm-d's default scores pick among `membership`'s.
    fn scored(
        &self,
        membership: &Arc<crate::upstream::Membership>,
        blocks: &[u64],
        tried: &[usize],
        now: u64,
    ) -> Option<usize> {
        let (fleet, m, aligned) = self.fleet_now()?;
        if !Arc::ptr_eq(&m, membership) {
            return None;
        }
        let stale = self.stale_ms();
        let report = |i: usize| crate::inference::fleet::report(&m.members[i], now, stale);
        fleet.pick_load_prefix(&aligned, &report, blocks, tried)
    }

    /// Connect, send, read the head and the stream up to the first token.
    async fn open(
        &self,
        m: Member,
        path: &str,
        body: &Bytes,
        ids: Ids<'_>,
    ) -> Result<Opened, TryError> {
        let pool = &self.spec.pool;
        let out = Outstanding::acquire(&m);
        let peer = pool.peer(&m);
        let r = self.exchange(&m, &peer, path, body, ids).await;
        if matches!(r, Err(TryError::Retry(_))) {
            pool.record_failure(&m);
        }
        let (session, state, first) = r?;
        Ok(Opened {
            session,
            state,
            first,
            member: m,
            peer,
            _out: out,
        })
    }

    async fn exchange(
        &self,
        m: &Member,
        peer: &HttpPeer,
        path: &str,
        body: &Bytes,
        ids: Ids<'_>,
    ) -> Result<(HttpSession, StreamState, Vec<Event>), TryError> {
        let retry = |what: &str, e: &dyn std::fmt::Display| {
            TryError::Retry(format!("{} ({}): {what}: {e}", m.label, m.addr))
        };
        let keepalive = self.spec.pool.settings.keepalive_idle;
        let pooled = keepalive.and_then(|k| self.idle.take(peer.reuse_hash(), k));
        let mut s = match pooled {
            Some(stream) => HttpSession::H1(HttpSessionV1::new(stream)),
            // Boxed: a new connection's state (TCP and TLS handshakes) is
            // some kilobytes, and inline it would size every opening, and
            // the relay task spawned with it, for the usual pooled
            // connection too.
            None => {
                Box::pin(connector().get_http_session(peer))
                    .await
                    .map_err(|e| retry("connect", &e))?
                    .0
            }
        };
        s.set_read_timeout(Some(self.spec.stall));
        let mut head = RequestHeader::build("POST", path.as_bytes(), Some(6))
            .map_err(|e| retry("request", &e))?;
        let _ = head.insert_header("host", m.label.as_str());
        let _ = head.insert_header("content-type", "application/json");
        let _ = head.insert_header("accept", "text/event-stream");
        let _ = head.insert_header("content-length", body.len());
        if let Some(id) = self.spec.pool.settings.request_id.header(ids.request_id) {
            let _ = head.insert_header("x-request-id", id);
        }
        if let Some(tp) = ids.traceparent {
            let _ = head.insert_header("traceparent", tp);
        }
        // Pingora's client flushes the head on its own: corked, the head
        // and the body leave in one segment (nginx's one `writev`), so the
        // member wakes once. On an error the session is dropped corked,
        // and closing sends what is held.
        let corked = cork(&s, true);
        s.write_request_header(Box::new(head))
            .await
            .map_err(|e| retry("write", &e))?;
        s.write_request_body(body.clone(), true)
            .await
            .map_err(|e| retry("write", &e))?;
        s.finish_request_body()
            .await
            .map_err(|e| retry("write", &e))?;
        if corked {
            cork(&s, false);
        }
        s.read_response_header()
            .await
            .map_err(|e| retry("read", &e))?;
        let status = s
            .response_header()
            .map(|h| h.status.as_u16())
            .unwrap_or(502);
        if status != 200 {
            return Err(refused(&mut s, m, status).await);
        }
        let mut st = StreamState::with_stops(ids.stops).forwarding(ids.raw);
        let mut first = Vec::new();
        loop {
            let chunk = s
                .read_response_body()
                .await
                .map_err(|e| retry("read", &e))?;
            let Some(chunk) = chunk else {
                return Err(TryError::Retry(format!(
                    "{} closed the stream before the first token",
                    m.label
                )));
            };
            st.feed(&chunk, &mut first);
            if let Some(Event::Error(e)) = first.last() {
                return Err(TryError::Retry(format!("{}: {e}", m.label)));
            }
            // Forwarded events without text (a role chunk) wait with the
            // opening: the first token is what a hedge races for.
            if first
                .iter()
                .any(|e| !matches!(e, Event::Raw { tokens: 0, .. }))
            {
                return Ok((s, st, first));
            }
        }
    }
}

/// The error of a non-200 answer: a retry for 5xx and 429, else final.
async fn refused(s: &mut HttpSession, m: &Member, status: u16) -> TryError {
    let mut text = Vec::new();
    while let Ok(Some(b)) = s.read_response_body().await {
        if text.len() < 64 << 10 {
            text.extend_from_slice(&b);
        }
    }
    let msg = body_text(&text);
    if status >= 500 || status == 429 {
        return TryError::Retry(format!("{} answered {status}: {msg}", m.label));
    }
    TryError::Final(BackendError {
        status,
        kind: "invalid_request_error",
        code: "upstream_rejected",
        param: None,
        message: format!("upstream answered {status}: {msg}"),
    })
}

/// What an upstream's error body says, bounded: its OpenAI-style
/// `error.message`, else its first bytes, else "(empty body)".
fn body_text(text: &[u8]) -> String {
    const MAX: usize = 300;
    let from_json = serde_json::from_slice::<Value>(text).ok().and_then(|v| {
        let e = &v["error"];
        e["message"].as_str().or(e.as_str()).map(str::to_string)
    });
    let s = from_json.unwrap_or_else(|| String::from_utf8_lossy(text).trim().to_string());
    if s.is_empty() {
        return "(empty body)".into();
    }
    match s.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s,
    }
}

/// Set `TCP_CORK` on the session's socket (Linux; elsewhere, or on a socket
/// that is not TCP, nothing is done). True when it was set.
fn cork(s: &HttpSession, on: bool) -> bool {
    #[cfg(target_os = "linux")]
    {
        let Some(stream) = s.stream() else {
            return false;
        };
        // An HTTP/1 session's id is its socket's descriptor (Pingora's
        // `UniqueID` for TCP and TLS streams).
        let fd = stream.id();
        if fd < 0 {
            return false;
        }
        #[allow(unsafe_code)]
        // SAFETY: `fd` belongs to the stream `s` owns, which is borrowed for
        // this whole call, so it is open and is that socket; the borrow
        // ends before this function returns.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        socket2::SockRef::from(&fd).set_tcp_cork(on).is_ok()
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (s, on);
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_upstream_error_body_is_shown_bounded_or_said_empty() {
        assert_eq!(body_text(b""), "(empty body)");
        assert_eq!(body_text(b"  \n"), "(empty body)");
        assert_eq!(
            body_text(br#"{"error":{"message":"bad model"}}"#),
            "bad model"
        );
        assert_eq!(body_text(br#"{"error":"Not Found"}"#), "Not Found");
        let long = "x".repeat(1000);
        assert_eq!(body_text(long.as_bytes()).len(), 303);
    }

    #[test]
    fn recent_quantile_needs_history_and_tracks_the_tail() {
        let mut r = Recent::default();
        for _ in 0..10 {
            r.push(Duration::from_millis(10));
        }
        assert_eq!(r.quantile(0.9), None);
        for i in 0..90 {
            r.push(Duration::from_millis(if i % 10 == 0 { 500 } else { 10 }));
        }
        // 9 of 100 samples are slow: p90 is fast, p95 is slow.
        assert_eq!(r.quantile(0.9), Some(Duration::from_millis(10)));
        assert_eq!(r.quantile(0.95), Some(Duration::from_millis(500)));
        for _ in 0..RECENT {
            r.push(Duration::from_millis(7));
        }
        assert_eq!(r.quantile(0.99), Some(Duration::from_millis(7)));
    }
}
