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

fn json_line(e: &Entry, out: &mut String) {
    let v = serde_json::json!({
        "time": rfc3339(e.time),
        "request_id": e.request_id,
        "client": e.client.map(|c| c.to_string()),
        "method": e.method.as_str(),
        "uri": e.uri,
        "route": e.route.as_ref().map(|r| r.name.as_str()),
        "upstream": e.upstream,
        "status": e.status,
        "bytes": e.bytes,
        "total_ms": e.total.as_secs_f64() * 1000.0,
        "upstream_ms": e.upstream_time.map(|d| d.as_secs_f64() * 1000.0),
        "tries": e.tries,
        "user_agent": e.user_agent,
        "lane": e.lane,
        "queue_ms": e.queue_ms,
    });
    out.push_str(&v.to_string());
    out.push('\n');
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
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        d.subsec_millis()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_known_instants() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(1_709_210_096_123);
        assert_eq!(rfc3339(t), "2024-02-29T12:34:56.123Z");
    }
}
