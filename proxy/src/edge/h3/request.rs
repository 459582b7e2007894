//! One HTTP/3 request handed to the proxy as a Pingora custom session:
//! the 0-RTT rule (what is not safe to replay waits for the handshake),
//! hop-by-hop headers dropped, and a first look at the body (a request
//! whose stream already ended has none).

use super::session::{FirstLook, H3Session, HOP_BY_HOP};
use bytes::{Buf, Bytes};
use pingora::apps::HttpServerApp;
use pingora::protocols::http::ServerSession;
use pingora::protocols::Digest;
use pingora::server::ShutdownWatch;
use std::sync::Arc;

/// Whether a method is safe to serve from 0-RTT data (RFC 8470 4.1: a
/// replay of it changes nothing).
pub fn idempotent_safe(m: &http::Method) -> bool {
    matches!(
        *m,
        http::Method::GET | http::Method::HEAD | http::Method::OPTIONS
    )
}

/// What each request of a connection needs.
pub struct Conn<A> {
    /// The proxy.
    pub app: Arc<A>,
    /// The QUIC connection (its close ends the proxy's idle waits).
    pub quic: quinn::Connection,
    /// Its addresses and TLS facts.
    pub digest: Arc<Digest>,
    /// Its loss prober, for event streams.
    pub probe: super::probe::Probe,
    /// True once the handshake is complete (at once without 0-RTT).
    pub confirmed: tokio::sync::watch::Receiver<bool>,
    /// The process's shutdown.
    pub shutdown: ShutdownWatch,
}

/// Serve one request of `conn`.
pub async fn serve<A: HttpServerApp + Send + Sync + 'static>(
    req: http::Request<()>,
    mut stream: h3::server::RequestStream<super::bounded::Bidi<Bytes>, Bytes>,
    conn: Arc<Conn<A>>,
) {
    let mut confirmed = conn.confirmed.clone();
    if !*confirmed.borrow()
        && !idempotent_safe(req.method())
        && confirmed.wait_for(|c| *c).await.is_err()
    {
        return;
    }
    // Still before the handshake's end: this request came in 0-RTT data.
    let early = !*confirmed.borrow();
    let (mut parts, ()) = req.into_parts();
    for h in &HOP_BY_HOP {
        parts.headers.remove(h);
    }
    // Host from `:authority`, as Pingora gives HTTP/2 requests (RFC 9114
    // 4.3.1): HTTP/1.1 origins read Host, and `h2`/`h2c` pools build their
    // `:authority` from it. A Host unlike `:authority` never gets here (h3
    // resets the stream, H3_MESSAGE_ERROR); one sent twice stays, and the
    // request filter refuses it (400).
    if !parts.headers.contains_key(http::header::HOST) {
        if let Some(v) = parts
            .uri
            .authority()
            .and_then(|a| http::HeaderValue::from_str(a.as_str()).ok())
        {
            parts.headers.insert(http::header::HOST, v);
        }
    }
    if early {
        // RFC 8470 5.1: the origin may answer 425 to what it will not take
        // from early data.
        parts
            .headers
            .insert("early-data", http::HeaderValue::from_static("1"));
    }
    let first = match futures_util::FutureExt::now_or_never(stream.recv_data()) {
        Some(Ok(None)) => FirstLook::Ended,
        Some(Ok(Some(mut c))) => FirstLook::Data(c.copy_to_bytes(c.remaining())),
        _ => FirstLook::Pending,
    };
    let session = H3Session::new(
        http::Request::from_parts(parts, ()),
        stream,
        first,
        conn.quic.clone(),
        conn.digest.clone(),
        conn.probe.clone(),
    );
    let _ = conn
        .app
        .process_new_http(ServerSession::new_custom(Box::new(session)), &conn.shutdown)
        .await;
}
