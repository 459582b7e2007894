//! Validation of `[lanes.*]`, `[rate_limits.*]` and `[api_keys]`; unchanged
//! rate limits, token budgets and key stores are reused on reload so their
//! buckets carry over.

use super::*;
use crate::admission::budget::{BudgetSpec, TokenBudget};
use crate::admission::keyfile::KeyFileError;
use crate::admission::keys::{resolve_path, ApiKeys};
use crate::cluster::OnStoreError;

pub(super) fn rate_limits(
    f: &FileConfig,
    prev: Option<&Snapshot>,
    errs: &mut Errors,
) -> LimiterMap {
    let mut out = BTreeMap::new();
    for (name, r) in &f.rate_limits {
        let at = FieldPath::key("rate_limits").k(name);
        // An unchanged limit keeps its buckets across a reload.
        if let Some(old) = prev.and_then(|c| c.limiters.get(name)) {
            if old.def == *r {
                out.insert(name.clone(), old.clone());
                continue;
            }
        }
        let Some(source) = KeySource::parse(&r.key) else {
            errs.push(
                at.k("key"),
                format!(
                    "`{}` is not client_ip, api_key, api_key:HEADER, header:NAME, route or pool",
                    r.key
                ),
            );
            continue;
        };
        let before = errs.0.len();
        // A section with only a token budget has no request limit.
        let rate = match (r.rate_per_s, r.tokens_per_min) {
            (Some(rate), _) => Some(rate),
            (None, Some(_)) => None,
            (None, None) => Some(RateLimitSection::DEFAULT_RATE_PER_S),
        };
        let mode = store_mode(&r.on_store_error, &at, errs);
        let requests = rate.and_then(|rate| request_limit(name, &source, rate, r, &at, errs));
        let requests = requests.map(|mut l| {
            l.on_store_error = mode;
            Arc::new(l)
        });
        let tokens = token_budget(name, &source, r, &at, errs).map(|mut b| {
            b.on_store_error = mode;
            Arc::new(b)
        });
        if errs.0.len() == before {
            let def = r.clone();
            out.insert(
                name.clone(),
                RateLimit {
                    def,
                    requests,
                    tokens,
                },
            );
        }
    }
    out
}

/// `on_store_error`: `local`, `open` or `closed`.
pub(super) fn store_mode(v: &str, at: &FieldPath, errs: &mut Errors) -> OnStoreError {
    OnStoreError::parse(v).unwrap_or_else(|| {
        errs.push(
            at.k("on_store_error"),
            format!("`{v}` is not one of local, open, closed"),
        );
        OnStoreError::Local
    })
}

fn request_limit(
    name: &str,
    source: &KeySource,
    rate: f64,
    r: &RateLimitSection,
    at: &FieldPath,
    errs: &mut Errors,
) -> Option<Limiter> {
    if !(rate > 0.0 && rate <= 1e9) {
        errs.push(at.k("rate_per_s"), "must be > 0 and at most 1e9");
        return None;
    }
    if r.burst == 0 {
        errs.push(at.k("burst"), "must be at least 1");
        return None;
    }
    let l = Limiter::new(name, source.clone(), rate, r.burst, r.max_keys);
    if l.is_none() {
        errs.push(at.k("rate_per_s"), "invalid rate limit");
    }
    l
}

fn token_budget(
    name: &str,
    source: &KeySource,
    r: &RateLimitSection,
    at: &FieldPath,
    errs: &mut Errors,
) -> Option<TokenBudget> {
    let Some(per_min) = r.tokens_per_min else {
        if r.burst_tokens.is_some() {
            errs.push(at.k("burst_tokens"), "needs tokens_per_min");
        }
        return None;
    };
    if !(per_min.is_finite() && per_min > 0.0 && per_min <= 1e12) {
        errs.push(at.k("tokens_per_min"), "must be > 0 and at most 1e12");
        return None;
    }
    // Default burst: one minute's worth.
    let burst = r.burst_tokens.unwrap_or(per_min.ceil() as u64);
    if !(1..=1_000_000_000_000).contains(&burst) {
        errs.push(at.k("burst_tokens"), "must be between 1 and 1e12");
        return None;
    }
    let spec = BudgetSpec {
        tokens_per_min: per_min,
        burst,
        max_keys: r.max_keys,
    };
    let b = TokenBudget::new(name, source.clone(), spec);
    if b.is_none() {
        errs.push(at.k("tokens_per_min"), "invalid token budget");
    }
    b
}

/// `[api_keys]`: the key store, and the key file's own errors (located in
/// that file). An unchanged section keeps the live store (the reload path
/// re-reads the file through `ApiKeys::reload`, which keeps the old keys on
/// error); a new or changed one reads the file now, and a bad file fails
/// the config.
pub(super) fn api_keys(
    f: &FileConfig,
    path: &Path,
    prev: Option<&Snapshot>,
    errs: &mut Errors,
) -> (Option<Arc<ApiKeys>>, Vec<ConfigError>) {
    let Some(s) = &f.api_keys else {
        return (None, Vec::new());
    };
    let at = FieldPath::key("api_keys");
    store_mode(&s.on_store_error, &at, errs);
    if s.file.trim().is_empty() {
        errs.push(at.k("file"), "must name the key file");
        return (None, Vec::new());
    }
    let file = resolve_path(path, &s.file);
    let watch = ms(s.watch_interval_ms);
    let live = prev.and_then(|c| c.api_keys.as_ref());
    if let Some(old) = live.filter(|k| k.path() == file && k.watch_interval() == watch) {
        return (Some(old.clone()), Vec::new());
    }
    let carry = live.map(|k| k.store());
    match ApiKeys::load(file, watch, carry.as_deref()) {
        Ok(k) => (Some(Arc::new(k)), Vec::new()),
        Err(KeyFileError::Unreadable { path, reason }) => {
            errs.push(
                at.k("file"),
                format!("cannot read key file {path}: {reason}"),
            );
            (None, Vec::new())
        }
        Err(KeyFileError::Invalid(v)) => (None, v),
    }
}

/// `[cluster]`: the Redis URL parses, the timeout and beat are sane.
/// Validate `[cluster]`; returns whether fair shares refuse while the
/// store is down (`fair_on_store_error = "closed"`).
pub(super) fn cluster(f: &FileConfig, errs: &mut Errors) -> bool {
    let Some(c) = &f.cluster else {
        return false;
    };
    let at = FieldPath::key("cluster");
    if c.redis.trim().is_empty() {
        errs.push(at.k("redis"), "must name the store: redis://host:port/db");
    } else if let Err(e) = crate::cluster::check_url(c.redis.trim()) {
        errs.push(at.k("redis"), e);
    }
    if !(1..=10_000).contains(&c.timeout_ms) {
        errs.push(at.k("timeout_ms"), "must be between 1 and 10000");
    }
    if !(1..=64).contains(&c.pool_size) {
        errs.push(at.k("pool_size"), "must be between 1 and 64");
    }
    if !(50..=60_000).contains(&c.heartbeat_ms) {
        errs.push(at.k("heartbeat_ms"), "must be between 50 and 60000");
    }
    let fair = crate::cluster::OnStoreError::parse(&c.fair_on_store_error);
    if fair.is_none() {
        errs.push(at.k("fair_on_store_error"), "must be local, open or closed");
    }
    fair == Some(crate::cluster::OnStoreError::Closed)
}

#[cfg(test)]
mod tests {
    use crate::config::{self, ConfigError};
    use crate::metrics::Metrics;
    use crate::runtime::{self as rt, BuildCtx, Snapshot as Config};
    use std::path::{Path, PathBuf};
    use std::sync::Arc;

    const BASE: &str = "[[listeners]]\naddress = \"127.0.0.1:18080\"\n\n\
                        [[routes]]\npath = \"/\"\nrate_limits = [\"rl\"]\n\
                        return = { status = 200, body = \"ok\" }\n\n";

    fn build(path: &Path, text: &str, prev: Option<&Config>) -> Result<Config, Vec<ConfigError>> {
        let metrics = Metrics::new();
        let f = config::parse_file(path, text)?;
        let ctx = BuildCtx {
            metrics: &metrics,
            resolved: &Default::default(),
            prev,
            prefetch_fraction: 0.8,
        };
        rt::build(&f, path, text, &ctx)
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ultrafast-cfg-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_section_may_limit_requests_tokens_or_both() {
        let text = format!(
            "{BASE}[rate_limits.rl]\nkey = \"api_key\"\ntokens_per_min = 1200\n\n\
             [rate_limits.both]\nrate_per_s = 2.0\ntokens_per_min = 60\nburst_tokens = 30\n\n\
             [rate_limits.old]\nkey = \"route\"\n"
        );
        let c = build(Path::new("u.toml"), &text, None).unwrap();
        let rl = &c.limiters["rl"];
        assert!(rl.requests.is_none(), "tokens only: no request limit");
        let spec = rl.tokens.as_ref().unwrap().spec();
        assert_eq!((spec.tokens_per_min, spec.burst), (1200.0, 1200));
        let both = &c.limiters["both"];
        assert!(both.requests.is_some());
        assert_eq!(both.tokens.as_ref().unwrap().spec().burst, 30);
        let old = &c.limiters["old"];
        assert!(
            old.requests.is_some() && old.tokens.is_none(),
            "default: 10/s"
        );
        let route = c.router.find("x", "/").unwrap();
        assert!(route.limiters.is_empty());
        assert_eq!(route.budgets.len(), 1);
    }

    /// The errors of a config that must fail, as `file:line:col: field: message`.
    fn errors(text: &str) -> Vec<String> {
        build(Path::new("u.toml"), text, None)
            .unwrap_err()
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    #[test]
    fn a_keepalive_out_of_range_is_located() {
        let text = format!("{BASE}[rate_limits.rl]\n\n[inference]\nkeepalive_ms = 50\n");
        let errs = errors(&text);
        assert!(
            errs.iter()
                .any(|e| e.contains("inference.keepalive_ms: must be between 1000 and 600000")),
            "{errs:?}"
        );
        let ok = format!("{BASE}[rate_limits.rl]\n\n[inference]\nkeepalive_ms = 30000\n");
        let built = build(Path::new("u.toml"), &ok, None);
        assert!(built.is_ok(), "{:?}", built.err());
    }

    #[test]
    fn bad_cluster_settings_are_located() {
        let text = format!(
            "{BASE}[rate_limits.rl]\non_store_error = \"maybe\"\n\n[cluster]\nredis = \"mysql://x\"\ntimeout_ms = 0\n"
        );
        let errs = errors(&text);
        let has = |p: &str| errs.iter().any(|e| e.starts_with(p));
        assert!(has("u.toml:10:1: rate_limits.rl.on_store_error: `maybe` is not one of local, open, closed"), "{errs:?}");
        assert!(
            has("u.toml:13:1: cluster.redis: `mysql://x` is not a Redis URL"),
            "{errs:?}"
        );
        assert!(has("u.toml:14:1: cluster.timeout_ms: "), "{errs:?}");
        // A good section builds (nothing connects at config time).
        let ok =
            format!("{BASE}[rate_limits.rl]\n\n[cluster]\nredis = \"redis://127.0.0.1:1/0\"\n");
        let built = build(Path::new("u.toml"), &ok, None);
        assert!(built.is_ok(), "{:?}", built.err());
    }

    #[test]
    fn bad_budgets_are_located() {
        let text = format!(
            "{BASE}[rate_limits.rl]\nburst_tokens = 5\n\n[rate_limits.z]\ntokens_per_min = -1.0\n"
        );
        let errs = errors(&text);
        assert!(
            errs.contains(&"u.toml:10:1: rate_limits.rl.burst_tokens: needs tokens_per_min".into()),
            "{errs:?}"
        );
        assert!(
            errs.iter()
                .any(|e| e.starts_with("u.toml:13:1: rate_limits.z.tokens_per_min: ")),
            "{errs:?}"
        );
    }

    #[test]
    fn api_keys_load_relative_to_the_config_and_fail_the_config_when_bad() {
        let dir = scratch("keys");
        std::fs::write(
            dir.join("keys.toml"),
            "[[keys]]\nname = \"a\"\nkey = \"sk-a\"\n",
        )
        .unwrap();
        let path = dir.join("u.toml");
        let text = format!("{BASE}[rate_limits.rl]\n\n[api_keys]\nfile = \"keys.toml\"\n");
        let c = build(&path, &text, None).unwrap();
        let keys = c.api_keys.clone().unwrap();
        assert_eq!(keys.path(), dir.join("keys.toml"));
        assert_eq!(
            keys.watch_interval(),
            Some(std::time::Duration::from_secs(2))
        );
        let mut h = http::HeaderMap::new();
        h.insert(http::header::AUTHORIZATION, "Bearer sk-a".parse().unwrap());
        assert_eq!(keys.authenticate(&h).unwrap().name, "a");

        // An unchanged section keeps the live store, even while the file is
        // broken: the reload path's `ApiKeys::reload` refuses the bad file.
        std::fs::write(dir.join("keys.toml"), "[[keys]]\nname = \"a\"\nkey = 5\n").unwrap();
        let next = build(&path, &text, Some(&c)).unwrap();
        assert!(Arc::ptr_eq(next.api_keys.as_ref().unwrap(), &keys));
        assert!(keys.reload().is_err());
        assert!(keys.authenticate(&h).is_ok());

        // At startup the same file is a config error in the key file.
        let errs = build(&path, &text, None).unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert!(
            errs[0].file.ends_with("keys.toml") && errs[0].line == 3,
            "{errs:?}"
        );
        assert_eq!(errs[0].field, "keys[].key");

        // A missing file is located at `api_keys.file` in the config.
        let text = text.replace("keys.toml", "nope.toml");
        let errs = build(&path, &text, None).unwrap_err();
        assert_eq!(
            (errs[0].line, errs[0].field.as_str()),
            (12, "api_keys.file"),
            "{errs:?}"
        );
    }
}
