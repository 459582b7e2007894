//! The exporter's HTTP client: one POST per batch over plain HTTP/1.1. It
//! runs on the SDK's batch thread (never on a request's runtime), so it may
//! block; a collector is normally a local agent or sidecar, so `http://`
//! only (put an agent in front of a remote TLS collector).

use bytes::Bytes;
use http::{Request, Response};
use opentelemetry_http::{HttpClient, HttpError};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// The most of a collector's answer read.
const MAX_ANSWER: u64 = 1 << 20;

#[derive(Debug)]
pub(super) struct Client {
    timeout: Duration,
}

impl Client {
    /// A client for `url`, which must be `http://host:port/...`.
    pub(super) fn new(url: &str) -> Result<Client, String> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| format!("otlp_endpoint `{url}`: only http:// is supported"))?;
        if rest.is_empty() || rest.starts_with('/') {
            return Err(format!("otlp_endpoint `{url}`: no host"));
        }
        Ok(Client {
            timeout: Duration::from_secs(5),
        })
    }
}

fn post(req: &Request<Bytes>, timeout: Duration) -> Result<Response<Bytes>, HttpError> {
    let uri = req.uri();
    let host = uri.host().ok_or("no host")?;
    let port = uri.port_u16().unwrap_or(80);
    let deadline = std::time::Instant::now() + timeout;
    // `[::1]` names the address without its brackets.
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let addr = (bare, port)
        .to_socket_addrs()?
        .next()
        .ok_or("the collector's name has no address")?;
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: {}\r\nConnection: close\r\n",
        req.body().len()
    );
    for (k, v) in req.headers() {
        if let Ok(v) = v.to_str() {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes())?;
    s.write_all(req.body())?;
    // One deadline for the whole answer: a collector that trickles bytes
    // must not hold the batch thread past it.
    let mut answer = Vec::new();
    let mut chunk = [0u8; 8192];
    while (answer.len() as u64) < MAX_ANSWER {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err("the collector's answer took too long".into());
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut chunk)? {
            0 => break,
            n => answer.extend_from_slice(&chunk[..n]),
        }
    }
    let end = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("the collector's answer has no head")?;
    let status: u16 = std::str::from_utf8(&answer[..end])
        .ok()
        .and_then(|h| h.strip_prefix("HTTP/1."))
        .and_then(|r| r.get(2..5))
        .and_then(|c| c.parse().ok())
        .ok_or("the collector's answer is not HTTP")?;
    // The body is protobuf: its bytes as they came.
    let body = Bytes::from(answer[end + 4..].to_vec());
    let mut r = Response::new(body);
    *r.status_mut() = http::StatusCode::from_u16(status)?;
    Ok(r)
}

#[async_trait::async_trait]
impl HttpClient for Client {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        post(&request, self.timeout)
    }
}
