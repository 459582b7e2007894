//! An HTTP/3 request as a Pingora server session (Pingora's custom-session
//! seam): the proxy reads the request body from the QUIC stream and writes
//! the response into it directly, so an HTTP/3 request takes the one
//! request path (routes, admission, inference, proxying, the response
//! policy, logs, metrics) with no protocol in between.

use super::probe::Probe;
use async_trait::async_trait;
use bytes::{Buf, Bytes};
use futures_util::Stream;
use h3::server::RequestStream;
use http::HeaderMap;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::protocols::http::body_buffer::FixedBuffer;
use pingora::protocols::http::custom::server::Session;
use pingora::protocols::http::custom::CustomMessageWrite;
use pingora::protocols::http::HttpTask;
use pingora::protocols::l4::socket::SocketAddr;
use pingora::protocols::Digest;
use pingora::{Error, ErrorType, OrErr, Result};
use std::sync::Arc;
use std::time::Duration;

/// Request body bytes kept for a retry (as Pingora's HTTP/2 session).
const RETRY_BUFFER: usize = 64 * 1024;

/// Headers HTTP/3 forbids (RFC 9114 4.2): dropped from requests before the
/// proxy sees them and from responses before they are sent.
pub const HOP_BY_HOP: [http::HeaderName; 5] = [
    http::header::CONNECTION,
    http::header::TRANSFER_ENCODING,
    http::header::UPGRADE,
    http::HeaderName::from_static("keep-alive"),
    http::HeaderName::from_static("proxy-connection"),
];

/// What a request's body looked like when the request arrived.
pub enum FirstLook {
    /// The stream had ended: no body at all.
    Ended,
    /// Nothing had arrived yet.
    Pending,
    /// Its first bytes.
    Data(Bytes),
}

type Tx = RequestStream<super::bounded::Send<Bytes>, Bytes>;
type Rx = RequestStream<super::bounded::Recv, Bytes>;

/// One HTTP/3 request and its response stream.
pub struct H3Session {
    req: RequestHeader,
    tx: Tx,
    rx: Rx,
    /// The request body's first bytes, read when the request arrived.
    first: Option<Bytes>,
    conn: quinn::Connection,
    /// The connection's addresses and TLS facts (shared by its requests).
    digest: Arc<Digest>,
    /// The connection's loss prober, told of each write of an event stream.
    probe: Probe,
    /// The response is an event stream (`text/event-stream`).
    event_stream: bool,
    read_timeout: Option<Duration>,
    write_timeout: Option<Duration>,
    drain_timeout: Option<Duration>,
    body_read: usize,
    body_sent: usize,
    /// The request body has ended.
    body_done: bool,
    /// The request came with no body at all.
    body_empty: bool,
    response: Option<ResponseHeader>,
    /// The response stream is finished (or reset).
    ended: bool,
    retry: Option<FixedBuffer>,
}

fn err(kind: ErrorType, what: &'static str, e: impl std::fmt::Display) -> Box<Error> {
    Error::explain(kind, format!("{what}: {e}"))
}

async fn within<T>(
    limit: Option<Duration>,
    kind: ErrorType,
    f: impl std::future::Future<Output = T>,
) -> Result<T> {
    match limit {
        Some(d) => tokio::time::timeout(d, f)
            .await
            .or_err(kind, "HTTP/3 stream timed out"),
        None => Ok(f.await),
    }
}

impl H3Session {
    /// A session for `req` on `stream`, whose body looked like `first`
    /// when it arrived.
    pub fn new(
        req: http::Request<()>,
        stream: RequestStream<super::bounded::Bidi<Bytes>, Bytes>,
        first: FirstLook,
        conn: quinn::Connection,
        digest: Arc<Digest>,
        probe: Probe,
    ) -> Self {
        let (tx, rx) = stream.split();
        let (parts, ()) = req.into_parts();
        let ended = matches!(first, FirstLook::Ended);
        H3Session {
            req: RequestHeader::from(parts),
            tx,
            rx,
            body_empty: ended,
            body_done: ended,
            first: match first {
                FirstLook::Data(b) => Some(b),
                _ => None,
            },
            conn,
            digest,
            probe,
            event_stream: false,
            read_timeout: None,
            write_timeout: None,
            drain_timeout: None,
            body_read: 0,
            body_sent: 0,
            response: None,
            ended: false,
            retry: None,
        }
    }

    async fn end(&mut self) -> Result<()> {
        if self.ended {
            return Ok(());
        }
        self.ended = true;
        within(
            self.write_timeout,
            ErrorType::WriteTimedout,
            self.tx.finish(),
        )
        .await?
        .map_err(|e| err(ErrorType::WriteError, "finishing the HTTP/3 response", e))
    }

    fn kept(&mut self, b: &Bytes) {
        self.body_read += b.len();
        if let Some(r) = &mut self.retry {
            r.write_to_buffer(b);
        }
    }
}

#[async_trait]
impl Session for H3Session {
    fn req_header(&self) -> &RequestHeader {
        &self.req
    }

    fn req_header_mut(&mut self) -> &mut RequestHeader {
        &mut self.req
    }

    async fn read_body_bytes(&mut self) -> Result<Option<Bytes>> {
        if let Some(b) = self.first.take() {
            self.kept(&b);
            return Ok(Some(b));
        }
        if self.body_done {
            return Ok(None);
        }
        let next = within(
            self.read_timeout,
            ErrorType::ReadTimedout,
            self.rx.recv_data(),
        )
        .await?
        .map_err(|e| err(ErrorType::ReadError, "reading the HTTP/3 request body", e))?;
        match next {
            Some(mut chunk) => {
                let b = chunk.copy_to_bytes(chunk.remaining());
                self.kept(&b);
                Ok(Some(b))
            }
            None => {
                self.body_done = true;
                Ok(None)
            }
        }
    }

    async fn drain_request_body(&mut self) -> Result<()> {
        let limit = self.drain_timeout;
        let drain = async {
            while self.read_body_bytes().await?.is_some() {}
            Ok(())
        };
        match limit {
            Some(d) => tokio::time::timeout(d, drain)
                .await
                .or_err(ErrorType::ReadTimedout, "draining the HTTP/3 request body")?,
            None => drain.await,
        }
    }

    async fn write_response_header(
        &mut self,
        mut head: Box<ResponseHeader>,
        end: bool,
    ) -> Result<()> {
        // One response per stream: informational heads are not sent (as
        // Pingora's HTTP/2 session does), nor a second head.
        if self.ended || head.status.is_informational() || self.response.is_some() {
            return Ok(());
        }
        for h in &HOP_BY_HOP {
            head.remove_header(h);
        }
        self.event_stream = crate::filters::is_event_stream(&head.headers);
        let mut parts = head.as_owned_parts();
        parts.version = http::Version::HTTP_3;
        let sent = within(
            self.write_timeout,
            ErrorType::WriteTimedout,
            self.tx.send_response(http::Response::from_parts(parts, ())),
        )
        .await?;
        sent.map_err(|e| err(ErrorType::WriteError, "writing the HTTP/3 response head", e))?;
        self.response = Some(*head);
        if end {
            self.end().await?;
        }
        Ok(())
    }

    async fn write_response_header_ref(&mut self, resp: &ResponseHeader, end: bool) -> Result<()> {
        self.write_response_header(Box::new(resp.clone()), end)
            .await
    }

    async fn write_body(&mut self, data: Bytes, end: bool) -> Result<()> {
        if self.ended {
            return Ok(());
        }
        if !data.is_empty() {
            let n = data.len();
            within(
                self.write_timeout,
                ErrorType::WriteTimedout,
                self.tx.send_data(data),
            )
            .await?
            .map_err(|e| err(ErrorType::WriteError, "writing the HTTP/3 response body", e))?;
            self.body_sent += n;
        }
        if end {
            self.end().await?;
        }
        if self.event_stream {
            self.probe.written(&self.conn);
        }
        Ok(())
    }

    async fn write_trailers(&mut self, trailers: HeaderMap) -> Result<()> {
        if self.ended {
            return Ok(());
        }
        within(
            self.write_timeout,
            ErrorType::WriteTimedout,
            self.tx.send_trailers(trailers),
        )
        .await?
        .map_err(|e| err(ErrorType::WriteError, "writing the HTTP/3 trailers", e))?;
        self.end().await
    }

    async fn response_duplex_vec(&mut self, tasks: Vec<HttpTask>) -> Result<bool> {
        let mut end_stream = false;
        for task in tasks {
            end_stream = match task {
                HttpTask::Header(head, end) => {
                    self.write_response_header(head, false).await?;
                    end
                }
                HttpTask::Body(Some(d), end) => {
                    self.write_body(d, false).await?;
                    end
                }
                HttpTask::Body(None, end) => end,
                HttpTask::UpgradedBody(..) => {
                    return Error::e_explain(
                        ErrorType::InternalError,
                        "upgraded body on an HTTP/3 session",
                    )
                }
                HttpTask::Trailer(Some(t)) => {
                    self.write_trailers(*t).await?;
                    true
                }
                HttpTask::Trailer(None) | HttpTask::Done => true,
                HttpTask::Failed(e) => return Err(e),
            } || end_stream;
        }
        if end_stream {
            self.end().await?;
        }
        Ok(end_stream)
    }

    fn set_read_timeout(&mut self, timeout: Option<Duration>) {
        self.read_timeout = timeout;
    }

    fn get_read_timeout(&self) -> Option<Duration> {
        self.read_timeout
    }

    fn set_write_timeout(&mut self, timeout: Option<Duration>) {
        self.write_timeout = timeout;
    }

    fn get_write_timeout(&self) -> Option<Duration> {
        self.write_timeout
    }

    fn set_total_drain_timeout(&mut self, timeout: Option<Duration>) {
        self.drain_timeout = timeout;
    }

    fn get_total_drain_timeout(&self) -> Option<Duration> {
        self.drain_timeout
    }

    fn request_summary(&self) -> String {
        format!(
            "{} {}, Host: {}",
            self.req.method,
            self.req.uri,
            self.req
                .uri
                .authority()
                .map(|a| a.as_str())
                .unwrap_or_default()
        )
    }

    fn response_written(&self) -> Option<&ResponseHeader> {
        self.response.as_ref()
    }

    async fn shutdown(&mut self, _code: u32, _ctx: &str) {
        if !self.ended {
            // Unfinished: the client must not take it for a whole
            // response.
            self.ended = true;
            self.tx.stop_stream(h3::error::Code::H3_INTERNAL_ERROR);
        }
    }

    fn is_body_done(&mut self) -> bool {
        self.body_done && self.first.is_none()
    }

    async fn finish(&mut self) -> Result<()> {
        self.end().await
    }

    fn is_body_empty(&mut self) -> bool {
        self.body_empty
    }

    async fn read_body_or_idle(&mut self, no_body_expected: bool) -> Result<Option<Bytes>> {
        if no_body_expected || self.is_body_done() {
            // Nothing more will come on the stream: wait for the client to
            // close the connection (a write notices a reset stream).
            let why = self.conn.closed().await;
            return Error::e_explain(
                ErrorType::ReadError,
                format!("client closed HTTP/3 connection: {why}"),
            );
        }
        self.read_body_bytes().await
    }

    fn body_bytes_sent(&self) -> usize {
        self.body_sent
    }

    fn body_bytes_read(&self) -> usize {
        self.body_read
    }

    fn digest(&self) -> Option<&Digest> {
        Some(&self.digest)
    }

    fn digest_mut(&mut self) -> Option<&mut Digest> {
        // Shared by the connection's requests, as Pingora's HTTP/2 does.
        Arc::get_mut(&mut self.digest)
    }

    fn client_addr(&self) -> Option<&SocketAddr> {
        self.digest
            .socket_digest
            .as_ref()?
            .peer_addr
            .get()?
            .as_ref()
    }

    fn server_addr(&self) -> Option<&SocketAddr> {
        self.digest
            .socket_digest
            .as_ref()?
            .local_addr
            .get()?
            .as_ref()
    }

    fn pseudo_raw_h1_request_header(&self) -> Bytes {
        pingora::protocols::http::v1::client::http_req_header_to_wire(&self.req)
            .map(|b| b.freeze())
            .unwrap_or_default()
    }

    fn enable_retry_buffering(&mut self) {
        if self.retry.is_none() {
            self.retry = Some(FixedBuffer::new(RETRY_BUFFER));
        }
    }

    fn retry_buffer_truncated(&self) -> bool {
        self.retry.as_ref().is_some_and(|r| r.is_truncated())
    }

    fn get_retry_buffer(&self) -> Option<Bytes> {
        self.retry.as_ref().and_then(|r| r.get_buffer())
    }

    async fn finish_custom(&mut self) -> Result<()> {
        Ok(())
    }

    fn take_custom_message_reader(
        &mut self,
    ) -> Option<Box<dyn Stream<Item = Result<Bytes>> + Unpin + Send + Sync + 'static>> {
        None
    }

    fn restore_custom_message_reader(
        &mut self,
        _reader: Box<dyn Stream<Item = Result<Bytes>> + Unpin + Send + Sync + 'static>,
    ) -> Result<()> {
        Ok(())
    }

    fn take_custom_message_writer(&mut self) -> Option<Box<dyn CustomMessageWrite>> {
        None
    }

    fn restore_custom_message_writer(
        &mut self,
        _writer: Box<dyn CustomMessageWrite>,
    ) -> Result<()> {
        Ok(())
    }
}
