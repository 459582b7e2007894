//! Response compression per route (nginx's `gzip`, plus brotli and zstd):
//! `compress = { gzip = 6, br = 5, zstd = 3, min_bytes = 256, types = [...] }`.
//!
//! The encoders are Pingora's (`protocols::http::compression`); the
//! negotiation is ours, because Pingora's module takes the first coding a
//! client lists and ignores q-values, and its list of compressible types
//! is fixed. A coding is chosen by the client's q-values (`*` included,
//! `q=0` refusing), ties going to the better ratio (br, then zstd, then
//! gzip). A response is compressed only when it is eligible: a type in
//! `types` (never `text/event-stream`, whose events must reach the client
//! as they come), no `Content-Encoding` already, no range, no
//! `Cache-Control: no-transform`, and a `Content-Length` (when it has one)
//! of at least `min_bytes`. An eligible response gets `Vary:
//! Accept-Encoding` whether or not this client's request picked a coding,
//! so a cache keeps the variants apart; its strong `ETag` is weakened, as
//! nginx does, since the bytes are no longer the origin's.

use bytes::Bytes;
use http::header::{
    HeaderValue, ACCEPT_RANGES, CACHE_CONTROL, CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_RANGE,
    CONTENT_TYPE, ETAG, TRANSFER_ENCODING, VARY,
};
use pingora::http::ResponseHeader;
use pingora::protocols::http::compression::{Algorithm, Encode};

/// A route's `compress` settings.
#[derive(Debug, Clone, PartialEq)]
pub struct CompressSpec {
    /// gzip level (1-9; 0 = not offered).
    pub gzip: u32,
    /// brotli quality (1-11; 0 = not offered).
    pub br: u32,
    /// zstd level (1-19; 0 = not offered).
    pub zstd: u32,
    /// Smallest `Content-Length` compressed.
    pub min_bytes: u64,
    /// Media types compressed: exact (`application/json`) or `type/*`.
    pub types: Vec<String>,
}

pub use crate::config::file::DEFAULT_TYPES;

/// Codings in order of preference when the client weighs them alike.
const PREFERENCE: [Algorithm; 3] = [Algorithm::Brotli, Algorithm::Zstd, Algorithm::Gzip];

impl CompressSpec {
    fn level(&self, a: Algorithm) -> u32 {
        match a {
            Algorithm::Gzip => self.gzip,
            Algorithm::Brotli => self.br,
            Algorithm::Zstd => self.zstd,
            _ => 0,
        }
    }

    /// The coding to use for a client that sent `accept` (its
    /// `Accept-Encoding`), with its level; `None`: send it as it is.
    pub fn choose(&self, accept: Option<&HeaderValue>) -> Option<(Algorithm, u32)> {
        let accept = accept?.to_str().ok()?;
        let weights = parse_accept(accept);
        let weight = |a: Algorithm| -> f32 {
            let name = a.as_str();
            weights
                .iter()
                .find(|(c, _)| c == name || (a == Algorithm::Gzip && c == "x-gzip"))
                .or_else(|| weights.iter().find(|(c, _)| c == "*"))
                .map_or(0.0, |(_, q)| *q)
        };
        let mut best: Option<(Algorithm, f32)> = None;
        for a in PREFERENCE {
            let q = weight(a);
            if self.level(a) == 0 || q <= 0.0 {
                continue;
            }
            if best.is_none_or(|(_, bq)| q > bq) {
                best = Some((a, q));
            }
        }
        best.map(|(a, _)| (a, self.level(a)))
    }

    /// Whether `resp` may be compressed at all (see the module's doc).
    pub fn eligible(&self, resp: &ResponseHeader) -> bool {
        let status = resp.status.as_u16();
        if status < 200 || matches!(status, 204 | 206 | 304) {
            return false;
        }
        let h = &resp.headers;
        let encoded = h
            .get(CONTENT_ENCODING)
            .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
        let no_transform = h
            .get_all(CACHE_CONTROL)
            .iter()
            .any(|v| crate::filters::has_token(v.as_bytes(), b"no-transform"));
        if encoded || no_transform || h.contains_key(CONTENT_RANGE) {
            return false;
        }
        let small = h
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .is_some_and(|n| n < self.min_bytes);
        if small {
            return false;
        }
        let Some(ct) = h.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
            return false;
        };
        let media = ct
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        if media == "text/event-stream" {
            return false;
        }
        self.types.iter().any(|t| match t.strip_suffix("/*") {
            Some(major) => media.split('/').next() == Some(major),
            None => *t == media,
        })
    }
}

/// `Accept-Encoding` as (coding, q) pairs, codings lowercased; q-values
/// that do not parse count as 1 (RFC 9110 12.4.2 allows 0 to 1).
fn parse_accept(value: &str) -> Vec<(String, f32)> {
    value
        .split(',')
        .filter_map(|item| {
            let mut parts = item.split(';');
            let coding = parts.next()?.trim().to_ascii_lowercase();
            if coding.is_empty() {
                return None;
            }
            let q = parts
                .filter_map(|p| p.trim().strip_prefix("q=").or(p.trim().strip_prefix("Q=")))
                .find_map(|q| q.trim().parse::<f32>().ok())
                .map_or(1.0, |q| q.clamp(0.0, 1.0));
            Some((coding, q))
        })
        .collect()
}

/// Add `Vary: Accept-Encoding` unless the response varies on it already.
pub fn add_vary(resp: &mut ResponseHeader) {
    let has = resp.headers.get_all(VARY).iter().any(|v| {
        crate::filters::has_token(v.as_bytes(), b"accept-encoding")
            || crate::filters::has_token(v.as_bytes(), b"*")
    });
    if !has {
        let _ = resp.append_header(VARY, "Accept-Encoding");
    }
}

/// Rewrite `resp`'s head for a body compressed with `a` as it streams:
/// no length, no ranges, a weak `ETag`; `chunked` where the client speaks
/// HTTP/1.
pub fn set_encoded(resp: &mut ResponseHeader, a: Algorithm, http1: bool) {
    resp.remove_header(&CONTENT_LENGTH);
    resp.remove_header(&ACCEPT_RANGES);
    if http1 {
        let _ = resp.insert_header(TRANSFER_ENCODING, "chunked");
    }
    let _ = resp.insert_header(CONTENT_ENCODING, a.as_str());
    if let Some(etag) = resp.headers.get(ETAG).map(|v| v.as_bytes().to_vec()) {
        if etag.starts_with(b"\"") {
            let weak = [b"W/".as_slice(), &etag].concat();
            if let Ok(v) = HeaderValue::from_bytes(&weak) {
                let _ = resp.insert_header(ETAG, v);
            }
        } else if !etag.starts_with(b"W/") {
            resp.remove_header(&ETAG);
        }
    }
}

/// A response body being compressed.
pub enum Encoder {
    /// Pingora's gzip or zstd encoder (each finishes its stream at the end).
    Pingora(Box<dyn Encode + Send + Sync>),
    /// brotli through the crate itself: Pingora's encoder only flushes at
    /// the end and never writes the stream's last block, so a strict
    /// decoder (curl's) stops with an error. `None` once finished.
    Brotli(Option<Box<brotli::CompressorWriter<Vec<u8>>>>),
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Encoder::Pingora(_) => "Encoder(pingora)",
            Encoder::Brotli(_) => "Encoder(brotli)",
        })
    }
}

impl Encoder {
    /// An encoder for `a` at `level`.
    pub fn new(a: Algorithm, level: u32) -> Option<Encoder> {
        if a == Algorithm::Brotli {
            // lgwin 22 is brotli's default window, as nginx's module uses.
            let w = brotli::CompressorWriter::new(Vec::new(), 4096, level.min(11), 22);
            return Some(Encoder::Brotli(Some(Box::new(w))));
        }
        a.compressor(level).map(Encoder::Pingora)
    }

    /// Compress one body chunk (`None`: the body ended with the last one);
    /// what to send in its place.
    pub fn encode(&mut self, chunk: Option<&Bytes>, end: bool) -> pingora::Result<Bytes> {
        use pingora::{Error, ErrorType};
        use std::io::Write;
        let input = chunk.map_or(&[][..], |b| &b[..]);
        match self {
            Encoder::Pingora(e) => e.encode(input, end),
            Encoder::Brotli(slot) => {
                let Some(w) = slot.as_mut() else {
                    return Ok(Bytes::new());
                };
                if let Err(e) = w.write_all(input) {
                    return Error::e_explain(ErrorType::InternalError, format!("brotli: {e}"));
                }
                if end {
                    let out = slot.take().map(|w| w.into_inner()).unwrap_or_default();
                    return Ok(out.into());
                }
                Ok(std::mem::take(w.get_mut()).into())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> CompressSpec {
        CompressSpec {
            gzip: 6,
            br: 5,
            zstd: 3,
            min_bytes: 256,
            types: DEFAULT_TYPES.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn pick(s: &CompressSpec, ae: &str) -> Option<&'static str> {
        s.choose(Some(&HeaderValue::from_str(ae).unwrap()))
            .map(|(a, _)| a.as_str())
    }

    #[test]
    fn the_coding_follows_the_clients_q_values_then_our_preference() {
        let s = spec();
        assert_eq!(pick(&s, "gzip"), Some("gzip"));
        assert_eq!(pick(&s, "gzip, deflate, br, zstd"), Some("br"));
        assert_eq!(pick(&s, "br;q=0.5, gzip"), Some("gzip"));
        assert_eq!(pick(&s, "zstd;q=1.0, br;q=0.9"), Some("zstd"));
        assert_eq!(pick(&s, "*"), Some("br"));
        assert_eq!(pick(&s, "*, br;q=0"), Some("zstd"));
        assert_eq!(pick(&s, "gzip;q=0"), None);
        assert_eq!(pick(&s, "identity"), None);
        assert_eq!(pick(&s, "x-gzip"), Some("gzip"));
        assert_eq!(pick(&s, "GZIP ; Q=0.8"), Some("gzip"));
        let only_gzip = CompressSpec {
            br: 0,
            zstd: 0,
            ..spec()
        };
        assert_eq!(pick(&only_gzip, "br, zstd, gzip;q=0.1"), Some("gzip"));
        assert_eq!(pick(&only_gzip, "br"), None);
        assert_eq!(s.choose(None), None, "no Accept-Encoding: as it is");
    }

    fn resp(status: u16, headers: &[(&str, &str)]) -> ResponseHeader {
        let mut r = ResponseHeader::build(status, None).unwrap();
        for (k, v) in headers {
            r.append_header(k.to_string(), *v).unwrap();
        }
        r
    }

    #[test]
    fn only_eligible_responses_are_compressed() {
        let s = spec();
        let json = ("content-type", "application/json; charset=utf-8");
        assert!(s.eligible(&resp(200, &[json, ("content-length", "5000")])));
        assert!(s.eligible(&resp(200, &[("content-type", "text/plain")])));
        assert!(s.eligible(&resp(404, &[("content-type", "text/html")])));
        assert!(!s.eligible(&resp(200, &[json, ("content-length", "100")])));
        assert!(!s.eligible(&resp(200, &[("content-type", "text/event-stream")])));
        assert!(!s.eligible(&resp(200, &[("content-type", "image/png")])));
        assert!(!s.eligible(&resp(200, &[])));
        assert!(!s.eligible(&resp(200, &[json, ("content-encoding", "gzip")])));
        assert!(!s.eligible(&resp(206, &[json, ("content-range", "bytes 0-9/99")])));
        assert!(!s.eligible(&resp(304, &[json])));
        assert!(!s.eligible(&resp(
            200,
            &[json, ("cache-control", "public, no-transform")]
        )));
    }

    #[test]
    fn an_encoded_head_has_no_length_a_weak_etag_and_one_vary() {
        let mut r = resp(
            200,
            &[
                ("content-length", "9"),
                ("etag", "\"abc\""),
                ("accept-ranges", "bytes"),
                ("vary", "Origin"),
            ],
        );
        add_vary(&mut r);
        add_vary(&mut r);
        set_encoded(&mut r, Algorithm::Gzip, true);
        assert!(r.headers.get("content-length").is_none());
        assert!(r.headers.get("accept-ranges").is_none());
        assert_eq!(r.headers.get("etag").unwrap(), "W/\"abc\"");
        assert_eq!(r.headers.get("content-encoding").unwrap(), "gzip");
        assert_eq!(r.headers.get_all("vary").iter().count(), 2);
    }
}
