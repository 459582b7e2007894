//! Access logging off the hot path. Requests hand a small `Entry` to a
//! bounded channel (`try_send`: never blocks a request; a full channel drops
//! the line and counts it); one writer thread formats and writes through a
//! buffer and flushes whenever the channel runs dry, so lines reach the
//! file within milliseconds at low load and in large writes at high load.

use crate::config::{LogFormat, LogTarget};
use crate::routing::Route;
use prometheus::IntCounter;
use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// One finished request. Its fields are what the request already holds
/// (shared header values, addresses, durations): the line is formatted on
/// the writer thread, so a request pays only for these clones.
#[derive(Debug)]
pub struct Entry {
    /// When the request started.
    pub time: SystemTime,
    /// Request id.
    pub request_id: http::HeaderValue,
    /// Client address.
    pub client: Option<IpAddr>,
    /// Method.
    pub method: http::Method,
    /// Path and query.
    pub uri: Option<http::uri::PathAndQuery>,
    /// Route, if one matched.
    pub route: Option<Arc<Route>>,
    /// Upstream member address, if proxied.
    pub upstream: Option<SocketAddr>,
    /// Status sent (0 if none).
    pub status: u16,
    /// Response body bytes sent.
    pub bytes: usize,
    /// Total time.
    pub total: Duration,
    /// Time to the upstream response header.
    pub upstream_time: Option<Duration>,
    /// Upstream tries.
    pub tries: u32,
    /// User agent.
    pub user_agent: Option<http::HeaderValue>,
    /// The config the request ran under, for its lane's name.
    pub config: Arc<crate::config::Config>,
    /// Lane (an index into the config's lanes).
    pub lane: usize,
    /// Time waited for an admission slot.
    pub queue: Option<Duration>,
}

impl Entry {
    fn lane(&self) -> &str {
        self.config
            .lanes
            .get(self.lane)
            .map_or("", |l| l.name.as_str())
    }

    fn uri(&self) -> &str {
        self.uri.as_ref().map_or("", |p| p.as_str())
    }

    fn user_agent(&self) -> &str {
        self.user_agent
            .as_ref()
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    fn request_id(&self) -> &str {
        self.request_id.to_str().unwrap_or("")
    }
}

enum Msg {
    Line(Box<Entry>),
    Flush(SyncSender<()>),
}

/// A handle for sending entries; cheap to clone.
#[derive(Clone)]
pub struct AccessLog {
    tx: Option<SyncSender<Msg>>,
    dropped: IntCounter,
}

impl AccessLog {
    /// Start the writer thread for `target` (no thread when off).
    pub fn start(
        target: &LogTarget,
        format: LogFormat,
        dropped: IntCounter,
    ) -> std::io::Result<Self> {
        let out: Box<dyn Write + Send> = match target {
            LogTarget::Off => return Ok(AccessLog { tx: None, dropped }),
            LogTarget::Stdout => Box::new(std::io::stdout()),
            LogTarget::File(p) => Box::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)?,
            ),
        };
        let (tx, rx) = sync_channel(16 * 1024);
        std::thread::Builder::new()
            .name("access-log".into())
            .spawn(move || writer(rx, out, format))?;
        Ok(AccessLog {
            tx: Some(tx),
            dropped,
        })
    }

    /// Queue an entry; drops it (and counts) if the writer is behind.
    pub fn log(&self, e: Entry) {
        if let Some(tx) = &self.tx {
            if let Err(TrySendError::Full(_)) = tx.try_send(Msg::Line(Box::new(e))) {
                self.dropped.inc();
            }
        }
    }

    /// Whether entries are written at all.
    pub fn enabled(&self) -> bool {
        self.tx.is_some()
    }

    /// Wait until every queued line is written (used at shutdown).
    pub fn flush(&self) {
        if let Some(tx) = &self.tx {
            let (ack_tx, ack_rx) = sync_channel(1);
            if tx.send(Msg::Flush(ack_tx)).is_ok() {
                let _ = ack_rx.recv_timeout(Duration::from_secs(2));
            }
        }
    }
}

fn writer(rx: Receiver<Msg>, out: Box<dyn Write + Send>, format: LogFormat) {
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, out);
    let mut line = String::with_capacity(512);
    let mut clock = Clock::default();
    loop {
        let msg = match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(m) => m,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => break,
        };
        let mut next = Some(msg);
        while let Some(m) = next.take() {
            match m {
                Msg::Line(e) => {
                    line.clear();
                    match format {
                        LogFormat::Json => json_line(&e, &mut line, &mut clock),
                        LogFormat::Combined => combined_line(&e, &mut line),
                    }
                    let _ = out.write_all(line.as_bytes());
                }
                Msg::Flush(ack) => {
                    let _ = out.flush();
                    let _ = ack.send(());
                }
            }
            next = rx.try_recv().ok();
        }
        let _ = out.flush();
    }
    let _ = out.flush();
}

/// One JSON line, written field by field: building a `serde_json::Value`
/// first (a map, a string per field) cost about 20,000 instructions per
/// request, and `core::fmt` for its numbers, addresses and time several
/// thousand more (benches/RESULTS.md section 13). Keys in the sorted order
/// that map wrote them in, so lines read as before.
fn json_line(e: &Entry, out: &mut String, clock: &mut Clock) {
    out.push_str("{\"bytes\":");
    push_u64(out, e.bytes as u64);
    out.push_str(",\"client\":");
    match e.client {
        Some(c) => {
            out.push('"');
            push_ip(out, c);
            out.push('"');
        }
        None => out.push_str("null"),
    }
    out.push_str(",\"lane\":");
    json_str(out, e.lane());
    out.push_str(",\"method\":");
    json_str(out, e.method.as_str());
    out.push_str(",\"queue_ms\":");
    push_ms(out, e.queue);
    out.push_str(",\"request_id\":");
    json_str(out, e.request_id());
    out.push_str(",\"route\":");
    match &e.route {
        Some(r) => json_str(out, &r.name),
        None => out.push_str("null"),
    }
    out.push_str(",\"status\":");
    push_u64(out, u64::from(e.status));
    out.push_str(",\"time\":\"");
    clock.rfc3339_into(out, e.time);
    out.push_str("\",\"total_ms\":");
    push_ms(out, Some(e.total));
    out.push_str(",\"tries\":");
    push_u64(out, u64::from(e.tries));
    out.push_str(",\"upstream\":");
    match e.upstream {
        Some(SocketAddr::V4(u)) => {
            out.push('"');
            push_ip(out, IpAddr::V4(*u.ip()));
            out.push(':');
            push_u64(out, u64::from(u.port()));
            out.push('"');
        }
        Some(u) => {
            // `[addr%scope]:port`, as `Display` writes it.
            use std::fmt::Write as _;
            let _ = write!(out, "\"{u}\"");
        }
        None => out.push_str("null"),
    }
    out.push_str(",\"upstream_ms\":");
    push_ms(out, e.upstream_time);
    out.push_str(",\"uri\":");
    json_str(out, e.uri());
    out.push_str(",\"user_agent\":");
    json_str(out, e.user_agent());
    out.push_str("}\n");
}

fn push_u64(out: &mut String, n: u64) {
    out.push_str(itoa::Buffer::new().format(n));
}

/// A duration in milliseconds to the microsecond, written as the shortest
/// form of that value would be (`1.5`, `0`, `12.345`), or `null`: integer
/// arithmetic, no float formatting.
fn push_ms(out: &mut String, d: Option<Duration>) {
    let Some(d) = d else {
        out.push_str("null");
        return;
    };
    let us = d.as_micros();
    push_u64(out, (us / 1000) as u64);
    let mut frac = (us % 1000) as u32;
    if frac == 0 {
        return;
    }
    let mut width = 3;
    while frac.is_multiple_of(10) {
        frac /= 10;
        width -= 1;
    }
    out.push('.');
    push_digits(out, frac, width);
}

/// `.` and three digits.
fn push_frac3(out: &mut String, n: u32) {
    out.push('.');
    push_digits(out, n, 3);
}

/// `n` in exactly `width` digits (zero-padded; `n` fits).
fn push_digits(out: &mut String, n: u32, width: u32) {
    let mut div = 10u32.pow(width - 1);
    while div > 0 {
        out.push(char::from(b'0' + (n / div % 10) as u8));
        div /= 10;
    }
}

/// An address as `Display` writes it; IPv4 (the common case) without
/// `core::fmt`.
pub(crate) fn push_ip(out: &mut String, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            for (i, o) in v4.octets().iter().enumerate() {
                if i > 0 {
                    out.push('.');
                }
                push_u64(out, u64::from(*o));
            }
        }
        IpAddr::V6(v6) => {
            use std::fmt::Write as _;
            let _ = write!(out, "{v6}");
        }
    }
}

/// `s` as a JSON string (RFC 8259: quote, backslash and controls escaped).
/// The escaped characters are all ASCII, so the scan is over bytes and a
/// string without any (the usual case) is copied whole.
pub(crate) fn json_str(out: &mut String, s: &str) {
    use std::fmt::Write as _;
    out.push('"');
    // One branch-free pass (vectorized) answers for the whole string.
    let special = s.bytes().fold(false, |acc, b| {
        acc | (b < 0x20) | (b == b'"') | (b == b'\\')
    });
    if !special {
        out.push_str(s);
        out.push('"');
        return;
    }
    let mut plain = 0;
    for (i, &b) in s.as_bytes().iter().enumerate() {
        let esc = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            b if b < 0x20 => "",
            _ => continue,
        };
        out.push_str(&s[plain..i]);
        if esc.is_empty() {
            let _ = write!(out, "\\u{:04x}", b);
        } else {
            out.push_str(esc);
        }
        plain = i + 1;
    }
    out.push_str(&s[plain..]);
    out.push('"');
}

fn combined_line(e: &Entry, out: &mut String) {
    use std::fmt::Write as _;
    let _ = writeln!(
        out,
        "{} - - [{}] \"{} {} HTTP/1.1\" {} {} \"-\" \"{}\" rid={} rt={:.3} urt={} up={}",
        e.client
            .map(|c| c.to_string())
            .unwrap_or_else(|| "-".into()),
        rfc3339(e.time),
        e.method,
        e.uri(),
        e.status,
        e.bytes,
        e.user_agent().replace('"', "'"),
        e.request_id(),
        e.total.as_secs_f64(),
        e.upstream_time
            .map(|d| format!("{:.3}", d.as_secs_f64()))
            .unwrap_or_else(|| "-".into()),
        e.upstream
            .map(|u| u.to_string())
            .unwrap_or_else(|| "-".into()),
    );
}

/// UTC RFC 3339 with milliseconds, without a date library.
pub fn rfc3339(t: SystemTime) -> String {
    let mut s = String::with_capacity(24);
    Clock::default().rfc3339_into(&mut s, t);
    s
}

/// The writer's clock: the date and time of the current second, formatted
/// once per second (as nginx caches its time strings).
#[derive(Default)]
struct Clock {
    second: Option<u64>,
    text: String,
}

impl Clock {
    /// `t` in RFC 3339 with milliseconds, appended to `out`.
    fn rfc3339_into(&mut self, out: &mut String, t: SystemTime) {
        let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
        if self.second != Some(d.as_secs()) {
            self.second = Some(d.as_secs());
            self.text.clear();
            civil(&mut self.text, d.as_secs() as i64);
        }
        out.push_str(&self.text);
        push_frac3(out, d.subsec_millis());
        out.push('Z');
    }
}

/// `YYYY-MM-DDTHH:MM:SS` of a second since the epoch (Howard Hinnant's
/// civil_from_days).
fn civil(out: &mut String, secs: i64) {
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + (month <= 2) as i64;
    let two = |out: &mut String, n: i64, sep: char| {
        push_digits(out, n as u32, 2);
        out.push(sep);
    };
    push_digits(out, year.clamp(0, 9999) as u32, 4);
    out.push('-');
    two(out, month, '-');
    two(out, day, 'T');
    two(out, rem / 3600, ':');
    two(out, rem / 60 % 60, ':');
    push_digits(out, (rem % 60) as u32, 2);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_json_line_parses_with_every_field_and_escape() {
        let e = Entry {
            time: UNIX_EPOCH + Duration::from_millis(1_709_210_096_123),
            request_id: http::HeaderValue::from_static("rid-\"1\""),
            client: Some("127.0.0.1".parse().unwrap()),
            method: http::Method::POST,
            uri: Some(http::uri::PathAndQuery::from_static("/a?b=\\c")),
            route: None,
            upstream: Some("10.0.0.1:80".parse().unwrap()),
            status: 201,
            bytes: 42,
            total: Duration::from_micros(1500),
            upstream_time: None,
            tries: 2,
            user_agent: None,
            config: Arc::new(lane_config("ultra")),
            lane: 0,
            queue: Some(Duration::from_micros(250)),
        };
        let mut line = String::new();
        json_line(&e, &mut line, &mut Clock::default());
        assert!(line.ends_with("}\n"));
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["request_id"], "rid-\"1\"");
        assert_eq!(v["uri"], "/a?b=\\c");
        assert_eq!(v["user_agent"], "");
        assert_eq!(v["client"], "127.0.0.1");
        assert_eq!(v["method"], "POST");
        assert_eq!(v["route"], serde_json::Value::Null);
        assert_eq!(v["upstream"], "10.0.0.1:80");
        assert_eq!(
            (v["status"].as_u64(), v["bytes"].as_u64()),
            (Some(201), Some(42))
        );
        assert_eq!(v["total_ms"].as_f64(), Some(1.5));
        assert_eq!(v["upstream_ms"], serde_json::Value::Null);
        assert_eq!(v["queue_ms"].as_f64(), Some(0.25));
        assert_eq!(v["tries"].as_u64(), Some(2));
        assert_eq!(v["lane"], "ultra");
        assert_eq!(v["time"], "2024-02-29T12:34:56.123Z");
        assert_eq!(v.as_object().unwrap().len(), 15);
        // An IPv6 member as `SocketAddr` writes it (brackets, scope).
        let e = Entry {
            upstream: Some("[fe80::1%3]:8000".parse().unwrap()),
            ..e
        };
        line.clear();
        json_line(&e, &mut line, &mut Clock::default());
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["upstream"], "[fe80::1%3]:8000");
    }

    fn lane_config(lane: &str) -> crate::config::Config {
        let text = format!("[[listeners]]\naddress = \"127.0.0.1:0\"\n[lanes.{lane}]\nrank = 0\n");
        let m = crate::metrics::Metrics::new();
        crate::config::parse(std::path::Path::new("t.toml"), &text, &m).unwrap()
    }

    #[test]
    fn strings_are_escaped_as_json() {
        for s in ["ua\u{1}\n\té\u{1F600}", "plain", "q\"b\\", "", "\u{1f}\r"] {
            let mut out = String::new();
            json_str(&mut out, s);
            let back: String = serde_json::from_str(&out).unwrap();
            assert_eq!(back, s, "{out}");
        }
    }

    #[test]
    fn durations_and_addresses_read_as_before() {
        let mut out = String::new();
        push_ms(&mut out, Some(Duration::from_nanos(12_345_678)));
        out.push(' ');
        push_ms(&mut out, Some(Duration::ZERO));
        out.push(' ');
        push_ms(&mut out, None);
        out.push(' ');
        push_ip(&mut out, "10.200.3.0".parse().unwrap());
        out.push(' ');
        push_ip(&mut out, "::1".parse().unwrap());
        out.push(' ');
        push_ms(&mut out, Some(Duration::from_micros(1_500)));
        out.push(' ');
        push_ms(&mut out, Some(Duration::from_micros(250)));
        out.push(' ');
        push_ms(&mut out, Some(Duration::from_micros(1_005)));
        assert_eq!(out, "12.345 0 null 10.200.3.0 ::1 1.5 0.25 1.005");
        let mut c = Clock::default();
        let t = UNIX_EPOCH + Duration::from_millis(1_709_210_096_123);
        let mut a = String::new();
        c.rfc3339_into(&mut a, t);
        c.rfc3339_into(&mut a, t + Duration::from_millis(5));
        c.rfc3339_into(&mut a, t + Duration::from_secs(86_400));
        assert_eq!(
            a,
            "2024-02-29T12:34:56.123Z2024-02-29T12:34:56.128Z2024-03-01T12:34:56.123Z"
        );
    }

    #[test]
    fn rfc3339_known_instants() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(1_709_210_096_123);
        assert_eq!(rfc3339(t), "2024-02-29T12:34:56.123Z");
    }
}
