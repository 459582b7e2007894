//! Entry points for the `cargo fuzz` targets in `proxy/fuzz/` and for the
//! plain regression test that replays their corpora (`tests/fuzz.rs`).
//!
//! Each function takes arbitrary bytes, runs one parser of outside input the
//! way the server runs it, and checks an invariant; a panic is a finding.
//! They call the real code paths (no copies of the logic), so a fix in the
//! parser is a fix here. Not part of the stable API.

use crate::config;
use crate::filters;
use crate::inference::openai::{self, Endpoint};
use crate::inference::sse;
use crate::metrics::Metrics;
use crate::runtime::{self, BuildCtx};
use pingora::protocols::http::v1::server::HttpSession;
use std::collections::HashMap;
use std::path::Path;

/// Most body reads per input: a fuzz input is small, this bounds a loop that
/// a framing bug could make endless.
const MAX_BODY_READS: usize = 256;

/// Request parsing of every dialect: the body of `/v1/chat/completions`,
/// `/v1/completions`, `/v1/messages` and `/v1/responses`. Errors must
/// render as a JSON error body (Anthropic's shape too).
pub fn openai_request(data: &[u8]) {
    let results = [
        openai::parse(Endpoint::Chat, data),
        openai::parse(Endpoint::Completions, data),
        crate::inference::dialect::anthropic::parse(data),
        crate::inference::dialect::responses::parse(data),
    ];
    for r in results {
        if let Err(e) = r {
            let body = openai::error_json(&e);
            let parsed: Result<serde_json::Value, _> = serde_json::from_slice(&body);
            assert!(parsed.is_ok(), "error body is not JSON: {body:?}");
            assert!((400..600).contains(&e.status), "status {}", e.status);
            let a = crate::inference::dialect::anthropic::error_body(e.status, &body);
            let parsed: Result<serde_json::Value, _> = serde_json::from_slice(&a);
            assert!(parsed.is_ok(), "Anthropic error body is not JSON: {a:?}");
        }
    }
}

/// The SSE parser fed an upstream stream. The first byte picks where the
/// rest is cut in two; the events must not depend on the cut (upstreams
/// chunk as they like), and a stream refused whole is refused cut too.
pub fn sse(data: &[u8]) {
    let Some((&cut, stream)) = data.split_first() else {
        return;
    };
    let whole = sse::Parser::default().feed(stream);
    let at = if stream.is_empty() {
        0
    } else {
        usize::from(cut) % (stream.len() + 1)
    };
    let mut p = sse::Parser::default();
    let split = p.feed(&stream[..at]).and_then(|mut first| {
        first.extend(p.feed(&stream[at..])?);
        Ok(first)
    });
    match (whole, split) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "events depend on the cut at {at}"),
        (Err(_), Err(_)) => {}
        (a, b) => panic!("whole {a:?} vs cut at {at} {b:?}"),
    }
}

/// The config loader: TOML text parsed and validated into a runtime config,
/// as `ultrafast check` and a reload do, with no DNS (names stay
/// unresolved, which validation reports) and a fresh metrics registry.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // A path that does not exist, so relative paths in the input (key
    // files, certificates) resolve to nothing.
    let path = Path::new("/nonexistent/ultrafast-fuzz/ultrafast.toml");
    let Ok(f) = config::parse_file(path, text) else {
        return;
    };
    let metrics = Metrics::new();
    let resolved = HashMap::new();
    let ctx = BuildCtx {
        metrics: &metrics,
        resolved: &resolved,
        prev: None,
        prefetch_fraction: 0.0,
    };
    if let Err(errs) = runtime::build(&f, path, text, &ctx) {
        assert!(!errs.is_empty(), "a refused config names no error");
    }
}

/// An HTTP/1 request head (and body) from a client: parsed by Pingora's own
/// HTTP/1 server session, as the listener does, then put through the checks
/// the request filter runs. A request the filter accepts must have one
/// unambiguous body framing.
pub fn http_request(data: &[u8]) {
    thread_local! {
        // One runtime per thread: building one per input would cost more
        // than the parse being fuzzed.
        static RT: Option<tokio::runtime::Runtime> = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .ok();
    }
    RT.with(|rt| {
        if let Some(rt) = rt {
            rt.block_on(parse_and_check(data));
        }
    });
}

/// Parse one request as the listener does and check it (see `http_request`).
async fn parse_and_check(data: &[u8]) {
    let stream = std::io::Cursor::new(data.to_vec());
    let mut session = HttpSession::new(Box::new(stream));
    let Ok(Some(_)) = session.read_request().await else {
        return;
    };
    let req = session.req_header();
    // The config's default limits, as a listener without `[limits]` runs.
    let l = config::file::LimitsSection::default();
    let refusal = filters::check_head(
        req,
        l.max_header_bytes,
        l.max_headers,
        l.client_max_body_bytes,
    );
    let _ = filters::request_id(req, std::time::SystemTime::now());
    let _ = filters::has_body(req);
    if refusal.is_none() {
        let te: Vec<_> = req
            .headers
            .get_all(http::header::TRANSFER_ENCODING)
            .iter()
            .collect();
        let cl = req
            .headers
            .get_all(http::header::CONTENT_LENGTH)
            .iter()
            .count();
        assert!(cl <= 1, "accepted with {cl} Content-Length headers");
        assert!(
            te.is_empty() || (te.len() == 1 && cl == 0),
            "accepted with Transfer-Encoding {te:?} and {cl} Content-Length"
        );
        if let Some(v) = te.first() {
            assert!(
                v.as_bytes().eq_ignore_ascii_case(b"chunked"),
                "accepted Transfer-Encoding {v:?}"
            );
        }
    }
    for _ in 0..MAX_BODY_READS {
        match session.read_body_bytes().await {
            Ok(Some(_)) => continue,
            _ => break,
        }
    }
}

/// The path normalizer (`crate::uri`) and the Host check on any text: what
/// it returns starts with `/`, holds no dot segment, no run of slashes
/// (merged), no NUL and no `%2F` decoded into a separator; it is never
/// longer than the input plus one `/`; and normalizing it again (when
/// nothing in it could be decoded again) changes nothing.
pub fn uri_path(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = crate::uri::valid_host(text);
    let path = format!("/{text}");
    for merge in [true, false] {
        let Ok(out) = crate::uri::normalize(&path, merge) else {
            continue;
        };
        assert!(out.starts_with('/'), "{path:?} -> {out:?}");
        assert!(out.len() <= path.len() + 1, "{path:?} -> {out:?}");
        assert!(!out.contains('\0'), "{path:?} -> {out:?}");
        let segs: Vec<&str> = out[1..].split('/').collect();
        assert!(
            segs.iter().all(|s| *s != "." && *s != ".."),
            "dot segment left: {path:?} -> {out:?}"
        );
        if merge {
            assert!(!out.contains("//"), "{path:?} -> {out:?}");
        }
        if !out.contains('%') {
            let again = crate::uri::normalize(&out, merge);
            assert_eq!(again.as_deref(), Ok(&*out), "not idempotent: {path:?}");
        }
    }
}
