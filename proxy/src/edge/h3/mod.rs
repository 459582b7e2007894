//! HTTP/3 to clients (QUIC, RFC 9000/9114) on TLS listeners with
//! `http3 = true`: quinn on the listener's UDP port, with the same rustls
//! certificate resolver as its TCP side (SNI, files, ACME), and the h3
//! crate for the requests.
//!
//! Each request goes to the same Pingora proxy as TCP requests, as a
//! Pingora custom session over its QUIC stream (`session`, `request`), so
//! it takes the one request path (routes, admission, inference, proxying,
//! the response policy, access log, metrics, traces); `is_h3` lets that
//! path tell it apart (`digest` gives its connection's digest).
//!
//! Limits: concurrent streams per connection and the idle timeout (QUIC
//! transport parameters), the TLS listener's handshake timeout, a cap on
//! connections (more are refused at once), address validation with a
//! Retry (`http3_retry`), 0-RTT off unless `http3_early_data`, and then
//! only for requests safe to replay.

mod bounded;
mod digest;
mod frames;
mod probe;
mod request;
mod session;

pub use digest::QUIC_VERSION;

use crate::config::{Http3, QuicRetry};
use crate::prom::registered;
use async_trait::async_trait;
use bytes::Bytes;
use pingora::apps::HttpServerApp;
use pingora::server::{ListenFds, ShutdownWatch};
use pingora::services::Service;
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Handshakes in progress above which `auto` asks new clients to prove
/// their address first.
const RETRY_HANDSHAKES: usize = 64;
/// Bytes a client may send on one stream before the proxy reads them.
const STREAM_WINDOW: u32 = 256 * 1024;
/// Bytes a client may send on one connection before the proxy reads them.
const CONNECTION_WINDOW: u32 = 2 * 1024 * 1024;
/// Most bytes of a request's header section (as the TCP listeners' 1 MiB),
/// checked when its HEADERS frame is announced (`frames`).
const MAX_FIELD_SECTION: u64 = 1 << 20;
/// Most bytes of unfinished request heads one connection may hold.
const CONNECTION_HEADS: u64 = 2 << 20;
/// Most bytes of unfinished request heads all HTTP/3 connections may hold.
const PROCESS_HEADS: u64 = 64 << 20;

/// Whether a request came over HTTP/3 (its connection's digest says QUIC).
pub fn is_h3(d: Option<&pingora::protocols::Digest>) -> bool {
    d.and_then(|d| d.ssl_digest.as_ref())
        .is_some_and(|s| s.version == QUIC_VERSION)
}

/// The HTTP/3 metric families.
#[derive(Clone)]
pub struct H3Metrics {
    open: IntGauge,
    conns: IntCounterVec,
    requests: IntCounter,
    probes: IntCounter,
    head_bytes: IntGauge,
    refused: IntCounterVec,
}

impl H3Metrics {
    /// Register the families.
    pub fn new(r: &Registry) -> Self {
        let conns = registered(
            r,
            IntCounterVec::new(
                Opts::new(
                    "ultrafast_http3_connections_total",
                    "QUIC connection attempts by result: accepted, refused (http3_max_connections), retry (asked to prove their address), failed (handshake failed or timed out).",
                ),
                &["result"],
            ),
        );
        for r in ["accepted", "refused", "retry", "failed"] {
            conns.with_label_values(&[r]);
        }
        let refused = registered(
            r,
            IntCounterVec::new(
                Opts::new(
                    "ultrafast_http3_refused_total",
                    "HTTP/3 streams and connections refused by reason: too_large (a frame announced more than its kind may hold), unbounded (a frame with no length), busy (the connection's or process's budget for unfinished heads spent), header_timeout (no whole head by client_header_timeout_ms), handshake_timeout (a 0-RTT connection's handshake not done by handshake_timeout_ms).",
                ),
                &["reason"],
            ),
        );
        for r in [
            "too_large",
            "unbounded",
            "busy",
            "header_timeout",
            "handshake_timeout",
        ] {
            refused.with_label_values(&[r]);
        }
        H3Metrics {
            open: registered(
                r,
                IntGauge::new(
                    "ultrafast_http3_connections",
                    "HTTP/3 connections open now.",
                ),
            ),
            conns,
            requests: registered(
                r,
                IntCounter::new(
                    "ultrafast_http3_requests_total",
                    "HTTP/3 requests received.",
                ),
            ),
            probes: registered(
                r,
                IntCounter::new(
                    "ultrafast_http3_loss_probes_total",
                    "Ack-eliciting probes sent after event streams' writes paused, so that a lost token is detected within about one RTT.",
                ),
            ),
            head_bytes: registered(
                r,
                IntGauge::new(
                    "ultrafast_http3_head_bytes",
                    "Bytes of unfinished HTTP/3 request heads held now, all connections together (at most 64 MiB; 2 MiB a connection).",
                ),
            ),
            refused,
        }
    }
}

/// The rustls and QUIC settings of an HTTP/3 listener: TLS 1.3 only, ALPN
/// `h3`, the TCP side's resolver and ticket keys; with 0-RTT, a session
/// cache instead of tickets (rustls accepts early data only on stateful
/// resumption, whose sessions are taken once: a replayed ClientHello
/// finds none).
pub fn server_config(
    resolver: Arc<super::certs::SniResolver>,
    ticketer: Option<Arc<super::ticket::RotatingTicketer>>,
    cache_size: usize,
    h3: &Http3,
) -> Result<quinn::ServerConfig, String> {
    pingora::tls::install_default_crypto_provider();
    let mut tls = rustls::ServerConfig::builder_with_protocol_versions(&[&rustls::version::TLS13])
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    tls.alpn_protocols = vec![b"h3".to_vec()];
    // 0-RTT is replayable (RFC 9001 9.2): off unless asked for.
    tls.max_early_data_size = if h3.early_data { u32::MAX } else { 0 };
    if h3.early_data {
        tls.session_storage = rustls::server::ServerSessionMemoryCache::new(cache_size.max(1024));
    } else if let Some(t) = ticketer {
        tls.ticketer = t;
    }
    let crypto =
        quinn::crypto::rustls::QuicServerConfig::try_from(tls).map_err(|e| e.to_string())?;
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    let mut transport = quinn::TransportConfig::default();
    transport.max_concurrent_bidi_streams(h3.max_streams.into());
    // The control and QPACK streams of each side.
    transport.max_concurrent_uni_streams(8u32.into());
    // What a client may send ahead of what the proxy reads (a request
    // body waiting for admission, say): 256 KiB per stream and 2 MiB per
    // connection, where quinn's default for a connection is unbounded
    // (nginx: `http3_stream_buffer_size` 64k).
    transport.stream_receive_window(STREAM_WINDOW.into());
    transport.receive_window(CONNECTION_WINDOW.into());
    // No QUIC datagrams: nothing here reads them (HTTP/3 datagrams are not
    // offered), and quinn would otherwise advertise them and keep up to
    // 1.25 MB of a client's unread datagrams per connection.
    transport.datagram_receive_buffer_size(None);
    transport.max_idle_timeout(Some(
        quinn::IdleTimeout::try_from(h3.idle_timeout).map_err(|e| e.to_string())?,
    ));
    cfg.transport_config(Arc::new(transport));
    Ok(cfg)
}

/// Bind a listener's UDP socket (SO_REUSEPORT, as its TCP socket, so that
/// a graceful upgrade's new process binds beside the old one).
pub fn bind(address: &str) -> std::io::Result<std::net::UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let addr: std::net::SocketAddr = address
        .parse()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let sock = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    sock.set_reuse_port(true)?;
    if addr.is_ipv6() {
        sock.set_only_v6(true)?;
    }
    sock.set_nonblocking(true)?;
    sock.bind(&addr.into())?;
    Ok(sock.into())
}

/// One HTTP/3 listener.
pub struct H3Endpoint<A> {
    /// The listener's name.
    pub name: String,
    /// Its UDP socket, bound.
    pub socket: std::net::UdpSocket,
    /// QUIC and TLS settings.
    pub config: quinn::ServerConfig,
    /// Limits.
    pub settings: Http3,
    /// The TLS handshake deadline (0-RTT connections included).
    pub handshake_timeout: std::time::Duration,
    /// Each request stream's head deadline (`client_header_timeout_ms`).
    pub header_timeout: Option<std::time::Duration>,
    /// The app its requests go to (the TCP listeners').
    pub app: Arc<A>,
}

/// The HTTP/3 listeners of the process.
pub struct H3Service<A> {
    endpoints: Vec<H3Endpoint<A>>,
    threads: usize,
    metrics: H3Metrics,
}

impl<A> H3Service<A> {
    /// A service for `endpoints` on `threads` threads.
    pub fn new(endpoints: Vec<H3Endpoint<A>>, threads: usize, metrics: H3Metrics) -> Self {
        H3Service {
            endpoints,
            threads,
            metrics,
        }
    }
}

/// What each connection of one endpoint shares.
struct Shared<A> {
    app: Arc<A>,
    settings: Http3,
    handshake_timeout: std::time::Duration,
    header_timeout: Option<std::time::Duration>,
    local: std::net::SocketAddr,
    metrics: H3Metrics,
    handshaking: AtomicUsize,
    open: AtomicUsize,
}

/// A count (and, for open connections, the gauge beside it) held up for
/// as long as this lives, whichever way its task ends.
struct Counted<'a>(&'a AtomicUsize, Option<&'a IntGauge>);

impl<'a> Counted<'a> {
    fn new(c: &'a AtomicUsize, gauge: Option<&'a IntGauge>) -> Self {
        c.fetch_add(1, Ordering::Relaxed);
        if let Some(g) = gauge {
            g.inc();
        }
        Counted(c, gauge)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
        if let Some(g) = self.1 {
            g.dec();
        }
    }
}

async fn serve_endpoint<A: HttpServerApp + Send + Sync + 'static>(
    ep: H3Endpoint<A>,
    metrics: H3Metrics,
    mut shutdown: ShutdownWatch,
) {
    let local = match ep.socket.local_addr() {
        Ok(a) => a,
        Err(e) => {
            log::error!("HTTP/3 listener `{}`: {e}", ep.name);
            return;
        }
    };
    let endpoint = match quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        Some(ep.config),
        ep.socket,
        Arc::new(quinn::TokioRuntime),
    ) {
        Ok(e) => e,
        Err(e) => {
            log::error!("HTTP/3 listener `{}` on {local}: {e}", ep.name);
            std::process::exit(1);
        }
    };
    let shared = Arc::new(Shared {
        app: ep.app,
        settings: ep.settings,
        handshake_timeout: ep.handshake_timeout,
        header_timeout: ep.header_timeout,
        local,
        metrics,
        handshaking: AtomicUsize::new(0),
        open: AtomicUsize::new(0),
    });
    loop {
        tokio::select! {
            changed = shutdown.changed() => {
                if changed.is_err() || *shutdown.borrow() {
                    break;
                }
            }
            incoming = endpoint.accept() => {
                let Some(incoming) = incoming else { break };
                admit(incoming, &shared, &shutdown);
            }
        }
    }
    // New connections are refused from here; open ones were told to go
    // away (each finishes its requests), and the endpoint waits for them.
    endpoint.set_server_config(None);
    endpoint.wait_idle().await;
    log::info!("HTTP/3 listener `{}` on {local} stopped", ep.name);
}

/// Refuse, validate or accept a new connection.
fn admit<A: HttpServerApp + Send + Sync + 'static>(
    incoming: quinn::Incoming,
    shared: &Arc<Shared<A>>,
    shutdown: &ShutdownWatch,
) {
    let s = &shared.settings;
    let open = shared.open.load(Ordering::Relaxed);
    if open >= s.max_connections {
        shared.metrics.conns.with_label_values(&["refused"]).inc();
        incoming.refuse();
        return;
    }
    let validate = match s.retry {
        QuicRetry::Always => true,
        QuicRetry::Never => false,
        QuicRetry::Auto => {
            shared.handshaking.load(Ordering::Relaxed) >= RETRY_HANDSHAKES
                || open >= s.max_connections / 2
        }
    };
    if validate && !incoming.remote_address_validated() {
        shared.metrics.conns.with_label_values(&["retry"]).inc();
        let _ = incoming.retry();
        return;
    }
    tokio::spawn(connection(incoming, shared.clone(), shutdown.clone()));
}

/// The handshake (0-RTT if allowed), then every request of the connection.
async fn connection<A: HttpServerApp + Send + Sync + 'static>(
    incoming: quinn::Incoming,
    shared: Arc<Shared<A>>,
    mut shutdown: ShutdownWatch,
) {
    let failed = || shared.metrics.conns.with_label_values(&["failed"]).inc();
    let handshaking = Counted::new(&shared.handshaking, None);
    let Ok(connecting) = incoming.accept() else {
        failed();
        return;
    };
    // With 0-RTT the connection serves at once and `confirmed` turns true
    // when the handshake completes; without, it is true from the start.
    let zero_rtt = match shared.settings.early_data {
        true => connecting.into_0rtt(),
        false => Err(connecting),
    };
    let (conn, confirmed) = match zero_rtt {
        Ok((conn, accepted)) => {
            let (tx, rx) = tokio::sync::watch::channel(false);
            let (quic, limit) = (conn.clone(), shared.handshake_timeout);
            let refused = shared.metrics.refused.clone();
            tokio::spawn(async move {
                // Served before its handshake ends, a 0-RTT connection still
                // has the handshake's deadline.
                match tokio::time::timeout(limit, accepted).await {
                    Ok(_) => {
                        let _ = tx.send(true);
                    }
                    Err(_) => {
                        refused.with_label_values(&["handshake_timeout"]).inc();
                        quic.close(0u32.into(), b"handshake timeout");
                    }
                }
            });
            (conn, rx)
        }
        Err(connecting) => match tokio::time::timeout(shared.handshake_timeout, connecting).await {
            Ok(Ok(c)) => (c, tokio::sync::watch::channel(true).1),
            _ => {
                failed();
                return;
            }
        },
    };
    drop(handshaking);
    shared.metrics.conns.with_label_values(&["accepted"]).inc();
    let _open = Counted::new(&shared.open, Some(&shared.metrics.open));
    serve(conn, &shared, &mut shutdown, confirmed).await;
}

async fn serve<A: HttpServerApp + Send + Sync + 'static>(
    conn: quinn::Connection,
    shared: &Arc<Shared<A>>,
    shutdown: &mut ShutdownWatch,
    confirmed: tokio::sync::watch::Receiver<bool>,
) {
    let peer = conn.remote_address();
    let quic = conn.clone();
    let bounds = Arc::new(bounded::Bounds::new(
        MAX_FIELD_SECTION,
        CONNECTION_HEADS,
        PROCESS_HEADS,
        shared.metrics.head_bytes.clone(),
        shared.metrics.refused.clone(),
        conn.clone(),
    ));
    let mut h3 = match h3::server::builder()
        .max_field_section_size(MAX_FIELD_SECTION)
        .build::<_, Bytes>(bounded::Conn::new(conn, bounds))
        .await
    {
        Ok(h) => h,
        Err(e) => {
            log::debug!("HTTP/3 connection from {peer}: {e}");
            return;
        }
    };
    let conn = Arc::new(request::Conn {
        app: shared.app.clone(),
        digest: Arc::new(digest::of(peer, shared.local)),
        probe: probe::Probe::new(shared.metrics.probes.clone()),
        quic,
        confirmed,
        shutdown: shutdown.clone(),
    });
    let mut going_away = false;
    loop {
        tokio::select! {
            accepted = h3.accept() => match accepted {
                Ok(Some(resolver)) => {
                    let conn = conn.clone();
                    let requests = shared.metrics.requests.clone();
                    let refused = shared.metrics.refused.clone();
                    let limit = shared.header_timeout;
                    tokio::spawn(async move {
                        let head = resolver.resolve_request();
                        let resolved = match limit {
                            Some(d) => match tokio::time::timeout(d, head).await {
                                Ok(r) => r,
                                Err(_) => {
                                    // Dropped: the stream is reset (H3_REQUEST_CANCELLED).
                                    refused.with_label_values(&["header_timeout"]).inc();
                                    return;
                                }
                            },
                            None => head.await,
                        };
                        if let Ok((req, stream)) = resolved {
                            requests.inc();
                            request::serve(req, stream, conn).await;
                        }
                    });
                }
                Ok(None) => break,
                Err(e) => {
                    log::debug!("HTTP/3 connection from {peer} ended: {e}");
                    break;
                }
            },
            changed = shutdown.changed(), if !going_away => {
                if changed.is_err() || *shutdown.borrow() {
                    // GOAWAY: requests already received finish.
                    going_away = true;
                    let _ = h3.shutdown(0).await;
                }
            }
        }
    }
}

#[async_trait]
impl<A: HttpServerApp + Send + Sync + 'static> Service for H3Service<A> {
    async fn start_service(
        &mut self,
        _fds: Option<ListenFds>,
        shutdown: ShutdownWatch,
        _per_fd: usize,
    ) {
        let loops: Vec<_> = self
            .endpoints
            .drain(..)
            .map(|ep| tokio::spawn(serve_endpoint(ep, self.metrics.clone(), shutdown.clone())))
            .collect();
        for l in loops {
            let _ = l.await;
        }
    }

    fn name(&self) -> &str {
        "http3"
    }

    fn threads(&self) -> Option<usize> {
        Some(self.threads)
    }
}
