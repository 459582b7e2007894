//! Test harness: a real origin server on loopback, the real `ultrafast`
//! binary started per test with its own config and ports, and a small
//! HTTP/1.1 client that can also send malformed requests. Every process and
//! thread a test starts is stopped when its handle drops.
#![allow(dead_code, clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub mod infer;
pub mod nginx;
pub mod redis;

/// A port that was free a moment ago (bind port 0, read it, release it),
/// never one this test process handed out before: the kernel may give a
/// just-released port again, and two listeners of one config on the same
/// port fail validation.
/// FNV-1a of `bytes`: the origin reports it, so a test can check that a
/// body arrived intact.
pub fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Server-side connections of `port` that the edge still holds open
/// (ESTABLISHED or CLOSE_WAIT in `/proc/net/tcp`).
pub fn held(port: u16) -> usize {
    held_by(&[port])[0]
}

/// [`held`] for several ports from one read of `/proc/net/tcp` (the
/// kernel writes the whole table, TIME_WAIT entries too, for each read:
/// a sampling loop that reads it twice takes CPU from what it measures).
pub fn held_by(ports: &[u16]) -> Vec<usize> {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let want: Vec<String> = ports.iter().map(|p| format!("{p:04X}")).collect();
    let mut counts = vec![0; ports.len()];
    for l in table.lines().skip(1) {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() <= 3 || !matches!(f[3], "01" | "08") {
            continue;
        }
        let local = f[1].rsplit(':').next().unwrap_or("");
        if let Some(i) = want.iter().position(|w| w == local) {
            counts[i] += 1;
        }
    }
    counts
}

/// What an HTTP/2 request got: the status, the response headers and the
/// time to the response head.
pub struct H2Answer {
    pub status: u16,
    pub headers: BTreeMap<String, String>,
    pub took: Duration,
}

/// Send `req` on a fresh h2c connection to `port` (an `h2` client, which
/// sends header lists curl will not); `end = false` leaves the stream
/// open with no body sent.
pub fn h2c(port: u16, req: http::Request<()>, end: bool) -> H2Answer {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let (mut client, conn) = h2::client::Builder::new()
            .max_header_list_size(1 << 20)
            .handshake::<_, bytes::Bytes>(tcp)
            .await
            .unwrap();
        tokio::spawn(conn);
        let t = Instant::now();
        let (resp, _body) = client.send_request(req, end).unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(10), resp)
            .await
            .expect("an answer in time")
            .expect("an answer, not a stream or connection error");
        H2Answer {
            status: resp.status().as_u16(),
            headers: resp
                .headers()
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_string()))
                .collect(),
            took: t.elapsed(),
        }
    })
}

/// `n` bytes of text the origin's `/text/N` sends.
pub fn text(n: usize) -> Vec<u8> {
    let line = b"the quick brown fox jumps over the lazy dog 0123456789\n";
    line.iter().copied().cycle().take(n).collect()
}

/// A port nobody listens on, for a server the test starts.
///
/// Chosen below the kernel's ephemeral range: a port from `bind(:0)` is
/// free only until some outgoing connection takes it as its local port,
/// and with many tests connecting in parallel one did (CI saw `admin`
/// fail with EADDRINUSE). Ports below the range are only ever taken by
/// an explicit bind, and ours are handed out once per process.
pub fn free_port() -> u16 {
    static GIVEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    static SEED: AtomicU64 = AtomicU64::new(0);
    let lo = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let mut given = GIVEN.lock().unwrap();
    if lo > 12_000 {
        // Another test process picks from the same range: start at a
        // point that differs per process and per call.
        let span = u64::from(lo - 11_000);
        let mut x = u64::from(std::process::id()) << 20
            ^ SEED.fetch_add(1, Ordering::SeqCst)
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
        for _ in 0..1000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let port = 10_000 + ((x >> 33) % span) as u16;
            if !given.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
                given.push(port);
                return port;
            }
        }
    }
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// How the origin misbehaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Answer normally.
    None,
    /// Read the request, then close the connection without answering.
    ResetAfterRequest,
    /// Send headers announcing a body, half the body, then close.
    TruncateBody,
    /// Send the response head announcing a body, then nothing (until the
    /// origin stops or 30 s pass).
    StallAfterHead,
    /// Send the response head announcing a body, then close.
    CloseAfterHead,
    /// Read the request, then reset the connection (RST, not FIN) before
    /// any response byte.
    RstAfterRequest,
    /// Send the head and half the body, then reset the connection (RST).
    RstMidBody,
}

/// Shared, adjustable origin state.
#[derive(Default)]
pub struct OriginState {
    pub connections: AtomicU64,
    pub requests: AtomicU64,
    pub delay_ms: AtomicU64,
    pub status: AtomicU16,
    pub health_status: AtomicU16,
    pub fault: Mutex<Option<Fault>>,
    pub last_headers: Mutex<BTreeMap<String, String>>,
    pub order: Mutex<Vec<String>>,
    pub stop: AtomicBool,
    /// When each `/big/` response was written whole.
    pub big_done: Mutex<Vec<Instant>>,
}

/// A real HTTP/1.1 origin on 127.0.0.1 with keepalive.
pub struct Origin {
    pub name: String,
    pub addr: SocketAddr,
    pub state: Arc<OriginState>,
    accept: Option<JoinHandle<()>>,
}

impl Origin {
    pub fn start(name: &str) -> Origin {
        Self::start_at(name, "127.0.0.1:0")
    }

    /// An origin on a given address (another loopback IP, a fixed port).
    pub fn start_at(name: &str, addr: &str) -> Origin {
        let listener = TcpListener::bind(addr).unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(OriginState::default());
        state.status.store(200, Ordering::SeqCst);
        state.health_status.store(200, Ordering::SeqCst);
        let (st, nm) = (state.clone(), name.to_string());
        let accept = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if st.stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                st.connections.fetch_add(1, Ordering::SeqCst);
                let (st, nm) = (st.clone(), nm.clone());
                std::thread::spawn(move || serve_conn(conn, st, nm));
            }
        });
        Origin {
            name: name.into(),
            addr,
            state,
            accept: Some(accept),
        }
    }

    pub fn requests(&self) -> u64 {
        self.state.requests.load(Ordering::SeqCst)
    }

    pub fn connections(&self) -> u64 {
        self.state.connections.load(Ordering::SeqCst)
    }

    /// Paths in the order the origin received them.
    pub fn order(&self) -> Vec<String> {
        self.state.order.lock().unwrap().clone()
    }

    pub fn set_fault(&self, f: Fault) {
        *self.state.fault.lock().unwrap() = Some(f);
    }

    /// Stop accepting and close every connection: the port then refuses.
    pub fn stop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
    }
}

impl Drop for Origin {
    fn drop(&mut self) {
        self.stop();
    }
}

fn read_head(r: &mut BufReader<TcpStream>) -> Option<(String, BTreeMap<String, String>)> {
    let mut line = String::new();
    match r.read_line(&mut line) {
        Ok(0) => return None,
        Ok(_) => {}
        Err(e)
            if e.kind() == std::io::ErrorKind::WouldBlock
                || e.kind() == std::io::ErrorKind::TimedOut =>
        {
            return Some((String::new(), BTreeMap::new()));
        }
        Err(_) => return None,
    }
    let request_line = line.trim_end().to_string();
    let mut headers = BTreeMap::new();
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).ok()? == 0 {
            return None;
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            let k = k.trim().to_ascii_lowercase();
            let v = v.trim().to_string();
            headers
                .entry(k)
                .and_modify(|old: &mut String| {
                    old.push_str(", ");
                    old.push_str(&v)
                })
                .or_insert(v);
        }
    }
    Some((request_line, headers))
}

fn serve_conn(conn: TcpStream, st: Arc<OriginState>, name: String) {
    conn.set_read_timeout(Some(Duration::from_millis(100))).ok();
    let mut w = conn.try_clone().unwrap();
    let mut r = BufReader::new(conn);
    loop {
        if st.stop.load(Ordering::SeqCst) {
            return;
        }
        let Some((line, headers)) = read_head(&mut r) else {
            return;
        };
        if line.is_empty() {
            continue; // read timeout: poll the stop flag
        }
        r.get_ref()
            .set_read_timeout(Some(Duration::from_secs(5)))
            .ok();
        let mut body = Vec::new();
        if let Some(n) = headers
            .get("content-length")
            .and_then(|v| v.parse::<usize>().ok())
        {
            body.resize(n, 0);
            if r.read_exact(&mut body).is_err() {
                return;
            }
        } else if headers
            .get("transfer-encoding")
            .is_some_and(|v| v.contains("chunked"))
        {
            loop {
                let mut sz = String::new();
                if r.read_line(&mut sz).unwrap_or(0) == 0 {
                    return;
                }
                let n = usize::from_str_radix(sz.trim(), 16).unwrap_or(0);
                let mut chunk = vec![0; n + 2];
                if r.read_exact(&mut chunk).is_err() {
                    return;
                }
                body.extend_from_slice(&chunk[..n]);
                if n == 0 {
                    break;
                }
            }
        }
        r.get_ref()
            .set_read_timeout(Some(Duration::from_millis(100)))
            .ok();
        let mut parts = line.split_whitespace();
        let method = parts.next().unwrap_or("").to_string();
        let path = parts.next().unwrap_or("").to_string();
        if path == "/health" {
            let s = st.health_status.load(Ordering::SeqCst);
            let _ = write!(w, "HTTP/1.1 {s} X\r\nContent-Length: 2\r\n\r\nok");
            continue;
        }
        st.requests.fetch_add(1, Ordering::SeqCst);
        st.order.lock().unwrap().push(path.clone());
        *st.last_headers.lock().unwrap() = headers.clone();
        if path.starts_with("/stream") {
            // A slow SSE-style stream: 20 events, 50 ms apart, chunked.
            let _ = write!(w, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n");
            for i in 0..20 {
                let ev = format!("data: {name}-{i}\n\n");
                if write!(w, "{:x}\r\n{ev}\r\n", ev.len()).is_err() {
                    return;
                }
                let _ = w.flush();
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = write!(w, "0\r\n\r\n");
            continue;
        }
        let fault = st.fault.lock().unwrap().unwrap_or(Fault::None);
        if fault == Fault::ResetAfterRequest {
            return;
        }
        if fault == Fault::RstAfterRequest {
            reset(&w);
            return;
        }
        if path.starts_with("/cache/") {
            let n = st.requests.load(Ordering::SeqCst);
            if cache_answer(&mut w, &st, &method, &path, &headers, n).is_err() {
                return;
            }
            continue;
        }
        if let Some(n) = path
            .strip_prefix("/text/")
            .and_then(|n| n.parse::<usize>().ok())
        {
            // Text that compresses, with the validators a cache would see.
            let body = text(n);
            let _ = write!(
                w,
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\nETag: \"v1\"\r\nAccept-Ranges: bytes\r\nContent-Length: {n}\r\n\r\n"
            );
            let _ = w.write_all(&body);
            continue;
        }
        if let Some((n, query)) = path.strip_prefix("/big/").and_then(|rest| {
            let (n, q) = rest.split_once('?').unwrap_or((rest, ""));
            Some((n.parse::<usize>().ok()?, q.to_string()))
        }) {
            // A large body, for clients that read slowly; `?accel=no` asks
            // the edge not to buffer it (nginx's `X-Accel-Buffering`).
            let accel = match query.as_str() {
                "accel=no" => "X-Accel-Buffering: no\r\n",
                _ => "",
            };
            let _ = write!(w, "HTTP/1.1 200 OK\r\nContent-Length: {n}\r\n{accel}\r\n");
            let chunk = vec![b'x'; 64 * 1024];
            let mut left = n;
            while left > 0 {
                let k = left.min(chunk.len());
                if w.write_all(&chunk[..k]).is_err() {
                    return;
                }
                left -= k;
            }
            let _ = w.flush();
            st.big_done.lock().unwrap().push(Instant::now());
            continue;
        }
        let delay = st.delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            std::thread::sleep(Duration::from_millis(delay));
        }
        let out = serde_json::json!({
            "origin": name, "method": method, "path": path,
            "headers": headers, "body_len": body.len(), "body_fnv": fnv(&body),
        })
        .to_string();
        let status = st.status.load(Ordering::SeqCst);
        if matches!(fault, Fault::StallAfterHead | Fault::CloseAfterHead) {
            let _ = write!(
                w,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
                out.len()
            );
            let _ = w.flush();
            if fault == Fault::StallAfterHead {
                let until = Instant::now() + Duration::from_secs(30);
                while Instant::now() < until && !st.stop.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            let _ = w.shutdown(std::net::Shutdown::Both);
            return;
        }
        if fault == Fault::RstMidBody {
            let _ = write!(
                w,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
                out.len() * 2
            );
            let _ = w.write_all(out.as_bytes());
            let _ = w.flush();
            std::thread::sleep(Duration::from_millis(50));
            reset(&w);
            return;
        }
        if fault == Fault::TruncateBody {
            let _ = write!(
                w,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
                out.len() * 2
            );
            let _ = w.write_all(out.as_bytes());
            let _ = w.flush();
            std::thread::sleep(Duration::from_millis(50));
            let _ = w.shutdown(std::net::Shutdown::Both);
            return;
        }
        let resp = format!(
            "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nx-origin: {name}\r\nx-remove-me: 1\r\nContent-Length: {}\r\n\r\n{out}",
            out.len()
        );
        if w.write_all(resp.as_bytes()).is_err() {
            return;
        }
    }
}

/// `%XX` and `+` of a query value.
pub fn unescape(v: &str) -> String {
    let b = v.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let h = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
                out.push(u8::from_str_radix(h, 16).unwrap_or(b'?'));
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `%`-escape a query value.
pub fn escape(v: &str) -> String {
    v.bytes()
        .map(|c| match c {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' => (c as char).to_string(),
            _ => format!("%{c:02X}"),
        })
        .collect()
}

/// A cacheable resource, shaped by its query: `cc` (Cache-Control),
/// `etag`, `lm` (a fixed Last-Modified), `vary`, `expires` (seconds from
/// now, may be negative), `cookie`, `delay` (ms before answering), `len`
/// (body bytes). The status is the origin's (`state.status`). A matching
/// `If-None-Match` / `If-Modified-Since` gets a 304. The body names the
/// request's number at the origin, so a test can tell a stored copy from a
/// fresh one.
fn cache_answer(
    w: &mut TcpStream,
    st: &OriginState,
    method: &str,
    path: &str,
    req: &BTreeMap<String, String>,
    n: u64,
) -> std::io::Result<()> {
    const LM: &str = "Tue, 01 Dec 2026 10:00:00 GMT";
    let q: BTreeMap<String, String> = path
        .split_once('?')
        .map(|(_, q)| q)
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), unescape(v)))
        .collect();
    if let Some(ms) = q.get("delay").and_then(|v| v.parse().ok()) {
        std::thread::sleep(Duration::from_millis(ms));
    }
    let mut head = String::new();
    if let Some(cc) = q.get("cc") {
        head += &format!("Cache-Control: {cc}\r\n");
    }
    let etag = q.get("etag").map(|e| format!("\"{e}\""));
    if let Some(e) = &etag {
        head += &format!("ETag: {e}\r\n");
    }
    if q.contains_key("lm") {
        head += &format!("Last-Modified: {LM}\r\n");
    }
    if let Some(v) = q.get("vary") {
        head += &format!("Vary: {v}\r\n");
    }
    if let Some(s) = q.get("expires").and_then(|v| v.parse::<i64>().ok()) {
        let now = std::time::SystemTime::now();
        let at = if s >= 0 {
            now + Duration::from_secs(s as u64)
        } else {
            now - Duration::from_secs(s.unsigned_abs())
        };
        head += &format!("Expires: {}\r\n", httpdate::fmt_http_date(at));
    }
    if q.contains_key("cookie") {
        head += "Set-Cookie: session=1\r\n";
    }
    let matched = etag
        .as_ref()
        .is_some_and(|e| req.get("if-none-match") == Some(e))
        || (q.contains_key("lm") && req.get("if-modified-since").map(|s| s.as_str()) == Some(LM));
    if matched {
        return write!(w, "HTTP/1.1 304 Not Modified\r\n{head}\r\n");
    }
    let varied: Vec<String> = q
        .get("vary")
        .map(|v| {
            v.split(',')
                .map(|h| h.trim().to_ascii_lowercase())
                .collect()
        })
        .unwrap_or_default();
    let seen: Vec<String> = varied
        .iter()
        .map(|h| format!("{h}={}", req.get(h).map_or("", |v| v.as_str())))
        .collect();
    let mut body = format!(
        "{} #{n} {}",
        path.split('?').next().unwrap_or(""),
        seen.join(" ")
    );
    if let Some(len) = q.get("len").and_then(|v| v.parse::<usize>().ok()) {
        while body.len() < len {
            body.push('x');
        }
        body.truncate(len);
    }
    let status = st.status.load(Ordering::SeqCst);
    write!(
        w,
        "HTTP/1.1 {status} X\r\nContent-Type: text/plain\r\n{head}Content-Length: {}\r\n\r\n",
        body.len()
    )?;
    if method != "HEAD" {
        w.write_all(body.as_bytes())?;
    }
    Ok(())
}

/// Make the coming close a TCP reset (SO_LINGER 0) instead of a FIN; the
/// caller returns, which closes every handle of the socket.
fn reset(s: &TcpStream) {
    let _ = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO));
}

/// Name -> (A records, TTL).
type Zone = BTreeMap<String, (Vec<std::net::Ipv4Addr>, u32)>;

/// A real DNS server on UDP loopback whose answers the test changes: A
/// records with a TTL per name, NXDOMAIN for unknown names, no AAAA records,
/// and a switch that makes it stop answering.
pub struct DnsServer {
    pub addr: SocketAddr,
    records: Arc<Mutex<Zone>>,
    silent: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    pub queries: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl DnsServer {
    pub fn start() -> DnsServer {
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let addr = sock.local_addr().unwrap();
        let records: Arc<Mutex<Zone>> = Arc::default();
        let (silent, stop, queries) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
        );
        let (r, si, st, q) = (
            records.clone(),
            silent.clone(),
            stop.clone(),
            queries.clone(),
        );
        let thread = std::thread::spawn(move || {
            let mut buf = [0u8; 1500];
            while !st.load(Ordering::SeqCst) {
                let Ok((n, from)) = sock.recv_from(&mut buf) else {
                    continue;
                };
                q.fetch_add(1, Ordering::SeqCst);
                if si.load(Ordering::SeqCst) || n < 12 {
                    continue;
                }
                if let Some(resp) = dns_answer(&buf[..n], &r.lock().unwrap()) {
                    let _ = sock.send_to(&resp, from);
                }
            }
        });
        DnsServer {
            addr,
            records,
            silent,
            stop,
            queries,
            thread: Some(thread),
        }
    }

    pub fn set(&self, name: &str, ips: &[&str], ttl: u32) {
        let ips = ips.iter().map(|i| i.parse().unwrap()).collect();
        self.records
            .lock()
            .unwrap()
            .insert(name.to_string(), (ips, ttl));
    }

    /// Stop (or resume) answering queries: the resolver sees timeouts.
    pub fn set_silent(&self, silent: bool) {
        self.silent.store(silent, Ordering::SeqCst);
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn dns_answer(
    q: &[u8],
    records: &BTreeMap<String, (Vec<std::net::Ipv4Addr>, u32)>,
) -> Option<Vec<u8>> {
    // Question: labels from byte 12 up to a zero byte, then type and class.
    let mut i = 12;
    let mut labels = Vec::new();
    while i < q.len() && q[i] != 0 {
        let l = q[i] as usize;
        labels.push(String::from_utf8_lossy(q.get(i + 1..i + 1 + l)?).to_ascii_lowercase());
        i += 1 + l;
    }
    let qend = i + 5;
    let qtype = u16::from_be_bytes([*q.get(i + 1)?, *q.get(i + 2)?]);
    let name = labels.join(".");
    let mut out = Vec::with_capacity(512);
    out.extend_from_slice(&q[0..2]);
    let found = records.get(&name);
    let rcode = if found.is_some() { 0 } else { 3 };
    out.extend_from_slice(&[0x81, 0x80 | rcode]);
    let answers: Vec<std::net::Ipv4Addr> = match (found, qtype) {
        (Some((ips, _)), 1) => ips.clone(),
        _ => vec![],
    };
    let ttl = found.map(|f| f.1).unwrap_or(0);
    out.extend_from_slice(&[0, 1]);
    out.extend_from_slice(&(answers.len() as u16).to_be_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(q.get(12..qend)?);
    for ip in answers {
        out.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1]);
        out.extend_from_slice(&ttl.to_be_bytes());
        out.extend_from_slice(&[0, 4]);
        out.extend_from_slice(&ip.octets());
    }
    Some(out)
}

/// POST to the admin API.
pub fn admin_post(admin: SocketAddr, path: &str) -> Resp {
    Client::connect(admin)
        .unwrap()
        .request("POST", path, &[], b"")
        .unwrap()
}

/// An HTTP response as the client saw it.
#[derive(Debug, Clone)]
pub struct Resp {
    pub status: u16,
    pub headers: BTreeMap<String, String>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not json ({e}): {}", self.text()))
    }
    pub fn header(&self, k: &str) -> Option<&str> {
        self.headers.get(k).map(|s| s.as_str())
    }
    /// The origin name that answered.
    pub fn origin(&self) -> String {
        self.json()["origin"].as_str().unwrap_or("").to_string()
    }
}

/// A keepalive HTTP/1.1 client connection.
pub struct Client {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Client {
    pub fn connect(addr: SocketAddr) -> std::io::Result<Client> {
        let s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        let w = s.try_clone()?;
        Ok(Client {
            r: BufReader::new(s),
            w,
        })
    }

    /// A client on a connection opened elsewhere.
    pub fn from_stream(s: TcpStream) -> Client {
        let w = s.try_clone().unwrap();
        Client {
            r: BufReader::new(s),
            w,
        }
    }

    /// Whether the peer closes the connection within `limit` (reads until EOF).
    pub fn closed_within(&mut self, limit: Duration) -> bool {
        let _ = self.r.get_ref().set_read_timeout(Some(limit));
        let mut buf = [0u8; 4096];
        loop {
            match self.r.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) => return e.kind() == std::io::ErrorKind::ConnectionReset,
            }
        }
    }

    /// Everything the peer sends until it closes or `limit` passes, and
    /// whether it closed.
    pub fn read_rest(&mut self, limit: Duration) -> (Vec<u8>, bool) {
        let deadline = Instant::now() + limit;
        let mut out = self.r.buffer().to_vec();
        self.r.consume(out.len());
        let mut buf = [0u8; 4096];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return (out, false);
            }
            let _ = self.r.get_ref().set_read_timeout(Some(left));
            match self.r.get_mut().read(&mut buf) {
                Ok(0) => return (out, true),
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return (out, true),
                Err(_) => return (out, false),
            }
        }
    }

    pub fn send_raw(&mut self, raw: &[u8]) -> std::io::Result<()> {
        self.w.write_all(raw)
    }

    pub fn request(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> std::io::Result<Resp> {
        let mut req = format!("{method} {path} HTTP/1.1\r\n");
        if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
            // The address connected to, as curl sends it.
            match self.w.peer_addr() {
                Ok(a) => req.push_str(&format!("Host: {a}\r\n")),
                Err(_) => req.push_str("Host: localhost\r\n"),
            }
        }
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        if !body.is_empty() || method == "POST" {
            req.push_str(&format!("Content-Length: {}\r\n", body.len()));
        }
        req.push_str("\r\n");
        self.w.write_all(req.as_bytes())?;
        self.w.write_all(body)?;
        self.read_response(method == "HEAD")
    }

    pub fn read_response(&mut self, head_only: bool) -> std::io::Result<Resp> {
        let mut line = String::new();
        if self.r.read_line(&mut line)? == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "closed",
            ));
        }
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("bad status line {line:?}")))?;
        let mut headers = BTreeMap::new();
        loop {
            let mut h = String::new();
            self.r.read_line(&mut h)?;
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
            }
        }
        let mut body = Vec::new();
        if head_only || status == 204 || status == 304 {
        } else if let Some(n) = headers
            .get("content-length")
            .and_then(|v| v.parse::<usize>().ok())
        {
            body.resize(n, 0);
            self.r.read_exact(&mut body)?;
        } else if headers
            .get("transfer-encoding")
            .is_some_and(|v| v.contains("chunked"))
        {
            loop {
                let mut sz = String::new();
                self.r.read_line(&mut sz)?;
                let n = usize::from_str_radix(sz.trim(), 16)
                    .map_err(|_| std::io::Error::other(format!("bad chunk size {sz:?}")))?;
                let mut chunk = vec![0; n + 2];
                self.r.read_exact(&mut chunk)?;
                body.extend_from_slice(&chunk[..n]);
                if n == 0 {
                    break;
                }
            }
        } else {
            self.r.read_to_end(&mut body)?;
        }
        Ok(Resp {
            status,
            headers,
            body,
        })
    }
}

/// One request on a fresh connection.
pub fn get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Resp {
    Client::connect(addr)
        .unwrap()
        .request("GET", path, headers, b"")
        .unwrap()
}

/// The resident memory of process `pid`, KiB (`VmRSS`).
pub fn rss_of(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// The largest RSS of process `pid` (KiB) while `f` runs, sampled every
/// 50 ms.
pub fn peak_rss<T>(pid: u32, f: impl FnOnce() -> T) -> (T, u64) {
    let done = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(rss_of(pid).unwrap_or(0)));
    let sampler = std::thread::spawn({
        let (done, peak) = (done.clone(), peak.clone());
        move || {
            while !done.load(Ordering::Relaxed) {
                if let Some(kib) = rss_of(pid) {
                    peak.fetch_max(kib, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    });
    let out = f();
    done.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    (out, peak.load(Ordering::Relaxed))
}

/// A running `ultrafast serve` with its own config, ports and files.
pub struct Ultrafast {
    pub head: String,
    pub child: Child,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub dir: PathBuf,
    pub config: PathBuf,
}

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_ultrafast")
}

/// A scratch directory unique to this test.
pub fn scratch(tag: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let d = std::env::temp_dir().join(format!(
        "ultrafast-test-{}-{}-{tag}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

impl Ultrafast {
    /// Start with `body` appended to a generated head that sets ports,
    /// pid/upgrade paths and the access log file.
    pub fn start(body: &str) -> Ultrafast {
        Self::start_with_env(body, &[])
    }

    /// `start` with extra environment variables for the server process.
    pub fn start_with_env(body: &str, env: &[(&str, &str)]) -> Ultrafast {
        let dir = scratch("uf");
        let (port, admin_port) = (free_port(), free_port());
        let head = format!(
            "[server]\nthreads = 1\npid_file = \"{d}/uf.pid\"\nupgrade_sock = \"{d}/uf.sock\"\nshutdown_grace_period_s = 10\n\n\
             [admin]\nlisten = \"127.0.0.1:{admin_port}\"\n\n[log]\naccess_log = \"{d}/access.log\"\n\n\
             [[listeners]]\nname = \"http\"\naddress = \"127.0.0.1:{port}\"\n\n",
            d = dir.display()
        );
        let config = dir.join("ultrafast.toml");
        std::fs::write(&config, format!("{head}{body}")).unwrap();
        let mut uf = Self::spawn_env(dir, config, port, admin_port, false, env);
        uf.head = head;
        uf
    }

    /// The server's resident memory, KiB.
    pub fn rss_kib(&self) -> u64 {
        rss_of(self.child.id()).unwrap_or(0)
    }

    /// Replace the config body (the generated head stays).
    pub fn write_config(&self, body: &str) {
        let tmp = self.dir.join("next.toml");
        std::fs::write(&tmp, format!("{}{body}", self.head)).unwrap();
        std::fs::rename(&tmp, &self.config).unwrap();
    }

    /// `POST /admin/reload`.
    pub fn reload(&self) -> Resp {
        admin_post(self.admin, "/admin/reload")
    }

    pub fn spawn(
        dir: PathBuf,
        config: PathBuf,
        port: u16,
        admin_port: u16,
        upgrade: bool,
    ) -> Ultrafast {
        Self::spawn_env(dir, config, port, admin_port, upgrade, &[])
    }

    pub fn spawn_env(
        dir: PathBuf,
        config: PathBuf,
        port: u16,
        admin_port: u16,
        upgrade: bool,
        env: &[(&str, &str)],
    ) -> Ultrafast {
        let mut cmd = Command::new(bin());
        cmd.envs(env.iter().copied());
        cmd.arg("serve").arg("-c").arg(&config);
        if upgrade {
            cmd.arg("--upgrade");
        }
        let stderr = std::fs::File::create(dir.join(if upgrade {
            "stderr.upgrade.log"
        } else {
            "stderr.log"
        }))
        .unwrap();
        let child = cmd
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap();
        let uf = Ultrafast {
            head: String::new(),
            child,
            addr: format!("127.0.0.1:{port}").parse().unwrap(),
            admin: format!("127.0.0.1:{admin_port}").parse().unwrap(),
            dir,
            config,
        };
        if !upgrade {
            uf.wait_ready();
        }
        uf
    }

    pub fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if TcpStream::connect(self.addr).is_ok() && TcpStream::connect(self.admin).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("ultrafast did not start: {}", self.stderr());
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.join("stderr.log")).unwrap_or_default()
    }

    pub fn access_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("access.log")).unwrap_or_default()
    }

    pub fn get(&self, path: &str) -> Resp {
        get(self.addr, path, &[])
    }

    /// Wait until `/readyz` answers 200 (model loaded and warmed up).
    pub fn wait_models_ready(&self, limit: Duration) {
        let ok = eventually(limit, || get(self.admin, "/readyz", &[]).status == 200);
        assert!(
            ok,
            "not ready: {} {}",
            get(self.admin, "/readyz", &[]).text(),
            self.stderr()
        );
    }

    pub fn metrics(&self) -> String {
        get(self.admin, "/metrics", &[]).text()
    }

    /// Sum of a metric's samples whose line contains every `filters` string.
    pub fn metric(&self, name: &str, filters: &[&str]) -> f64 {
        self.metrics()
            .lines()
            .filter(|l| l.starts_with(name) && !l.starts_with('#'))
            .filter(|l| l[name.len()..].starts_with(['{', ' ']))
            .filter(|l| filters.iter().all(|f| l.contains(f)))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// [`metric`](Self::metric) once it equals `want`, or its value after
    /// `limit`: a stream's counters are recorded when the proxy finishes
    /// the request, which may come just after the client read its end.
    pub fn metric_settled(&self, name: &str, filters: &[&str], want: f64, limit: Duration) -> f64 {
        let deadline = Instant::now() + limit;
        loop {
            let v = self.metric(name, filters);
            if v == want || Instant::now() >= deadline {
                return v;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY-free: kill(1) through the shell keeps the tests free of libc.
        let _ = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.child.id().to_string())
            .status();
    }

    /// Wait for exit up to `limit`; returns the exit status if it exited.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Ultrafast {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `[pools.NAME]` text for these origins.
pub fn pool_toml(name: &str, origins: &[&Origin], extra: &str) -> String {
    let members: Vec<String> = origins
        .iter()
        .map(|o| format!("{{ addr = \"{}\" }}", o.addr))
        .collect();
    format!(
        "[pools.{name}]\nmembers = [{}]\n{extra}\n",
        members.join(", ")
    )
}

/// Poll `f` until it is true or `limit` passes.
pub fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    false
}

/// Development certificates (`ultrafast certs dev`) in `dir`: the
/// `localhost` certificate and key (the CA is `dir/ca.pem`).
pub fn dev_certs(dir: &std::path::Path) -> (PathBuf, PathBuf) {
    let out = Command::new(bin())
        .args(["certs", "dev", "--out"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (dir.join("localhost.pem"), dir.join("localhost.key"))
}

/// Write `text` as a config file in `dir` and run `ultrafast check` on it,
/// which must refuse it; its output (stderr, then stdout).
pub fn check_refused(dir: &std::path::Path, text: &str) -> String {
    let cfg = dir.join("bad.toml");
    std::fs::write(&cfg, text).unwrap();
    let out = Command::new(bin())
        .args(["check", "-c"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout)
}

/// Run `serve -c cfg` and wait for it to exit (killed after `limit`): its
/// exit code (None if it kept running) and its stderr.
pub fn serve_until_exit(cfg: &std::path::Path, limit: Duration) -> (Option<i32>, String) {
    let mut child = Command::new(bin())
        .args(["serve", "-c"])
        .arg(cfg)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let code = child.try_wait().unwrap().and_then(|s| s.code());
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    (code, String::from_utf8_lossy(&out.stderr).into_owned())
}
