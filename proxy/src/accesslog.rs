//! Access logging without a hand-over per request. A request formats its
//! line on its own thread into that thread's buffer (a mutex nobody else
//! takes but the writer thread); a buffer past 32 KiB waits, full, beside
//! it, and the writer thread is woken to write it. The writer also takes
//! what the buffers hold every 100 ms, so a line reaches the file within
//! about 100 ms at low load and in large writes at high load (nginx's
//! `access_log ... buffer=32k flush=100ms`). A request never blocks on the
//! file: when the writer is behind, a full buffer is dropped and its lines
//! counted. Before, every request sent an owned entry over a channel and
//! woke the writer thread (about 4,500 instructions per request,
//! benches/RESULTS.md section 13).

use crate::config::{LogFormat, LogTarget};
use prometheus::IntCounter;
use std::cell::RefCell;
use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// One finished request, borrowed from the request itself: the line is
/// written before the request's state is dropped, so nothing is cloned.
#[derive(Debug)]
pub struct Entry<'a> {
    /// When the request started.
    pub time: SystemTime,
    /// Request id.
    pub request_id: &'a str,
    /// Client address.
    pub client: Option<IpAddr>,
    /// Method.
    pub method: &'a str,
    /// Path and query.
    pub uri: &'a str,
    /// Route name, if one matched.
    pub route: Option<&'a str>,
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
    pub user_agent: &'a str,
    /// The protocol the request came in (`HTTP/1.1`, `HTTP/2`, `HTTP/3`).
    pub protocol: &'static str,
    /// Lane name.
    pub lane: &'a str,
    /// Time waited for an admission slot.
    pub queue: Option<Duration>,
}

/// A buffer hands itself to the writer past this size.
const CHUNK: usize = 32 * 1024;
/// How often the writer takes what the buffers hold.
const FLUSH_EVERY: Duration = Duration::from_millis(100);

/// Full buffers the writer may be behind by, all threads together (2 MiB).
const BEHIND_MAX: usize = 64;

/// One thread's lines not yet written.
#[derive(Default)]
struct Buf {
    text: String,
    /// Lines in `text`.
    lines: u64,
    /// Full buffers, oldest first, all older than `text`: kept here, not
    /// sent, so that the writer takes a thread's lines in one place and in
    /// their order.
    full: Vec<String>,
    /// Empty buffers the writer gave back, for when `text` is full: buffers
    /// go round between the threads, never allocated again.
    spare: Vec<String>,
    memo: Memo,
}

type Shard = Arc<Mutex<Buf>>;

enum Msg {
    /// A buffer is full.
    Wake,
    Flush(SyncSender<()>),
}

struct Inner {
    format: LogFormat,
    tx: SyncSender<Msg>,
    shards: Mutex<Vec<Shard>>,
    /// Full buffers not yet written.
    behind: AtomicUsize,
    dropped: IntCounter,
}

thread_local! {
    /// This thread's buffer for each log (one, outside tests), by the log's
    /// address: the `Weak` keeps that allocation, so no later log has it.
    static MINE: RefCell<Vec<(Weak<Inner>, Shard)>> = const { RefCell::new(Vec::new()) };
}

/// A handle for logging; cheap to clone.
#[derive(Clone)]
pub struct AccessLog {
    inner: Option<Arc<Inner>>,
}

impl AccessLog {
    /// Start the writer thread for `target` (no thread when off).
    pub fn start(
        target: &LogTarget,
        format: LogFormat,
        dropped: IntCounter,
    ) -> std::io::Result<Self> {
        let out: Box<dyn Write + Send> = match target {
            LogTarget::Off => return Ok(AccessLog { inner: None }),
            LogTarget::Stdout => Box::new(std::io::stdout()),
            LogTarget::File(p) => Box::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)?,
            ),
        };
        // One wake pending is enough: the writer takes every full buffer.
        let (tx, rx) = sync_channel(1);
        let inner = Arc::new(Inner {
            format,
            tx,
            shards: Mutex::new(Vec::new()),
            behind: AtomicUsize::new(0),
            dropped,
        });
        let weak = Arc::downgrade(&inner);
        std::thread::Builder::new()
            .name("access-log".into())
            .spawn(move || writer(rx, out, weak))?;
        Ok(AccessLog { inner: Some(inner) })
    }

    /// Write `e`'s line into this thread's buffer.
    pub fn log(&self, e: &Entry<'_>) {
        let Some(inner) = &self.inner else {
            return;
        };
        MINE.with(|m| {
            let mut m = m.borrow_mut();
            let at = match m
                .iter()
                .position(|(w, _)| std::ptr::eq(w.as_ptr(), &**inner))
            {
                Some(at) => at,
                None => {
                    // First line of this thread: forget buffers of logs gone.
                    m.retain(|(w, _)| w.strong_count() > 0);
                    let s = Shard::default();
                    lock(&inner.shards).push(s.clone());
                    m.push((Arc::downgrade(inner), s));
                    m.len() - 1
                }
            };
            let mut b = lock(&m[at].1);
            let Buf {
                text,
                lines,
                full,
                spare,
                memo,
            } = &mut *b;
            match inner.format {
                LogFormat::Json => json_line(e, text, memo),
                LogFormat::Combined => combined_line(e, text),
            }
            *lines += 1;
            if text.len() < CHUNK {
                return;
            }
            if inner.behind.fetch_add(1, Ordering::Relaxed) >= BEHIND_MAX {
                // The writer is behind: these lines go, the buffer stays.
                inner.behind.fetch_sub(1, Ordering::Relaxed);
                inner.dropped.inc_by(std::mem::take(lines));
                text.clear();
                return;
            }
            let next = spare.pop().unwrap_or_else(new_buf);
            full.push(std::mem::replace(text, next));
            *lines = 0;
            drop(b);
            // A wake already pending does as well.
            let _ = inner.tx.try_send(Msg::Wake);
        });
    }

    /// Whether entries are written at all.
    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// Wait until every line logged so far is written (used at shutdown).
    pub fn flush(&self) {
        if let Some(inner) = &self.inner {
            let (ack_tx, ack_rx) = sync_channel(1);
            if inner.tx.send(Msg::Flush(ack_tx)).is_ok() {
                let _ = ack_rx.recv_timeout(Duration::from_secs(2));
            }
        }
    }
}

/// A poisoned buffer is still a buffer: a panic mid-line leaves at worst
/// a torn line, which is better than losing the log.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn new_buf() -> String {
    String::with_capacity(CHUNK + 1024)
}

fn writer(rx: Receiver<Msg>, mut out: Box<dyn Write + Send>, log: Weak<Inner>) {
    let mut drained = Instant::now();
    loop {
        match rx.recv_timeout(FLUSH_EVERY) {
            Ok(Msg::Wake) => {
                drain(&log, &mut out, false);
                // Full buffers from a busy thread must not hold back the
                // lines of the quiet ones.
                if drained.elapsed() < FLUSH_EVERY {
                    continue;
                }
            }
            Ok(Msg::Flush(ack)) => {
                drain(&log, &mut out, true);
                drained = Instant::now();
                let _ = ack.send(());
                continue;
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        drain(&log, &mut out, true);
        drained = Instant::now();
    }
    drain(&log, &mut out, true);
}

/// Write every thread's full buffers and, with `partial`, the lines of
/// the buffers still filling. A thread's buffers are taken under one lock,
/// so its lines are written in their order; written, they go back to it.
fn drain(log: &Weak<Inner>, out: &mut Box<dyn Write + Send>, partial: bool) {
    let Some(inner) = log.upgrade() else {
        return;
    };
    let shards: Vec<Shard> = lock(&inner.shards).clone();
    let mut wrote = false;
    for s in shards {
        let (mut taken, full) = {
            let mut b = lock(&s);
            let mut taken = std::mem::take(&mut b.full);
            let full = taken.len();
            if partial && !b.text.is_empty() {
                let next = b.spare.pop().unwrap_or_else(new_buf);
                taken.push(std::mem::replace(&mut b.text, next));
                b.lines = 0;
            }
            (taken, full)
        };
        if taken.is_empty() {
            continue;
        }
        for t in &mut taken {
            let _ = out.write_all(t.as_bytes());
            t.clear();
        }
        inner.behind.fetch_sub(full, Ordering::Relaxed);
        // Two spares are enough for a thread; the rest are freed.
        let mut b = lock(&s);
        let room = 2usize.saturating_sub(b.spare.len());
        b.spare.extend(taken.into_iter().take(room));
        wrote = true;
    }
    if wrote {
        let _ = out.flush();
    }
}

/// One JSON line, written field by field: building a `serde_json::Value`
/// first (a map, a string per field) cost about 20,000 instructions per
/// request, and `core::fmt` for its numbers, addresses and time several
/// thousand more (benches/RESULTS.md section 13). Keys in the sorted order
/// that map wrote them in, so lines read as before.
fn json_line(e: &Entry<'_>, out: &mut String, memo: &mut Memo) {
    out.push_str("{\"bytes\":");
    push_u64(out, e.bytes as u64);
    out.push_str(",\"client\":");
    match e.client {
        Some(c) => {
            out.push('"');
            out.push_str(memo.client.text(c, |s, c| push_ip(s, *c)));
            out.push('"');
        }
        None => out.push_str("null"),
    }
    out.push_str(",\"lane\":");
    json_str(out, e.lane);
    out.push_str(",\"method\":");
    json_str(out, e.method);
    out.push_str(",\"protocol\":");
    json_str(out, e.protocol);
    out.push_str(",\"queue_ms\":");
    push_ms(out, e.queue);
    out.push_str(",\"request_id\":");
    json_str(out, e.request_id);
    out.push_str(",\"route\":");
    match e.route {
        Some(r) => json_str(out, r),
        None => out.push_str("null"),
    }
    out.push_str(",\"status\":");
    push_u64(out, u64::from(e.status));
    out.push_str(",\"time\":\"");
    memo.clock.rfc3339_into(out, e.time);
    out.push_str("\",\"total_ms\":");
    push_ms(out, Some(e.total));
    out.push_str(",\"tries\":");
    push_u64(out, u64::from(e.tries));
    out.push_str(",\"upstream\":");
    match e.upstream {
        Some(u) => {
            out.push('"');
            out.push_str(memo.upstream.text(u, push_addr));
            out.push('"');
        }
        None => out.push_str("null"),
    }
    out.push_str(",\"upstream_ms\":");
    push_ms(out, e.upstream_time);
    out.push_str(",\"uri\":");
    json_str(out, e.uri);
    out.push_str(",\"user_agent\":");
    json_str(out, e.user_agent);
    out.push_str("}\n");
}

/// `[addr%scope]:port` for IPv6, as `Display` writes it; IPv4 without
/// `core::fmt`.
fn push_addr(out: &mut String, a: &SocketAddr) {
    match a {
        SocketAddr::V4(u) => {
            push_ip(out, IpAddr::V4(*u.ip()));
            out.push(':');
            push_u64(out, u64::from(u.port()));
        }
        SocketAddr::V6(u) => {
            use std::fmt::Write as _;
            let _ = write!(out, "{u}");
        }
    }
}

/// The last address written and its text: one connection's requests, and
/// a pool's few members, write the same addresses again and again.
struct Last<A> {
    addr: Option<A>,
    text: String,
}

impl<A> Default for Last<A> {
    fn default() -> Self {
        Last {
            addr: None,
            text: String::new(),
        }
    }
}

impl<A: PartialEq + Copy> Last<A> {
    fn text(&mut self, a: A, write: impl Fn(&mut String, &A)) -> &str {
        if self.addr != Some(a) {
            self.text.clear();
            write(&mut self.text, &a);
            self.addr = Some(a);
        }
        &self.text
    }
}

/// What a thread's lines reuse from line to line.
#[derive(Default)]
struct Memo {
    clock: Clock,
    client: Last<IpAddr>,
    upstream: Last<SocketAddr>,
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
    // u64 microseconds (585,000 years): u128 division is a library call.
    let us = d.as_secs().saturating_mul(1_000_000) + u64::from(d.subsec_micros());
    push_u64(out, us / 1000);
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

fn combined_line(e: &Entry<'_>, out: &mut String) {
    use std::fmt::Write as _;
    // What a client sent (method, target, User-Agent, X-Request-Id) is
    // escaped as nginx's `escape=default` does, so that none of it can
    // close a quoted field or forge another line or field.
    let _ = write!(
        out,
        "{} - - [{}] \"",
        e.client
            .map(|c| c.to_string())
            .unwrap_or_else(|| "-".into()),
        rfc3339(e.time),
    );
    push_log_escaped(out, e.method, true);
    out.push(' ');
    push_log_escaped(out, e.uri, true);
    let _ = write!(out, " {}\" {} {} \"-\" \"", e.protocol, e.status, e.bytes);
    push_log_escaped(out, e.user_agent, false);
    out.push_str("\" rid=");
    push_log_escaped(out, e.request_id, true);
    let _ = writeln!(
        out,
        " rt={:.3} urt={} up={}",
        e.total.as_secs_f64(),
        e.upstream_time
            .map(|d| format!("{:.3}", d.as_secs_f64()))
            .unwrap_or_else(|| "-".into()),
        e.upstream
            .map(|u| u.to_string())
            .unwrap_or_else(|| "-".into()),
    );
}

/// `s` with `"`, `\\`, every control and every non-ASCII byte written as
/// `\xHH`, as nginx writes a log line; spaces too where `space` (a field
/// outside quotes).
fn push_log_escaped(out: &mut String, s: &str, space: bool) {
    use std::fmt::Write as _;
    // Runs that need nothing (the usual case: all of it) are copied whole.
    let mut plain = 0;
    for (i, &b) in s.as_bytes().iter().enumerate() {
        let escape = matches!(b, b'"' | b'\\' | 0..=0x1f | 0x7f..=0xff) || (space && b == b' ');
        if escape {
            // Every byte of a multi-byte character is escaped, so a run
            // (ASCII only) starts and ends on character boundaries.
            if plain < i {
                out.push_str(&s[plain..i]);
            }
            let _ = write!(out, "\\x{b:02X}");
            plain = i + 1;
        }
    }
    out.push_str(&s[plain..]);
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

/// The family of access-log lines dropped because the writer fell behind,
/// registered with `r`.
pub fn dropped_metric(r: &prometheus::Registry) -> IntCounter {
    crate::prom::registered(
        r,
        IntCounter::new(
            "ultrafast_access_log_dropped_total",
            "Access log lines dropped because the writer fell behind.",
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_combined_line_cannot_be_forged_by_what_the_client_sent() {
        let e = Entry {
            time: UNIX_EPOCH,
            request_id: "r 1\" rt=0.000",
            client: None,
            method: "GET",
            uri: "/a\" 200 1 \"-\" \"x\"\n1.2.3.4 - - [x]",
            route: None,
            upstream: None,
            status: 404,
            bytes: 7,
            total: Duration::ZERO,
            upstream_time: None,
            tries: 1,
            user_agent: "ua\" rid=forged \u{e9}",
            protocol: "HTTP/1.1",
            lane: "",
            queue: None,
        };
        let mut line = String::new();
        combined_line(&e, &mut line);
        assert_eq!(line.matches('\n').count(), 1, "{line}");
        assert_eq!(
            line,
            "- - - [1970-01-01T00:00:00.000Z] \"GET /a\\x22\\x20200\\x201\\x20\\x22-\\x22\\x20\\x22x\\x22\\x0A1.2.3.4\\x20-\\x20-\\x20[x] HTTP/1.1\" \
             404 7 \"-\" \"ua\\x22 rid=forged \\xC3\\xA9\" rid=r\\x201\\x22\\x20rt=0.000 rt=0.000 urt=- up=-\n"
        );
    }

    #[test]
    fn a_json_line_parses_with_every_field_and_escape() {
        let e = Entry {
            time: UNIX_EPOCH + Duration::from_millis(1_709_210_096_123),
            request_id: "rid-\"1\"",
            client: Some("127.0.0.1".parse().unwrap()),
            method: "POST",
            uri: "/a?b=\\c",
            route: None,
            upstream: Some("10.0.0.1:80".parse().unwrap()),
            status: 201,
            bytes: 42,
            total: Duration::from_micros(1500),
            upstream_time: None,
            tries: 2,
            user_agent: "",
            protocol: "HTTP/1.1",
            lane: "ultra",
            queue: Some(Duration::from_micros(250)),
        };
        let mut line = String::new();
        let mut memo = Memo::default();
        json_line(&e, &mut line, &mut memo);
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
        assert_eq!(v.as_object().unwrap().len(), 16);
        assert_eq!(v["protocol"], "HTTP/1.1");
        // An IPv6 member as `SocketAddr` writes it (brackets, scope).
        let e = Entry {
            upstream: Some("[fe80::1%3]:8000".parse().unwrap()),
            ..e
        };
        // Through the same memo: a changed address is written anew.
        let e = Entry {
            client: Some("10.1.2.3".parse().unwrap()),
            ..e
        };
        line.clear();
        json_line(&e, &mut line, &mut memo);
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["upstream"], "[fe80::1%3]:8000");
        assert_eq!(v["client"], "10.1.2.3");
    }

    fn entry(uri: &str) -> Entry<'_> {
        Entry {
            time: UNIX_EPOCH,
            request_id: "r",
            client: None,
            method: "GET",
            uri,
            route: Some("root"),
            upstream: None,
            status: 200,
            bytes: 2,
            total: Duration::ZERO,
            upstream_time: None,
            tries: 0,
            user_agent: "",
            protocol: "HTTP/1.1",
            lane: "",
            queue: None,
        }
    }

    #[test]
    fn lines_from_many_threads_reach_the_file_in_order_per_thread() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("access.log");
        let dropped = IntCounter::new("d", "d").unwrap();
        let log = AccessLog::start(
            &LogTarget::File(path.clone()),
            LogFormat::Json,
            dropped.clone(),
        )
        .unwrap();
        // A lone line arrives by the writer's tick, without a flush.
        log.log(&entry("/first"));
        let t0 = std::time::Instant::now();
        while !std::fs::read_to_string(&path).unwrap().contains("/first") {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "the tick never wrote"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        // Enough lines to fill several buffers on each of three threads.
        let threads: Vec<_> = (0..3)
            .map(|t| {
                let log = log.clone();
                std::thread::spawn(move || {
                    for i in 0..600 {
                        log.log(&entry(&format!("/t{t}/{i}")));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        log.flush();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(dropped.get(), 0);
        for t in 0..3 {
            let seen: Vec<usize> = text
                .lines()
                .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
                .filter_map(|v| {
                    let uri = v["uri"].as_str()?.to_string();
                    uri.strip_prefix(&format!("/t{t}/"))?.parse().ok()
                })
                .collect();
            assert_eq!(seen, (0..600).collect::<Vec<_>>(), "thread {t}");
        }
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
