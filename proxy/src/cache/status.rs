//! RFC 9211 `Cache-Status`: what the cache did with a request, in one
//! header a client (or a developer with curl) can read.

use pingora::cache::CachePhase;
use std::time::SystemTime;

/// The cache's name in the header.
pub const NAME: &str = "ultrafast";

/// What the request path knows when the response head goes out.
pub struct Seen {
    /// Pingora's phase at that moment.
    pub phase: CachePhase,
    /// When the stored response stops (or stopped) being fresh, if one was
    /// used.
    pub fresh_until: Option<SystemTime>,
    /// The origin's status, when the request went there.
    pub fwd_status: Option<u16>,
    /// The response is being stored.
    pub stored: bool,
    /// The request method cannot be served from a cache.
    pub method: bool,
}

fn ttl(fresh_until: Option<SystemTime>, now: SystemTime) -> Option<i64> {
    let t = fresh_until?;
    Some(match t.duration_since(now) {
        Ok(d) => d.as_secs() as i64,
        // Stale by any fraction of a second reads as stale (`ttl=-1`).
        Err(e) => -(e.duration().as_secs_f64().ceil() as i64),
    })
}

/// The header's value.
pub fn value(s: &Seen, now: SystemTime) -> String {
    let mut v = String::from(NAME);
    let mut param = |p: &str| {
        v.push_str("; ");
        v.push_str(p);
    };
    let ttl = ttl(s.fresh_until, now).map(|t| format!("ttl={t}"));
    let fwd = s.fwd_status.map(|c| format!("fwd-status={c}"));
    let (head, detail): (&[&str], Option<&str>) = match s.phase {
        _ if s.method => (&["fwd=method"], None),
        CachePhase::Hit => (&["hit"], None),
        CachePhase::StaleUpdating => (&["hit"], Some("stale-while-revalidate")),
        CachePhase::Stale => (&["fwd=stale"], Some("stale-if-error")),
        CachePhase::Revalidated | CachePhase::RevalidatedNoCache(_) => (&["fwd=stale"], None),
        CachePhase::Expired => (&["fwd=stale"], None),
        CachePhase::Miss => (&["fwd=miss"], None),
        CachePhase::Disabled(r) => (&["fwd=miss"], Some(r.as_str())),
        _ => (&["fwd=bypass"], None),
    };
    for h in head {
        param(h);
    }
    let used_stored = matches!(
        s.phase,
        CachePhase::Hit
            | CachePhase::StaleUpdating
            | CachePhase::Stale
            | CachePhase::Revalidated
            | CachePhase::RevalidatedNoCache(_)
    );
    if !s.method && !used_stored {
        if let Some(f) = &fwd {
            param(f);
        }
    }
    if matches!(
        s.phase,
        CachePhase::Revalidated | CachePhase::RevalidatedNoCache(_)
    ) {
        param("fwd-status=304");
    }
    if used_stored {
        if let Some(t) = &ttl {
            param(t);
        }
    }
    if s.stored && !used_stored {
        param("stored");
    }
    if let Some(d) = detail {
        param(&format!("detail={}", d.replace([' ', ';', ','], "-")));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use pingora::cache::NoCacheReason;
    use std::time::Duration;

    fn seen(phase: CachePhase) -> Seen {
        Seen {
            phase,
            fresh_until: None,
            fwd_status: Some(200),
            stored: false,
            method: false,
        }
    }

    #[test]
    fn each_outcome_reads_as_rfc_9211_says() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let mut hit = seen(CachePhase::Hit);
        hit.fresh_until = Some(now + Duration::from_secs(30));
        hit.fwd_status = None;
        assert_eq!(value(&hit, now), "ultrafast; hit; ttl=30");
        let mut swr = seen(CachePhase::StaleUpdating);
        swr.fresh_until = Some(now - Duration::from_secs(5));
        assert_eq!(
            value(&swr, now),
            "ultrafast; hit; ttl=-5; detail=stale-while-revalidate"
        );
        let mut miss = seen(CachePhase::Miss);
        miss.stored = true;
        assert_eq!(
            value(&miss, now),
            "ultrafast; fwd=miss; fwd-status=200; stored"
        );
        let mut reval = seen(CachePhase::Revalidated);
        reval.fresh_until = Some(now + Duration::from_secs(60));
        assert_eq!(
            value(&reval, now),
            "ultrafast; fwd=stale; fwd-status=304; ttl=60"
        );
        let nc = seen(CachePhase::Disabled(NoCacheReason::OriginNotCache));
        assert_eq!(
            value(&nc, now),
            "ultrafast; fwd=miss; fwd-status=200; detail=OriginNotCache"
        );
        let mut post = seen(CachePhase::Disabled(NoCacheReason::NeverEnabled));
        post.method = true;
        assert_eq!(value(&post, now), "ultrafast; fwd=method");
    }
}
