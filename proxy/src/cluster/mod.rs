//! Several instances as one edge: the state that must be shared (request
//! rates, token budgets, async requests, who is alive) lives in Redis when
//! `[cluster]` names one; without it everything stays in memory.
//!
//! Data flow: `init` (once, at start) builds one `Cluster` with its own
//! one-thread Tokio runtime ("ultrafast-cluster"). Every Redis operation
//! runs as a task on that runtime and the request awaits it for at most
//! `timeout_ms` (`Cluster::call`): the connection and its reconnects then
//! always live on a runtime that outlives any listener's, and a request can
//! never wait on the store longer than the timeout. A failed or late
//! operation marks the store down (a log line, `ultrafast_cluster_store_up`
//! 0, a transition counted); while it is down, decisions skip Redis and
//! each limit's `on_store_error` decides at once, and the heartbeat probes
//! four times a second until an operation succeeds again.
//!
//! - `limits`: GCRA request rates and token buckets as one Lua script per
//!   admission decision (all or nothing), refunds of settled reservations.
//! - `jobs`: the async store's jobs mirrored into Redis, read, followed and
//!   cancelled from any instance.
//! - `fair`: the fair-share counters of every gate and engine, exchanged
//!   four times a second.
//! - `kv`: a lock one instance holds at a time and small shared values
//!   (the ACME certificate and its HTTP-01 answers).
//! - `members`: the heartbeat (a key with a TTL per instance) and the live
//!   count the `local` fallback divides limits by.

pub mod fair;
pub mod jobs;
mod kv;
pub mod limits;
mod members;
mod metrics;

pub use members::Member;
pub use metrics::ClusterMetrics;

use crate::config::file::ClusterSection;
use parking_lot::Mutex;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// What a limit does while the store is unreachable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnStoreError {
    /// Per-instance limits, divided by the live instances last seen.
    Local,
    /// Allow.
    Open,
    /// Refuse (503).
    Closed,
}

impl OnStoreError {
    /// Parse `local`, `open` or `closed`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "local" => Some(Self::Local),
            "open" => Some(Self::Open),
            "closed" => Some(Self::Closed),
            _ => None,
        }
    }

    /// The config spelling (metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Local => "local",
            Self::Open => "open",
            Self::Closed => "closed",
        }
    }
}

/// The store did not answer in time (or refused the operation): the
/// caller falls back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreDown;

/// The shared store of this process.
pub struct Cluster {
    /// This instance's id.
    pub instance: String,
    prefix: String,
    timeout: Duration,
    heartbeat: Duration,
    client: redis::Client,
    pool: Vec<redis::aio::ConnectionManager>,
    next: AtomicUsize,
    rt: tokio::runtime::Handle,
    up: AtomicBool,
    live: AtomicUsize,
    members: Mutex<Vec<Member>>,
    metrics: ClusterMetrics,
    jobs: jobs::Shared,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Cluster({})", self.instance)
    }
}

static CLUSTER: OnceLock<Arc<Cluster>> = OnceLock::new();

/// The cluster of this process, if `[cluster]` is configured.
pub fn get() -> Option<&'static Arc<Cluster>> {
    CLUSTER.get()
}

/// Check a `redis` URL without connecting (config validation).
pub fn check_url(url: &str) -> Result<(), String> {
    redis::Client::open(url)
        .map(|_| ())
        .map_err(|e| format!("`{url}` is not a Redis URL: {e}"))
}

fn default_instance() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".into());
    let id = crate::reqid::random_id();
    let suffix = id.get(4..12).unwrap_or("0");
    format!("{host}-{}-{suffix}", std::process::id())
}

/// Start the shared store of `[cluster]` (once per process): its runtime,
/// connection, heartbeat and subscriptions.
pub fn init(s: &ClusterSection, metrics: &ClusterMetrics) -> Result<(), String> {
    let client =
        redis::Client::open(s.redis.as_str()).map_err(|e| format!("cluster.redis: {e}"))?;
    let timeout = Duration::from_millis(s.timeout_ms.max(1));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("ultrafast-cluster")
        .enable_all()
        .build()
        .map_err(|e| format!("cluster runtime: {e}"))?;
    let handle = rt.handle().clone();
    // The runtime lives as long as the process: it is parked on a thread
    // of its own that never returns.
    std::thread::Builder::new()
        .name("ultrafast-cluster-rt".into())
        .spawn(move || rt.block_on(std::future::pending::<()>()))
        .map_err(|e| format!("cluster thread: {e}"))?;
    let cfg = redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout))
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_millis(200));
    let pool = {
        let _in_rt = handle.enter();
        (0..s.pool_size.clamp(1, 64))
            .map(|_| {
                redis::aio::ConnectionManager::new_lazy_with_config(client.clone(), cfg.clone())
                    .map_err(|e| format!("cluster.redis: {e}"))
            })
            .collect::<Result<Vec<_>, _>>()?
    };
    let instance = if s.instance.trim().is_empty() {
        default_instance()
    } else {
        s.instance.trim().to_string()
    };
    let c = Arc::new(Cluster {
        instance,
        prefix: s.prefix.clone(),
        timeout,
        heartbeat: Duration::from_millis(s.heartbeat_ms.max(50)),
        client,
        pool,
        next: AtomicUsize::new(0),
        rt: handle,
        up: AtomicBool::new(true),
        live: AtomicUsize::new(1),
        members: Mutex::new(Vec::new()),
        metrics: metrics.clone(),
        jobs: jobs::Shared::default(),
    });
    metrics.up.set(1);
    CLUSTER
        .set(c.clone())
        .map_err(|_| "the cluster is already started".to_string())?;
    c.rt.spawn(members::heartbeat(c.clone()));
    c.rt.spawn(jobs::subscriber(c.clone()));
    c.rt.spawn(jobs::writer(c.clone()));
    c.rt.spawn(fair::sync(c.clone()));
    Ok(())
}

impl Cluster {
    /// A key or channel name under this cluster's prefix (`rest` may be
    /// `format_args!`, so the name is formatted once).
    pub fn key(&self, rest: impl std::fmt::Display) -> String {
        format!("{}{rest}", self.prefix)
    }

    /// Whether the store answered the last operation.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// Live instances last seen (at least this one).
    pub fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed).max(1)
    }

    /// The store's timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The metric families.
    pub fn metrics(&self) -> &ClusterMetrics {
        &self.metrics
    }

    /// A connection of the pool, round robin (a cheap handle: each
    /// manager is multiplexed and reconnects by itself).
    fn conn(&self) -> redis::aio::ConnectionManager {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.pool.len();
        self.pool[i].clone()
    }

    /// Run `op` on the cluster runtime, waiting at most the store timeout;
    /// a down store answers `StoreDown` at once (the heartbeat probes it).
    pub async fn call<T, F>(&self, op: F) -> Result<T, StoreDown>
    where
        T: Send + 'static,
        F: Future<Output = redis::RedisResult<T>> + Send + 'static,
    {
        if !self.is_up() {
            return Err(StoreDown);
        }
        let task = self.rt.spawn(op);
        let abort = task.abort_handle();
        match tokio::time::timeout(self.timeout, task).await {
            Ok(Ok(Ok(v))) => Ok(v),
            // Only a store that cannot be reached is "down"; an error the
            // store answered (a full memory, a wrong password) fails this
            // operation alone, and the heartbeat judges the store.
            Ok(Ok(Err(e))) => {
                if e.is_io_error()
                    || e.is_timeout()
                    || e.is_connection_dropped()
                    || e.is_connection_refusal()
                {
                    self.set_up(false, &e.to_string());
                } else {
                    log::debug!("cluster store refused an operation: {e}");
                }
                Err(StoreDown)
            }
            Ok(Err(e)) => {
                self.set_up(false, &e.to_string());
                Err(StoreDown)
            }
            Err(_) => {
                abort.abort();
                self.set_up(false, &format!("no answer within {:?}", self.timeout));
                Err(StoreDown)
            }
        }
    }

    /// Record the store's state; a change is logged and counted.
    fn set_up(&self, up: bool, why: &str) {
        if self.up.swap(up, Ordering::Relaxed) == up {
            return;
        }
        self.metrics.up.set(up as i64);
        let to = if up { "up" } else { "down" };
        self.metrics.transitions.with_label_values(&[to]).inc();
        if up {
            log::warn!("cluster store is reachable again; shared limits resume");
        } else {
            log::error!(
                "cluster store unreachable ({why}); limits use their on_store_error until it returns"
            );
        }
    }

    /// The live members last seen.
    pub fn members(&self) -> Vec<Member> {
        self.members.lock().clone()
    }

    /// `/admin/cluster`: this instance, the store's state and the members.
    pub fn view(&self) -> serde_json::Value {
        serde_json::json!({
            "instance": self.instance,
            "store": if self.is_up() { "up" } else { "down" },
            "live_instances": self.live(),
            "members": self.members().iter().map(Member::json).collect::<Vec<_>>(),
        })
    }
}
