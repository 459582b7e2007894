//! The keys of one version of the key file: a bearer token's SHA-256 ->
//! its `KeyEntry` (name, model allow-list, request limiter, token budget).
//!
//! A `KeyStore` is immutable once built; `keys::ApiKeys` swaps whole stores
//! on reload. Building from the previous store carries each key's limiter
//! and budget over (the same `Arc`s) when its name and limits are unchanged.
//! Lookups hash the presented token and compare digests, so no plaintext
//! key is held.

use super::budget::{BudgetRefusal, BudgetSpec, Reservation, TokenBudget};
use super::clock::Clock;
use super::keyfile::{self, KeyLimits, ValidKey};
use super::ratelimit::{cells, presented_key, quota, KeySource};
use bytes::Bytes;
use governor::clock::{Clock as _, DefaultClock};
use governor::{DefaultDirectRateLimiter, RateLimiter};
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// One API key.
pub struct KeyEntry {
    /// Its name from the key file.
    pub name: String,
    /// Models it may use; None = all.
    pub models: Option<Vec<String>>,
    /// Lanes it may use; None = all.
    pub lanes: Option<Vec<String>>,
    /// Its tenant for fair shares (its name and weight), built once.
    pub tenant: ultrafast_engine::fair::Tenant,
    /// Its limits as configured.
    pub limits: KeyLimits,
    /// Its request rate limit, if it has one.
    pub limiter: Option<Arc<DefaultDirectRateLimiter>>,
    /// Its token budget (one bucket, key 0), if it has one.
    pub budget: Option<Arc<TokenBudget>>,
}

impl fmt::Debug for KeyEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyEntry({})", self.name)
    }
}

impl KeyEntry {
    /// Whether this key may use `model`.
    pub fn allows_model(&self, model: &str) -> bool {
        self.models
            .as_ref()
            .is_none_or(|m| m.iter().any(|n| n == model))
    }

    /// Count one request against the key's rate; Err is the wait until it
    /// would be allowed.
    pub fn check_rate(&self) -> Result<(), Duration> {
        match &self.limiter {
            None => Ok(()),
            Some(l) => l
                .check()
                .map_err(|not_until| not_until.wait_time_from(DefaultClock::default().now())),
        }
    }

    /// `check_rate` as `share` requests' worth (capped at the burst): the
    /// `local` fallback of `[cluster]`, as `Limiter::check_scaled`.
    pub fn check_rate_scaled(&self, share: usize) -> Result<(), Duration> {
        let (Some(l), Some((_, burst))) = (&self.limiter, self.limits.rate) else {
            return self.check_rate();
        };
        match l.check_n(cells(share, burst)) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(not_until)) => Err(not_until.wait_time_from(DefaultClock::default().now())),
            Err(_) => Err(Duration::from_secs(1)),
        }
    }

    /// Reserve `tokens` from the key's budget; Ok(None) when it has none.
    pub fn reserve_tokens(&self, tokens: u64) -> Result<Option<Reservation>, BudgetRefusal> {
        match &self.budget {
            None => Ok(None),
            Some(b) => b.reserve(0, tokens).map(Some),
        }
    }
}

/// Why a request has no valid API key. Every case is a 401 with code
/// `invalid_api_key` (`KeyError::response`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// No `Authorization` header.
    #[error("no API key provided: send `Authorization: Bearer <key>` or `x-api-key: <key>`")]
    Missing,
    /// `Authorization` is not `Bearer <token>`.
    #[error("malformed API key: {0}")]
    Malformed(&'static str),
    /// A well-formed token that is no key.
    #[error("incorrect API key provided")]
    Unknown,
}

impl KeyError {
    /// Status, OpenAI error code and message of the refusal.
    pub fn response(&self) -> (u16, &'static str, String) {
        (401, "invalid_api_key", self.to_string())
    }

    /// The OpenAI-shaped JSON body of the refusal.
    pub fn body(&self) -> Bytes {
        let (_, code, message) = self.response();
        let body = serde_json::json!({
            "error": {"message": message, "type": "invalid_request_error", "param": null, "code": code},
        });
        Bytes::from(body.to_string())
    }
}

/// The keys of one version of the key file, by digest.
#[derive(Default)]
pub struct KeyStore {
    by_digest: HashMap<[u8; 32], Arc<KeyEntry>>,
}

impl fmt::Debug for KeyStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyStore({} keys)", self.by_digest.len())
    }
}

impl KeyStore {
    /// A store of `keys`, carrying over the limiter and budget of every key
    /// of `prev` with the same name and limits. Returns the store and how
    /// many keys carried state over.
    pub fn build(
        keys: Vec<ValidKey>,
        prev: Option<&KeyStore>,
        clock: &Arc<dyn Clock>,
    ) -> (Self, usize) {
        let old: HashMap<&str, &Arc<KeyEntry>> = prev
            .map(|p| p.by_digest.values().map(|e| (e.name.as_str(), e)).collect())
            .unwrap_or_default();
        let mut carried = 0;
        let mut by_digest = HashMap::with_capacity(keys.len());
        for k in keys {
            let digest = k.digest;
            let entry = match old.get(k.name.as_str()).filter(|o| o.limits == k.limits) {
                Some(o) => {
                    carried += 1;
                    KeyEntry {
                        tenant: ultrafast_engine::fair::Tenant::named(&k.name, k.weight),
                        name: k.name,
                        models: k.models,
                        lanes: k.lanes,
                        limits: k.limits,
                        limiter: o.limiter.clone(),
                        budget: o.budget.clone(),
                    }
                }
                None => fresh(k, clock),
            };
            by_digest.insert(digest, Arc::new(entry));
        }
        (KeyStore { by_digest }, carried)
    }

    /// The key presented in `Authorization: Bearer <token>` or, without
    /// that header, in Anthropic's `x-api-key: <token>`.
    pub fn authenticate(&self, headers: &http::HeaderMap) -> Result<Arc<KeyEntry>, KeyError> {
        let token = presented_key(headers)
            .map_err(KeyError::Malformed)?
            .ok_or(KeyError::Missing)?;
        self.by_digest
            .get(&keyfile::digest(token))
            .cloned()
            .ok_or(KeyError::Unknown)
    }

    /// Keys held.
    pub fn len(&self) -> usize {
        self.by_digest.len()
    }

    /// Whether there are no keys.
    pub fn is_empty(&self) -> bool {
        self.by_digest.is_empty()
    }

    /// The key named `name` (admin and tests; a linear scan).
    pub fn by_name(&self, name: &str) -> Option<Arc<KeyEntry>> {
        self.by_digest.values().find(|e| e.name == name).cloned()
    }
}

/// A key's entry with new limiter state.
fn fresh(k: ValidKey, clock: &Arc<dyn Clock>) -> KeyEntry {
    let limiter = k
        .limits
        .rate
        .and_then(|(r, b)| quota(r, b))
        .map(|q| Arc::new(RateLimiter::direct(q)));
    let budget = k.limits.tokens.and_then(|(t, b)| {
        let spec = BudgetSpec {
            tokens_per_min: t,
            burst: b,
            max_keys: 1,
        };
        TokenBudget::with_clock(&k.name, KeySource::Route, spec, clock.clone()).map(Arc::new)
    });
    KeyEntry {
        tenant: ultrafast_engine::fair::Tenant::named(&k.name, k.weight),
        name: k.name,
        models: k.models,
        lanes: k.lanes,
        limits: k.limits,
        limiter,
        budget,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::clock::ManualClock;
    use std::path::Path;

    fn headers(auth: Option<&str>) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        if let Some(a) = auth {
            h.insert(http::header::AUTHORIZATION, a.parse().unwrap());
        }
        h
    }

    const KEYS: &str = "[[keys]]\nname = \"a\"\nkey = \"sk-a\"\nmodels = [\"m1\"]\n\
                        tokens_per_min = 60\nburst_tokens = 10\n\n\
                        [[keys]]\nname = \"b\"\nkey = \"sk-b\"\nrate_per_s = 1.0\nburst = 2\n";

    fn store(clock: Arc<dyn Clock>) -> KeyStore {
        let keys = keyfile::parse(Path::new("k.toml"), KEYS).unwrap();
        KeyStore::build(keys, None, &clock).0
    }

    #[test]
    fn authenticate_by_digest() {
        let keys = store(Arc::new(ManualClock::new()));
        let a = keys.authenticate(&headers(Some("Bearer sk-a"))).unwrap();
        assert_eq!(a.name, "a");
        assert!(a.allows_model("m1") && !a.allows_model("m2"));
        assert!(keys
            .authenticate(&headers(Some("Bearer sk-b")))
            .unwrap()
            .allows_model("x"));
        let err = |h: Option<&str>| keys.authenticate(&headers(h)).unwrap_err();
        assert_eq!(err(None), KeyError::Missing);
        assert!(matches!(err(Some("Basic sk-a")), KeyError::Malformed(_)));
        assert!(matches!(err(Some("Bearer a b")), KeyError::Malformed(_)));
        assert_eq!(err(Some("Bearer sk-c")), KeyError::Unknown);
    }

    #[test]
    fn every_key_error_is_a_401_invalid_api_key() {
        for e in [
            KeyError::Missing,
            KeyError::Malformed("x"),
            KeyError::Unknown,
        ] {
            let (status, code, _) = e.response();
            assert_eq!((status, code), (401, "invalid_api_key"));
            let v: serde_json::Value = serde_json::from_slice(&e.body()).unwrap();
            assert_eq!(v["error"]["code"], "invalid_api_key");
            assert_eq!(v["error"]["type"], "invalid_request_error");
        }
    }

    #[test]
    fn per_key_rate_and_budget() {
        let clock = Arc::new(ManualClock::new());
        let keys = store(clock.clone());
        let a = keys.authenticate(&headers(Some("Bearer sk-a"))).unwrap();
        assert!(a.check_rate().is_ok(), "no rate limit on a");
        let r = a.reserve_tokens(8).unwrap().unwrap();
        assert_eq!(
            a.reserve_tokens(4).unwrap_err().retry_after(),
            Some(Duration::from_secs(2))
        );
        r.settle(3);
        assert!(a.reserve_tokens(4).unwrap().is_some());
        assert!(matches!(
            a.reserve_tokens(11),
            Err(BudgetRefusal::TooLarge { .. })
        ));
        let b = keys.authenticate(&headers(Some("Bearer sk-b"))).unwrap();
        assert!(
            b.reserve_tokens(1_000_000).unwrap().is_none(),
            "no budget on b"
        );
        assert!(b.check_rate().is_ok() && b.check_rate().is_ok());
        assert!(b.check_rate().unwrap_err() > Duration::from_millis(500));
    }
}
