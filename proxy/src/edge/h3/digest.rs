//! What the request path reads of an HTTP/3 request's connection: its
//! addresses, TLS facts and start, as Pingora's `Digest`.

use pingora::protocols::l4::socket::SocketAddr as PeerAddr;
use pingora::protocols::tls::SslDigest;
use pingora::protocols::{Digest, SocketDigest, TimingDigest};
use std::sync::Arc;
use std::time::SystemTime;

/// The `version` of an HTTP/3 connection's SSL digest: QUIC carries TLS
/// 1.3 (RFC 9001), and this is how a request tells it came over HTTP/3.
pub const QUIC_VERSION: &str = "QUIC";

/// The digest of a QUIC connection from `peer` to `local`.
pub fn of(peer: std::net::SocketAddr, local: std::net::SocketAddr) -> Digest {
    // No descriptor: the addresses are set here, so none is looked up.
    let socket = SocketDigest::from_raw_fd(-1);
    let _ = socket.peer_addr.set(Some(PeerAddr::Inet(peer)));
    let _ = socket.local_addr.set(Some(PeerAddr::Inet(local)));
    Digest {
        ssl_digest: Some(Arc::new(SslDigest::new(
            "TLS_AES_128_GCM_SHA256",
            QUIC_VERSION,
            None,
            None,
            Vec::new(),
        ))),
        timing_digest: vec![Some(TimingDigest {
            established_ts: SystemTime::now(),
            ..Default::default()
        })],
        proxy_digest: None,
        socket_digest: Some(Arc::new(socket)),
    }
}
