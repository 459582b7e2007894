//! The inference pools' idle HTTP/1 upstream connections, kept without a
//! watcher task.
//!
//! Pingora's pool parks each idle connection with a task that reads it, so
//! that a close is seen at once; taking the connection back means waking
//! that task and waiting for it to let go (about 40 us of the time to first
//! token, benches/RESULTS.md section 15), and every release spawns a task.
//! Here an idle connection waits in a list. Whether it is still good is
//! checked when it is taken: a read that must find nothing (a close or
//! stray bytes the server sent meanwhile make it unusable). Connections idle
//! past the pool's keepalive are closed when the list is next touched.

use parking_lot::Mutex;
use pingora::protocols::Stream;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;

/// Most idle connections kept per peer (Pingora's pool default is 128).
const PER_PEER: usize = 128;

/// Idle connections by peer (`HttpPeer::reuse_hash`), oldest first.
#[derive(Default)]
pub(super) struct Idle {
    by_peer: Mutex<HashMap<u64, Vec<(Stream, Instant)>>>,
}

impl Idle {
    /// A good idle connection to `peer`, the most recently used first (its
    /// state is the warmest, and the oldest are the likeliest to have been
    /// closed by the server).
    pub(super) fn take(&self, peer: u64, keepalive: Duration) -> Option<Stream> {
        loop {
            let mut s = {
                let mut by = self.by_peer.lock();
                let list = by.get_mut(&peer)?;
                let last = list.pop()?;
                if last.1.elapsed() > keepalive {
                    // The rest are older still.
                    let stale = std::mem::take(list);
                    drop(by);
                    drop(stale);
                    return None;
                }
                last.0
            };
            if still_open(&mut s) {
                return Some(s);
            }
        }
    }

    /// Keep `s` for reuse with `peer`.
    pub(super) fn put(&self, peer: u64, s: Stream, keepalive: Duration) {
        let now = Instant::now();
        let dropped: Vec<(Stream, Instant)> = {
            let mut by = self.by_peer.lock();
            let list = by.entry(peer).or_default();
            let expired = list
                .iter()
                .take_while(|(_, t)| now.saturating_duration_since(*t) > keepalive)
                .count();
            let over = (list.len() - expired + 1).saturating_sub(PER_PEER);
            let gone = list.drain(..expired + over).collect();
            list.push((s, now));
            gone
        };
        // Closed outside the lock.
        drop(dropped);
    }

    /// Idle connections held now (for tests).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.by_peer.lock().values().map(Vec::len).sum()
    }
}

/// Whether an idle connection is still open and quiet: a read that would
/// wait. A close (0 bytes), an error or bytes the server sent while nothing
/// was asked make it unusable.
fn still_open(s: &mut Stream) -> bool {
    use futures_util::FutureExt;
    let mut one = [0u8; 1];
    // `unconstrained`: the task's budget must not turn a ready read into
    // "pending".
    tokio::task::unconstrained(s.read(&mut one))
        .now_or_never()
        .is_none()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    async fn pair(l: &TcpListener) -> (Stream, TcpStream) {
        let addr = l.local_addr().unwrap();
        let (c, s) = tokio::join!(TcpStream::connect(addr), l.accept());
        (
            Box::new(pingora::protocols::l4::stream::Stream::from(c.unwrap())),
            s.unwrap().0,
        )
    }

    #[tokio::test]
    async fn a_quiet_connection_is_taken_back_and_a_closed_or_chatty_one_is_not() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let idle = Idle::default();
        let keep = Duration::from_secs(60);
        let (quiet, _quiet_server) = pair(&l).await;
        idle.put(1, quiet, keep);
        assert!(idle.take(1, keep).is_some());
        assert!(idle.take(1, keep).is_none(), "taken once");

        let (closed, server) = pair(&l).await;
        idle.put(1, closed, keep);
        drop(server);
        let (chatty, mut server2) = pair(&l).await;
        idle.put(2, chatty, keep);
        server2.write_all(b"x").await.unwrap();
        // Let the reactor see the close and the byte.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(idle.take(1, keep).is_none(), "closed by the server");
        assert!(idle.take(2, keep).is_none(), "unexpected bytes");
        assert_eq!(idle.len(), 0);
    }

    #[tokio::test]
    async fn connections_past_keepalive_are_closed_and_the_list_is_bounded() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let idle = Idle::default();
        let (a, _sa) = pair(&l).await;
        idle.put(7, a, Duration::from_secs(60));
        tokio::time::sleep(Duration::from_millis(30)).await;
        // Older than a 10 ms keepalive: not handed out.
        assert!(idle.take(7, Duration::from_millis(10)).is_none());
        assert_eq!(idle.len(), 0);

        let mut servers = Vec::new();
        for _ in 0..PER_PEER + 3 {
            let (c, s) = pair(&l).await;
            servers.push(s);
            idle.put(9, c, Duration::from_secs(60));
        }
        assert_eq!(idle.len(), PER_PEER);
    }
}
