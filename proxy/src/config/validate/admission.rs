//! Validation of `[lanes.*]` and `[rate_limits.*]`; unchanged rate limits
//! are reused on reload so their buckets carry over.

use super::*;

pub(super) fn lanes(f: &FileConfig, errs: &mut Errors) -> Vec<LaneSpec> {
    if f.lanes.is_empty() {
        return crate::admission::default_lanes();
    }
    let mut out = Vec::new();
    for (name, l) in &f.lanes {
        let at = FieldPath::key("lanes").k(name);
        if l.queue_len == 0 {
            errs.push(at.k("queue_len"), "must be at least 1");
        }
        if l.max_wait_ms == 0 {
            errs.push(at.k("max_wait_ms"), "must be > 0");
        }
        if !(0.0..=1.0).contains(&l.reserved_share) {
            errs.push(at.k("reserved_share"), "must be between 0.0 and 1.0");
        }
        if !(0.0..=1.0).contains(&l.high_watermark) {
            errs.push(at.k("high_watermark"), "must be between 0.0 and 1.0");
        }
        if f.lanes.iter().any(|(n, o)| n < name && o.rank == l.rank) {
            errs.push(
                at.k("rank"),
                format!("rank {} is used by another lane", l.rank),
            );
        }
        out.push(LaneSpec {
            name: name.clone(),
            rank: l.rank,
            queue_len: l.queue_len.max(1),
            max_wait: Duration::from_millis(l.max_wait_ms.max(1)),
            reserved_share: l.reserved_share.clamp(0.0, 1.0),
            preempt: l.preempt,
            high_watermark: l.high_watermark.clamp(0.0, 1.0),
            sjf_us_per_unit: l.sjf_us_per_unit,
        });
    }
    let reserved: f64 = out.iter().map(|l| l.reserved_share).sum();
    if reserved > 1.0 {
        errs.push(
            FieldPath::key("lanes"),
            "reserved_share of all lanes adds up to more than 1.0",
        );
    }
    out.sort_by_key(|l| l.rank);
    out
}

pub(super) fn rate_limits(f: &FileConfig, prev: Option<&Config>, errs: &mut Errors) -> LimiterMap {
    let mut out = BTreeMap::new();
    for (name, r) in &f.rate_limits {
        let at = FieldPath::key("rate_limits").k(name);
        // An unchanged limit keeps its buckets across a reload.
        if let Some((def, l)) = prev.and_then(|c| c.limiters.get(name)) {
            if def == r {
                out.insert(name.clone(), (def.clone(), l.clone()));
                continue;
            }
        }
        let source = match r.key.as_str() {
            "client_ip" => Some(KeySource::ClientIp),
            "api_key" => Some(KeySource::ApiKey(None)),
            "route" => Some(KeySource::Route),
            "pool" => Some(KeySource::Pool),
            k => match k.split_once(':') {
                Some(("api_key", h)) => HeaderName::from_bytes(h.as_bytes())
                    .ok()
                    .map(|h| KeySource::ApiKey(Some(h))),
                Some(("header", h)) => HeaderName::from_bytes(h.as_bytes())
                    .ok()
                    .map(KeySource::Header),
                _ => None,
            },
        };
        let Some(source) = source else {
            errs.push(
                at.k("key"),
                format!(
                    "`{}` is not client_ip, api_key, api_key:HEADER, header:NAME, route or pool",
                    r.key
                ),
            );
            continue;
        };
        if !(r.rate_per_s > 0.0 && r.rate_per_s <= 1e9) {
            errs.push(at.k("rate_per_s"), "must be > 0");
            continue;
        }
        if r.burst == 0 {
            errs.push(at.k("burst"), "must be at least 1");
            continue;
        }
        match Limiter::new(name, source, r.rate_per_s, r.burst, r.max_keys) {
            Some(l) => {
                out.insert(name.clone(), (r.clone(), Arc::new(l)));
            }
            None => errs.push(at.clone(), "invalid rate limit"),
        }
    }
    out
}
