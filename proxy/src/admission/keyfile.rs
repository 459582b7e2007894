//! The API key file: its TOML format and its validation into `ValidKey`s.
//!
//! ```toml
//! [[keys]]
//! name = "team-a"
//! key = "sk-live-abc..."   # or key_sha256 = "<64 hex>": the secret need not be stored
//! models = ["smollm2-135m-instruct"]   # optional allow-list; absent = all models
//! rate_per_s = 5.0                     # optional request rate, with `burst`
//! burst = 10
//! tokens_per_min = 20000               # optional token budget, with `burst_tokens`
//! burst_tokens = 4000
//! lanes = ["standard", "batch"]        # optional: the lanes it may use; absent = all
//! weight = 3                           # optional share against other tenants in a lane; default 1
//! min_ttft_ms = 500                    # optional: the tightest TTFT a request may ask (x-slo-ttft-ms)
//! min_tpot_ms = 20                     # optional: the tightest inter-token target it may ask (x-slo-tpot-ms)
//! ```
//!
//! Parsing is serde with `deny_unknown_fields`; validation collects every
//! problem with file:line:col and the field (`keys[3].key_sha256`), located
//! like config errors (`config::locate`). A plaintext `key` is hashed here
//! (SHA-256, `ring`) and lives only in the parse buffers, which are dropped
//! when `parse` returns; what leaves this module is the digest. The file is
//! bounded: at most `MAX_KEYS` entries and `MAX_FILE_BYTES` bytes.

use crate::config::locate::{located, FieldPath};
use crate::config::ConfigError;
use serde::Deserialize;
use std::collections::HashMap;
use std::path::Path;

/// Most keys a key file may hold.
pub const MAX_KEYS: usize = 100_000;
/// Largest key file read.
pub const MAX_FILE_BYTES: u64 = 64 << 20;
/// Longest key name.
const MAX_NAME: usize = 256;

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct KeyFile {
    keys: Vec<KeySpec>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct KeySpec {
    name: String,
    key: Option<String>,
    key_sha256: Option<String>,
    models: Option<Vec<String>>,
    rate_per_s: Option<f64>,
    burst: Option<u32>,
    tokens_per_min: Option<f64>,
    burst_tokens: Option<u64>,
    lanes: Option<Vec<String>>,
    weight: Option<f64>,
    min_ttft_ms: Option<u64>,
    min_tpot_ms: Option<u64>,
}

/// The limits of one key.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KeyLimits {
    /// Requests per second and burst.
    pub rate: Option<(f64, u32)>,
    /// Tokens per minute and burst in tokens.
    pub tokens: Option<(f64, u64)>,
    /// The tightest time-to-first-token target its requests may ask for
    /// (`x-slo-ttft-ms`), ms; None: any within the lane's.
    pub min_ttft_ms: Option<u64>,
    /// The tightest inter-token target they may ask for, ms.
    pub min_tpot_ms: Option<u64>,
}

/// One validated key.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidKey {
    /// Its name (logs, metrics, carry-over of limiter state).
    pub name: String,
    /// SHA-256 of the bearer token.
    pub digest: [u8; 32],
    /// Models it may use; None = all.
    pub models: Option<Vec<String>>,
    /// Its own limits.
    pub limits: KeyLimits,
    /// Lanes it may use; None = all.
    pub lanes: Option<Vec<String>>,
    /// Its share of a lane against other tenants (fair shares; default 1).
    pub weight: f64,
}

/// Why a key file could not be loaded.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KeyFileError {
    /// The file cannot be read (missing, unreadable, too large).
    #[error("cannot read key file {path}: {reason}")]
    Unreadable {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// The file is malformed: every problem, located.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<ConfigError>),
}

impl KeyFileError {
    /// As config errors (an unreadable file is one error at line 1).
    pub fn into_config_errors(self) -> Vec<ConfigError> {
        match self {
            KeyFileError::Invalid(v) => v,
            KeyFileError::Unreadable { path, reason } => vec![ConfigError {
                file: path,
                line: 1,
                col: 1,
                field: String::new(),
                message: format!("cannot read key file: {reason}"),
            }],
        }
    }
}

/// SHA-256 of a bearer token.
pub fn digest(token: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, token);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// Read and validate a key file.
pub fn read(path: &Path) -> Result<Vec<ValidKey>, KeyFileError> {
    let unreadable = |reason: String| KeyFileError::Unreadable {
        path: path.display().to_string(),
        reason,
    };
    let meta = std::fs::metadata(path).map_err(|e| unreadable(e.to_string()))?;
    if meta.len() > MAX_FILE_BYTES {
        return Err(unreadable(format!(
            "{} bytes; at most {MAX_FILE_BYTES}",
            meta.len()
        )));
    }
    let text = std::fs::read_to_string(path).map_err(|e| unreadable(e.to_string()))?;
    parse(path, &text).map_err(KeyFileError::Invalid)
}

/// Validate key file text that came from `path`.
pub fn parse(path: &Path, text: &str) -> Result<Vec<ValidKey>, Vec<ConfigError>> {
    let file: KeyFile = crate::config::parse_toml(path, text)?;
    let mut errs: Vec<(FieldPath, String)> = Vec::new();
    let at = FieldPath::key("keys");
    if file.keys.len() > MAX_KEYS {
        errs.push((
            at.clone(),
            format!(
                "{} keys; a key file holds at most {MAX_KEYS}",
                file.keys.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(file.keys.len().min(MAX_KEYS));
    let mut names: HashMap<&str, usize> = HashMap::new();
    let mut digests: HashMap<[u8; 32], usize> = HashMap::new();
    for (i, k) in file.keys.iter().enumerate().take(MAX_KEYS) {
        let at = at.i(i);
        let before = errs.len();
        check_name(&k.name, &at, &mut errs);
        if let Some(j) = names
            .insert(&k.name, i)
            .filter(|_| !k.name.trim().is_empty())
        {
            let msg = format!("duplicate name `{}` (also keys[{j}])", k.name);
            errs.push((at.k("name"), msg));
        }
        let (field, digest) = secret(k, &at, &mut errs);
        if let Some(d) = digest {
            if let Some(j) = digests.insert(d, i) {
                errs.push((at.k(field), format!("the same key as keys[{j}]")));
            }
        }
        let models = k.models.clone();
        for (m, name) in models.iter().flatten().enumerate() {
            if name.trim().is_empty() {
                errs.push((at.k("models").i(m), "must be a model name".into()));
            }
        }
        for (l, name) in k.lanes.iter().flatten().enumerate() {
            if name.trim().is_empty() {
                errs.push((at.k("lanes").i(l), "must be a lane name".into()));
            }
        }
        let weight = k.weight.unwrap_or(1.0);
        if !(weight.is_finite() && (0.001..=1000.0).contains(&weight)) {
            errs.push((at.k("weight"), "must be a number from 0.001 to 1000".into()));
        }
        let limits = limits(k, &at, &mut errs);
        if let (Some(digest), true) = (digest, errs.len() == before) {
            out.push(ValidKey {
                name: k.name.clone(),
                digest,
                models,
                limits,
                lanes: k.lanes.clone(),
                weight,
            });
        }
    }
    if errs.is_empty() {
        return Ok(out);
    }
    Err(located(path, text, errs))
}

fn check_name(name: &str, at: &FieldPath, errs: &mut Vec<(FieldPath, String)>) {
    if name.trim().is_empty() {
        errs.push((at.k("name"), "every key needs a name".into()));
    } else if name.len() > MAX_NAME || name.chars().any(char::is_control) {
        let msg = format!("must be at most {MAX_NAME} bytes, without control characters");
        errs.push((at.k("name"), msg));
    }
}

/// The digest of the key's secret, and the field it came from.
fn secret(
    k: &KeySpec,
    at: &FieldPath,
    errs: &mut Vec<(FieldPath, String)>,
) -> (&'static str, Option<[u8; 32]>) {
    match (&k.key, &k.key_sha256) {
        (Some(_), Some(_)) => {
            errs.push((
                at.k("key_sha256"),
                "give `key` or `key_sha256`, not both".into(),
            ));
            ("key", None)
        }
        (None, None) => {
            errs.push((at.clone(), "needs `key` or `key_sha256`".into()));
            ("key", None)
        }
        (Some(key), None) => {
            let b = key.as_bytes();
            if b.is_empty() || b.len() > 4096 || !b.iter().all(u8::is_ascii_graphic) {
                let msg = "must be 1 to 4096 printable ASCII characters without spaces \
                           (what a client sends after `Bearer `)";
                errs.push((at.k("key"), msg.into()));
                return ("key", None);
            }
            ("key", Some(digest(b)))
        }
        (None, Some(hex)) => match from_hex(hex.trim()) {
            Some(d) => ("key_sha256", Some(d)),
            None => {
                errs.push((at.k("key_sha256"), "must be 64 hex digits".into()));
                ("key_sha256", None)
            }
        },
    }
}

fn from_hex(s: &str) -> Option<[u8; 32]> {
    let b = s.as_bytes();
    if b.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (o, pair) in out.iter_mut().zip(b.chunks_exact(2)) {
        let hi = (pair[0] as char).to_digit(16)?;
        let lo = (pair[1] as char).to_digit(16)?;
        *o = (hi * 16 + lo) as u8;
    }
    Some(out)
}

fn limits(k: &KeySpec, at: &FieldPath, errs: &mut Vec<(FieldPath, String)>) -> KeyLimits {
    let mut err = |f: &str, m: &str| errs.push((at.k(f), m.to_string()));
    let rate = match (k.rate_per_s, k.burst) {
        (None, Some(_)) => {
            err("burst", "needs rate_per_s");
            None
        }
        (None, None) => None,
        (Some(r), _) if !(r.is_finite() && r > 0.0 && r <= 1e9) => {
            err("rate_per_s", "must be > 0 and at most 1e9");
            None
        }
        (Some(_), Some(0)) => {
            err("burst", "must be at least 1");
            None
        }
        // Default burst: one second's worth.
        (Some(r), b) => Some((r, b.unwrap_or(r.ceil().min(u32::MAX as f64) as u32).max(1))),
    };
    let tokens = match (k.tokens_per_min, k.burst_tokens) {
        (None, Some(_)) => {
            err("burst_tokens", "needs tokens_per_min");
            None
        }
        (None, None) => None,
        (Some(t), _) if !(t.is_finite() && t > 0.0 && t <= 1e12) => {
            err("tokens_per_min", "must be > 0 and at most 1e12");
            None
        }
        (Some(_), Some(b)) if b == 0 || b > 1_000_000_000_000 => {
            err("burst_tokens", "must be between 1 and 1e12");
            None
        }
        // Default burst: one minute's worth.
        (Some(t), b) => Some((t, b.unwrap_or(t.ceil() as u64).max(1))),
    };
    for (f, v) in [
        ("min_ttft_ms", k.min_ttft_ms),
        ("min_tpot_ms", k.min_tpot_ms),
    ] {
        if v.is_some_and(|v| v == 0 || v > 86_400_000) {
            err(f, "must be between 1 and 86400000 (ms)");
        }
    }
    KeyLimits {
        rate,
        tokens,
        min_ttft_ms: k.min_ttft_ms,
        min_tpot_ms: k.min_tpot_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errors(text: &str) -> Vec<String> {
        parse(Path::new("keys.toml"), text)
            .unwrap_err()
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    #[test]
    fn parses_plain_and_hashed_keys_with_defaults() {
        let hex: String = digest(b"sk-b").iter().map(|b| format!("{b:02X}")).collect();
        let text = format!(
            "[[keys]]\nname = \"a\"\nkey = \"sk-a\"\nmodels = [\"m\"]\nrate_per_s = 2.5\n\
             tokens_per_min = 600\n\n[[keys]]\nname = \"b\"\nkey_sha256 = \"{hex}\"\n"
        );
        let keys = parse(Path::new("k.toml"), &text).unwrap();
        assert_eq!(keys[0].digest, digest(b"sk-a"));
        assert_eq!(keys[0].models, Some(vec!["m".to_string()]));
        assert_eq!(keys[0].limits.rate, Some((2.5, 3)));
        assert_eq!(keys[0].limits.tokens, Some((600.0, 600)));
        assert_eq!(keys[1].digest, digest(b"sk-b"));
        assert_eq!(keys[1].models, None);
        assert_eq!(keys[1].limits.rate, None);
    }

    #[test]
    fn every_error_names_file_line_and_field() {
        let text = "[[keys]]\nname = \"a\"\nkey = \"sk-a\"\n\n\
                    [[keys]]\nname = \"a\"\nkey_sha256 = \"xyz\"\n\n\
                    [[keys]]\nname = \"c\"\nkey = \"sk-a\"\nburst_tokens = 5\n\n\
                    [[keys]]\nname = \"d\"\nkey = \"sk d\"\nrate_per_s = -1.0\n";
        let errs = errors(text);
        let want = [
            "keys.toml:6:1: keys[1].name: duplicate name `a` (also keys[0])",
            "keys.toml:7:1: keys[1].key_sha256: must be 64 hex digits",
            "keys.toml:11:1: keys[2].key: the same key as keys[0]",
            "keys.toml:12:1: keys[2].burst_tokens: needs tokens_per_min",
            "keys.toml:16:1: keys[3].key: must be 1 to 4096",
            "keys.toml:17:1: keys[3].rate_per_s: must be > 0",
        ];
        assert_eq!(errs.len(), want.len(), "{errs:#?}");
        for (e, w) in errs.iter().zip(want) {
            assert!(e.starts_with(w), "{e}\nwant {w}");
        }
    }

    #[test]
    fn unknown_fields_and_type_errors_are_located() {
        let errs = errors("[[keys]]\nname = \"a\"\nkey = \"k\"\nmodel = [\"m\"]\n");
        assert!(
            errs[0].starts_with("keys.toml:4:1: keys[].model: "),
            "{errs:?}"
        );
        let errs = errors("[[keys]]\nname = \"a\"\nkey = \"k\"\nburst = \"many\"\n");
        assert!(errs[0].starts_with("keys.toml:4:"), "{errs:?}");
    }

    #[test]
    fn a_key_needs_exactly_one_secret() {
        let errs = errors("[[keys]]\nname = \"a\"\n");
        assert!(errs[0].contains("keys[0]: needs `key` or `key_sha256`"));
        let errs = errors("[[keys]]\nname = \"a\"\nkey = \"k\"\nkey_sha256 = \"00\"\n");
        assert!(errs[0].contains("keys[0].key_sha256: give `key` or `key_sha256`"));
    }

    #[test]
    fn oversized_files_are_refused() {
        let mut text = String::new();
        for i in 0..=MAX_KEYS {
            text.push_str(&format!("[[keys]]\nname = \"k{i}\"\nkey = \"sk-{i}\"\n"));
        }
        let errs = errors(&text);
        assert!(errs[0].contains("at most 100000"), "{}", errs[0]);
    }
}
