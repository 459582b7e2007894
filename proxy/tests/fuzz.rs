//! The fuzz targets of `proxy/fuzz/` in `cargo test`:
//!
//! - every seed-corpus and regression input replayed through the same
//!   `ultrafast::fuzzing` entry points the targets call (no fuzzer needed);
//! - each target run by `cargo fuzz` for a bounded time (20 s of fuzzing,
//!   killed by its PID if it outlives its wall-clock bound). A crash fails
//!   the test and its input is kept in `proxy/fuzz/regressions/<target>/`,
//!   so the replay test covers it from then on.
//!
//! `cargo fuzz` must be installed (`bash .ci/run` installs it); without it
//! the bounded runs fail rather than pass unrun.

#![allow(clippy::unwrap_used)]
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

type Entry = fn(&[u8]);

const TARGETS: [(&str, Entry); 5] = [
    ("openai_request", ultrafast::fuzzing::openai_request),
    ("sse", ultrafast::fuzzing::sse),
    ("config", ultrafast::fuzzing::config),
    ("http_request", ultrafast::fuzzing::http_request),
    ("uri_path", ultrafast::fuzzing::uri_path),
];

/// Seconds of fuzzing per target in `cargo test`.
const FUZZ_SECONDS: u64 = 20;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn inputs(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| Some(e.ok()?.path())).collect())
        .unwrap_or_default();
    out.retain(|p| p.is_file() && p.file_name().is_some_and(|n| n != ".gitkeep"));
    out.sort();
    out
}

#[test]
fn corpora_and_regressions_replay_cleanly() {
    for (name, entry) in TARGETS {
        let seeds = inputs(&fuzz_dir().join("corpus").join(name));
        assert!(
            seeds.len() >= 20,
            "{name}: only {} seed inputs",
            seeds.len()
        );
        let regressions = inputs(&fuzz_dir().join("regressions").join(name));
        for p in seeds.iter().chain(&regressions) {
            let data = std::fs::read(p).unwrap();
            let r = std::panic::catch_unwind(|| entry(&data));
            assert!(r.is_ok(), "{name}: {} panics", p.display());
        }
    }
}

/// `cargo fuzz` with the flags every call shares: stable Rust made to take
/// the fuzzer's `-Z` flags, no sanitizer (the ASan build of Pingora and the
/// engine costs minutes of CI; the targets are safe Rust), debug assertions
/// (the fuzz crate's profile also leaves dependencies unoptimized).
fn cargo_fuzz(sub: &str) -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    // Not the package variables cargo set for this test: build scripts
    // watch some (ring reruns on CARGO_MANIFEST_DIR), so the fuzz build
    // would differ from `cargo fuzz` run by hand and rebuild every time;
    // and not a target dir, which would mix the fuzzer's flags with ours.
    for (k, _) in std::env::vars() {
        let ours = k.starts_with("CARGO_PKG_")
            || k.starts_with("CARGO_BIN_EXE_")
            || matches!(
                k.as_str(),
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_TARGET_TMPDIR"
                    | "CARGO_TARGET_DIR"
                    | "CARGO_BUILD_TARGET_DIR"
            );
        if ours {
            c.env_remove(k);
        }
    }
    c.current_dir(workspace_root())
        .env("RUSTC_BOOTSTRAP", "1")
        .args([
            "fuzz",
            sub,
            "--fuzz-dir",
            "proxy/fuzz",
            "--sanitizer",
            "none",
        ])
        .args(["--release", "--debug-assertions"])
        // cargo fuzz defaults to one codegen unit per crate, which makes
        // the largest crates (Pingora, candle) the critical path on two
        // cores: 16 took the cold build from 11m18s to 5m59s here.
        .args(["--codegen-units", "16"]);
    c
}

/// Run `cmd` to completion or kill it (by its PID) after `limit`.
fn run_bounded(mut cmd: Command, log: &Path, limit: Duration) -> (Option<i32>, String) {
    let out = std::fs::File::create(log).unwrap();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s.code().unwrap_or(-1));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    (status, std::fs::read_to_string(log).unwrap_or_default())
}

fn tail(s: &str) -> &str {
    &s[s.len().saturating_sub(4000)..]
}

/// Build every target once for all the runs (the test threads share it).
fn built() -> &'static Result<Duration, String> {
    static BUILT: OnceLock<Result<Duration, String>> = OnceLock::new();
    BUILT.get_or_init(|| {
        let installed = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["fuzz", "--version"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !installed {
            return Err(
                "`cargo fuzz` is not installed: run `bash .ci/run` (it installs cargo-fuzz)".into(),
            );
        }
        let start = Instant::now();
        let log =
            std::env::temp_dir().join(format!("ultrafast-fuzz-build-{}.log", std::process::id()));
        let (status, out) = run_bounded(cargo_fuzz("build"), &log, Duration::from_secs(1500));
        let _ = std::fs::remove_file(&log);
        match status {
            Some(0) => {
                eprintln!("fuzz build: {:?}", start.elapsed());
                Ok(start.elapsed())
            }
            Some(c) => Err(format!("cargo fuzz build failed ({c}):\n{}", tail(&out))),
            None => Err(format!("cargo fuzz build timed out:\n{}", tail(&out))),
        }
    })
}

/// Fuzz `target` for `FUZZ_SECONDS`, new inputs into a scratch corpus (the
/// checked-in seeds are read, never written), crashes into a scratch
/// artifact dir, then kept as regressions.
fn fuzz(target: &str) {
    if let Err(e) = built() {
        panic!("{e}");
    }
    let scratch =
        std::env::temp_dir().join(format!("ultrafast-fuzz-{}-{target}", std::process::id()));
    let (corpus, artifacts) = (scratch.join("corpus"), scratch.join("artifacts"));
    std::fs::create_dir_all(&corpus).unwrap();
    std::fs::create_dir_all(&artifacts).unwrap();
    let seeds = fuzz_dir().join("corpus").join(target);
    let regressions = fuzz_dir().join("regressions").join(target);
    let mut cmd = cargo_fuzz("run");
    cmd.arg(target)
        .arg(&corpus)
        .arg(&seeds)
        .arg(&regressions)
        .arg("--")
        .arg(format!("-max_total_time={FUZZ_SECONDS}"))
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        .args([
            "-timeout=10",
            "-rss_limit_mb=2048",
            "-max_len=65536",
            "-print_final_stats=1",
        ]);
    let start = Instant::now();
    let log = scratch.join("fuzz.log");
    let (status, out) = run_bounded(cmd, &log, Duration::from_secs(FUZZ_SECONDS + 60));
    let crashes = inputs(&artifacts);
    for c in &crashes {
        std::fs::create_dir_all(&regressions).unwrap();
        let kept = regressions.join(c.file_name().unwrap());
        std::fs::copy(c, &kept).unwrap();
        eprintln!("{target}: crash input kept as {}", kept.display());
    }
    let _ = std::fs::remove_dir_all(&scratch);
    assert!(
        crashes.is_empty(),
        "{target}: the fuzzer found {} crash(es), kept in {}:\n{}",
        crashes.len(),
        regressions.display(),
        tail(&out)
    );
    assert_eq!(
        status,
        Some(0),
        "{target}: fuzzer failed or hung:\n{}",
        tail(&out)
    );
    // libFuzzer reports its executions at the end: a run that did not
    // fuzz (no inputs read, immediate exit) must not pass.
    let execs = out
        .lines()
        .rev()
        .find_map(|l| l.split("stat::number_of_executed_units:").nth(1))
        .and_then(|n| n.trim().parse::<u64>().ok())
        .unwrap_or(0);
    assert!(
        execs > 100,
        "{target}: only {execs} executions:\n{}",
        tail(&out)
    );
    eprintln!("{target}: {execs} executions in {:?}", start.elapsed());
}

#[test]
fn fuzz_openai_request() {
    fuzz("openai_request");
}

#[test]
fn fuzz_sse() {
    fuzz("sse");
}

#[test]
fn fuzz_config() {
    fuzz("config");
}

#[test]
fn fuzz_http_request() {
    fuzz("http_request");
}

#[test]
fn fuzz_uri_path() {
    fuzz("uri_path");
}
