//! One HTTP/3 request, relayed over the connection's in-memory HTTP/2
//! connection: the head as it came (pseudo-headers become the request
//! URI), the body both ways as it flows (under HTTP/2 flow control, so
//! neither side buffers more than a window), trailers, and a reset on
//! either side ending the other.

use bytes::{Buf, Bytes};
use h3::server::RequestStream;
use std::future::poll_fn;

/// The h3 stream types of a quinn connection.
type Stream = RequestStream<h3_quinn::BidiStream<Bytes>, Bytes>;

/// Headers that do not cross into HTTP/2 (RFC 9113 8.2.2; HTTP/3 forbids
/// them too, so a request carrying one is malformed anyway).
const HOP_BY_HOP: [http::HeaderName; 5] = [
    http::header::CONNECTION,
    http::header::TRANSFER_ENCODING,
    http::header::UPGRADE,
    http::HeaderName::from_static("keep-alive"),
    http::HeaderName::from_static("proxy-connection"),
];

/// Whether a method is safe to serve from 0-RTT data (RFC 8470 4.1: a
/// replay of it changes nothing).
pub fn idempotent_safe(m: &http::Method) -> bool {
    matches!(
        *m,
        http::Method::GET | http::Method::HEAD | http::Method::OPTIONS
    )
}

/// Send `data` on `tx` as HTTP/2 flow control allows.
async fn send_all(tx: &mut h2::SendStream<Bytes>, mut data: Bytes) -> Result<(), h2::Error> {
    while !data.is_empty() {
        tx.reserve_capacity(data.len());
        let granted = match poll_fn(|cx| tx.poll_capacity(cx)).await {
            Some(n) => n?,
            None => return Err(h2::Error::from(h2::Reason::CANCEL)),
        };
        if granted == 0 {
            continue;
        }
        tx.send_data(data.split_to(granted.min(data.len())), false)?;
    }
    Ok(())
}

/// The request body, from the client to the HTTP/2 side.
async fn upload(
    mut rx: RequestStream<h3_quinn::RecvStream, Bytes>,
    mut tx: h2::SendStream<Bytes>,
    first: Option<Bytes>,
) {
    if let Some(b) = first {
        if send_all(&mut tx, b).await.is_err() {
            return;
        }
    }
    loop {
        match rx.recv_data().await {
            Ok(Some(mut chunk)) => {
                let bytes = chunk.copy_to_bytes(chunk.remaining());
                if send_all(&mut tx, bytes).await.is_err() {
                    return;
                }
            }
            Ok(None) => break,
            Err(_) => {
                tx.send_reset(h2::Reason::CANCEL);
                return;
            }
        }
    }
    match rx.recv_trailers().await {
        Ok(Some(trailers)) => {
            let _ = tx.send_trailers(trailers);
        }
        Ok(None) => {
            let _ = tx.send_data(Bytes::new(), true);
        }
        Err(_) => tx.send_reset(h2::Reason::CANCEL),
    }
}

/// Relay one request; `confirmed` turns true once the handshake is
/// complete (it starts true without 0-RTT): a request that is not safe to
/// replay waits for it.
pub async fn relay(
    req: http::Request<()>,
    stream: Stream,
    h2: h2::client::SendRequest<Bytes>,
    mut confirmed: tokio::sync::watch::Receiver<bool>,
) {
    let (mut tx, rx) = stream.split();
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
    if early {
        // RFC 8470 5.1: the origin may answer 425 to what it will not
        // take from early data.
        parts
            .headers
            .insert("early-data", http::HeaderValue::from_static("1"));
    }
    parts.version = http::Version::HTTP_2;
    let req = http::Request::from_parts(parts, ());
    let mut h2 = h2;
    let Ok(mut ready) = poll_fn(|cx| h2.poll_ready(cx)).await.map(|_| h2) else {
        tx.stop_stream(h3::error::Code::H3_INTERNAL_ERROR);
        return;
    };
    // A request whose stream already ended (a GET, most often) goes as
    // one HEADERS frame with END_STREAM, and needs no upload task.
    let mut rx = rx;
    let (bodiless, first) = match futures_util::FutureExt::now_or_never(rx.recv_data()) {
        Some(Ok(None)) => (true, None),
        Some(Ok(Some(mut c))) => (false, Some(c.copy_to_bytes(c.remaining()))),
        _ => (false, None),
    };
    let (response, body_tx) = match ready.send_request(req, bodiless) {
        Ok(r) => r,
        Err(_) => {
            tx.stop_stream(h3::error::Code::H3_INTERNAL_ERROR);
            return;
        }
    };
    let upload = (!bodiless).then(|| tokio::spawn(upload(rx, body_tx, first)));
    let abort = || {
        if let Some(u) = &upload {
            u.abort();
        }
    };
    let resp = match response.await {
        Ok(r) => r,
        Err(_) => {
            abort();
            tx.stop_stream(h3::error::Code::H3_INTERNAL_ERROR);
            return;
        }
    };
    let (mut head, mut body) = resp.into_parts();
    head.version = http::Version::HTTP_3;
    if tx
        .send_response(http::Response::from_parts(head, ()))
        .await
        .is_err()
    {
        abort();
        return;
    }
    while let Some(chunk) = body.data().await {
        let Ok(chunk) = chunk else {
            abort();
            tx.stop_stream(h3::error::Code::H3_INTERNAL_ERROR);
            return;
        };
        let _ = body.flow_control().release_capacity(chunk.len());
        if tx.send_data(chunk).await.is_err() {
            // The client went away: dropping the HTTP/2 side resets it.
            abort();
            return;
        }
    }
    if let Ok(Some(trailers)) = body.trailers().await {
        if tx.send_trailers(trailers).await.is_err() {
            abort();
            return;
        }
    }
    let _ = tx.finish().await;
    // The body may still be arriving for a response that ended first.
    abort();
}
