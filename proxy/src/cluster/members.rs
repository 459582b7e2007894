//! Membership: each instance renews `PREFIX member:ID` (a TTL of three
//! beats) once a beat and lists the others with `SCAN`. The count is what
//! the `local` fallback divides each limit by; the beat doubles as the
//! store's health probe, four times a second while the store is down.

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

/// One beat: renew our key, then read every member's.
async fn beat(c: &Cluster) -> redis::RedisResult<Vec<Member>> {
    let mut conn = c.conn();
    let prefix = c.key("member:");
    let ttl = (c.heartbeat.as_millis() as u64).saturating_mul(3).max(150);
    let info = serde_json::json!({"at_ms": now_ms(), "pid": std::process::id()}).to_string();
    let _: () = conn
        .pset_ex(format!("{prefix}{}", c.instance), info, ttl)
        .await?;
    let mut keys: Vec<String> = Vec::new();
    let mut cursor: u64 = 0;
    // Bounded: a SCAN pass is at most 100 rounds of 100 keys.
    for _ in 0..100 {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(100)
            .query_async(&mut conn)
            .await?;
        keys.extend(batch);
        cursor = next;
        if cursor == 0 {
            break;
        }
    }
    keys.sort();
    keys.dedup();
    let infos: Vec<Option<String>> = if keys.is_empty() {
        Vec::new()
    } else {
        conn.mget(&keys).await?
    };
    Ok(keys
        .into_iter()
        .zip(infos)
        .filter_map(|(k, info)| {
            Some(Member {
                instance: k.strip_prefix(&prefix)?.to_string(),
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
