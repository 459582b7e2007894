//! Response buffering, nginx's `proxy_buffering on`: a proxied response
//! is written into a spool below Pingora instead of into a slow client's
//! socket, so Pingora reads the origin at the origin's pace and gives its
//! connection back to the pool as soon as the origin has sent everything.
//!
//! Pingora relays a response through a channel of four chunks between the
//! upstream and the downstream halves and releases the upstream connection
//! only when both are done, so a client that reads slowly held an origin
//! connection and up to four 64 KiB chunks until it had read the last
//! byte (`benches/RESULTS.md` section 12). The connection guard
//! (`conn::HeadDeadline`) takes every write of a buffered response into a
//! [`Spool`] at once: `memory` bytes in memory, the rest in an unlinked
//! temporary file (`proxy_temp_path`, `max_temp_file_bytes`), and sends it
//! to the client as the socket takes it. A response still being sent when
//! its request ends closes its connection after it (no keepalive): the
//! request's state is dropped, and [`drain`] sends the rest from a small
//! task of its own, within `send_timeout` between two writes. A client
//! that already sent its next request keeps the connection, and the next
//! response queues behind.
//!
//! Bounds: memory and disk in all, process-wide (`response_buffers_total_kb`,
//! `temp_files_total_mb`). At a bound the response streams unbuffered from
//! there (what is spooled goes first), counted by bound. A temporary file
//! is unlinked at creation, so it never outlives its descriptor, also when
//! the process dies.

use prometheus::{IntCounter, IntCounterVec, IntGauge};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::io::AsyncWrite;

/// Most bytes read back from the file for one write. They are read into
/// a buffer of the thread's, not the connection's: a client that takes a
/// few bytes at a time pins no memory between its reads (the page cache
/// keeps the file; a retried write reads its bytes again).
const CHUNK: usize = 16 * 1024;

thread_local! {
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The buffering's families, process-wide.
#[derive(Clone)]
pub struct SpoolMetrics {
    /// Responses buffered.
    pub buffered: IntCounter,
    /// Responses that met a bound and streamed unbuffered from there.
    pub overflows: IntCounterVec,
    /// Bytes held in memory by every spool.
    pub memory: IntGauge,
    /// Bytes held in temporary files by every spool.
    pub disk: IntGauge,
    /// Responses being sent after their request ended.
    pub detached: IntGauge,
    /// Connections closed at `send_timeout` while sending a spool.
    pub send_timeout: IntCounter,
}

/// What one buffered response may hold, and where.
#[derive(Clone)]
pub struct Terms {
    /// Bytes in memory for this connection (`response_buffer_kb`).
    pub memory: usize,
    /// Bytes in memory for all spools (`response_buffers_total_kb`).
    pub memory_total: i64,
    /// Bytes of this response's temporary file (`max_temp_file_bytes`; 0:
    /// none, memory only).
    pub file: u64,
    /// Bytes of all temporary files (`temp_files_total_mb`).
    pub disk_total: i64,
    /// Directory of the temporary files (`proxy_temp_path`), shared: a
    /// response's terms are made on every buffered response.
    pub dir: std::sync::Arc<std::path::Path>,
    /// Most time between two writes to the client (`send_timeout`).
    pub send_timeout: Option<Duration>,
    /// The families to count in (shared, as `dir`).
    pub metrics: std::sync::Arc<SpoolMetrics>,
}

/// A response's bytes written but not yet sent: `mem[sent..]`, then
/// `file[file_read..file_end]`. The file's bytes start past a hole of
/// `memory` bytes (sparse: no disk), where [`detach`](Spool::detach) moves
/// what memory still holds, so that a response left to a slow client
/// holds no memory of its own.
pub struct Spool {
    terms: Terms,
    mem: Vec<u8>,
    sent: usize,
    /// `mem`'s capacity, as counted in `metrics.memory`.
    mem_counted: usize,
    file: Option<File>,
    file_read: u64,
    file_end: u64,
    /// Bytes counted in `metrics.disk`.
    disk_counted: u64,
    /// False once the response has ended: an empty spool is retired.
    accepting: bool,
    /// A bound was met: nothing more is taken.
    overflowed: bool,
}

impl Spool {
    /// A spool for the response about to be written.
    pub fn new(terms: Terms) -> Self {
        terms.metrics.buffered.inc();
        Spool {
            terms,
            mem: Vec::new(),
            sent: 0,
            mem_counted: 0,
            file: None,
            file_read: 0,
            file_end: 0,
            disk_counted: 0,
            accepting: true,
            overflowed: false,
        }
    }

    /// Whether every byte taken has been sent.
    pub fn is_empty(&self) -> bool {
        self.sent == self.mem.len() && self.file_read == self.file_end
    }

    /// Whether the spool is done with: empty, and its response ended or
    /// streaming past a bound.
    pub fn retired(&self) -> bool {
        self.is_empty() && (!self.accepting || self.overflowed)
    }

    /// The response has ended (bytes after it, a chunked body's last
    /// chunk, still queue behind what is held).
    pub fn end(&mut self) {
        self.accepting = false;
    }

    /// Another response on the connection is buffered while this one is
    /// still being sent: it queues behind.
    pub fn resume(&mut self) {
        self.accepting = !self.overflowed;
    }

    /// Bytes held in memory and on disk, not yet sent.
    pub fn pending(&self) -> u64 {
        (self.mem.len() - self.sent) as u64 + (self.file_end - self.file_read)
    }

    /// Take `bytes` to be sent later. False at a bound (counted once):
    /// the caller sends what is held, then writes through.
    pub fn take(&mut self, bytes: &[u8]) -> bool {
        if self.overflowed {
            return false;
        }
        if bytes.is_empty() {
            return true;
        }
        // Memory only while nothing waits in the file (order).
        let (head, tail) = if self.file_read == self.file_end {
            bytes.split_at(self.mem_room().min(bytes.len()))
        } else {
            bytes.split_at(0)
        };
        if !tail.is_empty() {
            if let Err(bound) = self.push_file(tail) {
                self.overflowed = true;
                self.terms
                    .metrics
                    .overflows
                    .with_label_values(&[bound])
                    .inc();
                return false;
            }
        }
        if !head.is_empty() {
            self.push_mem(head);
        }
        true
    }

    /// Room in memory for this connection, within the process's total.
    fn mem_room(&self) -> usize {
        let own = self.terms.memory.saturating_sub(self.mem.len() - self.sent);
        let total = self.terms.memory_total - self.terms.metrics.memory.get();
        // What this spool already counts is its own to fill.
        let spare = (self.mem_counted - (self.mem.len() - self.sent)) as i64;
        own.min((total + spare).max(0) as usize)
    }

    fn push_mem(&mut self, bytes: &[u8]) {
        if self.sent > 0 && self.sent == self.mem.len() {
            self.mem.clear();
            self.sent = 0;
        } else if self.sent > 0 && self.mem.len() + bytes.len() > self.mem.capacity() {
            self.mem.drain(..self.sent);
            self.sent = 0;
        }
        if self.mem.len() + bytes.len() > self.mem.capacity() {
            // Grow by doubling, never past the connection's budget.
            let want = (self.mem.len() + bytes.len())
                .max(self.mem.capacity() * 2)
                .min(self.terms.memory.max(self.mem.len() + bytes.len()));
            self.mem.reserve_exact(want - self.mem.len());
        }
        self.mem.extend_from_slice(bytes);
        self.count_mem();
    }

    /// Follow `mem`'s capacity in the memory total.
    fn count_mem(&mut self) {
        let cap = self.mem.capacity();
        self.terms
            .metrics
            .memory
            .add(cap as i64 - self.mem_counted as i64);
        self.mem_counted = cap;
    }

    /// Append to the temporary file; `Err(bound)` where a bound (or the
    /// file system) refuses.
    fn push_file(&mut self, bytes: &[u8]) -> Result<(), &'static str> {
        let len = bytes.len() as u64;
        let used = match self.file {
            Some(_) => self.file_end - self.hole(),
            None => 0,
        };
        if used + len > self.terms.file {
            return Err("temp_file");
        }
        if self.terms.metrics.disk.get() + len as i64 > self.terms.disk_total {
            return Err("disk_total");
        }
        self.open_file()?;
        let f = self.file.as_ref().expect("opened above");
        if let Err(e) = f.write_all_at(bytes, self.file_end) {
            log::warn!("proxy_temp_path: {e}");
            return Err("temp_file_error");
        }
        self.file_end += len;
        self.count_disk(len);
        Ok(())
    }

    /// The file's bytes start here (the hole before is `detach`'s).
    fn hole(&self) -> u64 {
        self.terms.memory as u64
    }

    fn open_file(&mut self) -> Result<(), &'static str> {
        if self.file.is_some() {
            return Ok(());
        }
        match tempfile::tempfile_in(&self.terms.dir) {
            Ok(f) => {
                self.file = Some(f);
                self.file_read = self.hole();
                self.file_end = self.hole();
                Ok(())
            }
            Err(e) => {
                log::warn!("proxy_temp_path: {e}");
                Err("temp_file_error")
            }
        }
    }

    fn count_disk(&mut self, len: u64) {
        self.disk_counted += len;
        self.terms.metrics.disk.add(len as i64);
    }

    /// The request has ended with bytes still to send: move what memory
    /// holds into the file's hole, before the file's bytes, and free it.
    /// A connection left to a slow client then costs its socket and a
    /// small task, its bytes waiting in the page cache. Kept in memory if
    /// the file cannot take them.
    pub fn detach(&mut self) {
        let unsent = self.mem.len() - self.sent;
        if unsent > 0 {
            if self.terms.file == 0 || self.open_file().is_err() {
                return;
            }
            let at = self.file_read - unsent as u64;
            let f = self.file.as_ref().expect("opened above");
            if f.write_all_at(&self.mem[self.sent..], at).is_err() {
                return;
            }
            self.file_read = at;
            self.count_disk(unsent as u64);
        }
        self.mem = Vec::new();
        self.sent = 0;
        self.count_mem();
    }

    /// Everything sent: give memory and disk back (the file is kept,
    /// truncated, for the rest of the response).
    fn release(&mut self) {
        self.mem = Vec::new();
        self.sent = 0;
        self.count_mem();
        if let Some(f) = &self.file {
            if self.disk_counted > 0 {
                let _ = f.set_len(0);
            }
            self.file_read = self.hole();
            self.file_end = self.hole();
        }
        self.terms.metrics.disk.sub(self.disk_counted as i64);
        self.disk_counted = 0;
    }

    /// One write of what is held to `w`: `Ready(Ok(true))` after a write,
    /// `Ready(Ok(false))` when nothing is left; `Pending` (waker set)
    /// while `w` takes nothing.
    pub fn poll_step<W: AsyncWrite + Unpin + ?Sized>(
        &mut self,
        w: &mut W,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<bool>> {
        if self.sent < self.mem.len() {
            let n = ready!(Pin::new(&mut *w).poll_write(cx, &self.mem[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
            return Poll::Ready(Ok(true));
        }
        if self.file_read == self.file_end {
            self.release();
            return Poll::Ready(Ok(false));
        }
        let len = (self.file_end - self.file_read).min(CHUNK as u64) as usize;
        let f = self.file.as_ref().expect("bytes on file");
        let at = self.file_read;
        let n = SCRATCH.with(|s| -> Poll<io::Result<usize>> {
            let mut buf = s.borrow_mut();
            buf.resize(len, 0);
            f.read_exact_at(&mut buf, at)?;
            Pin::new(&mut *w).poll_write(cx, &buf)
        });
        let n = ready!(n)?;
        if n == 0 {
            return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
        }
        self.file_read += n as u64;
        Poll::Ready(Ok(true))
    }

    /// Send what `w` takes now: `Ready(Ok)` once everything is sent,
    /// `Pending` (waker set) while some waits.
    pub fn poll_send<W: AsyncWrite + Unpin + ?Sized>(
        &mut self,
        w: &mut W,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            match self.poll_step(w, cx) {
                Poll::Ready(Ok(true)) => continue,
                Poll::Ready(Ok(false)) => return Poll::Ready(Ok(())),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl Drop for Spool {
    fn drop(&mut self) {
        let m = &self.terms.metrics;
        m.memory.sub(self.mem_counted as i64);
        m.disk.sub(self.disk_counted as i64);
    }
}

/// Send the rest of `spool` to `out` after its request ended, then close
/// `out`; `keep` (the connection's place in `max_connections`) is held
/// until then. Gives up at `send_timeout` without a write.
pub async fn drain<W, K>(mut out: W, mut spool: Spool, keep: K)
where
    W: tokio::io::AsyncRead + AsyncWrite + Unpin,
{
    use tokio::io::AsyncWriteExt;
    let metrics = spool.terms.metrics.clone();
    metrics.detached.inc();
    spool.detach();
    forget_reader(&mut out);
    let wait = spool.terms.send_timeout;
    loop {
        let step = std::future::poll_fn(|cx| spool.poll_step(&mut out, cx));
        let done = match wait {
            Some(t) => match tokio::time::timeout(t, step).await {
                Ok(r) => r,
                Err(_) => {
                    metrics.send_timeout.inc();
                    break;
                }
            },
            None => step.await,
        };
        match done {
            Ok(true) => {}
            Ok(false) => {
                // A TLS stream may hold the last record until flushed.
                let close = async {
                    out.flush().await?;
                    out.shutdown().await
                };
                let _ = match wait {
                    Some(t) => tokio::time::timeout(t, close).await.unwrap_or(Ok(())),
                    None => close.await,
                };
                break;
            }
            Err(_) => break,
        }
    }
    metrics.detached.dec();
    drop(spool);
    drop(keep);
}

/// Let go of the request's task: the socket still held the waker of its
/// last read (the request's task polled reads), which kept that task's
/// memory for as long as the drain ran. A read with a waker that wakes
/// nothing takes its place; a byte it may read is dropped (the connection
/// closes after the drain).
fn forget_reader<R: tokio::io::AsyncRead + Unpin>(r: &mut R) {
    let mut one = [0u8; 1];
    let mut buf = tokio::io::ReadBuf::new(&mut one);
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let _ = Pin::new(r).poll_read(&mut cx, &mut buf);
}

/// What a guard keeps of its connection once [`drain`] has taken it: a
/// stream that is closed.
#[derive(Debug)]
pub struct Gone;

impl tokio::io::AsyncRead for Gone {
    fn poll_read(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        _: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Gone {
    fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, _: &[u8]) -> Poll<io::Result<usize>> {
        Poll::Ready(Err(io::ErrorKind::NotConnected.into()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[async_trait::async_trait]
impl pingora::protocols::Shutdown for Gone {
    async fn shutdown(&mut self) {}
}

impl pingora::protocols::UniqueID for Gone {
    fn id(&self) -> pingora::protocols::UniqueIDType {
        Default::default()
    }
}

impl pingora::protocols::Ssl for Gone {}

impl pingora::protocols::GetTimingDigest for Gone {
    fn get_timing_digest(&self) -> Vec<Option<pingora::protocols::TimingDigest>> {
        Vec::new()
    }
}

impl pingora::protocols::GetProxyDigest for Gone {
    fn get_proxy_digest(
        &self,
    ) -> Option<std::sync::Arc<pingora::protocols::raw_connect::ProxyDigest>> {
        None
    }
}

impl pingora::protocols::GetSocketDigest for Gone {
    fn get_socket_digest(&self) -> Option<std::sync::Arc<pingora::protocols::SocketDigest>> {
        None
    }
}

impl pingora::protocols::Peek for Gone {}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::Opts;

    fn terms(memory: usize, file: u64) -> Terms {
        Terms {
            memory,
            memory_total: 1 << 30,
            file,
            disk_total: 1 << 40,
            dir: std::env::temp_dir().into(),
            send_timeout: Some(Duration::from_secs(5)),
            metrics: std::sync::Arc::new(SpoolMetrics {
                buffered: IntCounter::new("b", "b").unwrap(),
                overflows: IntCounterVec::new(Opts::new("o", "o"), &["bound"]).unwrap(),
                memory: IntGauge::new("m", "m").unwrap(),
                disk: IntGauge::new("d", "d").unwrap(),
                detached: IntGauge::new("x", "x").unwrap(),
                send_timeout: IntCounter::new("t", "t").unwrap(),
            }),
        }
    }

    fn bytes(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[tokio::test]
    async fn bytes_come_out_in_order_across_memory_and_file() {
        let t = terms(1000, 1 << 20);
        let m = t.metrics.clone();
        let mut s = Spool::new(t);
        let mut want = Vec::new();
        for (i, n) in [300, 900, 5000, 10, 70_000].into_iter().enumerate() {
            let b = bytes(n, i as u8);
            assert!(s.take(&b));
            want.extend_from_slice(&b);
        }
        assert!(
            m.disk.get() > 0,
            "past the memory budget, bytes go to the file"
        );
        assert!(m.memory.get() <= 1000);
        let mut out: Vec<u8> = Vec::new();
        // Half-way, more bytes queue behind the file's.
        std::future::poll_fn(|cx| {
            let _ = s.poll_step(&mut out, cx);
            let _ = s.poll_step(&mut out, cx);
            Poll::Ready(())
        })
        .await;
        let late = bytes(2000, 9);
        assert!(s.take(&late));
        want.extend_from_slice(&late);
        std::future::poll_fn(|cx| s.poll_send(&mut out, cx))
            .await
            .unwrap();
        assert_eq!(out, want);
        assert!(s.is_empty());
        assert_eq!((m.memory.get(), m.disk.get()), (0, 0));
        drop(s);
        assert_eq!((m.memory.get(), m.disk.get()), (0, 0));
    }

    #[tokio::test]
    async fn a_detached_spool_keeps_its_bytes_on_disk_in_order() {
        let t = terms(1000, 1 << 20);
        let m = t.metrics.clone();
        let mut s = Spool::new(t);
        let a = bytes(900, 1);
        let b = bytes(5000, 2);
        assert!(s.take(&a) && s.take(&b));
        // A client that takes 100 bytes; the rest of memory moves to the
        // file's hole.
        let (mut w, mut r) = tokio::io::duplex(100);
        std::future::poll_fn(|cx| s.poll_step(&mut w, cx).map(|_| ())).await;
        assert_eq!(s.pending(), 5800);
        s.detach();
        assert_eq!(m.memory.get(), 0, "no memory of its own");
        assert_eq!(m.disk.get(), 5800);
        let task = tokio::spawn(drain(w, s, ()));
        let mut out = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut r, &mut out)
            .await
            .unwrap();
        task.await.unwrap();
        assert_eq!(out, [a, b].concat());
        assert_eq!((m.memory.get(), m.disk.get()), (0, 0));
    }

    #[test]
    fn a_bound_refuses_and_is_counted_once() {
        let t = terms(100, 1000);
        let m = t.metrics.clone();
        let mut s = Spool::new(t);
        assert!(s.take(&[1; 900]));
        assert!(!s.take(&[2; 300]), "past the file's bound");
        assert!(!s.take(&[3; 1]), "nothing more after a bound");
        assert_eq!(m.overflows.with_label_values(&["temp_file"]).get(), 1);
        assert_eq!(s.pending(), 900);
        let mut none = Spool::new(terms(100, 0));
        assert!(none.take(&[1; 100]), "memory alone holds what fits");
        assert!(!none.take(&[1; 1]));
    }

    #[test]
    fn the_process_total_sends_bytes_to_disk_then_refuses() {
        let mut t = terms(1000, 1 << 20);
        t.memory_total = 500;
        t.disk_total = 600;
        let m = t.metrics.clone();
        let mut a = Spool::new(t.clone());
        assert!(a.take(&[0; 400]));
        let mut b = Spool::new(t);
        assert!(b.take(&[0; 400]), "over the memory total: to disk");
        assert!(m.memory.get() <= 500 + 100);
        assert!(!b.take(&[0; 400]), "over the disk total");
        assert_eq!(m.overflows.with_label_values(&["disk_total"]).get(), 1);
    }

    #[tokio::test]
    async fn drain_sends_everything_then_closes() {
        let t = terms(64, 1 << 20);
        let m = t.metrics.clone();
        let mut s = Spool::new(t);
        let want = bytes(100_000, 3);
        assert!(s.take(&want));
        let (w, mut r) = tokio::io::duplex(512);
        let task = tokio::spawn(drain(w, s, ()));
        let mut got = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut r, &mut got)
            .await
            .unwrap();
        task.await.unwrap();
        assert_eq!(got, want);
        assert_eq!((m.detached.get(), m.memory.get(), m.disk.get()), (0, 0, 0));
    }

    #[tokio::test]
    async fn drain_gives_up_on_a_client_that_stops_reading() {
        let mut t = terms(64, 1 << 20);
        t.send_timeout = Some(Duration::from_millis(50));
        let m = t.metrics.clone();
        let mut s = Spool::new(t);
        assert!(s.take(&bytes(10_000, 1)));
        let (w, _r) = tokio::io::duplex(512);
        drain(w, s, ()).await;
        assert_eq!(m.send_timeout.get(), 1);
        assert_eq!(m.disk.get(), 0, "the file went with the spool");
    }
}
