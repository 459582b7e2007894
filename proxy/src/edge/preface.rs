//! The h2c preface check with a deadline, and without waiting for bytes a
//! short HTTP/1 request never sends.
//!
//! On an h2c listener Pingora decides between HTTP/2 and HTTP/1 by peeking
//! 24 bytes (the length of the HTTP/2 preface) with a plain `read_exact`,
//! before every request of a connection: an 18-byte `GET / HTTP/1.0` was
//! never answered, and a connection that sent nothing (or went idle after
//! a response) was held for ever. The connection guard answers the peek
//! itself: it reads only until the bytes can no longer be the preface,
//! within the head deadline (first request) or the keepalive timeout
//! (later ones), and hands the bytes it read back to the next reads.

use pingora::protocols::Stream;
use tokio::io::AsyncReadExt;

/// The HTTP/2 connection preface (RFC 9113 3.4).
pub(super) const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Read from `inner` into `stash` until it holds `want` bytes or the bytes
/// read so far cannot begin the preface. End of stream is an error (the
/// peek's caller closes the connection).
pub(super) async fn read_until_decided(
    inner: &mut Stream,
    stash: &mut Vec<u8>,
    want: usize,
) -> std::io::Result<()> {
    let mut chunk = [0u8; 64];
    while stash.len() < want && could_be_preface(stash) {
        let n = inner.read(&mut chunk[..want - stash.len()]).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        stash.extend_from_slice(&chunk[..n]);
    }
    Ok(())
}

/// Whether `bytes` are a prefix of the preface (or it of them).
pub(super) fn could_be_preface(bytes: &[u8]) -> bool {
    let n = bytes.len().min(PREFACE.len());
    bytes[..n] == PREFACE[..n]
}

/// Fill the peek buffer from what was read: the bytes themselves, then
/// zeros (a buffer that is not the preface, so the caller picks HTTP/1).
pub(super) fn fill_peek(buf: &mut [u8], stash: &[u8]) {
    let n = stash.len().min(buf.len());
    buf[..n].copy_from_slice(&stash[..n]);
    buf[n..].fill(0);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_request_is_decided_at_its_first_byte() {
        assert!(could_be_preface(b""));
        assert!(could_be_preface(b"PRI * HT"));
        assert!(could_be_preface(PREFACE));
        assert!(!could_be_preface(b"G"));
        let mut buf = [7u8; 24];
        fill_peek(&mut buf, b"GET / HTTP/1.0\r\n\r\n");
        assert_eq!(&buf[..18], b"GET / HTTP/1.0\r\n\r\n");
        assert_eq!(&buf[18..], &[0u8; 6]);
        assert_ne!(&buf[..], PREFACE);
    }
}
