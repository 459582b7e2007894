//! Loss probes for event streams: a token lost on the link is found
//! sooner.
//!
//! A streamed completion sends one small packet per token, tens of
//! milliseconds apart. When one is lost, QUIC (like TCP) learns it only
//! from the acknowledgement of a later packet, and the next packet is the
//! next token: the loss is declared about one token interval plus one RTT
//! after it was sent, and every token behind it waits that long (the
//! benchmark's gap spikes, `benches/RESULTS.md` section 27).
//!
//! So a short quiet time after an event stream writes (an eighth of the
//! RTT, 2 to 25 ms), one ack-eliciting byte goes out on a unidirectional
//! stream of a reserved type (RFC 9114 6.2.3: the peer discards it). Its
//! acknowledgement shows the token's packet missing, and QUIC's time
//! threshold (9/8 RTT after sending) declares it lost at once: about one
//! RTT after the token instead of one RTT plus the token interval. TCP
//! has nothing alike between HTTP/2 tokens. One probe per quiet time,
//! not per write, and at most `MAX_STREAMS` streams of `BYTES_PER_STREAM`
//! probes per connection; a probe that cannot go out at once (no stream
//! credit, no flow-control room) is skipped, never waited for.

use futures_util::FutureExt;
use prometheus::IntCounter;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::sync::mpsc;

/// The quiet time's bounds: loopback RTTs give the floor, long paths the
/// ceiling (a later token often comes first there).
const MIN_QUIET: Duration = Duration::from_millis(2);
const MAX_QUIET: Duration = Duration::from_millis(25);
/// A reserved stream type (0x1f * N + 0x21 with N = 0), one varint byte.
const RESERVED_TYPE: [u8; 1] = [0x21];
/// Probe bytes per stream before it is finished and another opened.
const BYTES_PER_STREAM: u32 = 1 << 16;
/// Probe streams per connection; probing stops after the last.
const MAX_STREAMS: u32 = 8;

/// A connection's prober, shared by its requests. Its task starts with
/// the first event stream and ends when every handle is gone or the
/// connection closes.
#[derive(Clone)]
pub struct Probe(Arc<Inner>);

struct Inner {
    wake: OnceLock<mpsc::Sender<()>>,
    sent: IntCounter,
}

impl Probe {
    /// A connection's prober, counting its probes in `sent`.
    pub fn new(sent: IntCounter) -> Self {
        Probe(Arc::new(Inner {
            wake: OnceLock::new(),
            sent,
        }))
    }

    /// An event stream of `quic` (this prober's connection) wrote: a probe
    /// follows unless more is written within the quiet time.
    pub fn written(&self, quic: &quinn::Connection) {
        let wake = self.0.wake.get_or_init(|| {
            let (tx, rx) = mpsc::channel(1);
            tokio::spawn(run(quic.clone(), rx, self.0.sent.clone()));
            tx
        });
        // Full: a wake is already pending, which is all it means.
        let _ = wake.try_send(());
    }
}

async fn run(quic: quinn::Connection, mut wake: mpsc::Receiver<()>, sent: IntCounter) {
    let mut stream: Option<(quinn::SendStream, u32)> = None;
    let mut opened = 0;
    while wake.recv().await.is_some() {
        // Wait for the writes to pause; a write meanwhile starts it again.
        loop {
            let quiet = (quic.rtt() / 8).clamp(MIN_QUIET, MAX_QUIET);
            tokio::select! {
                more = wake.recv() => if more.is_none() { return },
                () = tokio::time::sleep(quiet) => break,
                _ = quic.closed() => return,
            }
        }
        if stream.is_none() {
            if opened == MAX_STREAMS {
                return;
            }
            opened += 1;
            let Some(Ok(mut s)) = quic.open_uni().now_or_never() else {
                continue;
            };
            if !matches!(s.write(&RESERVED_TYPE).now_or_never(), Some(Ok(1))) {
                continue;
            }
            stream = Some((s, 0));
        }
        let Some((s, n)) = stream.as_mut() else {
            continue;
        };
        match s.write(&[0]).now_or_never() {
            Some(Ok(1)) => {
                sent.inc();
                *n += 1;
                if *n >= BYTES_PER_STREAM {
                    let _ = s.finish();
                    stream = None;
                }
            }
            // No room now: this probe is skipped.
            Some(Ok(_)) | None => {}
            // The peer stopped it: the next probe opens another.
            Some(Err(_)) => stream = None,
        }
    }
}
