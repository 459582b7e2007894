//! The gRPC health check (`health_check = { grpc = "service" }`): one
//! `grpc.health.v1.Health/Check` call over a fresh HTTP/2 connection (h2c,
//! or h2 with the pool's TLS: its CA, SNI, verification and client
//! certificate), as Kubernetes' gRPC probes and Envoy's gRPC health checks
//! make it. Up only for `SERVING`: `NOT_SERVING`, an unknown service
//! (grpc-status 5), any other status or a broken call is down.

use pingora::connectors::http::v2::{handshake, H2HandshakeSettings};
use pingora::connectors::TransportConnector;
use pingora::http::RequestHeader;
use pingora::protocols::ALPN;
use pingora::upstreams::peer::{HttpPeer, Peer};
use std::sync::OnceLock;

const PATH: &str = "/grpc.health.v1.Health/Check";

/// `HealthCheckResponse { status: SERVING }`: field 1, varint 1.
const SERVING: [u8; 2] = [0x08, 0x01];

/// A fresh connection per probe (no pool: a probe judges connecting too).
fn connector() -> &'static TransportConnector {
    static C: OnceLock<TransportConnector> = OnceLock::new();
    C.get_or_init(|| TransportConnector::new(None))
}

/// The request message, framed: `HealthCheckRequest { service }`.
fn request(service: &str) -> bytes::Bytes {
    let mut msg = Vec::with_capacity(service.len() + 3);
    if !service.is_empty() {
        msg.push(0x0a);
        push_varint(&mut msg, service.len() as u64);
        msg.extend_from_slice(service.as_bytes());
    }
    let mut frame = Vec::with_capacity(msg.len() + 5);
    frame.push(0); // not compressed
    frame.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    frame.extend_from_slice(&msg);
    frame.into()
}

fn push_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Whether the member behind `peer` says `service` is SERVING.
pub async fn probe(peer: &HttpPeer, authority: &str, service: &str) -> bool {
    check(peer, authority, service).await.unwrap_or(false)
}

async fn check(peer: &HttpPeer, authority: &str, service: &str) -> pingora::Result<bool> {
    let stream = connector().new_stream(peer).await?;
    if peer.tls() && stream.selected_alpn_proto() != Some(ALPN::H2) {
        // A member that does not speak HTTP/2 cannot serve gRPC.
        return Ok(false);
    }
    let mut settings = H2HandshakeSettings::new();
    settings.max_streams = 1;
    let conn = handshake(stream, settings).await?;
    let Some(mut h2) = conn.spawn_stream().await? else {
        return Ok(false);
    };
    let scheme = if peer.tls() { "https" } else { "http" };
    let mut req = RequestHeader::build("POST", PATH.as_bytes(), Some(3))?;
    let uri = http::Uri::builder()
        .scheme(scheme)
        .authority(authority)
        .path_and_query(PATH)
        .build();
    let Ok(uri) = uri else {
        return Ok(false);
    };
    req.set_uri(uri);
    req.insert_header("content-type", "application/grpc")?;
    req.insert_header("te", "trailers")?;
    req.insert_header("user-agent", "ultrafast-health")?;
    h2.write_request_header(Box::new(req), false)?;
    h2.write_request_body(request(service), true).await?;
    h2.read_response_header().await?;
    let Some(head) = h2.response_header() else {
        return Ok(false);
    };
    if head.status != 200 || head.headers.contains_key("grpc-status") {
        // Trailers-only: the call failed (5: no such service).
        return Ok(false);
    }
    let mut body = Vec::new();
    while let Some(b) = h2.read_response_body().await? {
        body.extend_from_slice(&b);
        if body.len() > 1024 {
            return Ok(false);
        }
    }
    let ok = h2
        .read_trailers()
        .await?
        .and_then(|t| t.get("grpc-status").cloned())
        .is_some_and(|v| v == "0");
    // One uncompressed message: 5 bytes of framing, then the response.
    Ok(ok && body.len() == 5 + SERVING.len() && body[0] == 0 && body[5..] == SERVING)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_is_a_framed_health_check_request() {
        assert_eq!(&request("")[..], &[0, 0, 0, 0, 0]);
        let r = request("test.Echo");
        assert_eq!(&r[..5], &[0, 0, 0, 0, 11]);
        assert_eq!(&r[5..7], &[0x0a, 9]);
        assert_eq!(&r[7..], b"test.Echo");
        let long = "s".repeat(200);
        let r = request(&long);
        assert_eq!(&r[5..8], &[0x0a, 0xc8, 0x01], "a two-byte length");
    }
}
