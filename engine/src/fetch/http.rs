//! HTTPS downloads in-process (no pip, no curl: a fresh machine may have
//! neither). One blocking `ureq` agent: rustls with ring, the system's CA
//! bundle as roots (so a site's own CA in the system store is honoured, as
//! curl and pip honour it), the built-in webpki roots when the system has no
//! bundle, proxies from the usual environment variables, redirects followed.
//! Files are streamed to disk, never held in memory; `file://` URLs (a
//! mirror on local disk) are copied.

use crate::error::{EngineError, Result};
use std::io::{IsTerminal, Read, Write};
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use ureq::tls::{Certificate, PemItem, RootCerts, TlsConfig};

/// Where Debian, Fedora, Alpine and macOS keep the system CA bundle.
const BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
];

fn system_roots() -> Option<Vec<Certificate<'static>>> {
    let from_env = std::env::var_os("SSL_CERT_FILE").map(std::path::PathBuf::from);
    let path = from_env
        .into_iter()
        .chain(BUNDLES.iter().map(std::path::PathBuf::from))
        .find(|p| p.is_file())?;
    let pem = std::fs::read(&path).ok()?;
    let certs: Vec<_> = ureq::tls::parse_pem(&pem)
        .filter_map(|item| match item {
            Ok(PemItem::Certificate(c)) => Some(c.to_owned()),
            _ => None,
        })
        .collect();
    (!certs.is_empty()).then_some(certs)
}

fn agent() -> &'static ureq::Agent {
    static AGENT: OnceLock<ureq::Agent> = OnceLock::new();
    AGENT.get_or_init(|| {
        let roots = match system_roots() {
            Some(c) => RootCerts::Specific(Arc::new(c)),
            None => RootCerts::WebPki,
        };
        ureq::Agent::config_builder()
            .timeout_connect(Some(Duration::from_secs(30)))
            // A stalled transfer fails instead of hanging the model load.
            .timeout_per_read(Some(Duration::from_secs(60)))
            .tls_config(TlsConfig::builder().root_certs(roots).build())
            .user_agent(concat!("ultrafast/", env!("CARGO_PKG_VERSION")))
            .build()
            .into()
    })
}

fn fetch_error(url: &str, e: impl std::fmt::Display) -> EngineError {
    EngineError::Fetch(format!("{url}: {e}"))
}

/// GET `url` as text (at most 16 MiB), sending `accept`.
pub fn get_text(url: &str, accept: &str) -> Result<(String, String)> {
    let mut resp = agent()
        .get(url)
        .header("Accept", accept)
        .call()
        .map_err(|e| fetch_error(url, e))?;
    let ctype = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = resp
        .body_mut()
        .with_config()
        .limit(16 << 20)
        .read_to_string()
        .map_err(|e| fetch_error(url, e))?;
    Ok((ctype, body))
}

/// Stream `url` into `dest` (created or truncated), with a progress line on
/// a terminal and a log line every quarter otherwise.
pub fn download(url: &str, dest: &Path) -> Result<u64> {
    // A mirror on local disk, as curl and huggingface_hub accept.
    if let Some(path) = url.strip_prefix("file://") {
        return std::fs::copy(path, dest).map_err(|e| fetch_error(url, e));
    }
    let mut resp = agent().get(url).call().map_err(|e| fetch_error(url, e))?;
    let total = resp
        .headers()
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let mut out =
        std::fs::File::create(dest).map_err(|e| EngineError::model(dest, e.to_string()))?;
    let mut body = resp.body_mut().as_reader();
    let mut buf = vec![0u8; 1 << 16];
    let mut done = 0u64;
    let mut progress = Progress::new(total);
    loop {
        let n = body.read(&mut buf).map_err(|e| fetch_error(url, e))?;
        if n == 0 {
            break;
        }
        out.write_all(&buf[..n])
            .map_err(|e| EngineError::model(dest, e.to_string()))?;
        done += n as u64;
        progress.show(done);
    }
    progress.finish(done);
    if total.is_some_and(|t| t != done) {
        return Err(fetch_error(url, format!("got {done} of {total:?} bytes")));
    }
    out.sync_all()
        .map_err(|e| EngineError::model(dest, e.to_string()))?;
    Ok(done)
}

struct Progress {
    total: Option<u64>,
    tty: bool,
    last: Instant,
    quarter: u64,
}

impl Progress {
    fn new(total: Option<u64>) -> Self {
        Progress {
            total,
            tty: std::io::stderr().is_terminal(),
            last: Instant::now(),
            quarter: 0,
        }
    }

    fn show(&mut self, done: u64) {
        let mib = done as f64 / (1 << 20) as f64;
        match (self.tty, self.total) {
            (true, _) if self.last.elapsed() >= Duration::from_millis(200) => {
                self.last = Instant::now();
                match self.total {
                    Some(t) => eprint!("\r  {mib:.1} / {:.1} MiB", t as f64 / (1 << 20) as f64),
                    None => eprint!("\r  {mib:.1} MiB"),
                }
            }
            (false, Some(t)) if t > 0 && done * 4 / t > self.quarter => {
                self.quarter = done * 4 / t;
                log::info!("  {}% ({mib:.1} MiB)", self.quarter * 25);
            }
            _ => {}
        }
    }

    fn finish(&self, done: u64) {
        if self.tty {
            eprintln!("\r  {:.1} MiB done", done as f64 / (1 << 20) as f64);
        }
    }
}
