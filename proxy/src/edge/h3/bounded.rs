//! The QUIC streams the h3 crate reads, each behind a `frames::Framer`
//! that refuses an oversized frame when its header arrives, and a count of
//! the bytes h3 holds for unfinished request heads, per connection and for
//! the process (`ultrafast_http3_head_bytes`).
//!
//! The h3 crate cannot be told this from outside (it buffers a frame whole
//! before it looks at it), so its QUIC seam (`h3::quic`) is wrapped: the
//! h3-quinn streams go through `Recv` before h3 sees a byte. A refused
//! request stream is stopped and reset with `H3_EXCESSIVE_LOAD` (or
//! `H3_REQUEST_REJECTED` when the connection's or the process's budget for
//! heads is spent: the client may retry); a refused control stream closes
//! the connection with `H3_EXCESSIVE_LOAD` (RFC 9114 8.1).

use super::frames::{Framer, Kind, Refusal, Step};
use bytes::{Buf, Bytes};
use h3::quic::{self, ConnectionErrorIncoming, StreamErrorIncoming, StreamId, WriteBuf};
use prometheus::{IntCounterVec, IntGauge};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

/// RFC 9114 8.1: the peer generates excessive load.
pub const H3_EXCESSIVE_LOAD: u64 = 0x0107;
/// RFC 9114 8.1: the request was not processed; the client may retry.
pub const H3_REQUEST_REJECTED: u64 = 0x010b;
/// RFC 9114 8.1: the request or its response is cancelled.
pub const H3_REQUEST_CANCELLED: u64 = 0x010c;

/// Bytes of each HEADERS frame held without a charge: an ordinary head is
/// never refused for a budget that trickled heads have spent.
const FREE_HEAD: u64 = 16 * 1024;

/// Bytes of unfinished request heads held by h3 across the process.
static PROCESS_HELD: AtomicU64 = AtomicU64::new(0);

/// What bounds one connection's streams.
pub struct Bounds {
    /// Most bytes of one request's field section (its HEADERS frame).
    pub field_section: u64,
    /// Most bytes of unfinished heads one connection may hold.
    pub per_connection: u64,
    /// Most bytes of unfinished heads the process may hold.
    pub per_process: u64,
    /// `ultrafast_http3_head_bytes`: the process's count.
    pub gauge: IntGauge,
    /// `ultrafast_http3_refused_total` by reason.
    pub refused: IntCounterVec,
    /// The connection (closed on a control stream's refusal).
    pub quic: quinn::Connection,
    held: AtomicU64,
}

impl Bounds {
    /// The bounds of a new connection.
    pub fn new(
        field_section: u64,
        per_connection: u64,
        per_process: u64,
        gauge: IntGauge,
        refused: IntCounterVec,
        quic: quinn::Connection,
    ) -> Self {
        Bounds {
            field_section,
            per_connection,
            per_process,
            gauge,
            refused,
            quic,
            held: AtomicU64::new(0),
        }
    }

    /// Count `n` more bytes held, if both budgets have room.
    fn take(&self, n: u64) -> bool {
        if self.held.fetch_add(n, Ordering::Relaxed) + n > self.per_connection {
            self.held.fetch_sub(n, Ordering::Relaxed);
            return false;
        }
        if PROCESS_HELD.fetch_add(n, Ordering::Relaxed) + n > self.per_process {
            PROCESS_HELD.fetch_sub(n, Ordering::Relaxed);
            self.held.fetch_sub(n, Ordering::Relaxed);
            return false;
        }
        self.gauge.add(n as i64);
        true
    }

    fn give(&self, n: u64) {
        if n == 0 {
            return;
        }
        self.held.fetch_sub(n, Ordering::Relaxed);
        PROCESS_HELD.fetch_sub(n, Ordering::Relaxed);
        self.gauge.sub(n as i64);
    }
}

/// A receive stream read through its framer.
pub struct Recv {
    inner: h3_quinn::RecvStream,
    framer: Framer,
    bounds: Arc<Bounds>,
    /// What h3 is to read next, each piece with the bytes it charged.
    ready: VecDeque<(Bytes, u64)>,
    /// Bytes charged for pieces still in `ready`.
    queued: u64,
    /// Bytes of the unfinished HEADERS frame read so far, and what they
    /// charged (all past `FREE_HEAD`).
    frame: u64,
    held: u64,
    /// Charges of whole frames: given back once h3 has been handed every
    /// piece of them and polls again (it has decoded them by then).
    done: u64,
    refused: Option<u64>,
    /// A request stream's refusal, told to its send half.
    tell: Option<Arc<AtomicU64>>,
}

impl Recv {
    fn new(
        inner: h3_quinn::RecvStream,
        kind: Kind,
        bounds: Arc<Bounds>,
        tell: Option<Arc<AtomicU64>>,
    ) -> Self {
        Recv {
            inner,
            framer: Framer::new(kind, bounds.field_section),
            bounds,
            ready: VecDeque::new(),
            queued: 0,
            frame: 0,
            held: 0,
            done: 0,
            refused: None,
            tell,
        }
    }

    fn refuse(&mut self, code: u64, reason: &str) -> StreamErrorIncoming {
        self.bounds.refused.with_label_values(&[reason]).inc();
        quic::RecvStream::stop_sending(&mut self.inner, code);
        if self.framer.kind() == Kind::Control {
            self.bounds.quic.close(
                quinn::VarInt::from_u64(code).unwrap_or_default(),
                b"frame too large",
            );
        }
        self.refused = Some(code);
        if let Some(t) = &self.tell {
            t.store(code, Ordering::Relaxed);
        }
        StreamErrorIncoming::StreamTerminated { error_code: code }
    }

    /// Read `chunk` through the framer into `ready`.
    fn take(&mut self, chunk: Bytes) -> Result<(), StreamErrorIncoming> {
        let mut steps = Vec::new();
        let read = self.framer.feed(chunk, &mut steps);
        for s in steps {
            match s {
                Step::Pass(b) => self.ready.push_back((b, 0)),
                Step::Held(b) => {
                    let before = self.frame.saturating_sub(FREE_HEAD);
                    self.frame += b.len() as u64;
                    let charge = self.frame.saturating_sub(FREE_HEAD) - before;
                    if charge > 0 && !self.bounds.take(charge) {
                        return Err(self.refuse(H3_REQUEST_REJECTED, "busy"));
                    }
                    self.held += charge;
                    self.queued += charge;
                    self.ready.push_back((b, charge));
                }
                Step::Done => {
                    self.done += self.held;
                    self.held = 0;
                    self.frame = 0;
                }
            }
        }
        read.map_err(|r: Refusal| self.refuse(H3_EXCESSIVE_LOAD, r.label()))
    }
}

impl Drop for Recv {
    fn drop(&mut self) {
        self.bounds.give(self.held + self.done);
    }
}

impl quic::RecvStream for Recv {
    type Buf = Bytes;

    fn poll_data(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Option<Bytes>, StreamErrorIncoming>> {
        // Once every piece of a whole frame is out, h3 decodes it before
        // it asks for more.
        if self.queued == 0 {
            let done = std::mem::take(&mut self.done);
            self.bounds.give(done);
        }
        loop {
            if let Some(code) = self.refused {
                return Poll::Ready(Err(StreamErrorIncoming::StreamTerminated {
                    error_code: code,
                }));
            }
            if let Some((b, charged)) = self.ready.pop_front() {
                self.queued -= charged;
                return Poll::Ready(Ok(Some(b)));
            }
            match std::task::ready!(self.inner.poll_data(cx)) {
                Ok(Some(chunk)) => {
                    if let Err(e) = self.take(chunk) {
                        return Poll::Ready(Err(e));
                    }
                }
                other => return Poll::Ready(other),
            }
        }
    }

    fn stop_sending(&mut self, error_code: u64) {
        quic::RecvStream::stop_sending(&mut self.inner, error_code)
    }

    fn recv_id(&self) -> StreamId {
        quic::RecvStream::recv_id(&self.inner)
    }
}

/// A send half that is reset, not finished, when dropped after its
/// stream was refused (quinn finishes a dropped send stream, which would
/// read as an empty answer).
pub struct Send<B: Buf> {
    inner: h3_quinn::SendStream<B>,
    refused: Arc<AtomicU64>,
    /// Finished or reset: nothing to do when dropped.
    ended: bool,
}

impl<B: Buf> Drop for Send<B> {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        // Dropped before its end (a refusal, a head past its deadline, a
        // response cut short): a reset, never a FIN a client would read as
        // a whole, empty or truncated answer.
        let code = match self.refused.load(Ordering::Relaxed) {
            0 => H3_REQUEST_CANCELLED,
            c => c,
        };
        quic::SendStream::reset(&mut self.inner, code);
    }
}

impl<B: Buf> quic::SendStream<B> for Send<B> {
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), StreamErrorIncoming>> {
        self.inner.poll_ready(cx)
    }

    fn send_data<T: Into<WriteBuf<B>>>(&mut self, data: T) -> Result<(), StreamErrorIncoming> {
        self.inner.send_data(data)
    }

    fn poll_finish(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), StreamErrorIncoming>> {
        let p = self.inner.poll_finish(cx);
        if p.is_ready() {
            self.ended = true;
        }
        p
    }

    fn reset(&mut self, reset_code: u64) {
        self.ended = true;
        self.inner.reset(reset_code)
    }

    fn send_id(&self) -> StreamId {
        self.inner.send_id()
    }
}

/// A request stream: its receive half bounded.
pub struct Bidi<B: Buf> {
    send: Send<B>,
    recv: Recv,
}

impl<B: Buf> Bidi<B> {
    fn new(s: h3_quinn::BidiStream<B>, bounds: Arc<Bounds>) -> Self {
        let (send, recv) = quic::BidiStream::split(s);
        let refused = Arc::new(AtomicU64::new(0));
        Bidi {
            send: Send {
                inner: send,
                refused: refused.clone(),
                ended: false,
            },
            recv: Recv::new(recv, Kind::Request, bounds, Some(refused)),
        }
    }
}

impl<B: Buf> quic::RecvStream for Bidi<B> {
    type Buf = Bytes;

    fn poll_data(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Option<Bytes>, StreamErrorIncoming>> {
        self.recv.poll_data(cx)
    }

    fn stop_sending(&mut self, error_code: u64) {
        self.recv.stop_sending(error_code)
    }

    fn recv_id(&self) -> StreamId {
        self.recv.recv_id()
    }
}

impl<B: Buf> quic::SendStream<B> for Bidi<B> {
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), StreamErrorIncoming>> {
        self.send.poll_ready(cx)
    }

    fn send_data<T: Into<WriteBuf<B>>>(&mut self, data: T) -> Result<(), StreamErrorIncoming> {
        self.send.send_data(data)
    }

    fn poll_finish(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), StreamErrorIncoming>> {
        self.send.poll_finish(cx)
    }

    fn reset(&mut self, reset_code: u64) {
        self.send.reset(reset_code)
    }

    fn send_id(&self) -> StreamId {
        self.send.send_id()
    }
}

impl<B: Buf> quic::BidiStream<B> for Bidi<B> {
    type SendStream = Send<B>;
    type RecvStream = Recv;

    fn split(self) -> (Self::SendStream, Self::RecvStream) {
        (self.send, self.recv)
    }
}

/// h3-quinn's connection (`Conn`) or stream opener (`Opener`), whose
/// bidirectional streams come bounded.
pub struct Bounded<T> {
    inner: T,
    bounds: Arc<Bounds>,
}

/// The connection h3 serves, its streams bounded.
pub type Conn = Bounded<h3_quinn::Connection>;

/// Opens the server's own streams (its control and QPACK streams; it
/// opens no request streams).
pub type Opener = Bounded<h3_quinn::OpenStreams>;

impl Conn {
    /// Wrap `quic` for h3.
    pub fn new(quic: quinn::Connection, bounds: Arc<Bounds>) -> Self {
        Bounded {
            inner: h3_quinn::Connection::new(quic),
            bounds,
        }
    }
}

impl<B, T> quic::OpenStreams<B> for Bounded<T>
where
    B: Buf,
    T: quic::OpenStreams<
        B,
        BidiStream = h3_quinn::BidiStream<B>,
        SendStream = h3_quinn::SendStream<B>,
    >,
{
    type BidiStream = Bidi<B>;
    type SendStream = h3_quinn::SendStream<B>;

    fn poll_open_bidi(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Self::BidiStream, StreamErrorIncoming>> {
        let bounds = &self.bounds;
        self.inner
            .poll_open_bidi(cx)
            .map_ok(|s| Bidi::new(s, bounds.clone()))
    }

    fn poll_open_send(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Self::SendStream, StreamErrorIncoming>> {
        self.inner.poll_open_send(cx)
    }

    fn close(&mut self, code: h3::error::Code, reason: &[u8]) {
        self.inner.close(code, reason)
    }
}

impl<B: Buf> quic::Connection<B> for Conn {
    type RecvStream = Recv;
    type OpenStreams = Opener;

    fn poll_accept_recv(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Self::RecvStream, ConnectionErrorIncoming>> {
        quic::Connection::<B>::poll_accept_recv(&mut self.inner, cx)
            .map_ok(|s| Recv::new(s, Kind::Uni, self.bounds.clone(), None))
    }

    fn poll_accept_bidi(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Self::BidiStream, ConnectionErrorIncoming>> {
        quic::Connection::<B>::poll_accept_bidi(&mut self.inner, cx)
            .map_ok(|s| Bidi::new(s, self.bounds.clone()))
    }

    fn opener(&self) -> Self::OpenStreams {
        Opener {
            inner: quic::Connection::<B>::opener(&self.inner),
            bounds: self.bounds.clone(),
        }
    }
}
