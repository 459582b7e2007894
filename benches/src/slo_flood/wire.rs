//! Incremental HTTP/1.1 response reading for `slo-flood`.
//!
//! Bytes enter through [`Response::feed`] exactly as they come off the
//! socket, split anywhere; the parser keeps only what it has not decoded
//! yet. Out come the response head (once), the SSE `data:` payloads of a
//! `text/event-stream` body, or the whole body of any other response
//! (capped, for error JSON). Framing is chunked, `content-length`, or
//! read-to-close; a `1xx` head is skipped. The design choice: one
//! forward-only state machine over a single pending buffer, compacted once
//! per `feed`, so a stream of a few hundred small chunks costs no
//! reallocation per chunk and no copying of decoded data except into the
//! SSE line buffer.

use std::fmt;

/// Largest response head accepted.
const MAX_HEAD: usize = 64 * 1024;
/// Largest non-SSE body kept (the rest is counted, not stored).
const MAX_BODY: usize = 1024 * 1024;
/// Longest SSE line or chunk-size line accepted.
const MAX_LINE: usize = 1024 * 1024;

/// A malformed or truncated response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireError(pub String);

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn err<T>(msg: impl Into<String>) -> Result<T, WireError> {
    Err(WireError(msg.into()))
}

/// The status line and headers of a response (names lower-cased).
#[derive(Debug, Clone, Default)]
pub struct Head {
    /// HTTP status code.
    pub status: u16,
    /// Headers in arrival order, names lower-cased, values trimmed.
    pub headers: Vec<(String, String)>,
}

impl Head {
    /// The first value of a header (name in lower case).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    Size,
    Data(u64),
    DataEnd,
    Trailer,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Chunked(Chunk),
    Length(u64),
    Close,
}

/// Server-sent events: lines in, `data` payloads out.
#[derive(Debug, Default)]
struct Sse {
    line: Vec<u8>,
    data: Vec<u8>,
    has_data: bool,
}

impl Sse {
    fn push(&mut self, mut bytes: &[u8], out: &mut Vec<String>) -> Result<(), WireError> {
        while let Some(nl) = bytes.iter().position(|&b| b == b'\n') {
            self.line.extend_from_slice(&bytes[..nl]);
            bytes = &bytes[nl + 1..];
            self.end_line(out);
        }
        self.line.extend_from_slice(bytes);
        if self.line.len() > MAX_LINE {
            return err("SSE line too long");
        }
        Ok(())
    }

    fn end_line(&mut self, out: &mut Vec<String>) {
        let mut line = std::mem::take(&mut self.line);
        if line.last() == Some(&b'\r') {
            line.pop();
        }
        if line.is_empty() {
            if self.has_data {
                out.push(String::from_utf8_lossy(&self.data).into_owned());
            }
            self.data.clear();
            self.has_data = false;
        } else if let Some(v) = line.strip_prefix(b"data:") {
            if self.has_data {
                self.data.push(b'\n');
            }
            self.data
                .extend_from_slice(v.strip_prefix(b" ").unwrap_or(v));
            self.has_data = true;
        }
        // Comments (`:`) and other fields (event, id, retry) carry nothing we time.
        line.clear();
        self.line = line;
    }
}

/// One HTTP/1.1 response being read.
#[derive(Debug)]
pub struct Response {
    pending: Vec<u8>,
    head: Option<Head>,
    framing: Framing,
    sse: Option<Sse>,
    body: Vec<u8>,
    body_len: u64,
    done: bool,
}

impl Default for Response {
    fn default() -> Self {
        Self::new()
    }
}

impl Response {
    /// A response not started yet.
    pub fn new() -> Self {
        Self {
            pending: Vec::with_capacity(4096),
            head: None,
            framing: Framing::Close,
            sse: None,
            body: Vec::new(),
            body_len: 0,
            done: false,
        }
    }

    /// The head, once it has arrived.
    pub fn head(&self) -> Option<&Head> {
        self.head.as_ref()
    }

    /// The body is complete (by its framing).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The stored body of a non-SSE response (at most 1 MiB).
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    /// Decode more bytes; SSE data payloads completed by them are appended
    /// to `events`.
    pub fn feed(&mut self, data: &[u8], events: &mut Vec<String>) -> Result<(), WireError> {
        if self.done {
            return Ok(());
        }
        if self.head.is_none() {
            self.pending.extend_from_slice(data);
            if !self.parse_head()? {
                return Ok(());
            }
            let rest = std::mem::take(&mut self.pending);
            return self.body_bytes(&rest, events);
        }
        self.body_bytes(data, events)
    }

    /// The connection closed: fine for read-to-close bodies, else truncated.
    pub fn eof(&mut self, events: &mut Vec<String>) -> Result<(), WireError> {
        if self.done {
            return Ok(());
        }
        if self.head.is_none() {
            return err("connection closed before the response head");
        }
        if self.framing == Framing::Close {
            if let Some(sse) = self.sse.as_mut() {
                sse.push(b"\n\n", events)?;
            }
            self.done = true;
            return Ok(());
        }
        err("connection closed inside the body")
    }

    /// Parse the head from `pending`; true when it is complete. The bytes
    /// after it stay in `pending`.
    fn parse_head(&mut self) -> Result<bool, WireError> {
        loop {
            let Some(end) = find(&self.pending, b"\r\n\r\n") else {
                if self.pending.len() > MAX_HEAD {
                    return err("response head too large");
                }
                return Ok(false);
            };
            let text = String::from_utf8_lossy(&self.pending[..end]).into_owned();
            self.pending.drain(..end + 4);
            let mut lines = text.split("\r\n");
            let status_line = lines.next().unwrap_or_default();
            let mut parts = status_line.splitn(3, ' ');
            let version = parts.next().unwrap_or_default();
            if !version.starts_with("HTTP/1.") {
                return err(format!("not an HTTP/1.x status line: {status_line:?}"));
            }
            let status: u16 = match parts.next().and_then(|s| s.parse().ok()) {
                Some(s) => s,
                None => return err(format!("bad status line: {status_line:?}")),
            };
            if (100..200).contains(&status) {
                continue; // 100 Continue and friends: the real head follows.
            }
            let headers: Vec<(String, String)> = lines
                .filter_map(|l| l.split_once(':'))
                .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
                .collect();
            let head = Head { status, headers };
            self.framing = if status == 204 || status == 304 {
                Framing::Length(0)
            } else if head
                .get("transfer-encoding")
                .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"))
            {
                Framing::Chunked(Chunk::Size)
            } else if let Some(v) = head.get("content-length") {
                match v.parse() {
                    Ok(n) => Framing::Length(n),
                    Err(_) => return err(format!("bad content-length {v:?}")),
                }
            } else {
                Framing::Close
            };
            if head
                .get("content-type")
                .is_some_and(|v| v.starts_with("text/event-stream"))
            {
                self.sse = Some(Sse::default());
            }
            if self.framing == Framing::Length(0) {
                self.done = true;
            }
            self.head = Some(head);
            return Ok(true);
        }
    }

    /// Body bytes as they arrive on the wire (chunk framing still on).
    fn body_bytes(&mut self, data: &[u8], events: &mut Vec<String>) -> Result<(), WireError> {
        match self.framing {
            Framing::Close => self.decoded(data, events),
            Framing::Length(left) => {
                let take = (left as usize).min(data.len());
                self.framing = Framing::Length(left - take as u64);
                self.decoded(&data[..take], events)?;
                if left == take as u64 {
                    self.done = true;
                }
                Ok(())
            }
            Framing::Chunked(_) => {
                self.pending.extend_from_slice(data);
                let mut pending = std::mem::take(&mut self.pending);
                let r = self.dechunk(&mut pending, events);
                self.pending = pending;
                r
            }
        }
    }

    /// Decode as much chunked framing from `buf` as is complete; what is
    /// left (a partial size line) stays in `buf`.
    fn dechunk(&mut self, buf: &mut Vec<u8>, events: &mut Vec<String>) -> Result<(), WireError> {
        let mut at = 0;
        while !self.done {
            let Framing::Chunked(state) = self.framing else {
                break;
            };
            let rest = &buf[at..];
            match state {
                Chunk::Size | Chunk::Trailer => {
                    let Some(nl) = find(rest, b"\r\n") else {
                        if rest.len() > MAX_LINE {
                            return err("chunk size line too long");
                        }
                        break;
                    };
                    let line = &rest[..nl];
                    at += nl + 2;
                    if state == Chunk::Trailer {
                        if line.is_empty() {
                            self.done = true;
                        }
                        continue;
                    }
                    let hex = line.split(|&b| b == b';').next().unwrap_or_default();
                    let text = String::from_utf8_lossy(hex);
                    let size = match u64::from_str_radix(text.trim(), 16) {
                        Ok(n) => n,
                        Err(_) => return err(format!("bad chunk size {text:?}")),
                    };
                    self.framing = Framing::Chunked(if size == 0 {
                        Chunk::Trailer
                    } else {
                        Chunk::Data(size)
                    });
                }
                Chunk::Data(left) => {
                    if rest.is_empty() {
                        break;
                    }
                    let take = (left as usize).min(rest.len());
                    self.framing = Framing::Chunked(if take as u64 == left {
                        Chunk::DataEnd
                    } else {
                        Chunk::Data(left - take as u64)
                    });
                    self.decoded(&rest[..take], events)?;
                    at += take;
                }
                Chunk::DataEnd => {
                    if rest.len() < 2 {
                        break;
                    }
                    if &rest[..2] != b"\r\n" {
                        return err("chunk data not followed by CRLF");
                    }
                    at += 2;
                    self.framing = Framing::Chunked(Chunk::Size);
                }
            }
        }
        buf.drain(..at.min(buf.len()));
        Ok(())
    }

    /// Decoded body bytes: into the SSE parser or the stored body.
    fn decoded(&mut self, data: &[u8], events: &mut Vec<String>) -> Result<(), WireError> {
        self.body_len += data.len() as u64;
        match self.sse.as_mut() {
            Some(sse) => sse.push(data, events),
            None => {
                let room = MAX_BODY.saturating_sub(self.body.len());
                self.body.extend_from_slice(&data[..room.min(data.len())]);
                Ok(())
            }
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunked(payloads: &[&str]) -> Vec<u8> {
        let mut w = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\nx-ultrafast-lane: ultra\r\n\r\n".to_vec();
        for p in payloads {
            w.extend_from_slice(format!("{:x};ext=1\r\n{p}\r\n", p.len()).as_bytes());
        }
        w.extend_from_slice(b"0\r\nx-trailer: 1\r\n\r\n");
        w
    }

    /// Feed `wire` split at every position into two pieces and at every byte.
    fn all_splits(wire: &[u8]) -> Vec<Vec<String>> {
        let mut outs = Vec::new();
        for cut in 0..=wire.len() {
            let mut r = Response::new();
            let mut ev = Vec::new();
            r.feed(&wire[..cut], &mut ev).unwrap();
            r.feed(&wire[cut..], &mut ev).unwrap();
            assert!(r.is_done(), "done after cut {cut}");
            outs.push(ev);
        }
        let mut r = Response::new();
        let mut ev = Vec::new();
        for b in wire {
            r.feed(std::slice::from_ref(b), &mut ev).unwrap();
        }
        assert!(r.is_done());
        outs.push(ev);
        outs
    }

    #[test]
    fn chunked_sse_any_split() {
        // Events split across chunks, a comment, CRLF line ends, two data lines.
        let wire = chunked(&[
            "data: {\"a\":1}\n\n: heartbeat\n\nda",
            "ta: {\"b\":2}\r\n\r\n",
            "data: x\ndata: y\n\ndata: [DONE]\n\n",
        ]);
        for ev in all_splits(&wire) {
            assert_eq!(ev, vec!["{\"a\":1}", "{\"b\":2}", "x\ny", "[DONE]"]);
        }
        let mut r = Response::new();
        r.feed(&wire, &mut Vec::new()).unwrap();
        let h = r.head().unwrap();
        assert_eq!(h.status, 200);
        assert_eq!(h.get("x-ultrafast-lane"), Some("ultra"));
    }

    #[test]
    fn content_length_json_and_interim_head() {
        let body = r#"{"error":{"code":"slo"},"retry_after_ms":120}"#;
        let wire = format!(
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 503 Service Unavailable\r\nContent-Length: {}\r\nRetry-After: 1\r\nx-ultrafast-shed: slo\r\n\r\n{body}",
            body.len()
        );
        for ev in all_splits(wire.as_bytes()) {
            assert!(ev.is_empty());
        }
        let mut r = Response::new();
        r.feed(wire.as_bytes(), &mut Vec::new()).unwrap();
        assert_eq!(r.head().unwrap().status, 503);
        assert_eq!(r.head().unwrap().get("x-ultrafast-shed"), Some("slo"));
        assert_eq!(r.body(), body.as_bytes());
    }

    #[test]
    fn read_to_close_and_truncation() {
        let mut r = Response::new();
        let mut ev = Vec::new();
        r.feed(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: 1\n\ndata: 2",
            &mut ev,
        )
        .unwrap();
        assert!(!r.is_done());
        r.eof(&mut ev).unwrap();
        assert_eq!(ev, vec!["1", "2"]);

        let w = chunked(&["data: 1\n\n"]);
        let mut r = Response::new();
        r.feed(&w[..w.len() - 3], &mut Vec::new()).unwrap();
        assert!(r.eof(&mut Vec::new()).is_err());
        assert!(Response::new().eof(&mut Vec::new()).is_err());
    }

    #[test]
    fn malformed() {
        let mut r = Response::new();
        assert!(r.feed(b"SSH-2.0-x\r\n\r\n", &mut Vec::new()).is_err());
        let mut r = Response::new();
        assert!(r
            .feed(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
                &mut Vec::new()
            )
            .is_err());
        let mut r = Response::new();
        assert!(r
            .feed(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\nabc",
                &mut Vec::new()
            )
            .is_err());
    }
}
