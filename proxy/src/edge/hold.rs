//! Request buffering below Pingora's parser (nginx's
//! `proxy_request_buffering on`).
//!
//! Pingora streams a request body upstream as it arrives, so a client that
//! trickles its body holds an upstream connection for as long as it likes.
//! It offers no way to read a body and hand it back afterwards (it keeps
//! at most 64 KiB for a retry), so the holding happens in the connection
//! guard, under Pingora's reads: once the proxy's request filter asks
//! ([`super::conn::hold_body`]), the guard reads the body off the socket
//! into a [`Hold`] (memory up to `client_body_buffer_kb`, then an unlinked
//! temporary file) and answers Pingora's reads with "not yet" until the
//! body is whole. Then it hands the bytes over at memory speed and the
//! upstream connection is taken only for the time it takes to send them.
//!
//! Where the body ends is read from its framing: a `Content-Length`, or the
//! chunked coding scanned by [`ChunkScan`].

use std::fs::File;
use std::future::Future;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, ReadBuf};

/// How the request's body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// `Content-Length: N`.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
}

/// Where a chunked body's scan is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// In a chunk-size line: the size so far, and whether the hex digits
    /// ended (an extension or whitespace follows).
    Size {
        size: u64,
        digits: bool,
        ended: bool,
    },
    /// In chunk data: bytes left.
    Data(u64),
    /// After chunk data, before its line end.
    DataEnd,
    /// In the trailer section: bytes since the last line feed.
    Trailer(usize),
    /// The body ended.
    Done,
    /// Not chunked coding as we read it: stop holding, let Pingora judge.
    Bad,
}

/// Finds where a chunked body ends (RFC 9112 7.1). It accepts a bare LF
/// as a line end; where it reads more leniently than Pingora's parser, the
/// hold ends later than Pingora would and the client, not the edge, waits
/// (its body timeout); it never ends a body before Pingora does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkScan(Chunk, u64);

impl Default for ChunkScan {
    fn default() -> Self {
        ChunkScan(
            Chunk::Size {
                size: 0,
                digits: false,
                ended: false,
            },
            0,
        )
    }
}

impl ChunkScan {
    /// Follow `bytes`; the count of them that belong to the body (all of
    /// them unless it ended inside).
    pub fn feed(&mut self, bytes: &[u8]) -> usize {
        let mut i = 0;
        while i < bytes.len() {
            if matches!(self.0, Chunk::Done | Chunk::Bad) {
                return i;
            }
            if let Chunk::Data(left) = self.0 {
                let take = left.min((bytes.len() - i) as u64);
                i += take as usize;
                self.1 += take;
                self.0 = match left - take {
                    0 => Chunk::DataEnd,
                    n => Chunk::Data(n),
                };
                continue;
            }
            self.step(bytes[i]);
            i += 1;
        }
        i
    }

    fn step(&mut self, b: u8) {
        self.0 = match (self.0, b) {
            (Chunk::Size { digits: false, .. }, b'\n') => Chunk::Bad,
            (Chunk::Size { size: 0, .. }, b'\n') => Chunk::Trailer(0),
            (Chunk::Size { size, .. }, b'\n') => Chunk::Data(size),
            (
                Chunk::Size {
                    size,
                    digits,
                    ended,
                },
                _,
            ) => match (ended, hex(b)) {
                (false, Some(d)) if size >> 60 == 0 => Chunk::Size {
                    size: size << 4 | d,
                    digits: true,
                    ended,
                },
                (false, Some(_)) => Chunk::Bad,
                (_, _) if digits => Chunk::Size {
                    size,
                    digits,
                    ended: true,
                },
                _ => Chunk::Bad,
            },
            (Chunk::DataEnd, b'\r') => Chunk::DataEnd,
            (Chunk::DataEnd, b'\n') => Chunk::Size {
                size: 0,
                digits: false,
                ended: false,
            },
            (Chunk::DataEnd, _) => Chunk::Bad,
            (Chunk::Trailer(0), b'\n') => Chunk::Done,
            (Chunk::Trailer(_), b'\n') => Chunk::Trailer(0),
            (Chunk::Trailer(n), b'\r') => Chunk::Trailer(n),
            (Chunk::Trailer(n), _) => Chunk::Trailer(n + 1),
            (other, _) => other,
        };
    }

    /// Data bytes so far (the body as decoded).
    pub fn data(&self) -> u64 {
        self.1
    }

    /// The body ended.
    pub fn done(&self) -> bool {
        self.0 == Chunk::Done
    }

    /// The bytes are not chunked coding as this scan reads it.
    pub fn bad(&self) -> bool {
        self.0 == Chunk::Bad
    }
}

fn hex(b: u8) -> Option<u64> {
    (b as char).to_digit(16).map(u64::from)
}

/// How a hold ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Still reading the body.
    Reading,
    /// The body is whole (or the client closed; Pingora's read will say).
    Whole,
    /// The body passed the size limit.
    TooLarge,
    /// No byte for `client_body_timeout`.
    TimedOut,
    /// The temporary file failed: what is held is handed over, the rest
    /// streams.
    Failed,
    /// The client closed before its body was whole.
    Closed,
}

/// A request body being read whole, then handed to Pingora's reads.
pub struct Hold {
    framing: Framing,
    chunks: ChunkScan,
    /// Body bytes still to come, for a `Content-Length` body.
    left: u64,
    /// Bytes held in memory.
    mem: Vec<u8>,
    mem_cap: usize,
    /// Bytes past `mem`, in an unlinked file.
    file: Option<File>,
    file_len: u64,
    /// Bytes read after the file failed (handed over last).
    overflow: Vec<u8>,
    /// Where the handing over is in `mem`, the file and `overflow`.
    mem_pos: usize,
    file_pos: u64,
    overflow_pos: usize,
    /// The body limit (`client_max_body_bytes`; no limit: `u64::MAX`).
    max: u64,
    temp_dir: std::path::PathBuf,
    /// How the reading ended.
    pub outcome: Outcome,
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hold")
            .field("framing", &self.framing)
            .field("held", &self.held())
            .field("outcome", &self.outcome)
            .finish()
    }
}

impl Hold {
    /// Hold a body of `framing`, of which `already` (bytes Pingora read
    /// with the head) has arrived. `max` is the body limit (0: none).
    pub fn new(
        framing: Framing,
        already: &[u8],
        mem_cap: usize,
        max: u64,
        temp_dir: &Path,
    ) -> Hold {
        let mut h = Hold {
            framing,
            chunks: ChunkScan::default(),
            left: match framing {
                Framing::Length(n) => n,
                Framing::Chunked => 0,
            },
            mem: Vec::new(),
            mem_cap,
            file: None,
            file_len: 0,
            overflow: Vec::new(),
            mem_pos: 0,
            file_pos: 0,
            overflow_pos: 0,
            max: if max == 0 { u64::MAX } else { max },
            temp_dir: temp_dir.to_path_buf(),
            outcome: Outcome::Reading,
        };
        h.follow(already);
        h
    }

    /// Bytes held so far.
    pub fn held(&self) -> u64 {
        self.mem.len() as u64 + self.file_len + self.overflow.len() as u64
    }

    /// Hold `bytes` just read: in memory while it has room, then in the file.
    pub fn add(&mut self, bytes: &[u8]) {
        if self.outcome == Outcome::Failed {
            self.overflow.extend_from_slice(bytes);
            return;
        }
        let room = self.mem_cap.saturating_sub(self.mem.len()).min(bytes.len());
        let (mem, file) = bytes.split_at(room);
        if !mem.is_empty() {
            self.mem.extend_from_slice(mem);
            self.follow(mem);
        }
        if !file.is_empty() {
            self.add_to_file(file);
        }
    }

    fn add_to_file(&mut self, bytes: &[u8]) {
        let written = match self.file.as_mut() {
            Some(f) => f.write_all(bytes),
            None => tempfile::tempfile_in(&self.temp_dir).and_then(|mut f| {
                f.write_all(bytes)?;
                self.file = Some(f);
                Ok(())
            }),
        };
        match written {
            Ok(()) => {
                self.file_len += bytes.len() as u64;
                self.follow(bytes);
            }
            Err(e) => {
                // Nothing read is lost: the bytes wait in memory, and the
                // rest of the body streams.
                log::warn!("client_body_temp_path: {e}");
                self.outcome = Outcome::Failed;
                self.overflow.extend_from_slice(bytes);
            }
        }
    }

    /// Track the body's end through `bytes` just held.
    fn follow(&mut self, bytes: &[u8]) {
        if self.outcome != Outcome::Reading {
            return;
        }
        let whole = match self.framing {
            Framing::Length(_) => {
                self.left = self.left.saturating_sub(bytes.len() as u64);
                self.left == 0
            }
            Framing::Chunked => {
                self.chunks.feed(bytes);
                self.chunks.done() || self.chunks.bad()
            }
        };
        // A chunked body's limit is on its data, as Pingora counts it; its
        // framing may add up to as much again (small chunks), no more.
        let over = match self.framing {
            Framing::Length(_) => self.held() > self.max,
            Framing::Chunked => {
                self.chunks.data() > self.max || self.held() / 2 > self.max.saturating_add(1 << 16)
            }
        };
        if whole {
            self.outcome = Outcome::Whole;
        } else if over {
            self.outcome = Outcome::TooLarge;
        }
    }

    /// Whether every held byte has been handed over.
    pub fn drained(&self) -> bool {
        self.mem_pos >= self.mem.len()
            && self.file_pos >= self.file_len
            && self.overflow_pos >= self.overflow.len()
    }

    /// Hand over up to `out.len()` held bytes (memory, then the file,
    /// then what came after a file error); how many.
    pub fn take(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        self.mem_cap = 0;
        if self.mem_pos < self.mem.len() {
            let n = out.len().min(self.mem.len() - self.mem_pos);
            out[..n].copy_from_slice(&self.mem[self.mem_pos..self.mem_pos + n]);
            self.mem_pos += n;
            if self.mem_pos == self.mem.len() {
                // Memory is handed over: give it back before the file's turn.
                self.mem_pos = 0;
                self.mem = Vec::new();
                if let Some(f) = self.file.as_mut() {
                    f.seek(SeekFrom::Start(0))?;
                }
            }
            return Ok(n);
        }
        if let (Some(f), true) = (self.file.as_mut(), self.file_pos < self.file_len) {
            let want = out.len().min((self.file_len - self.file_pos) as usize);
            let n = f.read(&mut out[..want])?;
            if n == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "client_body_temp_path: the body's file is shorter than written",
                ));
            }
            self.file_pos += n as u64;
            return Ok(n);
        }
        let n = out.len().min(self.overflow.len() - self.overflow_pos);
        out[..n].copy_from_slice(&self.overflow[self.overflow_pos..self.overflow_pos + n]);
        self.overflow_pos += n;
        Ok(n)
    }
}

/// Most bytes one handed-over read gives: what Pingora reads in the
/// request filter, with what it read along with the head, must fit the
/// 64 KiB it keeps for a retry, through which it sends the first bytes.
const HANDOVER: usize = 32 * 1024;

/// Most bytes Pingora may have read along with the head for a hold to
/// start (see [`HANDOVER`]).
pub const TAIL_MAX: usize = 16 * 1024;

/// The guard's side of a hold: the reads off the socket, timed between
/// reads as nginx's `client_body_timeout` is, then the handing over.
pub struct Holding {
    /// The body.
    pub hold: Hold,
    idle: Option<Duration>,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Holding {
    /// Start holding; `idle` is the most time between two reads.
    pub fn new(hold: Hold, idle: Option<Duration>) -> Holding {
        Holding {
            hold,
            idle,
            timer: idle.map(|d| Box::pin(tokio::time::sleep(d))),
        }
    }

    /// Read the body off `inner` until it is whole, then hand it over into
    /// `buf`. `Ok(false)`: all of it was handed over, reads go to `inner`.
    pub fn poll_read<R: AsyncRead + Unpin + ?Sized>(
        &mut self,
        inner: &mut R,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<bool>> {
        while self.hold.outcome == Outcome::Reading {
            let mut scratch = [0u8; 16 * 1024];
            let mut rb = ReadBuf::new(&mut scratch);
            match Pin::new(&mut *inner).poll_read(cx, &mut rb) {
                Poll::Ready(Ok(())) if rb.filled().is_empty() => {
                    // No upstream is taken for a body that never ends.
                    self.hold.outcome = Outcome::Closed;
                }
                Poll::Ready(Ok(())) => {
                    if let (Some(t), Some(d)) = (self.timer.as_mut(), self.idle) {
                        t.as_mut().reset(tokio::time::Instant::now() + d);
                    }
                    self.hold.add(rb.filled());
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    let fired = self
                        .timer
                        .as_mut()
                        .is_some_and(|t| t.as_mut().poll(cx).is_ready());
                    if !fired {
                        return Poll::Pending;
                    }
                    self.hold.outcome = Outcome::TimedOut;
                    return Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "client_body_timeout: the request body stopped arriving",
                    )));
                }
            }
        }
        self.timer = None;
        if self.hold.outcome == Outcome::Closed {
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the client closed before its request body was whole",
            )));
        }
        if self.hold.drained() {
            return Poll::Ready(Ok(false));
        }
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(true));
        }
        let out = buf.initialize_unfilled();
        let cap = out.len().min(HANDOVER);
        let n = self.hold.take(&mut out[..cap])?;
        buf.advance(n);
        Poll::Ready(Ok(true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(parts: &[&[u8]]) -> (ChunkScan, usize) {
        let mut s = ChunkScan::default();
        let mut used = 0;
        for p in parts {
            used += s.feed(p);
        }
        (s, used)
    }

    #[test]
    fn a_chunked_body_ends_after_its_last_chunk_and_trailers_however_it_is_split() {
        let body: &[u8] =
            b"5\r\nhello\r\n1a;ext=1\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nX-T: 1\r\n\r\nGET";
        let (s, used) = scan(&[body]);
        assert!(s.done());
        assert_eq!(used, body.len() - 3, "the next request is not body");
        for cut in 1..body.len() - 3 {
            let (s, _) = scan(&[&body[..cut], &body[cut..]]);
            assert!(s.done(), "split at {cut}");
        }
        let (s, _) = scan(&[b"5\r\nhel"]);
        assert!(!s.done() && !s.bad());
        let (s, _) = scan(&[b"0\n\n"]);
        assert!(s.done(), "bare line feeds");
        let (s, _) = scan(&[b"zz\r\n"]);
        assert!(s.bad());
        let (s, _) = scan(&[b"fffffffffffffffff\r\n"]);
        assert!(s.bad(), "a size past 64 bits");
    }

    #[test]
    fn a_held_body_spills_past_memory_to_a_file_and_comes_back_whole() {
        let dir = std::env::temp_dir();
        let body: Vec<u8> = (0..50_000u32).map(|i| (i % 251) as u8).collect();
        let mut h = Hold::new(Framing::Length(50_000), &body[..100], 4096, 0, &dir);
        // What Pingora read with the head is counted, not held again.
        for part in body[100..].chunks(3333) {
            h.add(part);
        }
        assert_eq!(h.outcome, Outcome::Whole);
        let mut out = Vec::new();
        let mut buf = [0u8; 3000];
        while !h.drained() {
            let n = h.take(&mut buf).expect("read back");
            assert!(n > 0);
            out.extend_from_slice(&buf[..n]);
        }
        assert_eq!(out, &body[100..]);
    }

    #[test]
    fn a_file_that_cannot_be_written_loses_no_byte() {
        let nowhere = std::path::Path::new("/nonexistent/ultrafast-test");
        let body: Vec<u8> = (0..9000u32).map(|i| (i % 199) as u8).collect();
        let mut h = Hold::new(Framing::Length(20_000), b"", 1000, 0, nowhere);
        for part in body.chunks(2500) {
            h.add(part);
        }
        assert_eq!(h.outcome, Outcome::Failed);
        let mut out = Vec::new();
        let mut buf = [0u8; 700];
        while !h.drained() {
            let n = h.take(&mut buf).expect("from memory");
            out.extend_from_slice(&buf[..n]);
        }
        assert_eq!(out, body);
    }

    #[test]
    fn a_body_past_the_limit_stops_the_hold() {
        let dir = std::env::temp_dir();
        let mut h = Hold::new(Framing::Chunked, b"", 16, 10, &dir);
        // The limit is on data: 11 bytes of it is past 10.
        h.add(b"ff\r\n0123456789");
        assert_eq!(h.outcome, Outcome::Reading, "10 data bytes, 14 on the wire");
        h.add(b"a");
        assert_eq!(h.outcome, Outcome::TooLarge);
    }
}
