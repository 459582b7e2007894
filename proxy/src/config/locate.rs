//! Turns a field path (`pools.api.members[1].addr`) into a line and column of
//! the file it came from, so every config error can say where to look.
//!
//! We re-parse the text with toml's span-preserving `DeValue` rather than
//! carrying `Spanned<T>` through every file struct: the file structs stay plain
//! and the cost is paid only when there is an error to report.

use std::fmt;
use toml::de::{DeTable, DeValue};

/// One step of a field path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seg {
    /// A table key.
    Key(String),
    /// An array index.
    Index(usize),
}

/// A dotted field path, displayed as `a.b[2].c`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldPath(pub Vec<Seg>);

impl FieldPath {
    /// A path from a single key.
    pub fn key(k: &str) -> Self {
        FieldPath(vec![Seg::Key(k.to_string())])
    }

    /// This path extended by a key.
    pub fn k(&self, k: &str) -> Self {
        let mut v = self.0.clone();
        v.push(Seg::Key(k.to_string()));
        FieldPath(v)
    }

    /// This path extended by an index.
    pub fn i(&self, i: usize) -> Self {
        let mut v = self.0.clone();
        v.push(Seg::Index(i));
        FieldPath(v)
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (n, s) in self.0.iter().enumerate() {
            match s {
                Seg::Key(k) if n == 0 => write!(f, "{k}")?,
                Seg::Key(k) => write!(f, ".{k}")?,
                Seg::Index(i) => write!(f, "[{i}]")?,
            }
        }
        Ok(())
    }
}

/// 1-based line and column of a byte offset.
pub fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let upto = &text.as_bytes()[..offset.min(text.len())];
    let line = upto.iter().filter(|b| **b == b'\n').count() + 1;
    let col = upto.iter().rev().take_while(|b| **b != b'\n').count() + 1;
    (line, col)
}

/// Line and column of the deepest part of `path` that exists in `text`
/// (a missing key points at the table that should hold it).
pub fn locate(text: &str, path: &FieldPath) -> (usize, usize) {
    let Ok(root) = DeTable::parse(text) else {
        return (1, 1);
    };
    let root = toml::Spanned::new(root.span(), DeValue::Table(root.into_inner()));
    let mut cur = &root;
    // A key's own span is more useful than its value's (a table's value span
    // is the whole table), so remember the key position while descending.
    let mut best = 0usize;
    for seg in &path.0 {
        let next = match (seg, cur.get_ref()) {
            (Seg::Key(k), DeValue::Table(t)) => t
                .iter()
                .find(|(key, _)| key.get_ref().as_ref() == k.as_str())
                .map(|(key, v)| {
                    best = key.span().start;
                    v
                }),
            (Seg::Index(i), DeValue::Array(a)) => a.get(*i).inspect(|v| best = v.span().start),
            _ => None,
        };
        match next {
            Some(v) => cur = v,
            None => break,
        }
    }
    line_col(text, best)
}

/// Validation errors of `text` (read from `path`), each located at its
/// field's line and column.
pub fn located(
    path: &std::path::Path,
    text: &str,
    errs: impl IntoIterator<Item = (FieldPath, String)>,
) -> Vec<super::ConfigError> {
    let file = path.display().to_string();
    errs.into_iter()
        .map(|(at, message)| {
            let (line, col) = locate(text, &at);
            super::ConfigError {
                file: file.clone(),
                line,
                col,
                field: at.to_string(),
                message,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_nested_keys_and_indices() {
        let text = "[server]\nthreads = 2\n\n[pools.api]\nmembers = [\n  { addr = \"a\" },\n  { addr = \"b\" },\n]\n";
        let p = FieldPath::key("pools").k("api").k("members").i(1).k("addr");
        assert_eq!(p.to_string(), "pools.api.members[1].addr");
        assert_eq!(locate(text, &p).0, 7);
        assert_eq!(locate(text, &FieldPath::key("server").k("threads")).0, 2);
        // A missing key reports its nearest existing parent.
        assert_eq!(
            locate(text, &FieldPath::key("pools").k("api").k("nope")).0,
            4
        );
    }

    #[test]
    fn array_of_tables() {
        let text = "[[routes]]\npath = \"/\"\n\n[[routes]]\npath = \"/x\"\npool = \"p\"\n";
        assert_eq!(locate(text, &FieldPath::key("routes").i(1).k("pool")).0, 6);
    }
}
