//! The connection guard in front of every traffic listener (plain and
//! TLS): a cap on open connections and a whole-request-head deadline.
//!
//! Pingora reads a request head with a per-read timeout only, so a client
//! that sends one header line every few seconds (slowloris) holds its
//! connection forever. nginx closes it at `client_header_timeout` however
//! the bytes trickle in. Pingora gives no hook before the head is parsed,
//! so the guard sits one layer below: [`Guarded`] wraps the listener's
//! [`ServerApp`] and hands it each new connection inside [`HeadDeadline`],
//! a stream that watches its own bytes. A request head is complete at its
//! first empty line; from the connection's accept (first request) or from
//! the first byte after a response (later ones) until then, a pending read
//! fails with `TimedOut` once `client_header_timeout_ms` has passed, and
//! Pingora closes the connection. HTTP/2 (ALPN `h2` or the h2c preface) and
//! connections upgraded by a `101` are not watched: their bytes are frames,
//! not heads.
//!
//! The cap (`[limits] max_connections`, nginx's `worker_connections`)
//! closes a connection at once when that many are open, before any byte is
//! read, so a flood of idle sockets cannot take every descriptor.
//!
//! Both settings are read from the live config for each new connection.

use super::bare::{self, Rewrite};
use super::hold::{self, Framing, Hold, Holding, Outcome};
use super::preface;
use super::spool::{self, Spool};
use crate::config::Deadlines;
use async_trait::async_trait;
use pingora::apps::ServerApp;
use pingora::protocols::raw_connect::ProxyDigest;
use pingora::protocols::tls::{SslDigest, TlsRef, ALPN};
use pingora::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl, Stream,
    TimingDigest, UniqueID, UniqueIDType,
};
use pingora::server::ShutdownWatch;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Counters of the guard, resolved once (a connection hashes no labels).
#[derive(Clone)]
pub struct ConnMetrics {
    /// Connections open now, all traffic listeners together.
    pub open: prometheus::IntGauge,
    /// Closed at the head deadline.
    pub header_timeout: prometheus::IntCounter,
    /// Closed at the connection cap.
    pub max_connections: prometheus::IntCounter,
    /// Closed at an h2c listener's preface deadline.
    pub preface_timeout: prometheus::IntCounter,
    /// Closed (408) at `client_body_timeout_ms`.
    pub body_timeout: prometheus::IntCounter,
    /// Closed at `send_timeout_ms`.
    pub send_timeout: prometheus::IntCounter,
}

/// The guard's terms for one new connection, read from the live config
/// at accept.
#[derive(Debug, Clone)]
pub struct Terms {
    /// Open traffic connections at most (0 = no cap).
    pub max_connections: usize,
    /// The deadlines of the listener it arrived on.
    pub deadlines: Deadlines,
    /// Max request head size and header count.
    pub head_limits: (usize, usize),
    /// The HSTS header of its TLS listener, if that sends one (for the
    /// edge's own answer to an unparseable head, `bare`).
    pub hsts: Option<http::HeaderValue>,
}

/// Where the guard finds its terms: the live config, through a view the
/// runtime implements (the guard ranks below the layer that swaps it).
pub trait Rules: Send + Sync {
    /// The terms of a connection accepted on `local`; `tls`: it came
    /// over TLS.
    fn terms(&self, local: Option<std::net::SocketAddr>, tls: bool) -> Terms;
}

/// A listener's app behind the connection guard.
pub struct Guarded<A> {
    inner: Arc<A>,
    rules: Arc<dyn Rules>,
    open: Arc<AtomicUsize>,
    metrics: ConnMetrics,
    h2c: bool,
}

impl<A> Guarded<A> {
    /// The guarded app (HTTP/3 requests go to it directly).
    pub fn inner(&self) -> &Arc<A> {
        &self.inner
    }

    /// Guard `inner`'s connections with the limits of the live config.
    /// Services given the same `open` counter share one cap.
    pub fn new(
        inner: A,
        rules: Arc<dyn Rules>,
        open: Arc<AtomicUsize>,
        metrics: ConnMetrics,
    ) -> Self {
        Guarded {
            inner: Arc::new(inner),
            rules,
            open,
            metrics,
            h2c: false,
        }
    }

    /// The listener accepts HTTP/2 with prior knowledge: its preface is
    /// timed by `h2c_preface_timeout_ms`.
    pub fn with_h2c(mut self, h2c: bool) -> Self {
        self.h2c = h2c;
        self
    }
}

/// One open connection, counted while alive.
struct Slot {
    open: Arc<AtomicUsize>,
    gauge: prometheus::IntGauge,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
        self.gauge.dec();
    }
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> ServerApp for Guarded<A> {
    async fn process_new(
        self: &Arc<Self>,
        stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        // A kept-alive connection comes back already guarded.
        if stream.as_any().downcast_ref::<HeadDeadline>().is_some() {
            return self.inner.process_new(stream, shutdown).await;
        }
        let local = stream
            .get_socket_digest()
            .and_then(|d| d.local_addr()?.as_inet().copied());
        let Terms {
            max_connections: cap,
            deadlines,
            head_limits: limits,
            hsts,
        } = self.rules.terms(local, stream.get_ssl_digest().is_some());
        let n = self.open.fetch_add(1, Ordering::Relaxed);
        self.metrics.open.inc();
        let slot = Slot {
            open: self.open.clone(),
            gauge: self.metrics.open.clone(),
        };
        if cap > 0 && n >= cap {
            self.metrics.max_connections.inc();
            return None;
        }
        let timeout = Duration::from_millis(deadlines.client_header_timeout_ms);
        let closed = self.metrics.header_timeout.clone();
        let mut guarded = HeadDeadline::new(stream, timeout, Some(slot), closed);
        guarded.hsts = hsts;
        guarded.keepalive = Duration::from_secs(deadlines.keepalive_timeout_s.max(1));
        guarded.limits = limits;
        if self.h2c {
            guarded.preface_timeout = deadlines.h2c_preface_timeout;
            guarded.preface_closed = Some(self.metrics.preface_timeout.clone());
        }
        if !guarded.read_first_head().await {
            return None;
        }
        self.inner.process_new(Box::new(guarded), shutdown).await
    }

    async fn cleanup(&self) {
        self.inner.cleanup().await
    }
}

/// Wait for `sleep`, or for ever when there is none.
async fn sleep_or_never(sleep: Option<&mut Pin<Box<tokio::time::Sleep>>>) {
    match sleep {
        Some(s) => s.as_mut().await,
        None => std::future::pending().await,
    }
}

/// Note that the proxy's request filter has seen the current request on
/// this connection, so a response to it is the policy's, not Pingora's
/// bare refusal (`bare`). A no-op on a stream the guard does not wrap
/// (HTTP/2 sessions have none to give).
pub fn mark_seen(stream: Option<&Stream>) {
    if let Some(g) = guard(stream) {
        g.seen.store(true, Ordering::Relaxed);
    }
}

/// The next flush of a response head on `stream` waits for the body bytes
/// that follow it at once, so that both leave in one write: for the
/// edge's own streamed responses, whose head is written only when their
/// first bytes are ready (Pingora flushes a head without `Content-Length`
/// at once, right for a proxied stream whose body may be slow to come).
/// Set around the head's write only (`on`, then off), so that no later
/// flush is ever held.
pub fn join_head_to_body(stream: Option<&Stream>, on: bool) {
    if let Some(g) = guard(stream) {
        g.join_head.store(on, Ordering::Relaxed);
    }
}

/// The guard under `stream`, if it wraps it.
fn guard(stream: Option<&Stream>) -> Option<&HeadDeadline> {
    stream.and_then(|s| s.as_any().downcast_ref::<HeadDeadline>())
}

/// Where a request head stands after `bytes`, from `text` (whether the
/// current line has a byte other than CR): ended at the byte at an index (a
/// line feed ending an empty line; a CR before a line feed does not start a
/// line), or not yet, with the new `text`; and the line feeds seen before
/// the end. One compare per byte in the common case.
fn head_scan(mut text: bool, bytes: &[u8]) -> (Result<usize, bool>, usize) {
    let mut lines = 0;
    for (i, &b) in bytes.iter().enumerate() {
        if b == b'\n' {
            if !text {
                return (Ok(i), lines);
            }
            text = false;
            lines += 1;
        } else if b != b'\r' {
            text = true;
        }
    }
    (Err(text), lines)
}

/// Whether `bytes` hold a whole request head, as [`HeadDeadline::saw`]
/// reads it.
fn head_ends(bytes: &[u8]) -> bool {
    head_scan(true, bytes).0.is_ok()
}

/// Bytes and lines of the head being read (the request line is a line).
#[derive(Debug, Clone, Copy, Default)]
struct HeadSize {
    bytes: usize,
    lines: usize,
}

/// Where a connection is in its current request head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Reading a head: whether the current line has text (false: a line
    /// just ended, so another line feed ends the head).
    Head { text: bool },
    /// The head is complete; a response has or has not been written since.
    Done { wrote: bool },
    /// HTTP/2 or an upgraded connection: not watched.
    Off,
}

/// A stream that fails a read pending past the head deadline.
pub struct HeadDeadline {
    inner: Stream,
    timeout: Duration,
    phase: Phase,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    /// A later head has begun: its deadline is armed when a read first
    /// has to wait for it (most heads come whole in one read, and a timer
    /// made and dropped per request was a tenth of the guard's cost).
    arm_on_wait: bool,
    first: bool,
    /// The connection's place under `max_connections`, held until it
    /// closes (by a spool's drain after the guard is gone).
    slot: Option<Slot>,
    closed: prometheus::IntCounter,
    /// Our request filter has seen the current request ([`mark_seen`]).
    seen: AtomicBool,
    /// HSTS of the listener, for the edge's own `400` (`bare`).
    hsts: Option<http::HeaderValue>,
    /// Pingora's bare `400` being replaced by ours.
    rewrite: Rewrite,
    /// Bytes the h2c check read, not yet handed to a read (`preface`).
    peeked: Vec<u8>,
    /// Size of the current head so far.
    head: HeadSize,
    /// `max_header_bytes` and `max_headers` of the config at accept.
    limits: (usize, usize),
    /// The idle wait for a next request, for the h2c check (a backstop:
    /// Pingora's own keepalive timeout usually closes an idle connection
    /// before the check starts).
    keepalive: Duration,
    /// Request buffering (`hold`): what Pingora read past the current
    /// head, and a body being held. Locked only by the request filter
    /// (reads have `&mut`).
    body: std::sync::Mutex<Body>,
    /// On an h2c listener, the time to tell the preface from HTTP/1.
    preface_timeout: Option<Duration>,
    /// Written bytes not yet sent: a head waits for its first body bytes.
    wbuf: super::wbuf::WriteBuf,
    /// The next flush leaves what is held for the body write that follows
    /// ([`join_head_to_body`]).
    join_head: AtomicBool,
    /// Closed at the preface deadline.
    preface_closed: Option<prometheus::IntCounter>,
    /// Response buffering (`spool`): the current response's bytes not yet
    /// sent. Locked only by the response filter (writes have `&mut`).
    spool: std::sync::Mutex<Option<Spool>>,
}

/// A connection's request-buffering state.
#[derive(Default)]
struct Body {
    /// Bytes that followed the current head in the read that ended it
    /// (Pingora's parser has them); `None` past [`hold::TAIL_MAX`].
    tail: Option<Vec<u8>>,
    /// The body being held, then handed over.
    holding: Option<Holding>,
}

impl HeadDeadline {
    fn body(&mut self) -> &mut Body {
        get(&mut self.body)
    }
}

/// Hold the current request's body (`framing`) below Pingora's reads until
/// it is whole (request buffering, `hold`): `mem_cap` bytes in memory, the
/// rest in a file in `dir`, `max` at most (0: no limit), `idle` at most
/// between two reads. False when it cannot be held here: not an HTTP/1
/// stream of the guard, or Pingora read much of the body with the head.
pub fn hold_body(
    stream: Option<&Stream>,
    framing: Framing,
    mem_cap: usize,
    max: u64,
    dir: &std::path::Path,
    idle: Option<Duration>,
) -> bool {
    let Some(g) = guard(stream) else {
        return false;
    };
    let mut body = lock(&g.body);
    let tail = body.tail.take();
    // Only where the guard saw this request's head end (so `tail` is what
    // Pingora read past it) and no earlier hold is still handing over
    // bytes (a request pipelined behind its body streams after them).
    if g.phase != (Phase::Done { wrote: false }) || body.holding.is_some() {
        return false;
    }
    let Some(tail) = tail else {
        return false;
    };
    let hold = Hold::new(framing, &tail, mem_cap, max, dir);
    if hold.outcome != Outcome::Reading {
        // Pingora has the whole body already.
        return false;
    }
    body.holding = Some(Holding::new(hold, idle));
    true
}

/// How the current request's hold stands, if it has one.
pub fn hold_outcome(stream: Option<&Stream>) -> Option<Outcome> {
    let outcome = lock(&guard(stream)?.body).holding.as_ref()?.hold.outcome;
    Some(outcome)
}

/// Buffer the response about to be written on `stream` (response
/// buffering, `spool`): its bytes are taken at once and sent as the client
/// reads. False where it cannot be: not an HTTP/1 stream of the guard, or
/// a head already written.
pub fn spool_response(stream: Option<&Stream>, terms: spool::Terms) -> bool {
    let Some(g) = guard(stream) else {
        return false;
    };
    if g.phase != (Phase::Done { wrote: false }) {
        return false;
    }
    let mut slot = lock(&g.spool);
    match slot.as_mut() {
        // A response before this one is still being sent: queue behind.
        Some(s) => s.resume(),
        None => *slot = Some(Spool::new(terms)),
    }
    true
}

/// The response on `stream` has ended: true when some of it is still to
/// be sent and the connection is to close after it (see `spool`). Not
/// when the client has already sent more (pipelined requests, read with
/// the head or after the response began): those are answered in order,
/// their responses queued behind.
pub fn end_response(stream: Option<&Stream>) -> bool {
    let Some(g) = guard(stream) else {
        return false;
    };
    let mut slot = lock(&g.spool);
    let Some(s) = slot.as_mut() else {
        return false;
    };
    s.end();
    if s.retired() {
        *slot = None;
        return false;
    }
    let more = matches!(g.phase, Phase::Head { .. })
        || lock(&g.body).tail.as_ref().is_some_and(|t| !t.is_empty());
    !more
}

/// A guard's lock (a poisoned lock holds plain data: still good).
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A lock's data, from `&mut` (no locking).
fn get<T>(m: &mut std::sync::Mutex<T>) -> &mut T {
    m.get_mut()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl std::fmt::Debug for HeadDeadline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeadDeadline")
            .field("phase", &self.phase)
            .field("inner", &self.inner)
            .finish()
    }
}

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0";

impl HeadDeadline {
    fn new(
        inner: Stream,
        timeout: Duration,
        slot: Option<Slot>,
        closed: prometheus::IntCounter,
    ) -> Self {
        let h2 = inner.selected_alpn_proto() == Some(ALPN::H2);
        let mut s = HeadDeadline {
            inner,
            timeout,
            phase: if h2 {
                Phase::Off
            } else {
                Phase::Head { text: true }
            },
            deadline: None,
            arm_on_wait: false,
            first: true,
            slot,
            closed,
            seen: AtomicBool::new(false),
            hsts: None,
            rewrite: Rewrite::Idle,
            peeked: Vec::new(),
            head: HeadSize::default(),
            limits: (usize::MAX, usize::MAX),
            keepalive: Duration::from_secs(75),
            body: std::sync::Mutex::new(Body::default()),
            preface_timeout: None,
            preface_closed: None,
            wbuf: Default::default(),
            join_head: AtomicBool::new(false),
            spool: std::sync::Mutex::new(None),
        };
        // The first head is timed from the accept, as nginx times it.
        if s.phase != Phase::Off {
            s.arm();
        }
        s
    }

    fn arm(&mut self) {
        if !self.timeout.is_zero() {
            self.deadline = Some(Box::pin(tokio::time::sleep(self.timeout)));
        }
    }

    /// Follow the bytes just read.
    fn saw(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        if self.first {
            self.first = false;
            let n = bytes.len().min(H2_PREFACE.len());
            if bytes[..n] == H2_PREFACE[..n] {
                self.phase = Phase::Off;
                self.deadline = None;
                return;
            }
        }
        if self.phase == (Phase::Done { wrote: true }) {
            // The next request starts with this byte.
            self.phase = Phase::Head { text: true };
            self.seen.store(false, Ordering::Relaxed);
            self.head = HeadSize::default();
            self.body().tail = None;
            self.arm_on_wait = true;
        }
        let Phase::Head { text } = self.phase else {
            return;
        };
        let (at, lines) = head_scan(text, bytes);
        self.head.lines += lines;
        match at {
            Ok(end) => {
                self.head.bytes += end + 1;
                self.phase = Phase::Done { wrote: false };
                self.deadline = None;
                self.arm_on_wait = false;
                let rest = &bytes[end + 1..];
                let body = self.body();
                body.tail = (rest.len() <= hold::TAIL_MAX).then(|| rest.to_vec());
            }
            Err(text) => {
                self.head.bytes += bytes.len();
                self.phase = Phase::Head { text };
            }
        }
    }

    /// Read the first request head (or enough of it to tell the HTTP/2
    /// preface) before Pingora's session for it exists. Pingora's
    /// per-connection state (its session, buffers and proxy future, some
    /// tens of KiB) is then only allocated for a connection with a whole
    /// head: a slowloris connection holds this stream and the bytes it
    /// sent. The bytes are handed to Pingora's reads afterwards, through
    /// `peeked`. False when the connection is to be closed: the client
    /// went away, or the head deadline passed (counted).
    async fn read_first_head(&mut self) -> bool {
        use tokio::io::AsyncReadExt;
        if self.phase == Phase::Off {
            return true;
        }
        // Past the limit the head is Pingora's to refuse (a 431, `bare`).
        let cap = self.limits.0.saturating_add(1).min(1 << 20);
        let mut decide = self
            .preface_timeout
            .map(|d| Box::pin(tokio::time::sleep(d)));
        loop {
            let b = &self.peeked;
            let preface = preface::could_be_preface(b);
            if b.len() > cap
                || (preface && b.len() >= preface::PREFACE.len())
                || (!preface && head_ends(b))
            {
                return true;
            }
            // Only while the bytes could still begin HTTP/2's preface.
            let undecided = preface && decide.is_some();
            self.peeked.reserve(1024);
            let read = self.inner.read_buf(&mut self.peeked);
            let n = tokio::select! {
                r = read => r,
                _ = sleep_or_never(self.deadline.as_mut()) => {
                    self.deadline = None;
                    self.phase = Phase::Off;
                    self.closed.inc();
                    self.answer_timeout().await;
                    return false;
                }
                _ = sleep_or_never(decide.as_mut()), if undecided => {
                    self.deadline = None;
                    self.phase = Phase::Off;
                    if let Some(c) = &self.preface_closed {
                        c.inc();
                    }
                    return false;
                }
            };
            if !matches!(n, Ok(n) if n > 0) {
                return false;
            }
        }
    }

    /// A `408` to a client whose head did not arrive in time, where one
    /// can be understood: it has sent part of an HTTP/1 head. Written only
    /// if the socket takes it at once; the connection closes either way.
    async fn answer_timeout(&mut self) {
        use tokio::io::AsyncWriteExt;
        if self.peeked.is_empty() || preface::could_be_preface(&self.peeked) {
            return;
        }
        let bytes = bare::response(self.hsts.as_ref(), bare::Bare::TimedOut);
        let write = self.inner.write_all(&bytes);
        let _ = tokio::time::timeout(Duration::from_millis(100), write).await;
    }

    /// Whether a write beginning with `first` is Pingora's bare refusal of
    /// a head our filter never saw, to be replaced by ours.
    fn replaces(&self, first: &[u8]) -> bool {
        self.rewrite.active()
            || (self.phase != Phase::Off
                && !self.seen.load(Ordering::Relaxed)
                && bare::is_400(first))
    }

    /// Write our `400` in place of a write of `len` bytes of Pingora's.
    fn poll_replace(&mut self, cx: &mut Context<'_>, len: usize) -> Poll<std::io::Result<usize>> {
        if !self.rewrite.active() {
            // Past the configured limits Pingora's parser gives up too
            // (at 256 headers or 1 MiB): that is a 431, as for the heads
            // Pingora parses and our filter refuses.
            let too_large = self.head.bytes > self.limits.0 || self.head.lines > self.limits.1 + 1;
            let why = match too_large {
                true => bare::Bare::TooLarge,
                false => bare::Bare::Unparsed,
            };
            self.rewrite.start(bare::response(self.hsts.as_ref(), why));
            self.phase = Phase::Done { wrote: true };
        }
        self.rewrite.poll(&mut self.inner, cx, len)
    }

    /// Send what a spool holds as far as the socket takes it now, and
    /// retire a spool that is done: `Pending` (waker set) while bytes
    /// wait, `Ready(Ok)` when none do (or there is no spool).
    fn pump_spool(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let spool = get(&mut self.spool);
        let Some(s) = spool.as_mut() else {
            return Poll::Ready(Ok(()));
        };
        let sent = s.poll_send(&mut self.inner, cx);
        if matches!(sent, Poll::Ready(Ok(()))) && s.retired() {
            *spool = None;
        }
        sent
    }

    /// Whether a spool holds bytes not yet sent.
    fn spooling(&mut self) -> bool {
        get(&mut self.spool).as_ref().is_some_and(|s| !s.is_empty())
    }

    /// A write while a spool is on: taken into it, or waiting for what it
    /// holds to go first; `None`: write through, as without buffering (no
    /// spool, or past a bound once the spool is sent).
    fn poll_spool(
        &mut self,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Option<Poll<std::io::Result<usize>>> {
        let spool = get(&mut self.spool);
        let s = spool.as_mut()?;
        if s.retired() {
            *spool = None;
            return None;
        }
        // A head held for its body (`wbuf`) goes first.
        match self.wbuf.poll_send(&mut self.inner, cx) {
            Poll::Ready(Ok(())) => {}
            other => return Some(other.map(|r| r.map(|()| 0))),
        }
        // Send what the socket takes now (a slow client's takes nothing).
        if let Poll::Ready(Err(e)) = s.poll_send(&mut self.inner, cx) {
            return Some(Poll::Ready(Err(e)));
        }
        if !s.take(buf) {
            // A bound: what is held goes first, then the rest streams.
            return match s.poll_send(&mut self.inner, cx) {
                Poll::Ready(Ok(())) => {
                    *spool = None;
                    None
                }
                other => Some(other.map(|r| r.map(|()| 0))),
            };
        }
        self.wrote(buf);
        Some(Poll::Ready(Ok(buf.len())))
    }

    /// Follow the bytes just written.
    fn wrote(&mut self, bytes: &[u8]) {
        // Only a response's head can switch protocols: a body chunk that
        // happens to begin with the same bytes (an origin's, a client's
        // echo) written after the head must not turn the guard off.
        let head_next = matches!(self.phase, Phase::Done { wrote: false });
        let switching = bytes.starts_with(b"HTTP/1.1 101") || bytes.starts_with(b"HTTP/1.0 101");
        if head_next && switching {
            self.phase = Phase::Off;
            self.deadline = None;
        } else if head_next {
            // An interim 1xx (100 Continue) is not the response.
            let interim = bytes.starts_with(b"HTTP/1.1 1") || bytes.starts_with(b"HTTP/1.0 1");
            if !interim && !bytes.is_empty() {
                self.phase = Phase::Done { wrote: true };
            }
        }
    }
}

impl AsyncRead for HeadDeadline {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        // A read is a chance to send more of a spool (and to be woken when
        // the client takes more).
        if let Poll::Ready(Err(e)) = this.pump_spool(cx) {
            return Poll::Ready(Err(e));
        }
        let held = {
            get(&mut this.body).holding.as_mut().map(|h| {
                // What the first-head read took past the head, not yet
                // read by Pingora, comes before the socket's next bytes.
                if !this.peeked.is_empty() {
                    h.hold.add(&std::mem::take(&mut this.peeked));
                }
                h.poll_read(&mut this.inner, cx, buf)
            })
        };
        match held {
            None => {}
            Some(Poll::Pending) => return Poll::Pending,
            Some(Poll::Ready(Err(e))) => return Poll::Ready(Err(e)),
            Some(Poll::Ready(Ok(true))) => {
                this.saw(&buf.filled()[before..]);
                return Poll::Ready(Ok(()));
            }
            // Handed over: reads go to the socket again.
            Some(Poll::Ready(Ok(false))) => this.body().holding = None,
        }
        if !self.peeked.is_empty() {
            // What the h2c check read, first.
            let this = &mut *self;
            let n = this.peeked.len().min(buf.remaining());
            buf.put_slice(&this.peeked[..n]);
            this.peeked.drain(..n);
            this.saw(&buf.filled()[before..]);
            return Poll::Ready(Ok(()));
        }
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let this = &mut *self;
                this.saw(&buf.filled()[before..]);
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                if std::mem::take(&mut self.arm_on_wait) && matches!(self.phase, Phase::Head { .. })
                {
                    self.arm();
                }
                let fired = self
                    .deadline
                    .as_mut()
                    .is_some_and(|d| d.as_mut().poll(cx).is_ready());
                if !fired {
                    return Poll::Pending;
                }
                self.deadline = None;
                self.phase = Phase::Off;
                self.closed.inc();
                if self.head.bytes > 0 {
                    // Part of a head came: a 408 can be understood. One
                    // write, no wait: a client that does not take it at
                    // once is not waited for.
                    let bytes = bare::response(self.hsts.as_ref(), bare::Bare::TimedOut);
                    let _ = Pin::new(&mut self.inner).poll_write(cx, &bytes);
                }
                Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "client_header_timeout: the request head did not arrive in time",
                )))
            }
            other => other,
        }
    }
}

impl AsyncWrite for HeadDeadline {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = &mut *self;
        if this.replaces(buf) {
            ready!(this.wbuf.poll_send(&mut this.inner, cx))?;
            return this.poll_replace(cx, buf.len());
        }
        if let Some(r) = this.poll_spool(cx, buf) {
            return r;
        }
        if this.wbuf.takes(buf.len()) {
            this.wbuf.hold(buf);
            this.wrote(buf);
            return Poll::Ready(Ok(buf.len()));
        }
        ready!(this.wbuf.poll_send(&mut this.inner, cx))?;
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r {
            this.wrote(&buf[..n]);
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        match this.pump_spool(cx) {
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            // Bytes held are the spool's to send as the client reads.
            Poll::Pending => return Poll::Ready(Ok(())),
            Poll::Ready(Ok(())) => {}
        }
        if this.join_head.swap(false, Ordering::Relaxed) && !this.wbuf.is_empty() {
            // The head's own flush: its body follows at once.
            return Poll::Ready(Ok(()));
        }
        ready!(this.wbuf.poll_send(&mut this.inner, cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if this.spooling() {
            // The drain closes the connection once the spool is sent.
            return Poll::Ready(Ok(()));
        }
        ready!(this.wbuf.poll_send(&mut this.inner, cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        // Only a status line's first bytes matter: keep them on the stack
        // (the buffers are gone once written).
        let mut head = [0u8; 16];
        let len = bufs.iter().find(|b| !b.is_empty()).map_or(0, |b| {
            let n = b.len().min(head.len());
            head[..n].copy_from_slice(&b[..n]);
            n
        });
        let this = &mut *self;
        if this.spooling() {
            // A spool takes one buffer at a time (a short write).
            let first = bufs
                .iter()
                .find(|b| !b.is_empty())
                .map_or(&[][..], |b| &b[..]);
            return Pin::new(this).poll_write(cx, first);
        }
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if this.replaces(&head[..len]) {
            ready!(this.wbuf.poll_send(&mut this.inner, cx))?;
            return this.poll_replace(cx, total);
        }
        if this.wbuf.takes(total) {
            for b in bufs {
                this.wbuf.hold(b);
            }
            if total > 0 {
                this.wrote(&head[..len]);
            }
            return Poll::Ready(Ok(total));
        }
        ready!(this.wbuf.poll_send(&mut this.inner, cx))?;
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = &r {
            if *n > 0 {
                this.wrote(&head[..len.min(*n)]);
            }
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl Drop for HeadDeadline {
    fn drop(&mut self) {
        // A response still being sent when its request ended: the rest
        // goes out from a task of its own, the request's state gone.
        let Some(s) = get(&mut self.spool).take() else {
            return;
        };
        if s.is_empty() {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let inner = std::mem::replace(&mut self.inner, Box::new(spool::Gone));
        rt.spawn(spool::drain(inner, s, self.slot.take()));
    }
}

#[async_trait]
impl Shutdown for HeadDeadline {
    async fn shutdown(&mut self) {
        if self.spooling() {
            // The drain closes the connection once the spool is sent.
            return;
        }
        // What is held goes out before the close.
        let _ = std::future::poll_fn(|cx| self.wbuf.poll_send(&mut self.inner, cx)).await;
        self.inner.shutdown().await
    }
}

impl UniqueID for HeadDeadline {
    fn id(&self) -> UniqueIDType {
        self.inner.id()
    }
}

impl Ssl for HeadDeadline {
    fn get_ssl(&self) -> Option<&TlsRef> {
        self.inner.get_ssl()
    }

    fn get_ssl_digest(&self) -> Option<Arc<SslDigest>> {
        self.inner.get_ssl_digest()
    }

    fn selected_alpn_proto(&self) -> Option<ALPN> {
        self.inner.selected_alpn_proto()
    }
}

impl GetTimingDigest for HeadDeadline {
    fn get_timing_digest(&self) -> Vec<Option<TimingDigest>> {
        self.inner.get_timing_digest()
    }

    fn get_read_pending_time(&self) -> Duration {
        self.inner.get_read_pending_time()
    }

    fn get_write_pending_time(&self) -> Duration {
        self.inner.get_write_pending_time()
    }
}

impl GetProxyDigest for HeadDeadline {
    fn get_proxy_digest(&self) -> Option<Arc<ProxyDigest>> {
        self.inner.get_proxy_digest()
    }

    fn set_proxy_digest(&mut self, digest: ProxyDigest) {
        self.inner.set_proxy_digest(digest)
    }
}

impl GetSocketDigest for HeadDeadline {
    fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
        self.inner.get_socket_digest()
    }

    fn set_socket_digest(&mut self, digest: SocketDigest) {
        self.inner.set_socket_digest(digest)
    }
}

#[async_trait]
impl Peek for HeadDeadline {
    /// Pingora's h2c check (`preface`): bytes read until they cannot be
    /// the preface, within the head deadline (first request) or the
    /// keepalive timeout (later ones); they are handed back to the reads.
    async fn try_peek(&mut self, buf: &mut [u8]) -> std::io::Result<bool> {
        if self.phase == Phase::Off {
            return self.inner.try_peek(buf).await;
        }
        // Idle between requests is the keepalive timeout's (not counted, as
        // Pingora's own is not); before the first, the head deadline's.
        let first = matches!(self.phase, Phase::Head { .. });
        if std::mem::take(&mut self.arm_on_wait) && first {
            self.arm();
        }
        let mut stash = std::mem::take(&mut self.peeked);
        let read = preface::read_until_decided(&mut self.inner, &mut stash, buf.len());
        let timed_out = match (self.phase, self.deadline.as_mut()) {
            (Phase::Head { .. }, Some(d)) => tokio::select! {
                r = read => r.map(|_| false),
                _ = d.as_mut() => Ok(true),
            },
            _ => match tokio::time::timeout(self.keepalive, read).await {
                Ok(r) => r.map(|_| false),
                Err(_) => Ok(true),
            },
        };
        self.peeked = stash;
        if timed_out? {
            self.deadline = None;
            self.phase = Phase::Off;
            if first {
                self.closed.inc();
            }
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no request (or HTTP/2 preface) in time",
            ));
        }
        preface::fill_peek(buf, &self.peeked);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard() -> HeadDeadline {
        let a = std::io::Cursor::new(Vec::<u8>::new());
        let open = Arc::new(AtomicUsize::new(1));
        let gauge = prometheus::IntGauge::new("g", "g").unwrap();
        let closed = prometheus::IntCounter::new("c", "c").unwrap();
        let slot = Slot { open, gauge };
        // No ALPN and no timeout: watching a head, no deadline armed.
        HeadDeadline::new(Box::new(a), Duration::ZERO, Some(slot), closed)
    }

    /// `head_scan` against the byte-by-byte rule it replaced (which counted
    /// the bytes where only none or some matters), on every string of up to
    /// 7 bytes over `a`, CR and LF, from either start.
    #[test]
    fn the_line_feed_scan_agrees_with_the_byte_rule() {
        fn by_byte(mut since_lf: usize, bytes: &[u8]) -> (Result<usize, bool>, usize) {
            let mut lines = 0;
            for (i, &b) in bytes.iter().enumerate() {
                since_lf = match b {
                    b'\n' if since_lf == 0 => return (Ok(i), lines),
                    b'\n' => {
                        lines += 1;
                        0
                    }
                    b'\r' => since_lf,
                    _ => since_lf + 1,
                };
            }
            (Err(since_lf > 0), lines)
        }
        for len in 0..=7u32 {
            for code in 0..3usize.pow(len) {
                let bytes: Vec<u8> = (0..len)
                    .map(|i| b"a\r\n"[code / 3usize.pow(i) % 3])
                    .collect();
                for start in [0, 1] {
                    assert_eq!(
                        head_scan(start > 0, &bytes),
                        by_byte(start, &bytes),
                        "{bytes:?} from {start}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_head_ends_at_its_first_empty_line_in_any_chunking() {
        let req = b"GET / HTTP/1.1\r\nHost: a\r\n\r\nbody";
        for split in 1..req.len() {
            let mut g = guard();
            g.saw(&req[..split]);
            g.saw(&req[split..]);
            assert_eq!(g.phase, Phase::Done { wrote: false }, "split at {split}");
        }
        let mut g = guard();
        g.saw(b"GET / HTTP/1.1\nHost: a\n\n");
        assert_eq!(g.phase, Phase::Done { wrote: false }, "bare line feeds");
        let mut g = guard();
        g.saw(b"GET / HTTP/1.1\r\nHost: a\r\n");
        assert!(matches!(g.phase, Phase::Head { .. }), "no empty line yet");
    }

    #[test]
    fn the_next_head_starts_after_a_response_but_not_after_100_continue() {
        let mut g = guard();
        g.saw(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\n\r\n");
        g.wrote(b"HTTP/1.1 100 Continue\r\n\r\n");
        g.saw(b"the body, with no empty line");
        assert_eq!(g.phase, Phase::Done { wrote: false });
        g.wrote(b"HTTP/1.1 200 OK\r\n\r\n");
        g.saw(b"GET /next");
        assert!(matches!(g.phase, Phase::Head { .. }));
    }

    #[test]
    fn a_whole_head_is_told_as_saw_tells_it() {
        assert!(head_ends(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"));
        assert!(head_ends(b"GET / HTTP/1.0\n\nbody"));
        assert!(!head_ends(b"GET / HTTP/1.1\r\nHost: a\r\n"));
        assert!(!head_ends(b""));
    }

    /// The limits are checked after the head: a head read whole in one
    /// read counts its lines and bytes as one read a byte at a time does.
    #[test]
    fn a_head_read_at_once_counts_every_line() {
        let head = format!(
            "GET / HTTP/1.1\r\nHost: a\r\n{}\r\nbody",
            "x: 1\r\n".repeat(300)
        );
        let mut whole = guard();
        whole.saw(head.as_bytes());
        let mut drip = guard();
        for b in head.as_bytes().chunks(1) {
            drip.saw(b);
        }
        assert_eq!(whole.head.lines, 302);
        assert_eq!(whole.head.bytes, head.len() - 4);
        assert_eq!((drip.head.lines, drip.head.bytes), (302, head.len() - 4));
    }

    #[test]
    fn http2_and_upgrades_are_not_watched() {
        let mut g = guard();
        g.saw(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
        assert_eq!(g.phase, Phase::Off);
        let mut g = guard();
        g.saw(b"GET /ws HTTP/1.1\r\nUpgrade: websocket\r\n\r\n");
        g.wrote(b"HTTP/1.1 101 Switching Protocols\r\n\r\n");
        g.saw(b"\x81\x05hello");
        assert_eq!(g.phase, Phase::Off);
    }

    #[test]
    fn a_body_that_begins_like_a_101_leaves_the_guard_on() {
        let mut g = guard();
        g.saw(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n");
        g.wrote(b"HTTP/1.1 200 OK\r\nContent-Length: 36\r\n\r\n");
        g.wrote(b"HTTP/1.1 101 Switching Protocols\r\n\r\n");
        assert_eq!(g.phase, Phase::Done { wrote: true });
        assert!(g.phase != Phase::Off);
    }
}
