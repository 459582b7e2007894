//! The write buffer under a client connection.
//!
//! Pingora's own listeners put a write buffer of one segment
//! (`DEFAULT_L4_WRITE_BUFFER_SIZE`) under every stream they accept; ours
//! ([`super::listener`]) build the stream themselves and had none, so a
//! response head and its first body bytes left in two writes (two system
//! calls, two segments, and a streamed response's first token behind the
//! second). Pingora writes a head without flushing and flushes after body
//! writes and at the end of a response, so with the buffer both leave
//! together, as they do behind Pingora's listeners.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::AsyncWrite;

/// Most bytes held: Pingora's default, one TCP segment. A larger write
/// goes straight through (after what is held).
pub const CAPACITY: usize = pingora::protocols::l4::stream::DEFAULT_L4_WRITE_BUFFER_SIZE;

/// Bytes written but not yet sent.
#[derive(Debug, Default)]
pub struct WriteBuf {
    held: Vec<u8>,
}

impl WriteBuf {
    /// Whether `len` more bytes are held rather than written through.
    pub fn takes(&self, len: usize) -> bool {
        len < CAPACITY && self.held.len() + len <= CAPACITY
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Hold `bytes` (after [`takes`](Self::takes) said so).
    pub fn hold(&mut self, bytes: &[u8]) {
        if self.held.capacity() == 0 {
            self.held.reserve_exact(CAPACITY);
        }
        self.held.extend_from_slice(bytes);
    }

    /// Send what is held to `w` (not flushing `w` itself).
    pub fn poll_send<W: AsyncWrite + Unpin + ?Sized>(
        &mut self,
        w: &mut W,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        while !self.held.is_empty() {
            let n = ready!(Pin::new(&mut *w).poll_write(cx, &self.held))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.held.drain(..n);
        }
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn small_writes_are_held_until_sent_and_large_ones_are_not() {
        let mut b = WriteBuf::default();
        assert!(b.takes(200));
        b.hold(&[1; 200]);
        assert!(b.takes(CAPACITY - 200));
        assert!(!b.takes(CAPACITY - 199));
        assert!(!b.takes(CAPACITY));
        let mut out: Vec<u8> = Vec::new();
        std::future::poll_fn(|cx| b.poll_send(&mut out, cx))
            .await
            .unwrap();
        assert_eq!(out, vec![1; 200]);
        assert!(b.takes(CAPACITY - 1));
    }
}
