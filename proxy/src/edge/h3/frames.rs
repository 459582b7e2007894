//! HTTP/3 frames read as they arrive, before the h3 crate buffers them.
//!
//! The h3 crate collects a whole frame in memory before it decodes it
//! (HEADERS, SETTINGS and every unknown type alike), and checks the field
//! section's size only after decoding: a client announcing a 2^40-byte
//! HEADERS frame and then sending zeros grows the server at the client's
//! bandwidth. `Framer` reads each frame's type and length as they come and
//! decides then, before a payload byte is held:
//! - DATA passes (h3 streams it, holding one chunk at a time);
//! - HEADERS passes up to the field-section limit, and its bytes are
//!   counted as held until the frame is whole (`Step::Held`);
//! - frames h3 knows (SETTINGS, GOAWAY, ...) pass up to `SMALL_FRAME`;
//! - unknown and reserved types (RFC 9114 7.2.8: "no meaning") are dropped
//!   here as they stream by, so no length of theirs is ever buffered;
//! - anything larger, or a frame with no length (WebTransport's), refuses
//!   the stream.

use bytes::Bytes;

/// Largest frame other than DATA and HEADERS passed to h3 (SETTINGS,
/// GOAWAY, MAX_PUSH_ID, CANCEL_PUSH, and the HTTP/2 types it refuses).
pub const SMALL_FRAME: u64 = 16 * 1024;

const DATA: u64 = 0x0;
const HEADERS: u64 = 0x1;
/// A WebTransport stream's frame: a type with no length after it.
const WEBTRANSPORT_BI: u64 = 0x41;
/// The unidirectional stream type of a control stream.
const CONTROL_STREAM: u64 = 0x0;

/// Frame types the h3 crate decodes (or refuses by name); any other type
/// has no meaning and is dropped.
fn known(ty: u64) -> bool {
    matches!(ty, 0x0..=0x9 | 0xd)
}

/// What kind of stream a framer reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A client's bidirectional request stream: frames from the start.
    Request,
    /// A unidirectional stream whose type varint has not been read.
    Uni,
    /// The peer's control stream: frames after the type.
    Control,
    /// Any other unidirectional stream (QPACK's, unknown types): its bytes
    /// pass as they are (h3 never reads QPACK streams with a dynamic table
    /// of 0, so QUIC's stream window bounds them).
    Raw,
}

/// Why a stream was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A frame announced more than its kind may hold.
    TooLarge,
    /// A frame type that cannot be bounded (no length).
    Unbounded,
}

impl Refusal {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::TooLarge => "too_large",
            Refusal::Unbounded => "unbounded",
        }
    }
}

/// One piece of what a framer makes of a chunk.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Bytes to hand to h3.
    Pass(Bytes),
    /// Bytes to hand to h3 that belong to an unfinished HEADERS frame:
    /// the caller counts them as held until `Done` (or the stream's end).
    Held(Bytes),
    /// The HEADERS frame being counted is whole.
    Done,
}

/// The state of one stream's frame reading.
#[derive(Debug)]
pub struct Framer {
    kind: Kind,
    limit: u64,
    head: [u8; 16],
    head_len: usize,
    pass: u64,
    skip: u64,
    counting: bool,
}

/// A QUIC varint's length from its first byte (RFC 9000 16).
fn varint_len(first: u8) -> usize {
    1 << (first >> 6)
}

/// The varint at the start of `b`, with its length, if it is whole.
fn varint(b: &[u8]) -> Option<(u64, usize)> {
    let first = *b.first()?;
    let n = varint_len(first);
    if b.len() < n {
        return None;
    }
    let mut v = u64::from(first & 0x3f);
    for x in &b[1..n] {
        v = (v << 8) | u64::from(*x);
    }
    Some((v, n))
}

impl Framer {
    /// A framer for a stream of `kind` whose HEADERS frames may hold
    /// `field_section` bytes.
    pub fn new(kind: Kind, field_section: u64) -> Self {
        Framer {
            kind,
            limit: field_section,
            head: [0; 16],
            head_len: 0,
            pass: 0,
            skip: 0,
            counting: false,
        }
    }

    /// The stream's kind as known so far.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Read `chunk`, pushing what h3 is to see into `out`.
    pub fn feed(&mut self, mut chunk: Bytes, out: &mut Vec<Step>) -> Result<(), Refusal> {
        while !chunk.is_empty() {
            if self.kind == Kind::Raw {
                out.push(Step::Pass(chunk));
                return Ok(());
            }
            if self.pass > 0 {
                let n = usize::try_from(self.pass)
                    .unwrap_or(usize::MAX)
                    .min(chunk.len());
                let piece = chunk.split_to(n);
                self.pass -= n as u64;
                if self.counting {
                    out.push(Step::Held(piece));
                    if self.pass == 0 {
                        self.counting = false;
                        out.push(Step::Done);
                    }
                } else {
                    out.push(Step::Pass(piece));
                }
                continue;
            }
            if self.skip > 0 {
                let n = usize::try_from(self.skip)
                    .unwrap_or(usize::MAX)
                    .min(chunk.len());
                let _ = chunk.split_to(n);
                self.skip -= n as u64;
                continue;
            }
            // A frame's (or a stream's) head: take bytes until it is whole.
            let want = self.head_want();
            let take = (want - self.head_len).min(chunk.len());
            self.head[self.head_len..self.head_len + take].copy_from_slice(&chunk[..take]);
            self.head_len += take;
            let _ = chunk.split_to(take);
            if self.head_len == self.head_want() {
                self.decide(out)?;
            }
        }
        Ok(())
    }

    /// Head bytes needed to decide, given those read so far (the type's
    /// varint, then the length's).
    fn head_want(&self) -> usize {
        if self.head_len == 0 {
            return 1;
        }
        let ty = varint_len(self.head[0]);
        if self.kind == Kind::Uni || self.head_len < ty {
            return ty;
        }
        if self.head_len == ty {
            return ty + 1;
        }
        ty + varint_len(self.head[ty])
    }

    fn decide(&mut self, out: &mut Vec<Step>) -> Result<(), Refusal> {
        let Some((ty, n)) = varint(&self.head[..self.head_len]) else {
            return Ok(());
        };
        if self.kind == Kind::Uni {
            self.kind = if ty == CONTROL_STREAM {
                Kind::Control
            } else {
                Kind::Raw
            };
            out.push(Step::Pass(self.take_head()));
            return Ok(());
        }
        let request = self.kind == Kind::Request;
        if request && ty == WEBTRANSPORT_BI {
            // h3 reads this type with no length after it.
            return Err(Refusal::Unbounded);
        }
        let Some((len, _)) = varint(&self.head[n..self.head_len]) else {
            return Ok(());
        };
        if request && ty == DATA {
            out.push(Step::Pass(self.take_head()));
            self.pass = len;
        } else if request && ty == HEADERS {
            if len > self.limit {
                return Err(Refusal::TooLarge);
            }
            out.push(Step::Pass(self.take_head()));
            self.pass = len;
            self.counting = len > 0;
        } else if known(ty) {
            if len > SMALL_FRAME {
                return Err(Refusal::TooLarge);
            }
            out.push(Step::Pass(self.take_head()));
            self.pass = len;
        } else {
            // No meaning (RFC 9114 7.2.8): dropped as it streams by.
            self.head_len = 0;
            self.skip = len;
        }
        Ok(())
    }

    fn take_head(&mut self) -> Bytes {
        let b = Bytes::copy_from_slice(&self.head[..self.head_len]);
        self.head_len = 0;
        b
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn enc(v: u64) -> Vec<u8> {
        match v {
            0..=63 => vec![v as u8],
            64..=16383 => ((v as u16) | 0x4000).to_be_bytes().to_vec(),
            16384..=0x3fff_ffff => ((v as u32) | 0x8000_0000).to_be_bytes().to_vec(),
            _ => (v | 0xc000_0000_0000_0000).to_be_bytes().to_vec(),
        }
    }

    fn frame(ty: u64, payload: &[u8]) -> Vec<u8> {
        let mut f = enc(ty);
        f.extend(enc(payload.len() as u64));
        f.extend_from_slice(payload);
        f
    }

    /// Feed `bytes` one byte at a time and in one piece; both must agree.
    fn run(kind: Kind, bytes: &[u8]) -> (Vec<u8>, usize, Result<(), Refusal>) {
        let whole = {
            let mut f = Framer::new(kind, 1024);
            let mut out = Vec::new();
            let r = f.feed(Bytes::copy_from_slice(bytes), &mut out);
            (
                flatten(&out),
                out.iter().filter(|s| **s == Step::Done).count(),
                r,
            )
        };
        let mut f = Framer::new(kind, 1024);
        let mut out = Vec::new();
        let mut r = Ok(());
        for b in bytes {
            r = f.feed(Bytes::copy_from_slice(&[*b]), &mut out);
            if r.is_err() {
                break;
            }
        }
        let bytewise = (
            flatten(&out),
            out.iter().filter(|s| **s == Step::Done).count(),
            r,
        );
        assert_eq!(whole, bytewise);
        whole
    }

    fn flatten(out: &[Step]) -> Vec<u8> {
        let mut v = Vec::new();
        for s in out {
            match s {
                Step::Pass(b) | Step::Held(b) => v.extend_from_slice(b),
                Step::Done => {}
            }
        }
        v
    }

    #[test]
    fn data_and_headers_pass_whole_and_unknown_frames_are_dropped() {
        let mut s = frame(0x1, b"abc");
        s.extend(frame(0x21, &[7; 300])); // reserved: dropped
        s.extend(frame(0x0, b"body"));
        s.extend(frame(0x1f * 3 + 0x21, b"")); // reserved, empty
        s.extend(frame(0x1, b"t"));
        let mut want = frame(0x1, b"abc");
        want.extend(frame(0x0, b"body"));
        want.extend(frame(0x1, b"t"));
        let (out, done, r) = run(Kind::Request, &s);
        assert_eq!(r, Ok(()));
        assert_eq!(out, want);
        assert_eq!(done, 2, "each HEADERS frame ends its count");
    }

    #[test]
    fn an_oversized_headers_frame_is_refused_when_announced() {
        let mut s = enc(0x1);
        s.extend(enc(1 << 40));
        let (out, _, r) = run(Kind::Request, &s);
        assert_eq!(r, Err(Refusal::TooLarge));
        assert!(out.is_empty(), "nothing of it reaches h3");
        // At the limit it passes.
        let (_, done, r) = run(Kind::Request, &frame(0x1, &[0; 1024]));
        assert_eq!((r, done), (Ok(()), 1));
        let (_, _, r) = run(Kind::Request, &frame(0x1, &[0; 1025]));
        assert_eq!(r, Err(Refusal::TooLarge));
    }

    #[test]
    fn an_unknown_frame_of_any_length_costs_nothing_held() {
        let mut s = enc(0x2f);
        s.extend(enc(1 << 40));
        s.extend([0; 5000]);
        let (out, _, r) = run(Kind::Request, &s);
        assert_eq!(r, Ok(()));
        assert!(out.is_empty());
    }

    #[test]
    fn control_streams_bound_every_frame_and_qpack_streams_pass() {
        let mut s = enc(0x0); // control stream type
        s.extend(frame(0x4, b"\x06\x40\x00")); // SETTINGS
        s.extend(frame(0x2f, &[1; 40])); // unknown: dropped
        let mut want = enc(0x0);
        want.extend(frame(0x4, b"\x06\x40\x00"));
        let (out, _, r) = run(Kind::Uni, &s);
        assert_eq!((out, r), (want, Ok(())));

        let mut big = enc(0x0);
        big.extend(enc(0x4));
        big.extend(enc(SMALL_FRAME + 1));
        assert_eq!(run(Kind::Uni, &big).2, Err(Refusal::TooLarge));

        let mut qpack = enc(0x2);
        qpack.extend([0x3f, 0xe1, 0x1f, 9, 9]);
        let (out, _, r) = run(Kind::Uni, &qpack);
        assert_eq!((out, r), (qpack.clone(), Ok(())));
    }

    #[test]
    fn a_frame_with_no_length_is_refused() {
        let mut s = enc(WEBTRANSPORT_BI);
        s.extend(enc(4));
        assert_eq!(run(Kind::Request, &s).2, Err(Refusal::Unbounded));
    }
}
