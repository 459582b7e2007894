//! TLS listeners: our own accept loop in front of the same Pingora HTTP
//! app as the plain listeners.
//!
//! Pingora's rustls wrapper builds its `ServerConfig` itself, with no place
//! for a ticketer or a session cache, so we build the `ServerConfig` (SNI
//! resolver, rotating ticketer, bounded session cache, ALPN h2/http1.1, TLS
//! 1.2 and 1.3 only) and run the handshake through Pingora's
//! `Acceptor::from_server_config`, then hand the TLS stream to the proxy's
//! `ServerApp::process_new` exactly as Pingora's own listener does. Each
//! handshake has a deadline, so garbage, stalls and truncated handshakes end
//! in a clean close that is counted.

use super::certs::SniResolver;
use super::ticket::RotatingTicketer;
use async_trait::async_trait;
use pingora::apps::ServerApp;
use pingora::listeners::tls::Acceptor;
use pingora::protocols::l4::stream::Stream as L4Stream;
use pingora::protocols::{GetSocketDigest, SocketDigest, Ssl, Stream, ALPN};
use pingora::server::ListenFds;
use pingora::server::ShutdownWatch;
use pingora::services::Service;
use prometheus::{Histogram, IntCounterVec};
use rustls::server::{ServerSessionMemoryCache, StoresServerSessions};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Metric handles of TLS listeners.
#[derive(Clone)]
pub struct TlsMetrics {
    /// Handshakes by result (full, resumed_ticket, resumed_cache, failed).
    pub handshakes: IntCounterVec,
    /// Failed handshakes by reason.
    pub failures: IntCounterVec,
    /// Negotiated TLS versions.
    pub versions: IntCounterVec,
    /// Negotiated ALPN protocols.
    pub alpn: IntCounterVec,
    /// Handshake duration.
    pub duration: Histogram,
}

/// A bounded session cache that counts resumptions through it.
#[derive(Debug)]
pub struct CountingCache {
    inner: Arc<ServerSessionMemoryCache>,
    hits: prometheus::IntCounter,
}

impl CountingCache {
    /// A cache of `size` sessions.
    pub fn new(size: usize, hits: prometheus::IntCounter) -> Self {
        CountingCache {
            inner: ServerSessionMemoryCache::new(size.max(1)),
            hits,
        }
    }
}

impl StoresServerSessions for CountingCache {
    fn put(&self, key: Vec<u8>, value: Vec<u8>) -> bool {
        self.inner.put(key, value)
    }
    fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        let v = self.inner.get(key);
        if v.is_some() {
            self.hits.inc();
        }
        v
    }
    fn take(&self, key: &[u8]) -> Option<Vec<u8>> {
        let v = self.inner.take(key);
        if v.is_some() {
            self.hits.inc();
        }
        v
    }
    fn can_cache(&self) -> bool {
        true
    }
}

/// What a TLS listener needs to build its `ServerConfig`.
pub struct TlsBuild {
    /// SNI certificate selection.
    pub resolver: Arc<SniResolver>,
    /// Ticketer, when tickets are on.
    pub ticketer: Option<Arc<RotatingTicketer>>,
    /// Session cache size (0 = off).
    pub cache_size: usize,
    /// Offer h2 in ALPN.
    pub h2: bool,
}

/// Build the rustls server config of a TLS listener.
pub fn server_config(b: TlsBuild, metrics: &TlsMetrics) -> Arc<rustls::ServerConfig> {
    pingora::tls::install_default_crypto_provider();
    let mut cfg = rustls::ServerConfig::builder_with_protocol_versions(&[
        &rustls::version::TLS13,
        &rustls::version::TLS12,
    ])
    .with_no_client_auth()
    .with_cert_resolver(b.resolver);
    cfg.alpn_protocols = if b.h2 {
        vec![b"h2".to_vec(), b"http/1.1".to_vec()]
    } else {
        vec![b"http/1.1".to_vec()]
    };
    if let Some(t) = b.ticketer {
        cfg.ticketer = t;
    }
    cfg.session_storage = if b.cache_size > 0 {
        Arc::new(CountingCache::new(
            b.cache_size,
            metrics.handshakes.with_label_values(&["resumed_cache"]),
        ))
    } else {
        Arc::new(rustls::server::NoServerSessionStorage {})
    };
    Arc::new(cfg)
}

/// A TLS listener service serving `app`.
pub struct TlsService<A> {
    name: String,
    address: String,
    /// Bound at start (`serve` fails there when it cannot bind); taken by
    /// `start_service`.
    socket: Option<std::net::TcpListener>,
    config: Arc<rustls::ServerConfig>,
    app: Arc<A>,
    handshake_timeout: Duration,
    threads: usize,
    metrics: TlsMetrics,
}

impl<A> TlsService<A> {
    /// A service accepting on `socket` (from [`bind_reuseport`]), bound to
    /// `address`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        name: String,
        address: String,
        socket: std::net::TcpListener,
        config: Arc<rustls::ServerConfig>,
        app: Arc<A>,
        handshake_timeout: Duration,
        threads: usize,
        metrics: TlsMetrics,
    ) -> Self {
        TlsService {
            name,
            address,
            socket: Some(socket),
            config,
            app,
            handshake_timeout,
            threads,
            metrics,
        }
    }
}

fn failure_reason(e: &str) -> &'static str {
    let e = e.to_ascii_lowercase();
    if e.contains("no server certificate")
        || e.contains("unrecognised name")
        || e.contains("unrecognized name")
    {
        "unknown_sni"
    } else if e.contains("protocol version")
        || e.contains("incompatible")
        || e.contains("no cipher")
    {
        "incompatible"
    } else if e.contains("corrupt") || e.contains("invalid") || e.contains("decode") {
        "malformed"
    } else if e.contains("eof") || e.contains("reset") || e.contains("closed") {
        "client_closed"
    } else {
        "other"
    }
}

async fn serve_conn<A: ServerApp + Send + Sync + 'static>(
    tcp: tokio::net::TcpStream,
    acceptor: Arc<Acceptor>,
    app: Arc<A>,
    shutdown: ShutdownWatch,
    timeout: Duration,
    metrics: TlsMetrics,
) {
    let _ = tcp.set_nodelay(true);
    let fd = tcp.as_raw_fd();
    let mut l4: L4Stream = tcp.into();
    l4.set_socket_digest(SocketDigest::from_raw_fd(fd));
    let start = Instant::now();
    let tls = match tokio::time::timeout(timeout, acceptor.tls_handshake(l4)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            metrics.handshakes.with_label_values(&["failed"]).inc();
            metrics
                .failures
                .with_label_values(&[failure_reason(&e.to_string())])
                .inc();
            log::debug!("TLS handshake failed: {e}");
            return;
        }
        Err(_) => {
            metrics.handshakes.with_label_values(&["failed"]).inc();
            metrics.failures.with_label_values(&["timeout"]).inc();
            return;
        }
    };
    metrics.duration.observe(start.elapsed().as_secs_f64());
    if let Some(d) = tls.get_ssl_digest() {
        metrics
            .versions
            .with_label_values(&[d.version.as_ref()])
            .inc();
    }
    let alpn = match tls.selected_alpn_proto() {
        Some(ALPN::H2) => "h2",
        _ => "http/1.1",
    };
    metrics.alpn.with_label_values(&[alpn]).inc();
    let stream: Stream = Box::new(tls);
    let mut next = app.process_new(stream, &shutdown).await;
    while let Some(s) = next {
        next = app.process_new(s, &shutdown).await;
    }
}

/// Bind with SO_REUSEPORT, so a new process started for a graceful upgrade
/// can bind the same address while the old one drains (Pingora hands its
/// own listeners over a socket; ours are simply shared by the kernel until
/// the old process closes them).
pub fn bind_reuseport(address: &str) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let addr: std::net::SocketAddr = address
        .parse()
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "bad address"))?;
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    sock.set_reuse_address(true)?;
    sock.set_reuse_port(true)?;
    sock.set_nonblocking(true)?;
    sock.bind(&addr.into())?;
    sock.listen(1024)?;
    Ok(sock.into())
}

/// The pause after the `n`th accept error in a row: 5 ms doubling to 1 s,
/// so a listener out of descriptors (EMFILE) or memory waits for some to
/// come back instead of spinning on an accept that fails at once.
pub fn accept_backoff(n: u32) -> Duration {
    Duration::from_millis(5u64 << n.min(8)).min(Duration::from_secs(1))
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> Service for TlsService<A> {
    async fn start_service(
        &mut self,
        _fds: Option<ListenFds>,
        mut shutdown: ShutdownWatch,
        _per_fd: usize,
    ) {
        let listener = match self.socket.take().map(tokio::net::TcpListener::from_std) {
            Some(Ok(l)) => l,
            other => {
                let e = other.map_or("started twice".to_string(), |r| {
                    r.err().map(|e| e.to_string()).unwrap_or_default()
                });
                // Bound at start, so this is a runtime failure: a serving
                // process without its listener must not look healthy.
                log::error!(
                    "TLS listener {} on {} cannot accept: {e}",
                    self.name,
                    self.address
                );
                std::process::exit(1);
            }
        };
        let acceptor = Arc::new(Acceptor::from_server_config(self.config.clone()));
        let mut errors = 0u32;
        loop {
            tokio::select! {
                _ = shutdown.changed() => break,
                accepted = listener.accept() => {
                    let tcp = match accepted {
                        Ok((tcp, _)) => {
                            errors = 0;
                            tcp
                        }
                        Err(e) => {
                            if errors == 0 {
                                log::warn!("TLS listener {} accept failed, backing off: {e}", self.name);
                            }
                            let pause = accept_backoff(errors);
                            errors = errors.saturating_add(1);
                            tokio::time::sleep(pause).await;
                            continue;
                        }
                    };
                    tokio::spawn(serve_conn(
                        tcp,
                        acceptor.clone(),
                        self.app.clone(),
                        shutdown.clone(),
                        self.handshake_timeout,
                        self.metrics.clone(),
                    ));
                }
            }
        }
        log::info!(
            "TLS listener {} on {} stopped accepting",
            self.name,
            self.address
        );
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn threads(&self) -> Option<usize> {
        Some(self.threads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_errors_back_off_up_to_a_second() {
        assert_eq!(accept_backoff(0), Duration::from_millis(5));
        assert_eq!(accept_backoff(1), Duration::from_millis(10));
        assert_eq!(accept_backoff(7), Duration::from_millis(640));
        assert_eq!(accept_backoff(8), Duration::from_secs(1));
        assert_eq!(accept_backoff(u32::MAX), Duration::from_secs(1));
    }
}
