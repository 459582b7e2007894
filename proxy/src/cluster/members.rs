//! Membership: each instance renews `PREFIX member:ID` (its description,
//! with a TTL of three beats) once a beat, and its entry in the sorted set
//! `PREFIX members` (scored by the same expiry, on Redis's clock); one
//! script renews both, drops the expired entries and lists the rest, so a
//! beat costs two round trips however many keys the limits hold. The count
//! is what the `local` fallback divides each limit by; the beat doubles as
//! the store's health probe, four times a second while the store is down.

use super::Cluster;
use redis::AsyncCommands;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// A live instance as its last heartbeat described it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Its id.
    pub instance: String,
    /// What it wrote: unix ms of the beat and its pid.
    pub info: String,
}

impl Member {
    /// `/admin/cluster` form.
    pub fn json(&self) -> serde_json::Value {
        let info: serde_json::Value =
            serde_json::from_str(&self.info).unwrap_or(serde_json::Value::Null);
        serde_json::json!({"instance": self.instance, "info": info})
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// KEYS: our member key, the members set. ARGV: our id, description, TTL
/// ms. Returns the ids of the live members.
const BEAT: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
return redis.call('ZRANGE', KEYS[2], 0, 999)
"#;

static BEAT_SCRIPT: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(BEAT));

/// One beat: renew our entry, then read the live members' descriptions.
async fn beat(c: &Cluster) -> redis::RedisResult<Vec<Member>> {
    let mut conn = c.conn();
    let prefix = c.key("member:");
    let ttl = (c.heartbeat.as_millis() as u64).saturating_mul(3).max(150);
    let info = serde_json::json!({"at_ms": now_ms(), "pid": std::process::id()}).to_string();
    let ids: Vec<String> = BEAT_SCRIPT
        .key(format!("{prefix}{}", c.instance))
        .key(c.key("members"))
        .arg(&c.instance)
        .arg(info)
        .arg(ttl)
        .invoke_async(&mut conn)
        .await?;
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let keys: Vec<String> = ids.iter().map(|i| format!("{prefix}{i}")).collect();
    let infos: Vec<Option<String>> = conn.mget(&keys).await?;
    Ok(ids
        .into_iter()
        .zip(infos)
        .filter_map(|(instance, info)| {
            Some(Member {
                instance,
                info: info?,
            })
        })
        .collect())
}

/// While the store is down: a PING on every connection of the pool, so
/// that none is left to fail the first decision after the store returns.
async fn probe_all(c: &Cluster) -> redis::RedisResult<()> {
    for mut conn in c.pool.iter().cloned() {
        let _: String = redis::cmd("PING").query_async(&mut conn).await?;
    }
    Ok(())
}

/// The heartbeat loop (runs on the cluster runtime for the process's life).
pub(super) async fn heartbeat(c: Arc<Cluster>) {
    loop {
        let op = {
            let c = c.clone();
            async move {
                if !c.is_up() {
                    probe_all(&c).await?;
                }
                beat(&c).await
            }
        };
        // The probe runs even while the store is marked down.
        let res = tokio::time::timeout(c.timeout.max(Duration::from_millis(200)), op).await;
        match res {
            Ok(Ok(members)) => {
                let n = members.len().max(1);
                c.live.store(n, Ordering::Relaxed);
                c.metrics.members.set(n as i64);
                *c.members.lock() = members;
                c.set_up(true, "");
            }
            Ok(Err(e)) => c.set_up(false, &e.to_string()),
            Err(_) => c.set_up(false, "heartbeat timed out"),
        }
        let pause = if c.is_up() {
            c.heartbeat
        } else {
            c.heartbeat.min(Duration::from_millis(250))
        };
        tokio::time::sleep(pause).await;
    }
}
