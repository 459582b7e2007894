//! `ultrafast models`: pull the default model into the cache (sha256
//! verified; a second pull finds it), list it, refuse unknown names.

#![allow(clippy::unwrap_used)]
mod common;
use std::process::Command;

#[test]
fn pull_list_and_unknown_models() {
    let out = Command::new(common::bin())
        .args(["models", "pull"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(path.ends_with("SmolLM2-135M-Instruct.Q4_1.gguf"), "{path}");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 98_362_432);
    let list = Command::new(common::bin())
        .args(["models", "list"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&list.stdout).contains(&path));
    let bad = Command::new(common::bin())
        .args(["models", "pull", "gpt-9"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown model `gpt-9`"));
}
