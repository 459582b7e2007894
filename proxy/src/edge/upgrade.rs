//! WebSocket (and any HTTP/1.1 `Upgrade`) proxying on proxy routes.
//!
//! Pingora relays an upgraded connection both ways once the upstream
//! answers `101`; what it does not give is a cap, an idle deadline, counts,
//! or care about the bytes after an upgrade the upstream refused. Here:
//! - a request that asks to upgrade takes a slot of `[limits]
//!   max_upgraded` (all listeners together) before it is proxied, and gets
//!   a 503 when none is free; the slot is held while the tunnel lasts and
//!   given back if the upstream refuses;
//! - once upgraded, a client silent for `upgraded_idle_timeout_s` is
//!   closed (nginx closes an idle tunnel at `proxy_read_timeout`);
//! - an upgrade the upstream answers with anything but `101` closes the
//!   connection after that answer: bytes the client sent behind its
//!   request, meant for the tunnel, are never read as a request (the
//!   request-smuggling class of CVE-2026-2833).

use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Counts of upgraded connections.
pub struct UpgradeMetrics {
    /// Upgraded connections open now.
    pub open: IntGauge,
    /// Upgrade requests by outcome.
    pub upgraded: IntCounter,
    /// Refused at the cap.
    pub refused_cap: IntCounter,
    /// Answered by the upstream with something other than `101`.
    pub refused_upstream: IntCounter,
    /// Slots taken (requests asking to upgrade, and tunnels).
    slots: Arc<AtomicUsize>,
}

impl UpgradeMetrics {
    /// Create and register the families.
    pub fn new(registry: &Registry) -> Self {
        #[allow(clippy::expect_used)]
        let open = IntGauge::new(
            "ultrafast_upgraded_connections",
            "Upgraded (WebSocket) connections open now.",
        )
        .expect("static metric");
        #[allow(clippy::expect_used)]
        let total = IntCounterVec::new(
            Opts::new(
                "ultrafast_upgrades_total",
                "Upgrade requests by result: upgraded, refused_cap (max_upgraded), refused_upstream (no 101).",
            ),
            &["result"],
        )
        .expect("static metric");
        let _ = registry.register(Box::new(open.clone()));
        let _ = registry.register(Box::new(total.clone()));
        UpgradeMetrics {
            open,
            upgraded: total.with_label_values(&["upgraded"]),
            refused_cap: total.with_label_values(&["refused_cap"]),
            refused_upstream: total.with_label_values(&["refused_upstream"]),
            slots: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Take a slot under `cap` (0: no cap); `None` when all are taken.
    pub fn take(&self, cap: usize) -> Option<Slot> {
        let n = self.slots.fetch_add(1, Ordering::Relaxed);
        if cap > 0 && n >= cap {
            self.slots.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(Slot {
            slots: self.slots.clone(),
            open: None,
        })
    }
}

/// A slot of `max_upgraded`, given back when dropped (the request or the
/// tunnel ended).
pub struct Slot {
    slots: Arc<AtomicUsize>,
    /// The gauge, counted while the connection is upgraded.
    open: Option<IntGauge>,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("upgraded", &self.open.is_some())
            .finish()
    }
}

impl Slot {
    /// The upstream answered `101`: count the tunnel.
    pub fn upgraded(&mut self, gauge: &IntGauge) {
        if self.open.is_none() {
            gauge.inc();
            self.open = Some(gauge.clone());
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.slots.fetch_sub(1, Ordering::Relaxed);
        if let Some(g) = &self.open {
            g.dec();
        }
    }
}

/// Whether `req` asks to upgrade its connection, exactly as Pingora reads
/// it (an HTTP/1.1 request with an `Upgrade` header, `Connection` or not:
/// Pingora then tunnels it and re-adds the hop-by-hop headers upstream),
/// so that every such tunnel gets the upgrade controls (a `max_upgraded`
/// slot, the idle timeout, the metrics) and stays off the cache. HTTP/2
/// has no upgrade.
pub fn asks_upgrade(req: &pingora::http::RequestHeader) -> bool {
    pingora::protocols::http::v1::common::is_upgrade_req(req)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_capped_and_given_back() {
        let m = UpgradeMetrics::new(&Registry::new());
        let a = m.take(2).expect("first");
        let mut b = m.take(2).expect("second");
        assert!(m.take(2).is_none(), "the cap");
        b.upgraded(&m.open);
        assert_eq!(m.open.get(), 1);
        drop(b);
        assert_eq!(m.open.get(), 0);
        assert!(m.take(2).is_some(), "a slot came back");
        drop(a);
        assert!(m.take(0).is_some(), "no cap");
    }

    #[test]
    fn an_upgrade_request_is_what_pingora_tunnels() {
        let mut r = pingora::http::RequestHeader::build("GET", b"/ws", None).unwrap();
        assert!(!asks_upgrade(&r));
        // No `Connection: upgrade`: Pingora tunnels it all the same.
        r.insert_header("upgrade", "websocket").unwrap();
        assert!(asks_upgrade(&r));
        r.insert_header("connection", "keep-alive, Upgrade")
            .unwrap();
        assert!(asks_upgrade(&r));
        r.set_version(http::Version::HTTP_10);
        assert!(!asks_upgrade(&r), "HTTP/1.0 has no upgrade");
    }
}
