//! The house by ranks: every top-level module of `proxy/src` and of
//! `engine/src` has a rank (ARCHITECTURE.md), and a module may name
//! (`crate::x`) only modules of its own rank or below. The arrows that
//! still point up today are listed here, each by name: the test fails on
//! any other, and on a listed one that is gone (so the list only shrinks,
//! until it is empty). No dependency: the sources are read as text.

#![allow(clippy::unwrap_used)]
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// `proxy/src`'s ranks, lowest first (the same table as `lib.rs` and
/// ARCHITECTURE.md).
const PROXY: &[(&str, u8)] = &[
    // Leaf helpers.
    ("alloc", 0),
    ("drain", 0),
    ("hash", 0),
    ("uri", 0),
    ("reqid", 0),
    ("filters", 0),
    // Config is data.
    ("config", 1),
    // Subsystems below admission.
    ("otel", 2),
    ("accesslog", 2),
    ("edge", 2),
    ("cache", 2),
    ("compress", 2),
    ("cluster", 2),
    ("admission", 3),
    ("upstream", 4),
    ("routing", 5),
    ("inference", 6),
    // The runtime layer (today: metrics, reload).
    ("metrics", 7),
    ("reload", 7),
    ("proxy", 8),
    ("admin", 8),
    ("server", 9),
    ("cli", 9),
    // Test entry points of the fuzz targets: they reach everything.
    ("fuzzing", 10),
];

/// Upward arrows of `proxy/src` that remain (from, to).
const PROXY_UP: &[(&str, &str)] = &[
    ("config", "admission"),
    ("config", "cache"),
    ("config", "cluster"),
    ("config", "compress"),
    ("config", "edge"),
    ("config", "inference"),
    ("config", "metrics"),
    ("config", "routing"),
    ("config", "upstream"),
    ("inference", "metrics"),
];

/// `engine/src`'s ranks, lowest first.
const ENGINE: &[(&str, u8)] = &[
    ("error", 0),
    ("kv", 0),
    ("fair", 0),
    // The seam the proxy depends on.
    ("api", 1),
    ("tokenizer", 2),
    ("guide", 2),
    ("sampling", 2),
    ("fetch", 2),
    ("model", 3),
    ("backend", 3),
    ("generate", 4),
    ("scheduler", 5),
    ("service", 6),
];

/// Upward arrows of `engine/src` that remain.
const ENGINE_UP: &[(&str, &str)] = &[
    ("api", "guide"),
    ("backend", "generate"),
    ("sampling", "backend"),
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The top-level module a source file belongs to (None: the crate root).
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel.components().next()?.as_os_str().to_str()?.to_string();
    let name = first.strip_suffix(".rs").unwrap_or(&first).to_string();
    (!matches!(name.as_str(), "lib" | "main")).then_some(name)
}

/// Every `crate::name` a text mentions.
fn names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("crate::") {
        let after = &rest[i + "crate::".len()..];
        let name: String = after
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.insert(name);
        }
        rest = after;
    }
    out
}

/// The arrows between top-level modules of the crate at `src`.
fn arrows(src: &Path) -> BTreeMap<(String, String), PathBuf> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut out = BTreeMap::new();
    for f in files {
        let Some(from) = module_of(src, &f) else {
            continue;
        };
        let text = std::fs::read_to_string(&f).unwrap();
        for to in names(&text) {
            if to != from {
                out.entry((from.clone(), to)).or_insert_with(|| f.clone());
            }
        }
    }
    out
}

fn check(crate_dir: &str, ranks: &[(&str, u8)], allowed: &[(&str, &str)]) -> Vec<String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(crate_dir)
        .join("src");
    let rank: BTreeMap<&str, u8> = ranks.iter().copied().collect();
    let mut problems = Vec::new();
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let modules: BTreeSet<String> = files.iter().filter_map(|f| module_of(&src, f)).collect();
    for m in &modules {
        if !rank.contains_key(m.as_str()) {
            problems.push(format!("{crate_dir}: module `{m}` has no rank"));
        }
    }
    let found = arrows(&src);
    let mut up_seen = BTreeSet::new();
    for ((from, to), file) in &found {
        let (Some(a), Some(b)) = (rank.get(from.as_str()), rank.get(to.as_str())) else {
            continue;
        };
        if b > a {
            if allowed.contains(&(from.as_str(), to.as_str())) {
                up_seen.insert((from.clone(), to.clone()));
            } else {
                problems.push(format!(
                    "{crate_dir}: `{from}` (rank {a}) imports `{to}` (rank {b}), in {}",
                    file.display()
                ));
            }
        }
    }
    for (from, to) in allowed {
        if !up_seen.contains(&(from.to_string(), to.to_string())) {
            problems.push(format!(
                "{crate_dir}: `{from}` -> `{to}` is listed as allowed but no longer exists: take it off the list"
            ));
        }
    }
    problems
}

#[test]
fn every_import_points_down_the_ranks_but_the_listed_ones() {
    let mut problems = check("proxy", PROXY, PROXY_UP);
    problems.extend(check("engine", ENGINE, ENGINE_UP));
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn the_reader_finds_the_arrows_it_should() {
    let found = names("use crate::a::b; x(crate::c_d::e); // crate::\nlet y = crate::f;");
    let want: BTreeSet<String> = ["a", "c_d", "f"].map(String::from).into_iter().collect();
    assert_eq!(found, want);
}
