//! The stream an HTTP/3 connection is served through: one end of an
//! in-memory pipe that Pingora reads as an HTTP/2 connection (ALPN `h2`),
//! carrying the QUIC connection's addresses and TLS facts, so routes,
//! admission, inference, proxying, the response policy, logs and metrics
//! see an HTTP/3 request as they see any other.

use async_trait::async_trait;
use pingora::protocols::l4::socket::SocketAddr as PeerAddr;
use pingora::protocols::raw_connect::ProxyDigest;
use pingora::protocols::tls::SslDigest;
use pingora::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl,
    TimingDigest, UniqueID, UniqueIDType, ALPN,
};
use std::pin::Pin;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::SystemTime;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, DuplexStream, ReadBuf};

/// The `version` of an HTTP/3 connection's SSL digest: QUIC carries TLS
/// 1.3 (RFC 9001), and this is how a request tells it came over HTTP/3.
pub const QUIC_VERSION: &str = "QUIC";

/// Ids of bridges: negative, so they never meet a socket's descriptor.
static NEXT_ID: AtomicI32 = AtomicI32::new(-2);

/// Pingora's end of an HTTP/3 connection's pipe.
#[derive(Debug)]
pub struct Bridge {
    io: DuplexStream,
    ssl: Arc<SslDigest>,
    socket: Arc<SocketDigest>,
    id: UniqueIDType,
    established: SystemTime,
}

impl Bridge {
    /// A bridge over `io` for a QUIC connection from `peer` to `local`.
    pub fn new(io: DuplexStream, peer: std::net::SocketAddr, local: std::net::SocketAddr) -> Self {
        // No descriptor: the addresses are set here, so none is looked up.
        let socket = SocketDigest::from_raw_fd(-1);
        let _ = socket.peer_addr.set(Some(PeerAddr::Inet(peer)));
        let _ = socket.local_addr.set(Some(PeerAddr::Inet(local)));
        Bridge {
            io,
            ssl: Arc::new(SslDigest::new(
                "TLS_AES_128_GCM_SHA256",
                QUIC_VERSION,
                None,
                None,
                Vec::new(),
            )),
            socket: Arc::new(socket),
            id: NEXT_ID.fetch_sub(1, Ordering::Relaxed).min(-2),
            established: SystemTime::now(),
        }
    }
}

impl AsyncRead for Bridge {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Bridge {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[async_trait]
impl Shutdown for Bridge {
    async fn shutdown(&mut self) {
        let _ = AsyncWriteExt::shutdown(&mut self.io).await;
    }
}

impl UniqueID for Bridge {
    fn id(&self) -> UniqueIDType {
        self.id
    }
}

impl Ssl for Bridge {
    fn get_ssl_digest(&self) -> Option<Arc<SslDigest>> {
        Some(self.ssl.clone())
    }

    fn selected_alpn_proto(&self) -> Option<ALPN> {
        Some(ALPN::H2)
    }
}

impl GetTimingDigest for Bridge {
    fn get_timing_digest(&self) -> Vec<Option<TimingDigest>> {
        vec![Some(TimingDigest {
            established_ts: self.established,
            ..Default::default()
        })]
    }
}

impl GetProxyDigest for Bridge {
    fn get_proxy_digest(&self) -> Option<Arc<ProxyDigest>> {
        None
    }
}

impl GetSocketDigest for Bridge {
    fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
        Some(self.socket.clone())
    }
}

#[async_trait]
impl Peek for Bridge {}
