//! `ultrafast check` over a directory of broken configs (one mistake each):
//! every one exits 1 and names file:line and the field. Plus a property test:
//! validation never panics, whatever TOML it is given.

#![allow(clippy::unwrap_used)]
mod common;
use proptest::prelude::*;
use std::path::Path;
use std::process::Command;

#[test]
fn check_names_file_line_and_field_for_every_bad_config() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/bad_configs");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let expect = text
            .lines()
            .next()
            .unwrap()
            .strip_prefix("# expect: ")
            .unwrap();
        let (line, field) = expect.split_once(' ').unwrap();
        let out = Command::new(common::bin())
            .args(["check", "-c"])
            .arg(&path)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{}: {stderr}", path.display());
        let want = format!("{}:{line}:", path.display());
        assert!(
            stderr.contains(&want),
            "{}: expected `{want}` in:\n{stderr}",
            path.display()
        );
        if field != "-" {
            assert!(
                stderr.contains(&format!(": {field}: ")),
                "{}: expected field `{field}` in:\n{stderr}",
                path.display()
            );
        }
        seen += 1;
    }
    assert!(seen >= 15, "only {seen} bad configs");
}

#[test]
fn check_accepts_the_shipped_configs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for f in [
        "conf/ultrafast.toml",
        "conf/examples/nginx-replacement.toml",
    ] {
        let out = Command::new(common::bin())
            .args(["check", "-c"])
            .arg(root.join(f))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{f}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn the_tls_example_validates_with_dev_certificates() {
    // The example's paths are relative to the working directory, as in the
    // README: run `certs dev` then `check` from the same directory.
    let dir = common::scratch("tlsexample");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::fs::create_dir_all(dir.join("conf/examples")).unwrap();
    std::fs::copy(
        root.join("conf/examples/tls.toml"),
        dir.join("conf/examples/tls.toml"),
    )
    .unwrap();
    let out = Command::new(common::bin())
        .current_dir(&dir)
        .args(["certs", "dev"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(common::bin())
        .current_dir(&dir)
        .args(["check", "-c", "conf/examples/tls.toml"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn check_reports_every_error_not_just_the_first() {
    let dir = common::scratch("multi");
    let p = dir.join("multi.toml");
    std::fs::write(
        &p,
        "[[listeners]]\naddress = \"x\"\n[pools.p]\nmembers = []\nlb = \"nope\"\n",
    )
    .unwrap();
    let out = Command::new(common::bin())
        .args(["check", "-c"])
        .arg(&p)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    for f in ["listeners[0].address", "pools.p.members", "pools.p.lb"] {
        assert!(stderr.contains(f), "missing {f} in {stderr}");
    }
    assert!(stderr.contains("3 error(s)"), "{stderr}");
    let _ = std::fs::remove_dir_all(dir);
}

const KEYS: &[&str] = &[
    "server",
    "threads",
    "work_stealing",
    "pid_file",
    "admin",
    "listen",
    "log",
    "access_log",
    "format",
    "limits",
    "client_max_body_bytes",
    "max_header_bytes",
    "listeners",
    "name",
    "address",
    "routes",
    "hosts",
    "path",
    "match",
    "pool",
    "return",
    "status",
    "body",
    "redirect",
    "location",
    "headers",
    "request",
    "response",
    "set",
    "add",
    "remove",
    "upstream_host",
    "pools",
    "p",
    "members",
    "addr",
    "weight",
    "lb",
    "hash_key",
    "hash_load_factor",
    "health_check",
    "interval_ms",
    "rise",
    "fall",
    "passive",
    "max_fails",
    "retry",
    "attempts",
    "budget_ratio",
    "bogus",
];
const STRINGS: &[&str] = &[
    "",
    "/",
    "/x",
    "127.0.0.1:8080",
    "127.0.0.1:0",
    "[::1]:80",
    "p",
    "round_robin",
    "consistent_hash",
    "peak_ewma",
    "header:x-u",
    "cookie:",
    "cookie:s",
    "regex",
    "exact",
    "priority_prefix",
    "(",
    "*.a.b",
    "*",
    "off",
    "json",
    "ünï\u{0}",
    "stdout",
    "$request_uri",
    "a\nb",
];

fn value() -> impl Strategy<Value = toml::Value> {
    let leaf = prop_oneof![
        any::<i64>().prop_map(toml::Value::Integer),
        prop_oneof![Just(0i64), Just(1), Just(-1), Just(1000), Just(65536)]
            .prop_map(toml::Value::Integer),
        any::<f64>().prop_map(toml::Value::Float),
        any::<bool>().prop_map(toml::Value::Boolean),
        proptest::sample::select(STRINGS).prop_map(|s| toml::Value::String(s.to_string())),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(toml::Value::Array),
            proptest::collection::btree_map(
                proptest::sample::select(KEYS).prop_map(String::from),
                inner,
                0..6
            )
            .prop_map(|m| toml::Value::Table(m.into_iter().collect())),
        ]
    })
}

fn document() -> impl Strategy<Value = String> {
    proptest::collection::btree_map(
        proptest::sample::select(KEYS).prop_map(String::from),
        value(),
        0..8,
    )
    .prop_map(|m| {
        let t: toml::Table = m.into_iter().collect();
        toml::to_string(&t).unwrap_or_default()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn validate_never_panics_on_structured_toml(doc in document()) {
        let metrics = ultrafast::metrics::Metrics::new();
        let r = ultrafast::runtime::parse(Path::new("prop.toml"), &doc, &metrics);
        if let Err(errs) = r {
            prop_assert!(!errs.is_empty());
            for e in errs {
                prop_assert!(e.line >= 1 && e.col >= 1);
            }
        }
    }

    #[test]
    fn validate_never_panics_on_arbitrary_text(doc in "\\PC{0,200}") {
        let metrics = ultrafast::metrics::Metrics::new();
        let _ = ultrafast::runtime::parse(Path::new("prop.toml"), &doc, &metrics);
    }
}
