//! Editing the heads Pingora parsed, in `http`'s own types. Pingora's
//! `RequestHeader` keeps a second map of each name's case and sizes both
//! maps to the headers parsed, so each header the edge adds grows two maps
//! and parses its name again: about 3,000 instructions per added header
//! (benches/RESULTS.md section 13). Here the head's `http` parts are moved
//! out, grown once, edited with constant names, and moved back without the
//! case map: header names then go out lowercase, as HTTP/2 requires and as
//! Envoy and HAProxy send them on HTTP/1.1 too (names are case-insensitive,
//! RFC 9110 5.1). A request target the URI does not reproduce byte for
//! byte (absolute-form, non-UTF-8) keeps Pingora's head and its methods.
//! Responses go the same way through the response policy.

use crate::routing::HeaderOps;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::Result;

/// The edits the edge makes to a head, on either representation.
pub(crate) trait HeadEdit {
    /// The first value of `name`.
    fn get(&self, name: &HeaderName) -> Option<&HeaderValue>;
    /// Replace every value of `name`.
    fn set(&mut self, name: &HeaderName, value: HeaderValue) -> Result<()>;
    /// Add a value of `name`.
    fn add(&mut self, name: &HeaderName, value: HeaderValue) -> Result<()>;
    /// Remove every value of `name`.
    fn remove(&mut self, name: &HeaderName);
}

impl HeadEdit for HeaderMap {
    fn get(&self, name: &HeaderName) -> Option<&HeaderValue> {
        HeaderMap::get(self, name)
    }
    fn set(&mut self, name: &HeaderName, value: HeaderValue) -> Result<()> {
        self.insert(name.clone(), value);
        Ok(())
    }
    fn add(&mut self, name: &HeaderName, value: HeaderValue) -> Result<()> {
        self.append(name.clone(), value);
        Ok(())
    }
    fn remove(&mut self, name: &HeaderName) {
        HeaderMap::remove(self, name);
    }
}

impl HeadEdit for RequestHeader {
    fn get(&self, name: &HeaderName) -> Option<&HeaderValue> {
        self.headers.get(name)
    }
    fn set(&mut self, name: &HeaderName, value: HeaderValue) -> Result<()> {
        self.insert_header(name.clone(), value)
    }
    fn add(&mut self, name: &HeaderName, value: HeaderValue) -> Result<()> {
        self.append_header(name.clone(), value).map(|_| ())
    }
    fn remove(&mut self, name: &HeaderName) {
        self.remove_header(name);
    }
}

/// Apply header rules to a head: remove, then set, then add.
pub(crate) fn apply_ops(ops: &HeaderOps, req: &mut dyn HeadEdit) -> Result<()> {
    for n in &ops.remove {
        req.remove(n);
    }
    for (n, v) in &ops.set {
        req.set(n, v.clone())?;
    }
    for (n, v) in &ops.add {
        req.add(n, v.clone())?;
    }
    Ok(())
}

/// Runs `f` on `req`'s headers with room for `extra` more, as plain `http`
/// parts where the URI reproduces the request target (see the module's
/// comment), else on Pingora's head.
pub(crate) fn edit_request(
    req: &mut RequestHeader,
    extra: usize,
    f: impl FnOnce(&mut dyn HeadEdit) -> Result<()>,
) -> Result<()> {
    let from_uri = req.uri.path_and_query().map(|p| p.as_str().as_bytes()) == Some(req.raw_path());
    if !from_uri {
        return f(req);
    }
    let end_stream = req.send_end_stream();
    let empty = RequestHeader::from(http::Request::new(()).into_parts().0);
    let mut parts = http::request::Parts::from(std::mem::replace(req, empty));
    parts.headers.reserve(extra);
    let result = f(&mut parts.headers);
    *req = RequestHeader::from(parts);
    if let Some(end) = end_stream {
        req.set_send_end_stream(end);
    }
    result
}

/// Runs `f` on `resp`'s headers with room for `extra` more, as plain
/// `http` parts (names go out lowercase; a custom reason phrase is kept).
pub(crate) fn edit_response(
    resp: &mut ResponseHeader,
    extra: usize,
    f: impl FnOnce(&mut dyn HeadEdit) -> Result<()>,
) -> Result<()> {
    let reason = resp
        .get_reason_phrase()
        .filter(|r| Some(*r) != resp.status.canonical_reason())
        .map(str::to_owned);
    let empty = ResponseHeader::from(http::Response::new(()).into_parts().0);
    let mut parts = http::response::Parts::from(std::mem::replace(resp, empty));
    parts.headers.reserve(extra);
    let result = f(&mut parts.headers);
    *resp = ResponseHeader::from(parts);
    if reason.is_some() {
        resp.set_reason_phrase(reason.as_deref())?;
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire(req: &RequestHeader) -> String {
        let mut buf = bytes::BytesMut::new();
        req.header_to_h1_wire(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    }

    #[test]
    fn origin_form_heads_are_edited_as_parts_and_keep_their_target() {
        let mut req = RequestHeader::build("GET", b"/a/b?c=1", None).unwrap();
        req.append_header("X-Mixed-Case", "1").unwrap();
        let xff = HeaderName::from_static("x-forwarded-for");
        edit_request(&mut req, 2, |h| {
            assert!(h.get(&HeaderName::from_static("x-mixed-case")).is_some());
            h.set(&xff, HeaderValue::from_static("10.0.0.1"))?;
            h.add(&xff, HeaderValue::from_static("10.0.0.2"))
        })
        .unwrap();
        assert_eq!(req.raw_path(), b"/a/b?c=1");
        assert_eq!(req.method, http::Method::GET);
        let w = wire(&req);
        assert!(w.contains("x-mixed-case: 1\r\n"), "{w}");
        assert!(w.contains("x-forwarded-for: 10.0.0.1\r\n"), "{w}");
        assert_eq!(req.headers.get_all(&xff).iter().count(), 2);
    }

    #[test]
    fn responses_are_edited_as_parts_and_keep_a_custom_reason() {
        let mut resp = ResponseHeader::build(299, None).unwrap();
        resp.set_reason_phrase(Some("Fine Indeed")).unwrap();
        resp.append_header("X-Up", "1").unwrap();
        let rid = HeaderName::from_static("x-request-id");
        edit_response(&mut resp, 1, |h| h.set(&rid, HeaderValue::from_static("r"))).unwrap();
        assert_eq!(resp.status.as_u16(), 299);
        assert_eq!(resp.get_reason_phrase(), Some("Fine Indeed"));
        assert_eq!(resp.headers.get("x-up").unwrap(), "1");
        assert_eq!(resp.headers.get(&rid).unwrap(), "r");
        let mut ok = ResponseHeader::build(200, None).unwrap();
        edit_response(&mut ok, 0, |_| Ok(())).unwrap();
        assert_eq!(ok.get_reason_phrase(), Some("OK"));
    }

    #[test]
    fn targets_the_uri_does_not_reproduce_keep_pingoras_head() {
        let mut req = RequestHeader::build("GET", b"http://example.com/x", None).unwrap();
        req.append_header("X-Mixed-Case", "1").unwrap();
        let name = HeaderName::from_static("x-request-id");
        edit_request(&mut req, 1, |h| {
            h.set(&name, HeaderValue::from_static("r1"))
        })
        .unwrap();
        assert_eq!(req.raw_path(), b"http://example.com/x");
        let w = wire(&req);
        assert!(w.contains("X-Mixed-Case: 1\r\n"), "case kept: {w}");
        assert!(w.contains("x-request-id: r1\r\n"), "{w}");
    }
}
