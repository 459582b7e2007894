//! Access logging off the hot path. Requests hand a small `Entry` to a
//! bounded channel (`try_send`: never blocks a request; a full channel drops
//! the line and counts it); one writer thread formats and writes through a
//! buffer and flushes whenever the channel runs dry, so lines reach the
//! file within milliseconds at low load and in large writes at high load.

use crate::config::{LogFormat, LogTarget};
use crate::routing::Route;
use prometheus::IntCounter;
use std::io::Write;
use std::net::IpAddr;
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// One finished request.
#[derive(Debug)]
pub struct Entry {
    /// When the request started.
    pub time: SystemTime,
    /// Request id.
    pub request_id: String,
    /// Client address.
    pub client: Option<IpAddr>,
    /// Method.
    pub method: http::Method,
    /// Path and query.
    pub uri: String,
    /// Route, if one matched.
    pub route: Option<Arc<Route>>,
    /// Upstream member address, if proxied.
    pub upstream: Option<String>,
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
    pub user_agent: String,
    /// Lane.
    pub lane: String,
    /// Time waited for an admission slot.
    pub queue_ms: Option<f64>,
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
                        LogFormat::Json => json_line(&e, &mut line),
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
/// request (benches/RESULTS.md section 13). Keys in the sorted order that
/// map wrote them in, so lines read as before.
fn json_line(e: &Entry, out: &mut String) {
    use std::fmt::Write as _;
    let _ = write!(out, "{{\"bytes\":{},\"client\":", e.bytes);
    match e.client {
        Some(c) => {
            let _ = write!(out, "\"{c}\"");
        }
        None => out.push_str("null"),
    }
    out.push_str(",\"lane\":");
    json_str(out, &e.lane);
    out.push_str(",\"method\":");
    json_str(out, e.method.as_str());
    out.push_str(",\"queue_ms\":");
    json_num(out, e.queue_ms);
    out.push_str(",\"request_id\":");
    json_str(out, &e.request_id);
    out.push_str(",\"route\":");
    match &e.route {
        Some(r) => json_str(out, &r.name),
        None => out.push_str("null"),
    }
    let _ = write!(out, ",\"status\":{},\"time\":\"", e.status);
    rfc3339_into(out, e.time);
    out.push_str("\",\"total_ms\":");
    json_num(out, Some(e.total.as_secs_f64() * 1000.0));
    let _ = write!(out, ",\"tries\":{},\"upstream\":", e.tries);
    match &e.upstream {
        Some(u) => json_str(out, u),
        None => out.push_str("null"),
    }
    out.push_str(",\"upstream_ms\":");
    json_num(out, e.upstream_time.map(|d| d.as_secs_f64() * 1000.0));
    out.push_str(",\"uri\":");
    json_str(out, &e.uri);
    out.push_str(",\"user_agent\":");
    json_str(out, &e.user_agent);
    out.push_str("}\n");
}

/// `s` as a JSON string (RFC 8259: quote, backslash and controls escaped).
pub(crate) fn json_str(out: &mut String, s: &str) {
    use std::fmt::Write as _;
    out.push('"');
    let mut plain = 0;
    for (i, c) in s.char_indices() {
        let esc = match c {
            '"' => "\\\"",
            '\\' => "\\\\",
            '\n' => "\\n",
            '\r' => "\\r",
            '\t' => "\\t",
            c if (c as u32) < 0x20 => "",
            _ => continue,
        };
        out.push_str(&s[plain..i]);
        if esc.is_empty() {
            let _ = write!(out, "\\u{:04x}", c as u32);
        } else {
            out.push_str(esc);
        }
        plain = i + c.len_utf8();
    }
    out.push_str(&s[plain..]);
    out.push('"');
}

/// A finite number, or `null` (Rust's shortest round-trip form is valid
/// JSON: no exponent, no NaN for a duration).
fn json_num(out: &mut String, v: Option<f64>) {
    use std::fmt::Write as _;
    match v.filter(|v| v.is_finite()) {
        Some(v) => {
            let _ = write!(out, "{v}");
        }
        None => out.push_str("null"),
    }
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
        e.uri,
        e.status,
        e.bytes,
        e.user_agent.replace('"', "'"),
        e.request_id,
        e.total.as_secs_f64(),
        e.upstream_time
            .map(|d| format!("{:.3}", d.as_secs_f64()))
            .unwrap_or_else(|| "-".into()),
        e.upstream.as_deref().unwrap_or("-"),
    );
}

/// UTC RFC 3339 with milliseconds, without a date library.
pub fn rfc3339(t: SystemTime) -> String {
    let mut s = String::with_capacity(24);
    rfc3339_into(&mut s, t);
    s
}

/// [`rfc3339`], appended to `out`.
fn rfc3339_into(out: &mut String, t: SystemTime) {
    use std::fmt::Write as _;
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + (month <= 2) as i64;
    let _ = write!(
        out,
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        d.subsec_millis()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_json_line_parses_with_every_field_and_escape() {
        let e = Entry {
            time: UNIX_EPOCH + Duration::from_millis(1_709_210_096_123),
            request_id: "rid-\"1\"".into(),
            client: Some("127.0.0.1".parse().unwrap()),
            method: http::Method::POST,
            uri: "/a?b=\\c".into(),
            route: None,
            upstream: Some("10.0.0.1:80".into()),
            status: 201,
            bytes: 42,
            total: Duration::from_micros(1500),
            upstream_time: None,
            tries: 2,
            user_agent: "ua\u{1}\n\té\u{1F600}".into(),
            lane: "ultra".into(),
            queue_ms: Some(0.25),
        };
        let mut line = String::new();
        json_line(&e, &mut line);
        assert!(line.ends_with("}\n"));
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["request_id"], "rid-\"1\"");
        assert_eq!(v["uri"], "/a?b=\\c");
        assert_eq!(v["user_agent"], "ua\u{1}\n\té\u{1F600}");
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
    }

    #[test]
    fn rfc3339_known_instants() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(1_709_210_096_123);
        assert_eq!(rfc3339(t), "2024-02-29T12:34:56.123Z");
    }
}
