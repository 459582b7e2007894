//! API keys: which key a request's bearer token is, which models it may use,
//! and its own request rate and token budget.
//!
//! Data flow: `[api_keys] file` is read and validated by `keyfile` into a
//! `KeyStore` (SHA-256 digest of the token -> `Arc<KeyEntry>`), held by
//! `ApiKeys` behind an `ArcSwap`. The request path calls
//! `ApiKeys::authenticate(headers)`, which hashes the presented token and
//! looks the digest up: the plaintext of a key is never kept, and a lookup
//! compares digests only. The entry answers `allows_model`, `check_rate`
//! (governor, one direct limiter per key) and `reserve_tokens` (one bucket
//! from `budget`).
//!
//! Reload: `ApiKeys::reload` (called on every config reload) and
//! the runtime's key-file loop (when the file's bytes change) rebuild the
//! store and swap it whole. A malformed file keeps the old store serving and
//! logs every error with file, line and field. A key whose name and limits
//! are unchanged keeps its limiter and budget state (the same `Arc`s), so a
//! reload does not hand out a fresh burst.

use super::clock::{Clock, MonotonicClock};
use super::keyfile::{self, KeyFileError};
pub use super::keystore::{KeyEntry, KeyError, KeyStore};
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// What a successful key reload did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyReload {
    /// Keys now served.
    pub keys: usize,
    /// Keys whose limiter and budget state carried over.
    pub carried: usize,
}

/// What the file held when last read: a digest of its bytes. An edit
/// within the same second and of the same size (a key's hash swapped for
/// another) changes no (mtime, size) stamp; it changes the digest.
type Stamp = Option<[u8; 32]>;

fn stamp(path: &Path) -> Stamp {
    let bytes = std::fs::read(path).ok()?;
    let d = ring::digest::digest(&ring::digest::SHA256, &bytes);
    d.as_ref().try_into().ok()
}

/// The live API keys of one `[api_keys]` section.
pub struct ApiKeys {
    path: PathBuf,
    watch: Option<Duration>,
    store: ArcSwap<KeyStore>,
    stamp: Mutex<Stamp>,
    reload_lock: Mutex<()>,
    clock: Arc<dyn Clock>,
}

impl fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ApiKeys({}, {:?})",
            self.path.display(),
            self.store.load()
        )
    }
}

/// The key file of `[api_keys] file`: relative to the config file's
/// directory unless absolute.
pub fn resolve_path(config: &Path, file: &str) -> PathBuf {
    let file = Path::new(file);
    match config.parent() {
        Some(dir) if file.is_relative() => dir.join(file),
        _ => file.to_path_buf(),
    }
}

impl ApiKeys {
    /// Read `path` (blocking), carrying limiter state over from `carry`.
    pub fn load(
        path: PathBuf,
        watch: Option<Duration>,
        carry: Option<&KeyStore>,
    ) -> Result<Self, KeyFileError> {
        Self::load_with_clock(path, watch, carry, Arc::new(MonotonicClock))
    }

    /// `load` with the clock the token budgets run on.
    pub fn load_with_clock(
        path: PathBuf,
        watch: Option<Duration>,
        carry: Option<&KeyStore>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, KeyFileError> {
        let seen = stamp(&path);
        let keys = keyfile::read(&path)?;
        let (store, _) = KeyStore::build(keys, carry, &clock);
        Ok(ApiKeys {
            path,
            watch,
            store: ArcSwap::from_pointee(store),
            stamp: Mutex::new(seen),
            reload_lock: Mutex::new(()),
            clock,
        })
    }

    /// The key presented by a request.
    pub fn authenticate(&self, headers: &http::HeaderMap) -> Result<Arc<KeyEntry>, KeyError> {
        self.store.load().authenticate(headers)
    }

    /// The keys now served.
    pub fn store(&self) -> Arc<KeyStore> {
        self.store.load_full()
    }

    /// The key file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How often the file is checked for changes (None: only on reload).
    pub fn watch_interval(&self) -> Option<Duration> {
        self.watch
    }

    /// Re-read the key file (blocking: file read and hashing; run it off
    /// the request runtime) and swap the store. On error the old keys keep
    /// serving and every problem is logged with file, line and field.
    pub fn reload(&self) -> Result<KeyReload, KeyFileError> {
        let _one_at_a_time = self.reload_lock.lock();
        *self.stamp.lock() = stamp(&self.path);
        let keys = match keyfile::read(&self.path) {
            Ok(k) => k,
            Err(e) => {
                for err in e.clone().into_config_errors() {
                    log::error!("API key reload refused, old keys keep serving: {err}");
                }
                return Err(e);
            }
        };
        let old = self.store.load_full();
        let (store, carried) = KeyStore::build(keys, Some(&old), &self.clock);
        let report = KeyReload {
            keys: store.len(),
            carried,
        };
        self.store.store(Arc::new(store));
        log::info!(
            "API keys reloaded from {}: {} key(s), {} with their limits carried over",
            self.path.display(),
            report.keys,
            report.carried
        );
        Ok(report)
    }

    /// How often the file is looked at (`[api_keys] watch_interval_ms`),
    /// `None`: only on a config reload.
    pub fn watch_every(&self) -> Option<Duration> {
        self.watch
    }

    /// `reload` if the file's bytes changed since the last read.
    pub fn reload_if_changed(&self) -> Option<Result<KeyReload, KeyFileError>> {
        if stamp(&self.path) == *self.stamp.lock() {
            return None;
        }
        Some(self.reload())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(auth: Option<&str>) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        if let Some(a) = auth {
            h.insert(http::header::AUTHORIZATION, a.parse().unwrap());
        }
        h
    }

    fn scratch(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ultrafast-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    const KEYS: &str = "[[keys]]\nname = \"a\"\nkey = \"sk-a\"\nmodels = [\"m1\"]\n\
                        tokens_per_min = 60\nburst_tokens = 10\n\n\
                        [[keys]]\nname = \"b\"\nkey = \"sk-b\"\nrate_per_s = 1.0\nburst = 2\n";

    #[test]
    fn an_edit_of_the_same_size_and_time_is_noticed() {
        let path = scratch("same-stamp.toml", KEYS);
        let keys = ApiKeys::load(path.clone(), Some(Duration::from_secs(1)), None).unwrap();
        let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
        // A key swapped for another of the same length, the mtime put back.
        std::fs::write(&path, KEYS.replace("sk-a", "sk-z")).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        assert!(keys.reload_if_changed().is_some_and(|r| r.is_ok()));
        assert!(keys.authenticate(&headers(Some("Bearer sk-z"))).is_ok());
        assert!(keys.authenticate(&headers(Some("Bearer sk-a"))).is_err());
    }

    #[test]
    fn a_bad_reload_keeps_the_old_keys_and_a_good_one_carries_state() {
        let path = scratch("reload.toml", KEYS);
        let keys = ApiKeys::load(path.clone(), Some(Duration::from_secs(1)), None).unwrap();
        assert!(keys.reload_if_changed().is_none());
        let budget_a = keys.store().by_name("a").unwrap().budget.clone().unwrap();
        let limiter_b = keys.store().by_name("b").unwrap().limiter.clone().unwrap();

        std::fs::write(
            &path,
            format!("{KEYS}\n[[keys]]\nname = \"a\"\nkey = \"sk-x\"\n"),
        )
        .unwrap();
        let errs = keys
            .reload_if_changed()
            .unwrap()
            .unwrap_err()
            .into_config_errors();
        assert!(
            errs[0]
                .to_string()
                .contains("reload.toml:15:1: keys[2].name: duplicate name"),
            "{errs:?}"
        );
        assert!(keys.authenticate(&headers(Some("Bearer sk-a"))).is_ok());
        assert!(
            keys.reload_if_changed().is_none(),
            "a bad file is not re-read until it changes"
        );

        // `a` keeps its limits under a new key; `b` changes its limits.
        let next = KEYS
            .replace("sk-a", "sk-a2")
            .replace("burst = 2", "burst = 3");
        std::fs::write(&path, next).unwrap();
        let report = keys.reload().unwrap();
        assert_eq!(
            report,
            KeyReload {
                keys: 2,
                carried: 1
            }
        );
        assert_eq!(
            keys.authenticate(&headers(Some("Bearer sk-a")))
                .unwrap_err(),
            KeyError::Unknown
        );
        let a = keys.authenticate(&headers(Some("Bearer sk-a2"))).unwrap();
        assert!(Arc::ptr_eq(a.budget.as_ref().unwrap(), &budget_a));
        let b = keys.store().by_name("b").unwrap();
        assert!(!Arc::ptr_eq(b.limiter.as_ref().unwrap(), &limiter_b));
    }

    #[test]
    fn unreadable_file_is_an_error() {
        let e = ApiKeys::load(PathBuf::from("/nonexistent/keys.toml"), None, None).unwrap_err();
        assert!(matches!(e, KeyFileError::Unreadable { .. }));
    }

    #[test]
    fn key_file_path_is_relative_to_the_config_file() {
        let p = resolve_path(Path::new("conf/ultrafast.toml"), "keys.toml");
        assert_eq!(p, PathBuf::from("conf/keys.toml"));
        assert_eq!(
            resolve_path(Path::new("u.toml"), "k.toml"),
            PathBuf::from("k.toml")
        );
        assert_eq!(
            resolve_path(Path::new("conf/u.toml"), "/etc/k.toml"),
            PathBuf::from("/etc/k.toml")
        );
    }
}
