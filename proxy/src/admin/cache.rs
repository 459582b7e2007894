//! `POST /admin/cache/purge` and `GET /admin/cache`: purge what a route's
//! cache holds, and see what each zone holds.

use super::reply;
use crate::cache::{self, Purge};
use http::Response;
use pingora::protocols::http::ServerSession;

/// Purge requests are small JSON objects.
const MAX_BODY: usize = 64 * 1024;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PurgeRequest {
    /// `scheme://host[:port]/path?query`, as a client asked for it.
    url: Option<String>,
    /// One route's zone; default: every zone.
    zone: Option<String>,
    /// Everything in the zone(s).
    #[serde(default)]
    all: bool,
}

fn error(status: u16, msg: &str) -> Response<Vec<u8>> {
    let body = serde_json::json!({"error": msg});
    reply(status, "application/json", body.to_string().into_bytes())
}

async fn read_body(session: &mut ServerSession) -> Result<Vec<u8>, &'static str> {
    let mut body = Vec::new();
    loop {
        match session.read_request_body().await {
            Ok(Some(b)) => {
                body.extend_from_slice(&b);
                if body.len() > MAX_BODY {
                    return Err("body over 64 KiB");
                }
            }
            Ok(None) => return Ok(body),
            Err(_) => return Err("could not read the body"),
        }
    }
}

/// The key a URL is cached under, as the proxy builds it: its host
/// without a trailing dot, and the path the origin would be asked for:
/// its normal form (`uri::normalize_target`) where normalizing changes it,
/// or the URL's own where the matching route sends the original target.
fn url_key(url: &str, cfg: &crate::runtime::Snapshot) -> Result<String, String> {
    use std::borrow::Cow;
    let uri: http::Uri = url
        .parse()
        .map_err(|e| format!("`url` is not a URL: {e}"))?;
    let (Some(scheme), Some(auth)) = (uri.scheme_str(), uri.authority()) else {
        return Err("`url` needs a scheme and a host (http://host/path)".into());
    };
    let host = crate::uri::host_without_dot(auth.as_str()).to_ascii_lowercase();
    let path = crate::uri::normalize(uri.path(), cfg.file.server.merge_slashes)
        .map_err(|e| format!("`url`: {}", e.reason()))?;
    let original = cfg
        .router
        .find(&host, &path)
        .is_some_and(|r| r.upstream_path == crate::routing::UpstreamPath::Original);
    let asked = match &path {
        Cow::Owned(_) if !original => Cow::Owned(
            crate::uri::normalize_target(uri.path(), cfg.file.server.merge_slashes)
                .map_err(|e| format!("`url`: {}", e.reason()))?,
        ),
        _ => Cow::Borrowed(uri.path()),
    };
    Ok(cache::primary(
        &scheme.to_ascii_lowercase(),
        &host,
        &asked,
        uri.query(),
    ))
}

/// `POST /admin/cache/purge` with `{"url": ...}` (every `Vary` variant
/// of it) or `{"all": true}`, optionally `"zone": "<route>"`.
pub(super) async fn purge(
    session: &mut ServerSession,
    cfg: &crate::runtime::Snapshot,
) -> Response<Vec<u8>> {
    let body = match read_body(session).await {
        Ok(b) => b,
        Err(why) => return error(400, why),
    };
    let req: PurgeRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return error(
                400,
                &format!("expected {{\"url\": ...}} or {{\"all\": true}}: {e}"),
            )
        }
    };
    let key;
    let what = match (&req.url, req.all) {
        (Some(url), false) => match url_key(url, cfg) {
            Ok(k) => {
                key = k;
                Purge::Url(&key)
            }
            Err(why) => return error(400, &why),
        },
        (None, true) => Purge::All,
        _ => return error(400, "give exactly one of `url` and `all`"),
    };
    match cache::purge(req.zone.as_deref(), what) {
        Some(n) => {
            let body = serde_json::json!({"purged": n});
            reply(200, "application/json", body.to_string().into_bytes())
        }
        None => error(
            404,
            "no cache zone by that name (zones are named after their routes)",
        ),
    }
}

/// `GET /admin/cache`: each zone's bytes and objects.
pub(super) fn list() -> Response<Vec<u8>> {
    let zones: Vec<_> = cache::usage()
        .into_iter()
        .map(|(zone, bytes, objects)| serde_json::json!({"zone": zone, "bytes": bytes, "objects": objects}))
        .collect();
    let body = serde_json::json!({"zones": zones});
    reply(200, "application/json", body.to_string().into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use crate::runtime::{self as rt, BuildCtx};
    use std::path::Path;

    /// A config with a route that sends the original target (`/raw/`)
    /// beside one that sends the normalized path (everything else).
    fn snapshot() -> rt::Snapshot {
        let text = "[[listeners]]\naddress = \"127.0.0.1:18080\"\n\n\
                    [pools.o]\nmembers = [{ addr = \"127.0.0.1:1\" }]\n\n\
                    [[routes]]\npath = \"/raw/\"\npool = \"o\"\nupstream_path = \"original\"\n\n\
                    [[routes]]\npath = \"/\"\npool = \"o\"\n";
        let path = Path::new("/nonexistent/ultrafast.toml");
        let metrics = Metrics::new();
        let f = crate::config::parse_file(path, text).unwrap_or_else(|e| panic!("{e:?}"));
        let ctx = BuildCtx {
            metrics: &metrics,
            resolved: &Default::default(),
            prev: None,
            prefetch_fraction: 0.8,
        };
        rt::build(&f, path, text, &ctx).unwrap_or_else(|e| panic!("{e:?}"))
    }

    #[test]
    fn a_url_keys_as_the_proxy_keys_a_request() {
        let cfg = snapshot();
        let key = |u: &str| url_key(u, &cfg);
        assert_eq!(
            key("HTTP://Example.COM.:8080/a/B?x=1"),
            Ok(cache::primary(
                "http",
                "example.com:8080",
                "/a/B",
                Some("x=1")
            ))
        );
        assert_eq!(key("http://h"), Ok(cache::primary("http", "h", "/", None)));
        // The path normalized as a request's is, and encoded again as the
        // origin is asked for it.
        assert_eq!(
            key("http://h//a/./%62/caf%c3%a9"),
            Ok(cache::primary("http", "h", "/a/b/caf%C3%A9", None))
        );
        // A route that sends the original target keys on it.
        assert_eq!(
            key("http://h/raw//x/../y"),
            Ok(cache::primary("http", "h", "/raw//x/../y", None))
        );
        assert!(key("http://h/%2e%2e/x").is_err());
        assert!(key("/only/a/path").is_err());
    }
}
