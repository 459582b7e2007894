//! Every listening socket of the process (plain, TLS and admin) runs
//! through our own accept loop in front of a Pingora `ServerApp`.
//!
//! Pingora's listening service binds its sockets only once the server runs,
//! and a failure there ends that service's thread while the process stays
//! up and ready; its accept loop backs off only on `EMFILE`. Ours: every
//! socket is bound before the server starts (so `serve` fails with the
//! address and the cause), every accept error backs off, and the sockets go
//! into Pingora's handover table, so a graceful upgrade (`serve --upgrade`,
//! then `SIGQUIT` to the old process) passes the very same sockets to the
//! new process: no connection waiting in a backlog is lost, which a second
//! socket bound with `SO_REUSEPORT` cannot promise when the old one closes.
//!
//! A connection is then handed to the app's `process_new` exactly as
//! Pingora's own listener does: after a TLS handshake with a deadline (TLS
//! listeners) or at once (plain ones).

use super::tls::{failure_reason, TlsMetrics};
use async_trait::async_trait;
use pingora::apps::ServerApp;
use pingora::listeners::tls::Acceptor;
use pingora::protocols::l4::stream::Stream as L4Stream;
use pingora::protocols::{GetSocketDigest, SocketDigest, Ssl, Stream, ALPN};
use pingora::server::ListenFds;
use pingora::server::ShutdownWatch;
use pingora::services::Service;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How a listener's connections begin.
pub enum Handshake {
    /// Plain TCP: HTTP/1.x, and h2c where the app allows it.
    Plain,
    /// A TLS handshake first.
    Tls(TlsHandshake),
}

/// A TLS listener's handshake.
pub struct TlsHandshake {
    /// Pingora's acceptor over the listener's rustls config
    /// (`tls::server_config`).
    pub acceptor: Acceptor,
    /// Deadline of one handshake.
    pub timeout: Duration,
    /// Handshake metrics.
    pub metrics: TlsMetrics,
}

/// One listening address and the app behind it.
pub struct Endpoint<A> {
    /// The listener's name in the config (for logs).
    pub name: String,
    /// The address as written in the config: the key of the upgrade
    /// handover table.
    pub address: String,
    /// Bound at start, or `None` when it is to come from the old process in
    /// a graceful upgrade.
    pub socket: Option<std::net::TcpListener>,
    /// Plain or TLS.
    pub handshake: Handshake,
    /// A PROXY protocol header first, where the listener expects one (read
    /// before a TLS handshake).
    pub proxy_protocol: Option<Arc<super::proxy_protocol::Policy>>,
    /// The app serving its connections.
    pub app: Arc<A>,
}

/// A Pingora service accepting on one or more endpoints, all on one
/// runtime.
pub struct ListenerService<A> {
    name: String,
    endpoints: Vec<Endpoint<A>>,
    threads: usize,
}

impl<A> ListenerService<A> {
    /// A service named `name` running `endpoints` on `threads` threads.
    pub fn new(name: String, endpoints: Vec<Endpoint<A>>, threads: usize) -> Self {
        ListenerService {
            name,
            endpoints,
            threads,
        }
    }
}

/// Bind `address` for listening (SO_REUSEADDR, not SO_REUSEPORT: a second
/// process can only get this socket by the handover, so a bind that finds
/// the address taken says so).
pub fn bind(address: &str) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let addr: std::net::SocketAddr = address
        .parse()
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "bad address"))?;
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    sock.set_reuse_address(true)?;
    if addr.is_ipv6() {
        // `[::]` means IPv6 only, as in nginx; `0.0.0.0` is its own listener.
        sock.set_only_v6(true)?;
    }
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

/// The socket of `ep`: the one handed over by the old process if the table
/// has it, else the one bound at start (which then goes into the table for
/// the next upgrade).
fn take_socket<A>(ep: &mut Endpoint<A>, fds: &Option<ListenFds>) -> Option<std::net::TcpListener> {
    let inherited = fds
        .as_ref()
        .and_then(|f| f.lock().get(&ep.address).copied());
    if let Some(fd) = inherited {
        #[allow(unsafe_code)]
        // SAFETY: the fd was received by Pingora's handover for this very
        // address (SCM_RIGHTS, so it is a fresh descriptor of this process),
        // and nothing else in the process takes ownership of it: the table
        // only keeps the number to send on, before this listener closes.
        let sock = unsafe { <std::net::TcpListener as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        let _ = sock.set_nonblocking(true);
        // The socket bound at start, if any, was only a check.
        ep.socket = None;
        return Some(sock);
    }
    let sock = ep.socket.take()?;
    if let Some(f) = fds {
        f.lock().add(ep.address.clone(), sock.as_raw_fd());
    }
    Some(sock)
}

async fn handshake(
    tcp: tokio::net::TcpStream,
    hs: &Handshake,
    proxy: Option<&super::proxy_protocol::Policy>,
) -> Option<Stream> {
    let _ = tcp.set_nodelay(true);
    let fd = tcp.as_raw_fd();
    let peer = proxy.and_then(|_| tcp.peer_addr().ok());
    let mut l4: L4Stream = tcp.into();
    l4.set_socket_digest(SocketDigest::from_raw_fd(fd));
    // Both steps are boxed: inline, their futures (some 8 KiB with the TLS
    // handshake's) sized the connection's task for its whole life, plain
    // connections and finished handshakes included.
    if let Some(p) = proxy {
        if !Box::pin(p.accept(&mut l4, peer)).await {
            return None;
        }
    }
    let Handshake::Tls(t) = hs else {
        return Some(Box::new(l4));
    };
    let start = Instant::now();
    let handshake = Box::pin(t.acceptor.tls_handshake(l4));
    let tls = match tokio::time::timeout(t.timeout, handshake).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            t.metrics.handshakes.with_label_values(&["failed"]).inc();
            t.metrics
                .failures
                .with_label_values(&[failure_reason(&e.to_string())])
                .inc();
            log::debug!("TLS handshake failed: {e}");
            return None;
        }
        Err(_) => {
            t.metrics.handshakes.with_label_values(&["failed"]).inc();
            t.metrics.failures.with_label_values(&["timeout"]).inc();
            return None;
        }
    };
    t.metrics.duration.observe(start.elapsed().as_secs_f64());
    if let Some(d) = tls.get_ssl_digest() {
        t.metrics
            .versions
            .with_label_values(&[d.version.as_ref()])
            .inc();
    }
    let alpn = match tls.selected_alpn_proto() {
        Some(ALPN::H2) => "h2",
        _ => "http/1.1",
    };
    t.metrics.alpn.with_label_values(&[alpn]).inc();
    Some(Box::new(tls))
}

async fn serve_conn<A: ServerApp + Send + Sync + 'static>(
    tcp: tokio::net::TcpStream,
    hs: Arc<Handshake>,
    proxy: Option<Arc<super::proxy_protocol::Policy>>,
    app: Arc<A>,
    shutdown: ShutdownWatch,
) {
    let Some(stream) = handshake(tcp, &hs, proxy.as_deref()).await else {
        return;
    };
    let mut next = app.process_new(stream, &shutdown).await;
    while let Some(s) = next {
        next = app.process_new(s, &shutdown).await;
    }
}

/// Whether a change of the shutdown watch means "stop accepting" (the first
/// read of the initial `false` does not).
fn stopping(changed: Result<(), tokio::sync::watch::error::RecvError>, w: &ShutdownWatch) -> bool {
    changed.is_err() || *w.borrow()
}

async fn accept_loop<A: ServerApp + Send + Sync + 'static>(
    name: String,
    listener: tokio::net::TcpListener,
    hs: Arc<Handshake>,
    proxy: Option<Arc<super::proxy_protocol::Policy>>,
    app: Arc<A>,
    mut shutdown: ShutdownWatch,
) {
    let mut errors = 0u32;
    loop {
        tokio::select! {
            changed = shutdown.changed() => {
                if stopping(changed, &shutdown) {
                    break;
                }
            }
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => {
                    errors = 0;
                    tokio::spawn(serve_conn(
                        tcp,
                        hs.clone(),
                        proxy.clone(),
                        app.clone(),
                        shutdown.clone(),
                    ));
                }
                Err(e) => {
                    if errors == 0 {
                        log::warn!("listener {name} accept failed, backing off: {e}");
                    }
                    let pause = accept_backoff(errors);
                    errors = errors.saturating_add(1);
                    tokio::time::sleep(pause).await;
                }
            },
        }
    }
    log::info!("listener {name} stopped accepting");
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> Service for ListenerService<A> {
    async fn start_service(
        &mut self,
        fds: Option<ListenFds>,
        shutdown: ShutdownWatch,
        _per_fd: usize,
    ) {
        let mut loops = Vec::new();
        for ep in &mut self.endpoints {
            let listener = take_socket(ep, &fds).map(tokio::net::TcpListener::from_std);
            let listener = match listener {
                Some(Ok(l)) => l,
                other => {
                    let why = match other {
                        Some(Err(e)) => e.to_string(),
                        _ => "the old process did not hand its socket over".to_string(),
                    };
                    // A serving process without one of its listeners must
                    // not look healthy.
                    log::error!(
                        "listener `{}` on {} cannot accept: {why}",
                        ep.name,
                        ep.address
                    );
                    std::process::exit(1);
                }
            };
            let name = format!("`{}` on {}", ep.name, ep.address);
            let hs = Arc::new(std::mem::replace(&mut ep.handshake, Handshake::Plain));
            loops.push(tokio::spawn(accept_loop(
                name,
                listener,
                hs,
                ep.proxy_protocol.clone(),
                ep.app.clone(),
                shutdown.clone(),
            )));
        }
        for l in loops {
            let _ = l.await;
        }
        for ep in &self.endpoints {
            ep.app.cleanup().await;
        }
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn threads(&self) -> Option<usize> {
        Some(self.threads)
    }

    fn listen_addresses(&self) -> Option<Vec<String>> {
        Some(self.endpoints.iter().map(|e| e.address.clone()).collect())
    }
}

/// Whether each new address in `new` can be bound now: a reload cannot
/// open listeners (they change with a graceful upgrade), but it says at
/// once when the upgrade would fail.
pub fn unbindable(old: &[crate::config::Listener], new: &[crate::config::Listener]) -> Vec<String> {
    new.iter()
        .filter(|l| !old.iter().any(|o| o.address == l.address))
        .filter_map(|l| {
            std::net::TcpListener::bind(&l.address)
                .err()
                .map(|e| format!("listener `{}` cannot bind {}: {e}", l.name, l.address))
        })
        .collect()
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

    #[test]
    fn a_taken_address_is_refused_not_shared() {
        let a = bind("127.0.0.1:0").expect("bind");
        let addr = a.local_addr().expect("addr").to_string();
        let e = bind(&addr).expect_err("second bind of a taken address");
        assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
        assert!(bind("not an address").is_err());
    }
}
#[cfg(test)]
mod task_size {
    /// What every connection's task holds for its whole life: the TLS
    /// handshake and the PROXY header read are boxed (inline they made it
    /// some 8 KiB).
    #[tokio::test]
    async fn the_handshake_keeps_the_connection_task_small() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let tcp = tokio::net::TcpStream::connect(l.local_addr().unwrap())
            .await
            .unwrap();
        let f = super::handshake(tcp, &super::Handshake::Plain, None);
        assert!(
            std::mem::size_of_val(&f) < 1024,
            "{}",
            std::mem::size_of_val(&f)
        );
    }
}
