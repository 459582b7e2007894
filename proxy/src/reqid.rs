//! Request ids: UUID version 7 (RFC 9562: 48 bits of Unix time in ms, then
//! 74 random bits), so ids sort by time and every upstream server accepts
//! them (llama.cpp's server refuses anything but a UUID). The random bits
//! come from the system CSPRNG, drawn a buffer at a time per thread so an
//! id costs no system call in the common case.
//!
//! What an upstream is sent is set per pool (`request_id`): `forward` the
//! request's id when it is a UUID, else a fresh one; `uuid` always a fresh
//! one; `none` no header.

use bytes::Bytes;
use std::cell::RefCell;

/// What a pool's members are sent as `X-Request-Id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Upstream {
    /// The request's id when it is a UUID, else a fresh UUID.
    #[default]
    Forward,
    /// Always a fresh UUID.
    Uuid,
    /// No header.
    None,
}

impl Upstream {
    /// Parse the config value.
    pub fn parse(v: &str) -> Option<Upstream> {
        match v {
            "forward" => Some(Upstream::Forward),
            "uuid" => Some(Upstream::Uuid),
            "none" => Some(Upstream::None),
            _ => None,
        }
    }

    /// What to send for a request whose id is `id`; `ours` when the edge
    /// made it (a UUID, not looked at again).
    pub fn send(self, id: &str, ours: bool) -> Send {
        match self {
            Upstream::None => Send::Nothing,
            Upstream::Forward if ours || is_uuid(id) => Send::Same,
            Upstream::Forward | Upstream::Uuid => Send::Fresh,
        }
    }

    /// The id to send for a request whose id is `id` (None: send none).
    pub fn header(self, id: &str) -> Option<String> {
        match self.send(id, false) {
            Send::Nothing => None,
            Send::Same => Some(id.to_string()),
            Send::Fresh => Some(new()),
        }
    }
}

/// What a member is sent as `X-Request-Id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Send {
    /// No header.
    Nothing,
    /// The request's own id (shared, no copy needed).
    Same,
    /// A fresh UUIDv7.
    Fresh,
}

const BUF: usize = 4096;

thread_local! {
    static POOL: RefCell<(Vec<u8>, usize)> = const { RefCell::new((Vec::new(), BUF)) };
}

/// `n` bytes from the system CSPRNG (through a per-thread buffer).
fn random(out: &mut [u8]) {
    use ring::rand::SecureRandom;
    POOL.with(|p| {
        let mut p = p.borrow_mut();
        let (buf, at) = &mut *p;
        if *at + out.len() > buf.len() {
            buf.resize(BUF, 0);
            if ring::rand::SystemRandom::new().fill(buf).is_err() {
                // No system randomness: time-based bits keep ids unique
                // (not secret); ids never grant access by themselves.
                let t = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_nanos() as u64;
                for (i, b) in buf.iter_mut().enumerate() {
                    *b = (crate::hash::mix64(t ^ i as u64) >> 7) as u8;
                }
            }
            *at = 0;
        }
        out.copy_from_slice(&buf[*at..*at + out.len()]);
        *at += out.len();
    });
}

/// The 16 bytes of a new UUIDv7.
fn bytes(ms: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..6].copy_from_slice(&ms.to_be_bytes()[2..]);
    random(&mut b[6..]);
    b[6] = 0x70 | (b[6] & 0x0f);
    b[8] = 0x80 | (b[8] & 0x3f);
    b
}

/// The canonical text of a UUID's bytes (8-4-4-4-12 lowercase hex).
fn text(b: &[u8; 16]) -> [u8; 36] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = [b'-'; 36];
    let mut at = 0;
    for (i, x) in b.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            at += 1;
        }
        out[at] = HEX[(x >> 4) as usize];
        out[at + 1] = HEX[(x & 15) as usize];
        at += 2;
    }
    out
}

fn format(b: &[u8; 16]) -> String {
    // Hex digits and dashes: always ASCII.
    String::from_utf8_lossy(&text(b)).into_owned()
}

fn now_ms() -> u64 {
    ms(std::time::SystemTime::now())
}

fn ms(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

/// A new UUIDv7, as text.
pub fn new() -> String {
    format(&bytes(now_ms()))
}

/// A new UUIDv7 as a header value, for a request that came at `at` (a
/// request has read the clock already).
pub fn header_value(at: std::time::SystemTime) -> http::HeaderValue {
    http::HeaderValue::from_maybe_shared(Bytes::copy_from_slice(&text(&bytes(ms(at)))))
        .unwrap_or(http::HeaderValue::from_static("0"))
}

/// Whether `s` is a UUID in its canonical text form (any version).
pub fn is_uuid(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 36
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_hexdigit(),
        })
}

/// 64 random bits from the system's CSPRNG (jitter, random points of a
/// window).
pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    random(&mut b);
    u64::from_le_bytes(b)
}

/// A fresh job id: `req_` and 128 random bits from the system's CSPRNG,
/// so an id can be neither guessed nor chosen by a client.
pub fn random_id() -> String {
    use ring::rand::SecureRandom;
    let mut b = [0u8; 16];
    if ring::rand::SystemRandom::new().fill(&mut b).is_err() {
        // No system randomness: still unique, though not secret.
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        b = (t ^ (N.fetch_add(1, std::sync::atomic::Ordering::Relaxed) as u128) << 64)
            .to_le_bytes();
    }
    let mut s = String::with_capacity(36);
    s.push_str("req_");
    for x in b {
        s.push_str(&format!("{x:02x}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_version_7_uuids_ordered_by_time_and_unique() {
        let a = new();
        assert!(is_uuid(&a), "{a}");
        assert_eq!(&a[14..15], "7");
        assert!(matches!(&a[19..20], "8" | "9" | "a" | "b"), "{a}");
        let mut seen = std::collections::HashSet::new();
        for _ in 0..10_000 {
            assert!(seen.insert(new()));
        }
        let (x, y) = (format(&bytes(1_000)), format(&bytes(2_000)));
        assert!(x < y, "time-ordered: {x} {y}");
        assert_eq!(&x[..13], "00000000-03e8");
    }

    #[test]
    fn upstream_modes() {
        let client = "abc-123";
        let uuid = new();
        assert_eq!(Upstream::Forward.header(&uuid), Some(uuid.clone()));
        let fresh = Upstream::Forward.header(client).unwrap();
        assert!(is_uuid(&fresh) && fresh != client);
        assert_ne!(Upstream::Uuid.header(&uuid), Some(uuid.clone()));
        assert_eq!(Upstream::None.header(&uuid), None);
        assert!(!is_uuid("0193a3c4-0000-7000-8000-00000000000g"));
        assert!(is_uuid("0193A3C4-0000-7000-8000-000000000000"));
    }
}
