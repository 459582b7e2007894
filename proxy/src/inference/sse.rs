//! Server-sent events: framing what we send, and an incremental parser for
//! what upstream servers send (any chunking, `\n` or `\r\n` line ends,
//! comments, multi-line data).

use bytes::{Bytes, BytesMut};

/// `data: {json}\n\n`.
pub fn data(payload: &str) -> Bytes {
    let mut b = BytesMut::with_capacity(payload.len() + 8);
    b.extend_from_slice(b"data: ");
    b.extend_from_slice(payload.as_bytes());
    b.extend_from_slice(b"\n\n");
    b.freeze()
}

/// `id: N\ndata: {json}\n\n` (resumable with `Last-Event-ID`).
pub fn data_with_id(id: usize, payload: &str) -> Bytes {
    Bytes::from(format!("id: {id}\ndata: {payload}\n\n"))
}

/// A comment line (heartbeats, trailing timing): ignored by SSE clients.
pub fn comment(text: &str) -> Bytes {
    Bytes::from(format!(": {text}\n\n"))
}

/// The end-of-stream marker of the OpenAI protocol.
pub const DONE: &[u8] = b"data: [DONE]\n\n";

/// Incremental SSE parser: feed bytes, get the `data` of complete events.
#[derive(Debug, Default)]
pub struct Parser {
    buf: BytesMut,
    data: Option<String>,
}

/// Most bytes one event may span before the stream is declared malformed.
const MAX_EVENT: usize = 4 << 20;

impl Parser {
    /// Feed bytes; returns the data of every event completed by them, or an
    /// error for an event that is not text or is too long.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<String>, String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(nl) = memchr::memchr(b'\n', &self.buf) {
            let line = self.buf.split_to(nl + 1);
            let mut line = &line[..nl];
            if line.last() == Some(&b'\r') {
                line = &line[..line.len() - 1];
            }
            if line.is_empty() {
                if let Some(d) = self.data.take() {
                    out.push(d);
                }
                continue;
            }
            if line[0] == b':' {
                continue;
            }
            let (field, value) = match line.iter().position(|&b| b == b':') {
                Some(i) => {
                    let v = &line[i + 1..];
                    (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
                }
                None => (line, &b""[..]),
            };
            if field == b"data" {
                let v =
                    std::str::from_utf8(value).map_err(|_| "SSE data is not UTF-8".to_string())?;
                match &mut self.data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(v);
                    }
                    None => self.data = Some(v.to_string()),
                }
                if self.data.as_ref().is_some_and(|d| d.len() > MAX_EVENT) {
                    return Err("SSE event too long".into());
                }
            }
        }
        if self.buf.len() > MAX_EVENT {
            return Err("SSE line too long".into());
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_across_chunk_boundaries() {
        let text = b"data: {\"a\":1}\r\n\r\n: keepalive\n\ndata: x\ndata: y\n\ndata: [DONE]\n\n";
        for split in 0..text.len() {
            let mut p = Parser::default();
            let mut got = p.feed(&text[..split]).unwrap();
            got.extend(p.feed(&text[split..]).unwrap());
            assert_eq!(got, vec!["{\"a\":1}", "x\ny", "[DONE]"], "split at {split}");
        }
    }

    #[test]
    fn rejects_binary_data() {
        let mut p = Parser::default();
        assert!(p.feed(b"data: \xff\xfe\n\n").is_err());
    }
}
