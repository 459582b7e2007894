//! Configuration as data: the TOML file format (`file`), the typed,
//! comparable settings the file becomes, and error locations (`locate`).
//!
//! Three layers, as in river and pingora: what users write, a validation
//! that reports every problem with file, line and field and never panics,
//! and the live objects the proxy runs on. This module holds the first
//! and the data of the second; it imports no subsystem and holds no
//! runtime handle. `runtime` builds the live snapshot from it (and owns
//! validation of the sections that become objects), swaps it whole on
//! reload, and keeps the loops that walk it.

pub mod acme;
pub mod file;
pub mod locate;
pub mod spec;
pub mod validate;

use std::fmt;
use std::path::{Path, PathBuf};

/// One problem in a config file, with where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The file.
    pub file: String,
    /// 1-based line.
    pub line: usize,
    /// 1-based column.
    pub col: usize,
    /// Dotted field path (may be empty for syntax errors).
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}: ", self.file, self.line, self.col)?;
        if !self.field.is_empty() {
            write!(f, "{}: ", self.field)?;
        }
        f.write_str(&self.message)
    }
}

/// Process-wide settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerSettings {
    /// Worker threads of the traffic service.
    pub threads: usize,
    /// Work stealing between worker threads.
    pub work_stealing: bool,
    /// SIGTERM drain window, seconds.
    pub grace_period_s: u64,
    /// Runtime stop timeout, seconds.
    pub shutdown_timeout_s: u64,
    /// Pid file.
    pub pid_file: String,
    /// Upgrade socket.
    pub upgrade_sock: String,
    /// Idle upstream connections kept, all pools together.
    pub keepalive_pool_size: usize,
}

/// Where access logs go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogTarget {
    /// No access log.
    Off,
    /// Standard output.
    Stdout,
    /// Appended to a file.
    File(PathBuf),
}

/// Access log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// One JSON object per line.
    Json,
    /// nginx's `combined` format plus request id and timings.
    Combined,
}

/// A listener's deadlines on its clients (`[limits]`'s unless the
/// listener sets its own); nginx's directive beside each.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Deadlines {
    /// Whole-request-head deadline, ms, 0 = none (`client_header_timeout`).
    pub client_header_timeout_ms: u64,
    /// Most time between two reads of a request body, `None`: no limit
    /// (`client_body_timeout`).
    pub client_body_timeout: Option<std::time::Duration>,
    /// Most time one write to the client may take, `None`: no limit
    /// (`send_timeout`).
    pub send_timeout: Option<std::time::Duration>,
    /// Idle keepalive between requests, seconds (`keepalive_timeout`).
    pub keepalive_timeout_s: u64,
    /// On an h2c listener, time to tell the HTTP/2 preface from HTTP/1;
    /// `None`: the head deadline.
    pub h2c_preface_timeout: Option<std::time::Duration>,
}

/// Downstream limits.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Max request body (0 = unlimited).
    pub client_max_body_bytes: u64,
    /// Max request head size.
    pub max_header_bytes: usize,
    /// Max header count.
    pub max_headers: usize,
    /// Open traffic connections at most (0 = no cap).
    pub max_connections: usize,
    /// Deadlines of listeners that set none of their own.
    pub deadlines: Deadlines,
    /// Proxied bodies are read whole before an upstream is taken.
    pub request_buffering: bool,
    /// Bytes of a buffered body held in memory.
    pub client_body_buffer_bytes: usize,
    /// Directory of spilled bodies.
    pub client_body_temp_path: PathBuf,
    /// Proxied responses are read from the origin into a buffer.
    pub response_buffering: bool,
    /// Bytes of a buffered response in memory, per connection.
    pub response_buffer_bytes: usize,
    /// Bytes of buffered responses in memory, all connections.
    pub response_buffers_total_bytes: u64,
    /// Bytes of one response's temporary file (0: memory only).
    pub max_temp_file_bytes: u64,
    /// Bytes of all temporary files of buffered responses.
    pub temp_files_total_bytes: u64,
    /// Directory of those files.
    pub proxy_temp_path: std::sync::Arc<std::path::Path>,
    /// Upgraded connections at most (0 = no cap).
    pub max_upgraded: usize,
    /// Most silence from an upgraded connection's client (`None`: none).
    pub upgraded_idle_timeout: Option<std::time::Duration>,
}

/// A traffic listener.
#[derive(Debug, Clone, PartialEq)]
pub struct Listener {
    /// Name.
    pub name: String,
    /// `ip:port`.
    pub address: String,
    /// TLS settings, for a TLS listener.
    pub tls: Option<TlsListener>,
    /// HTTP/2 with prior knowledge on a plain listener.
    pub h2c: bool,
    /// Redirect everything to HTTPS on this port (0 = off).
    pub redirect_https_port: u16,
    /// Its deadlines (`[limits]`'s where it sets none).
    pub deadlines: Deadlines,
    /// Its PROXY protocol settings, when its connections carry the header.
    pub proxy_protocol: Option<spec::ProxyProtocol>,
}

/// One certificate entry of a listener.
#[derive(Debug, Clone, PartialEq)]
pub struct CertSpec {
    /// PEM chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key (RSA, ECDSA or Ed25519).
    pub key: PathBuf,
    /// DER OCSP response to staple, if any.
    pub ocsp: Option<PathBuf>,
    /// SNI names it serves: exact or `*.suffix`.
    pub names: Vec<String>,
    /// Serve it when no name matches.
    pub default: bool,
    /// Skipped while its file does not exist (an ACME certificate not yet
    /// issued); any other entry that cannot load fails its store.
    pub optional: bool,
}

/// The ACME challenge a listener answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcmeChallenge {
    /// `http-01`: a token under `/.well-known/acme-challenge/` on port 80.
    Http01,
    /// `tls-alpn-01`: a certificate for the `acme-tls/1` protocol.
    TlsAlpn01,
}

/// A listener's ACME settings, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct AcmeSpec {
    /// Directory URL.
    pub directory: String,
    /// Names of the certificate (lowercase).
    pub domains: Vec<String>,
    /// Account contacts.
    pub contact: Vec<String>,
    /// The challenge to answer.
    pub challenge: AcmeChallenge,
    /// DER certificates trusted for the directory (empty: the web roots).
    pub trust_roots: Vec<Vec<u8>>,
    /// Account and certificate state.
    pub state_dir: PathBuf,
    /// DER roots the directory's certificates chain to (`issuer_roots`;
    /// empty: the web's roots): a certificate from the cluster's store is
    /// installed only if it chains to one.
    pub issuer_roots: Vec<Vec<u8>>,
    /// The key that seals what is shared through the cluster's store
    /// (`shared_key_file`); `None`: nothing is shared.
    pub shared_key: Option<[u8; 32]>,
}

impl AcmeSpec {
    /// The file holding the issued chain and its key.
    pub fn cert_file(&self) -> PathBuf {
        self.state_dir.join("certificate.pem")
    }

    /// The certificate entry that serves the issued certificate.
    pub fn cert_spec(&self, default: bool) -> CertSpec {
        CertSpec {
            cert: self.cert_file(),
            key: self.cert_file(),
            ocsp: None,
            names: self.domains.clone(),
            default,
            optional: true,
        }
    }
}

/// TLS settings of a listener.
#[derive(Debug, Clone, PartialEq)]
pub struct TlsListener {
    /// Certificates.
    pub certs: Vec<CertSpec>,
    /// Offer h2.
    pub h2: bool,
    /// Issue tickets.
    pub tickets: bool,
    /// Ticket key rotation period.
    pub rotation: std::time::Duration,
    /// Shared ticket secret, read at start.
    pub ticket_secret: Option<Vec<u8>>,
    /// Session cache size.
    pub cache_size: usize,
    /// Handshake deadline.
    pub handshake_timeout: std::time::Duration,
    /// HSTS max-age (None: no header).
    pub hsts_max_age_s: Option<u64>,
    /// ACME settings, when a certificate comes from ACME.
    pub acme: Option<AcmeSpec>,
    /// HTTP/3 settings, when the listener also speaks QUIC.
    pub http3: Option<Http3>,
}

/// When an HTTP/3 listener asks a new client to prove its address (a QUIC
/// Retry: one round trip more, no state kept for a spoofed source).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuicRetry {
    /// Under load only.
    Auto,
    /// Every new connection.
    Always,
    /// Never.
    Never,
}

/// A TLS listener's HTTP/3 settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Http3 {
    /// Concurrent request streams per connection.
    pub max_streams: u32,
    /// Idle timeout.
    pub idle_timeout: std::time::Duration,
    /// Connections at most.
    pub max_connections: usize,
    /// Address validation.
    pub retry: QuicRetry,
    /// 0-RTT accepted.
    pub early_data: bool,
    /// `Alt-Svc` max-age.
    pub alt_svc_max_age_s: u64,
}

/// What a listener does to every request it receives.
#[derive(Debug, Clone, PartialEq)]
pub struct ListenerRule {
    /// The listener's address.
    pub addr: std::net::SocketAddr,
    /// Redirect to HTTPS on this port.
    pub redirect_https_port: Option<u16>,
    /// HSTS header value for responses.
    pub hsts: Option<http::HeaderValue>,
    /// `Alt-Svc` advertising HTTP/3 on this listener's port, for its TCP
    /// responses.
    pub alt_svc: Option<http::HeaderValue>,
    /// The listener's deadlines.
    pub deadlines: Deadlines,
}

/// Rules for listeners that redirect, send HSTS or have deadlines of
/// their own (the others have none: the lookup stays short).
pub fn listener_rules(listeners: &[Listener], defaults: &Deadlines) -> Vec<ListenerRule> {
    listeners
        .iter()
        .filter_map(|l| {
            let addr: std::net::SocketAddr = l.address.parse().ok()?;
            let redirect = (l.redirect_https_port != 0).then_some(l.redirect_https_port);
            let hsts = l
                .tls
                .as_ref()
                .and_then(|t| t.hsts_max_age_s)
                .and_then(|s| http::HeaderValue::from_str(&format!("max-age={s}")).ok());
            let alt_svc = l.tls.as_ref().and_then(|t| t.http3.as_ref()).and_then(|h| {
                let v = format!("h3=\":{}\"; ma={}", addr.port(), h.alt_svc_max_age_s);
                http::HeaderValue::from_str(&v).ok()
            });
            let own = l.deadlines != *defaults;
            (redirect.is_some() || hsts.is_some() || alt_svc.is_some() || own).then_some(
                ListenerRule {
                    addr,
                    redirect_https_port: redirect,
                    hsts,
                    alt_svc,
                    deadlines: l.deadlines,
                },
            )
        })
        .collect()
}

/// A whole-file error (unreadable file, resolver failure) at line 1.
pub fn file_error(path: &Path, message: String) -> Vec<ConfigError> {
    vec![ConfigError {
        file: path.display().to_string(),
        line: 1,
        col: 1,
        field: String::new(),
        message,
    }]
}

/// Read a config file's text.
pub fn read(path: &Path) -> Result<String, Vec<ConfigError>> {
    std::fs::read_to_string(path)
        .map_err(|e| file_error(path, format!("cannot read config file: {e}")))
}

/// Parse TOML text into the file structs (syntax and unknown-key errors,
/// located).
pub fn parse_file(path: &Path, text: &str) -> Result<file::FileConfig, Vec<ConfigError>> {
    parse_toml(path, text)
}

/// Parse TOML text from `path` into `T`, with a syntax, type or unknown-key
/// error located (file:line:col and the field).
pub fn parse_toml<T: serde::de::DeserializeOwned>(
    path: &Path,
    text: &str,
) -> Result<T, Vec<ConfigError>> {
    toml::from_str(text).map_err(|e| {
        let (line, col) = e
            .span()
            .map(|s| locate::line_col(text, s.start))
            .unwrap_or((1, 1));
        vec![ConfigError {
            file: path.display().to_string(),
            line,
            col,
            field: field_from_toml_error(text, &e),
            message: e.message().trim().to_string(),
        }]
    })
}

/// toml names only the offending key; prefix it with the table header above
/// it (`[server]` + `threds` -> `server.threds`) so the field reads as a path.
fn field_from_toml_error(text: &str, e: &toml::de::Error) -> String {
    let Some(span) = e.span() else {
        return String::new();
    };
    let start = span.start.min(text.len());
    let line_start = text[..start].rfind('\n').map(|i| i + 1).unwrap_or(0);
    let line = text[line_start..].split('\n').next().unwrap_or("");
    let key = match line.split_once('=') {
        Some((k, _)) if !k.trim_start().starts_with('[') => k.trim(),
        _ => return String::new(),
    };
    let table = text[..line_start]
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('['))
        .map(|l| {
            l.trim_start_matches('[')
                .split(']')
                .next()
                .unwrap_or("")
                .trim()
        });
    match table {
        Some(t) if text[..line_start].contains(&format!("[[{t}]]")) => format!("{t}[].{key}"),
        Some(t) => format!("{t}.{key}"),
        None => key.to_string(),
    }
}

/// Default pid/upgrade paths: unique per config file, so two instances
/// started from different files never share them.
pub fn default_runtime_path(config_path: &Path, ext: &str) -> String {
    let canon = std::fs::canonicalize(config_path).unwrap_or_else(|_| config_path.to_path_buf());
    let h = crate::hash::hash_bytes(canon.to_string_lossy().as_bytes());
    format!("/tmp/ultrafast-{:08x}.{ext}", h as u32)
}
