//! Routes matched on the normalized path, against a real nginx: the same
//! set of locations as nginx `location` blocks and as ultrafast routes,
//! each answering its own label, and thousands of generated paths
//! (percent-encodings, dot segments, runs of slashes, case, `;`) sent to
//! both. For every path ultrafast picks nginx's location or refuses with
//! 400; where nginx refuses, ultrafast refuses too. nginx is installed by
//! `.ci/run` and started and stopped here by PID.

#![allow(clippy::unwrap_used, clippy::expect_used)]
mod common;
use common::nginx::Nginx;
use common::Ultrafast;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// (match kind as ultrafast names it, path, label).
const LOCATIONS: [(&str, &str, &str); 9] = [
    ("exact", "/exact", "L-exact"),
    ("exact", "/", "L-exact-root"),
    ("prefix", "/private/", "L-private"),
    ("priority_prefix", "/static/", "L-static"),
    ("regex", "\\.php$", "L-php"),
    ("regex", "^/api/v[0-9]+/", "L-api"),
    ("prefix", "/a/b/", "L-ab"),
    ("prefix", "/caf\u{e9}/", "L-cafe"),
    ("prefix", "/", "L-root"),
];

/// Segments the generator joins: names that match a location only once
/// decoded or normalized, dot segments plain and encoded, separators and
/// NUL encoded, malformed escapes, case and `;`.
const SEGMENTS: [&str; 36] = [
    "",
    ".",
    "..",
    "%2e",
    "%2E%2e",
    ".%2e",
    "private",
    "%70rivate",
    "PRIVATE",
    "priv%61te",
    "static",
    "%73tatic",
    "exact",
    "%65xact",
    "a",
    "b",
    "%61",
    "%62",
    "x.php",
    "x.ph%70",
    "x.PHP",
    "x.php;y",
    "y;x",
    "api",
    "v1",
    "v%31",
    "caf%C3%A9",
    "caf%c3%a9",
    "%2F",
    "%2f",
    "%00",
    "%zz",
    "%",
    "%C3",
    "x%20y",
    "~",
];

fn nginx() -> Nginx {
    let mut locs = String::new();
    for (kind, path, label) in LOCATIONS {
        let m = match kind {
            "exact" => "= ",
            "priority_prefix" => "^~ ",
            "regex" => "~ ",
            _ => "",
        };
        locs.push_str(&format!(
            "location {m}{path} {{ return 200 \"{label}\"; }}\n"
        ));
    }
    common::nginx::start(
        "nginx-paths",
        &format!("server {{ listen 127.0.0.1:{{port}};\n{locs}}}"),
    )
}

fn ultrafast() -> Ultrafast {
    let mut routes = String::new();
    for (kind, path, label) in LOCATIONS {
        routes.push_str(&format!(
            "[[routes]]\npath = '{path}'\nmatch = \"{kind}\"\nreturn = {{ status = 200, body = \"{label}\" }}\n\n"
        ));
    }
    Ultrafast::start(&routes)
}

/// What a server made of a path: a location's label, or another status.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Label(String),
    Status(u16),
}

fn ask(addr: SocketAddr, path: &str) -> Seen {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out);
    let status: u16 = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status for {path}: {text:?}"));
    if status != 200 {
        return Seen::Status(status);
    }
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("");
    Seen::Label(body.trim().to_string())
}

/// Paths from a seeded generator (xorshift), plus the audit's probes.
fn paths(n: usize) -> Vec<String> {
    let mut out: Vec<String> = [
        "/index.ph%70",
        "//private/x",
        "/%70rivate/x",
        "/./private/x",
        "/a/../private/x",
        "/private/../static/x",
        "/static/../x.php",
        "/exact/",
        "//exact",
        "/caf%C3%A9/x",
        "/..",
        "/a/%2e%2e/%2e%2e/x",
    ]
    .map(String::from)
    .to_vec();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move |m: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % m as u64) as usize
    };
    while out.len() < n {
        let mut p = String::new();
        for _ in 0..1 + next(5) {
            p.push_str(if next(6) == 0 { "//" } else { "/" });
            p.push_str(SEGMENTS[next(SEGMENTS.len())]);
        }
        if next(5) == 0 {
            p.push('/');
        }
        if next(8) == 0 {
            p.push_str("?q=%2e/..");
        }
        out.push(p);
    }
    out
}

#[test]
fn routes_pick_nginxs_location_for_every_generated_path_or_refuse_with_400() {
    let ngx = nginx();
    let uf = ultrafast();
    let (mut agreed, mut refused, mut wrong) = (0, 0, Vec::new());
    for p in paths(3000) {
        let want = ask(ngx.addr, &p);
        let got = ask(uf.addr, &p);
        match (&want, &got) {
            (w, g) if w == g => agreed += 1,
            (Seen::Label(_), Seen::Status(400)) => refused += 1,
            _ => wrong.push(format!("{p}: nginx {want:?}, ultrafast {got:?}")),
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of 3000 paths routed differently, first: {:#?}",
        wrong.len(),
        &wrong[..wrong.len().min(20)]
    );
    // Refusing everything would pass the check above: most paths must be
    // routed as nginx routes them.
    assert!(agreed >= 2000, "agreed {agreed}, refused {refused}");
    eprintln!("agreed {agreed}, refused where nginx routed {refused}");
}
