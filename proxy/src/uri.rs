//! Request paths as nginx sees them, for routing and the cache key.
//!
//! nginx matches locations against the decoded, normalized URI: every
//! `%XX` decoded, `.` and `..` segments resolved (RFC 3986 5.2.4) and runs
//! of slashes merged (`merge_slashes on`, its default). An origin behind
//! the edge normalizes too, so a route matched on the raw target is a route
//! a client can walk around: `/%70rivate/x`, `//private/x` and
//! `/a/../private/x` are all `/private/x` to the origin.
//!
//! Where nginx would still pass something ambiguous, this refuses it with
//! 400 instead: an encoded `/` (nginx decodes it into a separator, many
//! origins do not), an encoded NUL, a `..` above the root, bytes that
//! are not UTF-8 once decoded (routes and regexes match text), and dot
//! segments with `;` parameters (`dot_parameter`). What goes upstream is
//! the target in normal form (`normalize_target`: dot segments and
//! slashes resolved, only unreserved escapes decoded), unless a route asks
//! for the original target (`upstream_path = "original"`); either way the
//! cache keys on what the origin is asked.

use std::borrow::Cow;

/// Why a path cannot be normalized safely (each is a 400).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadPath {
    /// A `%` not followed by two hex digits.
    Encoding,
    /// `%2F`: a separator to some readers and not to others.
    EncodedSlash,
    /// `%00`.
    Nul,
    /// More `..` segments than segments before them.
    AboveRoot,
    /// Decoded bytes that are not UTF-8.
    NotUtf8,
}

impl BadPath {
    /// The reason, for the 400's body and the log.
    pub fn reason(self) -> &'static str {
        match self {
            BadPath::Encoding => "malformed percent-encoding in the path",
            BadPath::EncodedSlash => "encoded slash (%2F) in the path",
            BadPath::Nul => "encoded NUL (%00) in the path",
            BadPath::AboveRoot => "the path climbs above the root",
            BadPath::NotUtf8 => "the decoded path is not UTF-8",
        }
    }
}

/// The normalized form of `path` (the request target's path, without the
/// query). A path that needs nothing (the common case) is borrowed; one
/// that does not start with `/` (`*`) is left as it is.
pub fn normalize(path: &str, merge_slashes: bool) -> Result<Cow<'_, str>, BadPath> {
    let b = path.as_bytes();
    if b.first() != Some(&b'/') || is_normal(b, merge_slashes) {
        return Ok(Cow::Borrowed(path));
    }
    let decoded = decode(b)?;
    let out = resolve(&decoded, merge_slashes)?;
    String::from_utf8(out)
        .map(Cow::Owned)
        .map_err(|_| BadPath::NotUtf8)
}

/// No `%`, no dot segment, no run of slashes (when merged).
fn is_normal(b: &[u8], merge_slashes: bool) -> bool {
    // A raw NUL cannot come through the HTTP parsers; refused all the same.
    if b.contains(&b'%') || b.contains(&0) {
        return false;
    }
    let mut segs = b[1..].split(|&c| c == b'/').peekable();
    while let Some(seg) = segs.next() {
        let last = segs.peek().is_none();
        if seg == b"." || seg == b".." || (merge_slashes && seg.is_empty() && !last) {
            return false;
        }
    }
    true
}

fn hex(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Every `%XX` decoded.
fn decode(b: &[u8]) -> Result<Vec<u8>, BadPath> {
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == 0 {
            return Err(BadPath::Nul);
        }
        if b[i] != b'%' {
            out.push(b[i]);
            i += 1;
            continue;
        }
        let (Some(h), Some(l)) = (
            b.get(i + 1).copied().and_then(hex),
            b.get(i + 2).copied().and_then(hex),
        ) else {
            return Err(BadPath::Encoding);
        };
        match h << 4 | l {
            b'/' => return Err(BadPath::EncodedSlash),
            0 => return Err(BadPath::Nul),
            c => out.push(c),
        }
        i += 3;
    }
    Ok(out)
}

/// Dot segments resolved and (when asked) empty segments dropped, from a
/// decoded path that starts with `/`.
fn resolve(b: &[u8], merge_slashes: bool) -> Result<Vec<u8>, BadPath> {
    let segs: Vec<&[u8]> = b[1..].split(|&c| c == b'/').collect();
    let mut kept: Vec<&[u8]> = Vec::with_capacity(segs.len());
    // Whether the result ends with '/': after `.`, `..` or an empty last
    // segment, as RFC 3986's algorithm and nginx leave it.
    let mut dir = false;
    for (i, seg) in segs.iter().enumerate() {
        let last = i + 1 == segs.len();
        match *seg {
            b"." => dir = last,
            b".." => {
                kept.pop().ok_or(BadPath::AboveRoot)?;
                dir = last;
            }
            b"" if last => dir = true,
            b"" if merge_slashes => {}
            s => {
                kept.push(s);
                dir = false;
            }
        }
    }
    let mut out = Vec::with_capacity(b.len());
    for s in &kept {
        out.push(b'/');
        out.extend_from_slice(s);
    }
    if dir || kept.is_empty() {
        out.push(b'/');
    }
    Ok(out)
}

/// Whether `host` (a Host header or a target's authority) is an RFC 3986
/// reg-name or IP literal with an optional port. nginx refuses the rest
/// with 400 ("client sent invalid host header"); here they would reach the
/// router and the cache key, where a `/` could bend the key's path.
/// Empty is valid (an HTTP/1.0 request without a Host).
pub fn valid_host(host: &str) -> bool {
    let b = host.as_bytes();
    let (name, port) = if b.first() == Some(&b'[') {
        let Some(end) = b.iter().position(|&c| c == b']') else {
            return false;
        };
        let lit = &b[1..end];
        if lit.is_empty()
            || !lit
                .iter()
                .all(|c| c.is_ascii_hexdigit() || b":.".contains(c))
        {
            return false;
        }
        match &b[end + 1..] {
            [] => return true,
            [b':', port @ ..] => (&b[..0], port),
            _ => return false,
        }
    } else {
        match b.iter().rposition(|&c| c == b':') {
            Some(i) => (&b[..i], &b[i + 1..]),
            None => (b, &b[..0]),
        }
    };
    let port_ok = port.len() <= 5 && port.iter().all(u8::is_ascii_digit);
    let name_ok = name
        .iter()
        .all(|&c| c.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=%".contains(&c))
        && !name.windows(2).any(|w| w == b"..");
    // A ':' with no port after it (`host:`) is allowed by RFC 3986.
    port_ok && name_ok
}

/// The target path an origin is asked for, normalized without changing
/// what it names (RFC 3986 6.2.2): `%XX` of an unreserved character
/// (letters, digits, `-._~`) decoded, every other `%XX` kept (upper-case
/// hex), so `%3B` stays a character of the segment and never becomes a
/// `;` parameter, `%2B` never a `+`; dot segments resolved (after `%2e`
/// decoded), runs of slashes merged as routing merges them; bytes a target
/// may not carry raw (controls, space, non-ASCII, `"<>\\^`{|}`) encoded.
/// The caller has normalized `path` already (`normalize` refused what is
/// unsafe: `%2F`, NUL, climbing above the root).
pub fn normalize_target(path: &str, merge_slashes: bool) -> Result<String, BadPath> {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    fn unreserved(c: u8) -> bool {
        c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~')
    }
    fn raw_ok(c: u8) -> bool {
        c > 0x20 && c < 0x7f && !b"\"#<>\\^`{|}".contains(&c)
    }
    let b = path.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'%' {
            let (Some(h), Some(l)) = (
                b.get(i + 1).copied().and_then(hex),
                b.get(i + 2).copied().and_then(hex),
            ) else {
                return Err(BadPath::Encoding);
            };
            let v = h << 4 | l;
            if unreserved(v) {
                out.push(v);
            } else {
                out.extend_from_slice(&[b'%', HEX[usize::from(h)], HEX[usize::from(l)]]);
            }
            i += 3;
            continue;
        }
        if raw_ok(c) {
            out.push(c);
        } else {
            out.extend_from_slice(&[b'%', HEX[usize::from(c >> 4)], HEX[usize::from(c & 15)]]);
        }
        i += 1;
    }
    if out.first() != Some(&b'/') {
        return String::from_utf8(out).map_err(|_| BadPath::NotUtf8);
    }
    let resolved = resolve(&out, merge_slashes)?;
    // ASCII throughout: every other byte was encoded above.
    String::from_utf8(resolved).map_err(|_| BadPath::NotUtf8)
}

/// Whether a path has a dot segment carrying `;` parameters (`/..;/`,
/// `/.;x/`, `/%2e%2e;/`): Tomcat, Jetty and Spring drop the parameters
/// and then resolve the dots, so `/public/..;/admin` is `/admin` to them
/// while nginx (and routing here) read a segment named `..;`.
pub fn dot_parameter(path: &str) -> bool {
    let b = path.as_bytes();
    if !b.contains(&b';') {
        return false;
    }
    let decoded;
    let b = if b.contains(&b'%') {
        match decode(b) {
            Ok(d) => {
                decoded = d;
                decoded.as_slice()
            }
            // Refused as malformed anyway.
            Err(_) => return false,
        }
    } else {
        b
    };
    b.split(|&c| c == b'/').any(|seg| {
        seg.contains(&b';') && matches!(seg.split(|&c| c == b';').next(), Some(b".") | Some(b".."))
    })
}

/// A Host's name without its port (`[v6]:port` keeps its brackets).
pub fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        return host
            .split_once(']')
            .map(|(h, _)| &host[..h.len() + 1])
            .unwrap_or(host);
    }
    host.rsplit_once(':').map(|(h, _)| h).unwrap_or(host)
}

/// A Host (with or without a port) without one trailing dot on its name:
/// `api.example.com.:443` is `api.example.com:443`, as nginx reads it.
pub fn host_without_dot(host: &str) -> Cow<'_, str> {
    if let Some(h) = host.strip_suffix('.') {
        return Cow::Borrowed(h);
    }
    match host.rsplit_once(':') {
        Some((name, port))
            if name.ends_with('.') && !name.starts_with('[') && !name.contains(':') =>
        {
            Cow::Owned(format!("{}:{port}", &name[..name.len() - 1]))
        }
        _ => Cow::Borrowed(host),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(p: &str) -> Result<String, BadPath> {
        normalize(p, true).map(Cow::into_owned)
    }

    #[test]
    fn the_probes_of_the_audit_all_reach_the_route_they_name() {
        assert_eq!(n("/index.ph%70").unwrap(), "/index.php");
        assert_eq!(n("//private/x").unwrap(), "/private/x");
        assert_eq!(n("/%70rivate/x").unwrap(), "/private/x");
        assert_eq!(n("/./private/x").unwrap(), "/private/x");
        assert_eq!(n("/a/../private/x").unwrap(), "/private/x");
        assert_eq!(n("/a/%2e%2E/private/x").unwrap(), "/private/x");
    }

    #[test]
    fn dot_segments_follow_rfc_3986() {
        assert_eq!(n("/a/b/c/./../../g").unwrap(), "/a/g");
        assert_eq!(n("/a/..").unwrap(), "/");
        assert_eq!(n("/a/.").unwrap(), "/a/");
        assert_eq!(n("/a/b/..").unwrap(), "/a/");
        assert_eq!(n("/a/...").unwrap(), "/a/...");
        assert_eq!(n("/a/.b/..c").unwrap(), "/a/.b/..c");
        assert_eq!(n("/").unwrap(), "/");
        assert_eq!(n("/a/").unwrap(), "/a/");
        assert_eq!(n("/a//").unwrap(), "/a/");
        assert_eq!(n("/..").unwrap_err(), BadPath::AboveRoot);
        assert_eq!(n("/a/../..").unwrap_err(), BadPath::AboveRoot);
        assert_eq!(n("/%2e%2e/x").unwrap_err(), BadPath::AboveRoot);
    }

    #[test]
    fn slashes_merge_unless_turned_off() {
        assert_eq!(n("///a///b").unwrap(), "/a/b");
        assert_eq!(normalize("//a//b", false).unwrap(), "//a//b");
        assert_eq!(normalize("//a//../b", false).unwrap(), "//a/b");
    }

    #[test]
    fn what_cannot_be_normalized_safely_is_refused() {
        assert_eq!(n("/a%2Fb").unwrap_err(), BadPath::EncodedSlash);
        assert_eq!(n("/a%2fb").unwrap_err(), BadPath::EncodedSlash);
        assert_eq!(n("/a%00").unwrap_err(), BadPath::Nul);
        assert_eq!(n("/a\0b").unwrap_err(), BadPath::Nul);
        assert_eq!(n("/a%4").unwrap_err(), BadPath::Encoding);
        assert_eq!(n("/a%zz").unwrap_err(), BadPath::Encoding);
        assert_eq!(n("/a%ff").unwrap_err(), BadPath::NotUtf8);
        assert_eq!(n("/caf%C3%A9").unwrap(), "/café");
    }

    #[test]
    fn the_origin_is_asked_for_the_same_resource_in_normal_form() {
        let t = |p: &str| normalize_target(p, true).unwrap();
        assert_eq!(t("/%70rivate/x"), "/private/x");
        assert_eq!(t("/a/%2e%2e/b//c/./d"), "/b/c/d");
        // A reserved character stays encoded: `%3B` is no `;` parameter,
        // `%2B` no `+`, `%3F` no query.
        assert_eq!(t("/files/report%3bv2.pdf"), "/files/report%3Bv2.pdf");
        assert_eq!(t("/a%2Bb/c%3Fd%25"), "/a%2Bb/c%3Fd%25");
        assert_eq!(t("/caf%c3%a9/x"), "/caf%C3%A9/x");
        // Raw bytes a target may not carry are encoded; `;` stays raw.
        assert_eq!(t("/caf\u{e9}/a;b"), "/caf%C3%A9/a;b");
        assert_eq!(normalize_target("/a//b", false).unwrap(), "/a//b");
        // It names what routing matched: the same path once decoded.
        for p in ["/x/%2e/%61b%3Bc/..", "/%7Eu/./caf%C3%A9", "/a%20b"] {
            let target = t(p);
            let routed = normalize(p, true).unwrap();
            assert_eq!(normalize(&target, true).unwrap(), routed, "{p}");
        }
    }

    #[test]
    fn dot_segments_with_parameters_are_found_plain_and_encoded() {
        for bad in [
            "/public/..;/admin",
            "/a/.;x/b",
            "/%2e%2e;/x",
            "/a/..;jsessionid=1/b",
        ] {
            assert!(dot_parameter(bad), "{bad}");
        }
        for ok in ["/a;b/c", "/x.php;y", "/..a;b/", "/a/b", "/a/../b", "/.x;y"] {
            assert!(!dot_parameter(ok), "{ok}");
        }
    }

    #[test]
    fn one_trailing_dot_leaves_a_host() {
        assert_eq!(host_without_dot("api.example.com."), "api.example.com");
        assert_eq!(
            host_without_dot("api.example.com.:8443"),
            "api.example.com:8443"
        );
        assert_eq!(
            host_without_dot("api.example.com:8443"),
            "api.example.com:8443"
        );
        assert_eq!(host_without_dot("[::1]:8443"), "[::1]:8443");
        assert_eq!(host_without_dot("localhost"), "localhost");
    }

    #[test]
    fn hosts_are_reg_names_or_ip_literals_with_a_port() {
        for ok in [
            "example.com",
            "Example.COM:8080",
            "127.0.0.1",
            "[::1]",
            "[::1]:443",
            "",
            "a_b-c~d",
            "h:",
        ] {
            assert!(valid_host(ok), "{ok}");
        }
        for bad in [
            "example.com/a",
            "a b",
            "a@b",
            "a\\b",
            "[::1",
            "[::1]x",
            "[zz]",
            "h:80:80",
            "h:123456",
            "a..b",
            "h:8o",
            "é.com",
            "a\tb",
            "[]",
        ] {
            assert!(!valid_host(bad), "{bad}");
        }
    }

    #[test]
    fn normal_paths_are_borrowed_and_others_left_alone() {
        assert!(matches!(
            normalize("/v1/chat/completions", true),
            Ok(Cow::Borrowed(_))
        ));
        assert!(matches!(normalize("/a/b/", true), Ok(Cow::Borrowed(_))));
        assert!(matches!(normalize("/a/.b", true), Ok(Cow::Borrowed(_))));
        assert_eq!(normalize("*", true).unwrap(), "*");
        assert_eq!(n("/a;b/c").unwrap(), "/a;b/c");
    }
}
