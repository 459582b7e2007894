//! The proxy's cache phases: which requests may use the route's zone, the
//! cache key, what may be stored, `Vary`, and `Cache-Status`. Pingora runs
//! the rest (lookup, coalescing, revalidation, serving stale).

use super::*;
use crate::cache::status::{self, Seen};
use pingora::cache::cache_control::CacheControl;
use pingora::cache::filters::resp_cacheable;
use pingora::cache::key::HashBinary;
use pingora::cache::{
    CacheKey, CacheMeta, CacheMetaDefaults, CacheOptionOverrides, CachePhase, NoCacheReason,
    RespCacheable, VarianceBuilder,
};

/// Freshness comes from the response (or from the route's `default_ttl_s`,
/// applied below): Pingora's defaults are a function pointer, which cannot
/// carry a per-route value.
const FROM_RESPONSE: CacheMetaDefaults = CacheMetaDefaults::new(|_| None, 0, 0);

/// Statuses a cache may store without explicit freshness (RFC 9110 15.1,
/// "heuristically cacheable"), less 206: ranges are served from whole
/// stored bodies.
fn heuristic(status: u16) -> bool {
    matches!(
        status,
        200 | 203 | 204 | 300 | 301 | 308 | 404 | 405 | 410 | 414 | 501
    )
}

/// Turn the cache on for a request the route may serve from its zone.
pub(super) fn enable(session: &mut Session, ctx: &mut Ctx) {
    let Some(rc) = ctx.route.as_ref().and_then(|r| r.cache.clone()) else {
        return;
    };
    let req = session.req_header();
    if !pingora::cache::filters::request_cacheable(req) {
        ctx.cache.method = true;
        return;
    }
    if super::upgrade::asks_upgrade(req) {
        return;
    }
    let z = rc.zone();
    let mut o = CacheOptionOverrides::default();
    o.wait_timeout = Some(rc.spec.lock_timeout);
    session
        .cache
        .enable(&z.store, Some(&z.eviction), None, Some(&z.lock), Some(o));
    session
        .cache
        .set_max_file_size_bytes(rc.spec.max_object_bytes);
    ctx.cache.on = true;
}

/// Scheme, host, the path the origin is asked for and the query
/// (`cache::primary`), tagged with the zone. The request's target is that
/// path here: `ask_for_normalized` rewrote it for routes that send the
/// normalized path, and a route with `upstream_path = "original"` sends
/// (and so keys on) the client's own, as nginx's `$request_uri` key does.
pub(super) fn key(session: &Session, ctx: &Ctx) -> Result<CacheKey> {
    let Some(rc) = ctx.route.as_ref().and_then(|r| r.cache.as_ref()) else {
        return Error::e_explain(
            ErrorType::InternalError,
            "cache key for a route without cache",
        );
    };
    let req = session.req_header();
    // Without a trailing dot: `without_host_dot` rewrote Host at routing.
    let host = filters::request_host(req).to_ascii_lowercase();
    let scheme = if ctx.tls { "https" } else { "http" };
    Ok(CacheKey::new(
        crate::cache::primary(scheme, &host, req.uri.path(), req.uri.query()),
        rc.name.as_str(),
    ))
}

/// Whether (and for how long) a response may be stored.
pub(super) fn cacheable(session: &Session, resp: &ResponseHeader, ctx: &mut Ctx) -> RespCacheable {
    use RespCacheable::{Cacheable, Uncacheable};
    let Some(rc) = ctx.route.as_ref().and_then(|r| r.cache.clone()) else {
        return Uncacheable(NoCacheReason::NeverEnabled);
    };
    // A cookie is one client's (nginx does not cache it either), and
    // `Vary: *` matches no later request.
    if resp.headers.contains_key(http::header::SET_COOKIE) {
        return Uncacheable(NoCacheReason::Custom("set-cookie"));
    }
    let vary_star = resp.headers.get_all(http::header::VARY).iter().any(|v| {
        v.as_bytes()
            .split(|b| *b == b',')
            .any(|t| t.trim_ascii() == b"*")
    });
    if vary_star {
        return Uncacheable(NoCacheReason::Custom("vary-star"));
    }
    let cc = CacheControl::from_resp_headers(resp);
    let auth = session
        .req_header()
        .headers
        .contains_key(http::header::AUTHORIZATION);
    let out = match resp_cacheable(cc.as_ref(), resp.clone(), auth, &FROM_RESPONSE) {
        Cacheable(meta) => Cacheable(meta),
        Uncacheable(why) => match default_ttl(cc.as_ref(), resp, auth, &rc.spec) {
            Some(meta) => Cacheable(meta),
            None => Uncacheable(why),
        },
    };
    ctx.cache.stored = out.is_cacheable();
    out
}

/// The route's `default_ttl_s` for a response that states no freshness
/// and forbids nothing.
fn default_ttl(
    cc: Option<&CacheControl>,
    resp: &ResponseHeader,
    auth: bool,
    spec: &crate::cache::CacheSpec,
) -> Option<CacheMeta> {
    use pingora::cache::cache_control::{Cacheable as C, InterpretCacheControl};
    if spec.default_ttl.is_zero() || !heuristic(resp.status.as_u16()) {
        return None;
    }
    let refused = cc.is_some_and(|c| c.is_cacheable() == C::No)
        || (auth && !cc.is_some_and(|c| c.allow_caching_authorized_req()));
    if refused {
        return None;
    }
    let now = SystemTime::now();
    let (swr, sie) = pingora::cache::filters::calculate_serve_stale_durations(cc, &FROM_RESPONSE);
    let mut header = resp.clone();
    if let Some(c) = cc {
        c.strip_private_headers(&mut header);
    }
    Some(CacheMeta::new(
        now + spec.default_ttl,
        now,
        swr,
        sie,
        header,
    ))
}

/// The variant a request asks for, from the stored response's `Vary`.
pub(super) fn variance(meta: &CacheMeta, req: &RequestHeader) -> Option<HashBinary> {
    let mut b = VarianceBuilder::new();
    for v in meta.headers().get_all(http::header::VARY) {
        for name in v.to_str().unwrap_or("").split(',') {
            let name = name.trim().to_ascii_lowercase();
            if name.is_empty() {
                continue;
            }
            // Every line of the header, each length-delimited: a request
            // that repeats it (an empty line, then `gzip`) is not the
            // variant of one that sent only the first line, and no header
            // differs from one empty line.
            let mut value = Vec::new();
            for v in req.headers.get_all(name.as_str()) {
                value.extend_from_slice(&(v.len() as u32).to_le_bytes());
                value.extend_from_slice(v.as_bytes());
            }
            b.add_owned_name_value(name, value);
        }
    }
    b.finalize()
}

/// Per-request cache facts, for `Cache-Status` and the counts.
#[derive(Debug, Default)]
pub struct CacheCtx {
    /// The zone was consulted.
    pub(super) on: bool,
    /// The route caches but the method cannot be served from a cache.
    pub(super) method: bool,
    /// The response is being stored.
    pub(super) stored: bool,
    /// What happened, for `ultrafast_cache_requests_total`.
    pub(super) outcome: &'static str,
}

/// Add `Cache-Status` to a response of a caching route.
pub(super) fn status_header(session: &Session, resp: &mut ResponseHeader, ctx: &mut Ctx) {
    if ctx.route.as_ref().is_none_or(|r| r.cache.is_none()) {
        return;
    }
    let c = &session.cache;
    let phase = if ctx.cache.on {
        c.phase()
    } else {
        CachePhase::Disabled(NoCacheReason::NeverEnabled)
    };
    let fresh_until = c.maybe_cache_meta().map(|m| m.fresh_until());
    let seen = Seen {
        phase,
        fresh_until,
        fwd_status: Some(resp.status.as_u16()),
        stored: ctx.cache.stored,
        method: ctx.cache.method,
    };
    ctx.cache.outcome = match phase {
        _ if !ctx.cache.on => "bypass",
        CachePhase::Hit => "hit",
        CachePhase::StaleUpdating | CachePhase::Stale => "stale",
        CachePhase::Revalidated | CachePhase::RevalidatedNoCache(_) => "revalidated",
        CachePhase::Expired => "expired",
        CachePhase::Miss => "miss",
        CachePhase::Disabled(_) => "uncacheable",
        _ => "bypass",
    };
    let v = status::value(&seen, SystemTime::now());
    let _ = resp.insert_header("cache-status", v);
}
