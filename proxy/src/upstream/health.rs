//! Active health checks: the runtime's loop (`runtime::loops`) probes every
//! member of every pool with a health check, `GET path` over a fresh TCP
//! connection (or a gRPC health call, `grpc_health`), and flips `Member::healthy` after `fall` consecutive failures
//! or `rise` consecutive successes (nginx plus / HAProxy semantics).
//!
//! The loop reads the live config on each tick, so pools added by a
//! reload are checked without restarting anything.

use super::{Member, Pool};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Consecutive-result counters of one member, keyed by pool name and address.
pub type Streaks = HashMap<(String, String), (u32, u32)>;

/// Probe, concurrently, the pool's current members that `pick` selects.
async fn probe_members(pool: &Arc<Pool>, pick: impl Fn(&Member) -> bool) -> Vec<(Member, bool)> {
    let Some(h) = pool.health.clone() else {
        return Vec::new();
    };
    let tls = pool.settings.tls.is_some();
    let probes: Vec<_> = pool
        .members()
        .members
        .iter()
        .filter(|m| pick(m))
        .map(|m| {
            let (m, h) = (m.clone(), h.clone());
            let peer = h.grpc.is_some().then(|| pool.peer(&m));
            tokio::spawn(async move {
                let host = h.host.clone().unwrap_or_else(|| m.label.clone());
                let check = async {
                    match (&h.grpc, peer) {
                        (Some(service), Some(peer)) => {
                            super::grpc_health::probe(&peer, &host, service).await
                        }
                        _ => probe(&m, &host, &h.path, tls).await,
                    }
                };
                let ok = tokio::time::timeout(h.timeout, check)
                    .await
                    .unwrap_or(false);
                (m, ok)
            })
        })
        .collect();
    let mut out = Vec::with_capacity(probes.len());
    for p in probes {
        if let Ok(r) = p.await {
            out.push(r);
        }
    }
    out
}

/// Run one round of probes over the pool's current members, applying the
/// rise/fall rules.
pub async fn check_pool(pool: Arc<Pool>, streaks: &mut Streaks) {
    let Some(h) = pool.health.clone() else { return };
    for (m, ok) in probe_members(&pool, |_| true).await {
        let s = streaks
            .entry((pool.name.clone(), m.addr.to_string()))
            .or_insert((0, 0));
        if ok {
            *s = (s.0 + 1, 0);
        } else {
            *s = (0, s.1 + 1);
        }
        let was = m.state.healthy.load(Ordering::Relaxed);
        let now = if was { s.1 < h.fall } else { s.0 >= h.rise };
        if now != was {
            m.state.healthy.store(now, Ordering::Relaxed);
            log::warn!(
                "pool {}: member {} ({}) is now {}",
                pool.name,
                m.label,
                m.addr,
                if now { "up" } else { "down" }
            );
        }
        m.state.metrics.healthy.set(now as i64);
    }
}

/// Probe every member not in `carried` once and set its health from that
/// single result (used before a reload swaps a new or changed pool in).
pub async fn probe_new_members(pool: &Arc<Pool>, carried: &[std::net::SocketAddr]) {
    for (m, ok) in probe_members(pool, |m| !carried.contains(&m.addr)).await {
        m.state.healthy.store(ok, Ordering::Relaxed);
        m.state.metrics.healthy.set(ok as i64);
    }
}

/// One probe: any 2xx or 3xx status is healthy.
async fn probe(m: &Member, host: &str, path: &str, tls: bool) -> bool {
    let Ok(mut s) = TcpStream::connect(m.addr).await else {
        return false;
    };
    if tls {
        // HTTPS members: liveness is a completed TCP connect (the HTTP probe
        // would need its own TLS client; the proxy's retries and passive
        // ejection still judge real responses).
        return true;
    }
    let req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: ultrafast-health\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).await.is_err() {
        return false;
    }
    let mut buf = [0u8; 64];
    let mut n = 0;
    while n < 12 {
        match s.read(&mut buf[n..]).await {
            Ok(0) | Err(_) => break,
            Ok(k) => n += k,
        }
    }
    // "HTTP/1.1 200": the status is bytes 9..12.
    let head = &buf[..n];
    head.starts_with(b"HTTP/1.") && n >= 12 && matches!(head[9], b'2' | b'3')
}
