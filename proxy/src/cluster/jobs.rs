//! Async requests shared through the store: the instance that runs a job
//! keeps it in its own bounded store (`inference::jobs`, the truth for its
//! runner) and mirrors it into Redis, where any instance reads, follows
//! and cancels it.
//!
//! Layout under the prefix: `job:ID` is a hash (`owner` and `result` /
//! `error` as JSON, `created`, `status`, `inst`), `job:ID:ev` the list of
//! event payloads (list index = SSE event id, as locally). Every new event
//! or status is announced on channel `ev:ID`; `DELETE` on another instance
//! publishes the id on `cancel`, and the instance that runs it cancels it.
//! Keys expire `ttl` after the job finishes (and `ttl` + 10 minutes after
//! its last change while it runs, so a job whose instance died goes too);
//! the bytes are those of the runner's bounded store, so Redis holds at
//! most the sum of the instances' bounds.
//!
//! The creation is written before the `202` is answered (so the `Location`
//! works at once on any instance); events and status changes go through
//! one writer task in order, pipelined. While the store is down, writes
//! are dropped: the job still runs and is served by its own instance.

use super::Cluster;
use futures_util::StreamExt;
use parking_lot::Mutex;
use redis::AsyncCommands;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::sync::{mpsc, Notify};

/// Writes queued at most (then dropped and counted).
const QUEUE: usize = 65_536;
/// How long a running job's keys outlive its last change, beyond the TTL.
const RUNNING_GRACE: Duration = Duration::from_secs(600);

enum Op {
    Status(String, &'static str),
    /// An event payload and its index (the list's length before it).
    Event(String, usize, String),
    Finish {
        id: String,
        status: &'static str,
        result: Option<String>,
        error: Option<String>,
        /// Events the job had in all: fewer in the store means some
        /// writes were lost.
        events: usize,
        ttl: Duration,
    },
    /// The runner's store let the job go (evicted or expired).
    Remove(String),
}

/// One job write, atomic: nothing is written for a job whose creation is
/// not in the store (an outage lost it, or it expired), the status only
/// moves forward (`queued` -> `in_progress` -> a final one), and an event
/// is appended only at its own index; a gap (writes lost while the store
/// was away) marks the job `broken`, so readers elsewhere stop instead of
/// numbering events wrongly. KEYS: hash, list. ARGV: kind, running TTL ms,
/// channel, then per kind: s: status; e: index, payload; f: status,
/// result, error ('' = none), events, final TTL ms; r: nothing.
const MIRROR: &str = r#"
if ARGV[1] == 'r' then
  redis.call('DEL', KEYS[1], KEYS[2])
  return 0
end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local st = redis.call('HGET', KEYS[1], 'status')
local final = st == 'completed' or st == 'failed' or st == 'cancelled'
if ARGV[1] == 's' then
  if st == 'queued' then redis.call('HSET', KEYS[1], 'status', ARGV[4]) end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
elseif ARGV[1] == 'e' then
  if final then return 0 end
  if redis.call('LLEN', KEYS[2]) == tonumber(ARGV[4]) then
    redis.call('RPUSH', KEYS[2], ARGV[5])
  else
    redis.call('HSET', KEYS[1], 'broken', '1')
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
else
  if final then return 0 end
  redis.call('HSET', KEYS[1], 'status', ARGV[4])
  if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'result', ARGV[5]) end
  if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[6]) end
  if redis.call('LLEN', KEYS[2]) ~= tonumber(ARGV[7]) then
    redis.call('HSET', KEYS[1], 'broken', '1')
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[8])
  redis.call('PEXPIRE', KEYS[2], ARGV[8])
end
redis.call('PUBLISH', ARGV[3], '1')
return 1
"#;

/// Finishes kept for a retry while the store is away (then dropped).
const RETRY: usize = 4096;

type CancelFn = Box<dyn Fn(&str) + Send + Sync>;

/// The cluster's part of the async store.
pub struct Shared {
    tx: mpsc::Sender<(Op, Duration)>,
    rx: Mutex<Option<mpsc::Receiver<(Op, Duration)>>>,
    followers: Mutex<HashMap<String, (Arc<Notify>, usize)>>,
    on_cancel: OnceLock<CancelFn>,
}

impl Default for Shared {
    fn default() -> Self {
        let (tx, rx) = mpsc::channel(QUEUE);
        Shared {
            tx,
            rx: Mutex::new(Some(rx)),
            followers: Mutex::new(HashMap::new()),
            on_cancel: OnceLock::new(),
        }
    }
}

/// A job as another instance sees it in the store.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteJob {
    /// The tenant that created it.
    pub owner: Option<String>,
    /// Its status (wire spelling).
    pub status: String,
    /// The `GET /v1/requests/{id}` body.
    pub view: Value,
}

impl RemoteJob {
    /// Whether it is over.
    pub fn finished(&self) -> bool {
        matches!(self.status.as_str(), "completed" | "failed" | "cancelled")
    }
}

/// Woken on every announced change of one job while held.
pub struct Follow {
    cluster: Arc<Cluster>,
    id: String,
    /// The wake-up.
    pub notify: Arc<Notify>,
}

impl Drop for Follow {
    fn drop(&mut self) {
        let mut g = self.cluster.jobs.followers.lock();
        if let Some((_, n)) = g.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                g.remove(&self.id);
            }
        }
    }
}

fn job_key(c: &Cluster, id: &str) -> String {
    c.key(format_args!("job:{id}"))
}

fn ev_key(c: &Cluster, id: &str) -> String {
    c.key(format_args!("job:{id}:ev"))
}

impl Cluster {
    /// Set what a `cancel` message does here (the local store's cancel).
    pub fn on_cancel(&self, f: CancelFn) {
        let _ = self.jobs.on_cancel.set(f);
    }

    /// Write a new job now (awaited, within the store timeout), so any
    /// instance finds it once the `202` is out.
    /// False when the store did not take it: the job is then this
    /// instance's only (nothing more is mirrored).
    pub async fn job_created(
        &self,
        id: &str,
        owner: Option<&str>,
        created: u64,
        ttl: Duration,
    ) -> bool {
        let mut conn = self.conn();
        let (k, inst) = (job_key(self, id), self.instance.clone());
        let owner = serde_json::to_string(&owner).unwrap_or_else(|_| "null".into());
        let px = (ttl + RUNNING_GRACE).as_millis() as u64;
        self.call(async move {
            redis::pipe()
                .hset_multiple(
                    &k,
                    &[
                        ("owner", owner),
                        ("created", created.to_string()),
                        ("status", "queued".into()),
                        ("inst", inst),
                    ],
                )
                .pexpire(&k, px as i64)
                .query_async::<()>(&mut conn)
                .await
        })
        .await
        .is_ok()
    }

    fn queue(&self, op: Op, ttl: Duration) {
        match self.jobs.tx.try_send((op, ttl)) {
            Ok(()) => {}
            // A finish is never dropped: it waits for room (behind the
            // writes queued before it, so the order holds).
            Err(mpsc::error::TrySendError::Full((op @ Op::Finish { .. }, ttl))) => {
                let tx = self.jobs.tx.clone();
                self.rt.spawn(async move {
                    let _ = tx.send((op, ttl)).await;
                });
            }
            Err(_) => self.metrics.dropped_writes.inc(),
        }
    }

    /// The job started generating.
    pub fn job_started(&self, id: &str, ttl: Duration) {
        self.queue(Op::Status(id.to_string(), "in_progress"), ttl);
    }

    /// The job's event number `index`.
    pub fn job_event(&self, id: &str, index: usize, payload: &str, ttl: Duration) {
        self.queue(Op::Event(id.to_string(), index, payload.to_string()), ttl);
    }

    /// The job ended after `events` events.
    pub fn job_finished(
        &self,
        id: &str,
        status: &'static str,
        result: Option<&Value>,
        error: Option<&Value>,
        events: usize,
        ttl: Duration,
    ) {
        let op = Op::Finish {
            id: id.to_string(),
            status,
            result: result.map(Value::to_string),
            error: error.map(Value::to_string),
            events,
            ttl,
        };
        self.queue(op, ttl);
    }

    /// The runner's store let the job go: its copy goes too.
    pub fn job_removed(&self, id: &str) {
        self.queue(Op::Remove(id.to_string()), Duration::ZERO);
    }

    /// A job this instance does not hold, from the store (None: unknown,
    /// expired, or the store is down).
    pub async fn remote_job(&self, id: &str) -> Option<RemoteJob> {
        let mut conn = self.conn();
        let (k, e) = (job_key(self, id), ev_key(self, id));
        let (h, n): (HashMap<String, String>, u64) = self
            .call(async move {
                redis::pipe()
                    .atomic()
                    .hgetall(&k)
                    .llen(&e)
                    .query_async(&mut conn)
                    .await
            })
            .await
            .ok()?;
        let status = h.get("status")?.clone();
        let owner: Option<String> = h
            .get("owner")
            .and_then(|o| serde_json::from_str(o).ok())
            .flatten();
        let created: u64 = h.get("created").and_then(|c| c.parse().ok()).unwrap_or(0);
        let mut view = serde_json::json!({"id": id, "object": "request", "created": created,
            "status": status, "events": n});
        if h.contains_key("broken") {
            // Some writes were lost while the store was away: the events
            // here are not the whole stream (its runner has them all).
            view["events_incomplete"] = true.into();
        }
        for f in ["result", "error"] {
            if let Some(v) = h.get(f).and_then(|v| serde_json::from_str::<Value>(v).ok()) {
                view[f] = v;
            }
        }
        Some(RemoteJob {
            owner,
            status,
            view,
        })
    }

    /// Events from index `from` and whether the job is over, in one
    /// consistent read; Err when the store does not answer, the job is
    /// gone, or its events are incomplete there (writes were lost).
    pub async fn remote_events(&self, id: &str, from: usize) -> Result<(Vec<String>, bool), ()> {
        let start = isize::try_from(from).map_err(|_| ())?;
        let mut conn = self.conn();
        let (k, e) = (job_key(self, id), ev_key(self, id));
        let (evs, status, broken): (Vec<String>, Option<String>, bool) = self
            .call(async move {
                redis::pipe()
                    .atomic()
                    .lrange(&e, start, -1)
                    .hget(&k, "status")
                    .hexists(&k, "broken")
                    .query_async(&mut conn)
                    .await
            })
            .await
            .map_err(|_| ())?;
        let Some(status) = status else {
            return Err(());
        };
        if broken {
            return Err(());
        }
        let finished = matches!(status.as_str(), "completed" | "failed" | "cancelled");
        Ok((evs, finished))
    }

    /// Ask the instance that runs `id` to cancel it.
    pub async fn cancel_remote(&self, id: &str) -> bool {
        let mut conn = self.conn();
        let (ch, id) = (self.key("cancel"), id.to_string());
        self.call(async move { conn.publish::<_, _, i64>(ch, id).await })
            .await
            .is_ok()
    }

    /// Be woken on every announced change of `id` while the guard lives.
    pub fn follow(self: &Arc<Self>, id: &str) -> Follow {
        let mut g = self.jobs.followers.lock();
        let e = g
            .entry(id.to_string())
            .or_insert_with(|| (Arc::new(Notify::new()), 0));
        e.1 += 1;
        Follow {
            cluster: self.clone(),
            id: id.to_string(),
            notify: e.0.clone(),
        }
    }
}

fn add(c: &Cluster, pipe: &mut redis::Pipeline, op: &Op, ttl: Duration) {
    let id = match op {
        Op::Status(id, _) | Op::Event(id, _, _) | Op::Remove(id) | Op::Finish { id, .. } => id,
    };
    let kind = match op {
        Op::Status(..) => "s",
        Op::Event(..) => "e",
        Op::Finish { .. } => "f",
        Op::Remove(_) => "r",
    };
    // EVAL, not EVALSHA: a pipeline cannot retry a NOSCRIPT error per
    // command, and the script is small.
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(MIRROR)
        .arg(2)
        .arg(job_key(c, id))
        .arg(ev_key(c, id))
        .arg(kind)
        .arg((ttl + RUNNING_GRACE).as_millis().to_string())
        .arg(c.key(format_args!("ev:{id}")));
    match op {
        Op::Status(_, s) => {
            cmd.arg(*s);
        }
        Op::Event(_, i, payload) => {
            cmd.arg(*i).arg(payload);
        }
        Op::Finish {
            status,
            result,
            error,
            events,
            ttl,
            ..
        } => {
            cmd.arg(*status)
                .arg(result.as_deref().unwrap_or(""))
                .arg(error.as_deref().unwrap_or(""))
                .arg(*events)
                .arg(ttl.as_millis().max(1).to_string());
        }
        Op::Remove(_) => {}
    }
    pipe.add_command(cmd).ignore();
}

/// The writer: queued job writes in order, up to 256 per round trip. The
/// finishes of a batch the store did not take are tried again with the
/// next one (up to `RETRY` of them): the events lost meanwhile mark the job
/// incomplete there, but its end is not lost.
pub(super) async fn writer(c: Arc<Cluster>) {
    let Some(mut rx) = c.jobs.rx.lock().take() else {
        return;
    };
    let mut batch = Vec::with_capacity(256);
    let mut retry: Vec<(Op, Duration)> = Vec::new();
    loop {
        let got = if retry.is_empty() {
            rx.recv_many(&mut batch, 256).await
        } else {
            tokio::time::timeout(Duration::from_millis(250), rx.recv_many(&mut batch, 256))
                .await
                .unwrap_or_default()
        };
        if got == 0 && retry.is_empty() {
            return; // every sender is gone
        }
        let mut ops: Vec<(Op, Duration)> = std::mem::take(&mut retry);
        ops.append(&mut batch);
        let mut pipe = redis::pipe();
        for (op, ttl) in &ops {
            add(&c, &mut pipe, op, *ttl);
        }
        let mut conn = c.conn();
        let done = c
            .call(async move { pipe.query_async::<()>(&mut conn).await })
            .await;
        if done.is_err() {
            retry = ops
                .into_iter()
                .filter(|(op, _)| matches!(op, Op::Finish { .. }))
                .take(RETRY)
                .collect();
            if retry.is_empty() {
                continue;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// The subscriber: `cancel` messages for jobs run here, and change
/// announcements for the followers here. Reconnects four times a second
/// while the store is away (followers poll meanwhile).
pub(super) async fn subscriber(c: Arc<Cluster>) {
    let (cancel, pattern) = (c.key("cancel"), c.key("ev:*"));
    let ev_prefix = c.key("ev:");
    loop {
        if let Ok(mut ps) = c.client.get_async_pubsub().await {
            if ps.subscribe(&cancel).await.is_ok() && ps.psubscribe(&pattern).await.is_ok() {
                let mut stream = ps.on_message();
                while let Some(msg) = stream.next().await {
                    let ch = msg.get_channel_name();
                    if ch == cancel {
                        if let (Ok(id), Some(f)) =
                            (msg.get_payload::<String>(), c.jobs.on_cancel.get())
                        {
                            f(&id);
                        }
                    } else if let Some(id) = ch.strip_prefix(&ev_prefix) {
                        if let Some((n, _)) = c.jobs.followers.lock().get(id) {
                            n.notify_waiters();
                        }
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
