//! Load reported by the members themselves, for `lb = "queue_aware"`: a
//! background loop (`runtime::loops`) scrapes each member's Prometheus endpoint every
//! `scrape_interval_ms` and keeps `vllm:num_requests_waiting` and
//! `vllm:kv_cache_usage_perc` (the names the Gateway API Inference
//! Extension's endpoint picker reads; ultrafast exports them too). The
//! balancer picks by them while they are fresh and by requests in flight
//! when they are not, so a member whose metrics stop answering is balanced
//! as `least_outstanding` would.

use super::{now_ms, Member, Pool};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The most of a metrics page read (a vLLM page is a few tens of KiB).
const MAX_PAGE: usize = 4 << 20;

/// What a member last said about its load.
#[derive(Debug, Default)]
pub struct MemberLoad {
    waiting: AtomicU64,
    /// `kv_cache_usage_perc` as f64 bits.
    kv: AtomicU64,
    /// When it was read (`now_ms`); 0: never.
    at_ms: AtomicU64,
}

impl MemberLoad {
    /// Record a scrape's figures.
    pub fn set(&self, waiting: f64, kv: f64, now: u64) {
        // A member's page is input: a huge figure must not overflow the
        // score's sum (it only has to lose).
        self.waiting
            .store(waiting.clamp(0.0, 1e9) as u64, Ordering::Relaxed);
        self.kv
            .store(kv.clamp(0.0, 1.0).to_bits(), Ordering::Relaxed);
        self.at_ms.store(now.max(1), Ordering::Relaxed);
    }

    /// (waiting, KV usage) if read within `stale_ms` of `now`.
    pub fn fresh(&self, now: u64, stale_ms: u64) -> Option<(u64, f64)> {
        let at = self.at_ms.load(Ordering::Relaxed);
        (at != 0 && now.saturating_sub(at) <= stale_ms).then(|| {
            (
                self.waiting.load(Ordering::Relaxed),
                f64::from_bits(self.kv.load(Ordering::Relaxed)),
            )
        })
    }
}

/// How a queue-aware pool reads its members.
#[derive(Debug, Clone, PartialEq)]
pub struct ScrapeSpec {
    /// Time between scrapes of a member.
    pub interval: Duration,
    /// The metrics path.
    pub path: String,
}

impl ScrapeSpec {
    /// Figures older than this are stale: three intervals, so one slow or
    /// lost scrape does not flip the policy.
    pub fn stale_ms(&self) -> u64 {
        self.interval.as_millis() as u64 * 3
    }
}

/// The score of sending one more request to `m` (lower is better): what
/// waits there plus what this process has in flight there (fresh within a
/// scrape interval), per unit of weight, with a full KV cache costing as
/// much as two waiting requests (a member near it preempts).
pub fn score(m: &Member, waiting: u64, kv: f64) -> f64 {
    (waiting as f64 + m.outstanding() as f64) / m.weight.max(1) as f64 + 2.0 * kv
}

/// `vllm:num_requests_waiting` (summed over label sets: a server with
/// several models queues them all) and `vllm:kv_cache_usage_perc` (the
/// highest) from a Prometheus text page; None when the page has neither.
pub fn parse(page: &str) -> Option<(f64, f64)> {
    let (mut waiting, mut kv, mut seen) = (0.0, 0.0f64, false);
    for line in page.lines() {
        if line.starts_with('#') {
            continue;
        }
        let (name, rest) = match line.find(['{', ' ']) {
            Some(i) => line.split_at(i),
            None => continue,
        };
        // The value follows the label set (which may hold spaces in quotes).
        let value = match rest.rfind('}') {
            Some(j) => &rest[j + 1..],
            None => rest,
        };
        let Some(v) = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite())
        else {
            continue;
        };
        match name {
            "vllm:num_requests_waiting" => {
                waiting += v;
                seen = true;
            }
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                kv = kv.max(v);
                seen = true;
            }
            _ => {}
        }
    }
    seen.then_some((waiting, kv))
}

/// One scrape of `m`: `GET path` over a fresh connection.
async fn scrape(m: &Member, path: &str) -> Option<(f64, f64)> {
    let mut s = TcpStream::connect(m.addr).await.ok()?;
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: {}\r\nUser-Agent: ultrafast-load\r\nAccept: text/plain\r\nConnection: close\r\n\r\n",
        m.label
    );
    s.write_all(req.as_bytes()).await.ok()?;
    let mut buf = Vec::with_capacity(16 * 1024);
    let mut chunk = [0u8; 16 * 1024];
    // Servers that keep the connection open despite `Connection: close`
    // are read to their framing's end, not to a timeout.
    while !complete(&buf) {
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 || buf.len() + n > MAX_PAGE {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    if !head.starts_with("http/1.") || head.get(9..10) != Some("2") {
        return None;
    }
    let body = &buf[end + 4..];
    let body = if head.contains("transfer-encoding: chunked") {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    parse(std::str::from_utf8(&body).ok()?)
}

/// A chunked body's data (RFC 9112 7.1), or None when it is malformed.
fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(b.len());
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n")?;
        let size = std::str::from_utf8(&b[..eol]).ok()?;
        // Chunk extensions follow a `;`.
        let size = size.split(';').next()?.trim();
        let n = usize::from_str_radix(size, 16).ok()?;
        b = &b[eol + 2..];
        if n == 0 {
            return Some(out);
        }
        out.extend_from_slice(b.get(..n)?);
        b = b.get(n..)?.strip_prefix(b"\r\n")?;
    }
}

/// Whether `buf` holds a whole response: its head and a body of its
/// `Content-Length`, or a chunked body's last chunk.
fn complete(buf: &[u8]) -> bool {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    let body = &buf[end + 4..];
    let len = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok());
    match len {
        Some(n) => body.len() >= n,
        None if head.contains("transfer-encoding: chunked") => body.ends_with(b"0\r\n\r\n"),
        None => false,
    }
}

/// Scrape every member of `pool` once, concurrently (the runtime's
/// load loop calls it when the pool's interval is due).
pub async fn scrape_pool(pool: Arc<Pool>, spec: ScrapeSpec) {
    let jobs: Vec<_> = pool
        .members()
        .members
        .iter()
        .filter(|_| pool.settings.tls.is_none())
        .map(|m| {
            let (m, spec) = (m.clone(), spec.clone());
            tokio::spawn(async move {
                let got = tokio::time::timeout(spec.interval, scrape(&m, &spec.path)).await;
                if let Ok(Some((waiting, kv))) = got {
                    m.state.load.set(waiting, kv, now_ms());
                }
            })
        })
        .collect();
    for j in jobs {
        let _ = j.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_reads_vllm_names_and_ignores_the_rest() {
        let page = "# HELP vllm:num_requests_waiting Number of requests waiting.\n\
            # TYPE vllm:num_requests_waiting gauge\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"a b\"} 3.0\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"c\"} 2\n\
            vllm:num_requests_waiting_extra 100\n\
            vllm:kv_cache_usage_perc{model_name=\"a b\"} 0.25\n\
            vllm:kv_cache_usage_perc{model_name=\"c\"} 0.5\n\
            other_metric 7\n";
        assert_eq!(parse(page), Some((5.0, 0.5)));
        assert_eq!(parse("other 1\n"), None);
        assert_eq!(parse("vllm:num_requests_waiting NaN\n"), None);
        assert_eq!(
            parse("vllm:num_requests_waiting 4 1700000000\n"),
            Some((4.0, 0.0))
        );
    }

    #[test]
    fn a_response_is_complete_by_its_framing() {
        assert!(!complete(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nab"));
        assert!(complete(
            b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nabcd"
        ));
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n";
        assert!(!complete(chunked));
        assert!(complete(&[&chunked[..], b"0\r\n\r\n"].concat()));
    }

    #[test]
    fn a_chunked_page_is_decoded_before_it_is_parsed() {
        // A chunk boundary inside a value: "1" then "2" is 12.
        let body = b"1b\r\nvllm:num_requests_waiting 1\r\n2;ext=1\r\n2\n\r\n0\r\n\r\n";
        let data = dechunk(body).unwrap();
        assert_eq!(
            parse(std::str::from_utf8(&data).unwrap()),
            Some((12.0, 0.0))
        );
        assert_eq!(dechunk(b"zz\r\n"), None);
        assert_eq!(dechunk(b"5\r\nab"), None);
    }

    #[test]
    fn a_huge_figure_cannot_overflow_the_score() {
        let l = MemberLoad::default();
        l.set(1e30, 0.0, 1);
        let (w, _) = l.fresh(1, 10).unwrap();
        assert_eq!(w, 1_000_000_000);
    }

    #[test]
    fn figures_go_stale() {
        let l = MemberLoad::default();
        assert_eq!(l.fresh(1000, 3000), None);
        l.set(2.0, 0.75, 1000);
        assert_eq!(l.fresh(3999, 3000), Some((2, 0.75)));
        assert_eq!(l.fresh(4001, 3000), None);
        l.set(-1.0, 7.0, 5000);
        assert_eq!(l.fresh(5000, 3000), Some((0, 1.0)));
    }
}
