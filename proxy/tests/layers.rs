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
    ("prom", 0),
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
    // The metric families assembled from their owners'.
    ("metrics", 7),
    // The runtime layer: builds, swaps and walks the live snapshot.
    ("runtime", 8),
    ("proxy", 9),
    ("admin", 9),
    ("server", 10),
    ("cli", 10),
    // Test entry points of the fuzz targets: they reach everything.
    ("fuzzing", 11),
];

/// Upward arrows of `proxy/src` that remain (from, to).
const PROXY_UP: &[(&str, &str)] = &[];

/// `engine/src`'s ranks, lowest first.
const ENGINE: &[(&str, u8)] = &[
    // Leaves: errors, the KV block pool, fair shares, the SIMD primitives.
    ("error", 0),
    ("kv", 0),
    ("fair", 0),
    ("simd", 0),
    // The seam the proxy depends on: requests in, events out.
    ("api", 1),
    ("tokenizer", 2),
    ("guide", 2),
    ("sampling", 2),
    ("logprob", 2),
    ("fetch", 2),
    ("model", 3),
    // The runners (and the model loaded for them).
    ("backend", 4),
    ("generate", 5),
    ("scheduler", 6),
    ("service", 7),
];

/// Upward arrows of `engine/src` that remain.
const ENGINE_UP: &[(&str, &str)] = &[];

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

/// The import cycles among a crate's top-level modules (modules of one
/// rank may name each other, but not round in a circle): each cycle as
/// the path that closes it.
fn cycles(crate_dir: &str) -> Vec<String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(crate_dir)
        .join("src");
    let mut next: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (from, to) in arrows(&src).into_keys() {
        next.entry(from).or_default().push(to);
    }
    // Depth-first search; a module met again while on the path closes a
    // cycle.
    fn walk(
        m: &str,
        next: &BTreeMap<String, Vec<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
        out: &mut Vec<String>,
    ) {
        if let Some(i) = path.iter().position(|p| p == m) {
            out.push(format!("{} -> {m}", path[i..].join(" -> ")));
            return;
        }
        if !done.insert(m.to_string()) {
            return;
        }
        path.push(m.to_string());
        for to in next.get(m).into_iter().flatten() {
            walk(to, next, path, done, out);
        }
        path.pop();
    }
    let (mut out, mut done) = (Vec::new(), BTreeSet::new());
    for m in next.keys() {
        walk(m, &next, &mut Vec::new(), &mut done, &mut out);
    }
    out
}

#[test]
fn no_import_cycle_among_top_level_modules() {
    let mut found = cycles("proxy");
    found.extend(cycles("engine").into_iter().map(|c| format!("engine: {c}")));
    assert!(found.is_empty(), "{found:#?}");
}

#[test]
fn the_reader_finds_the_arrows_it_should() {
    let found = names("use crate::a::b; x(crate::c_d::e); // crate::\nlet y = crate::f;");
    let want: BTreeSet<String> = ["a", "c_d", "f"].map(String::from).into_iter().collect();
    assert_eq!(found, want);
}
