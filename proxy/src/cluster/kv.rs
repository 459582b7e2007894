//! Small shared values under the cluster's prefix: a lock one instance
//! holds for a while (one ACME order at a time), and blobs every instance
//! reads (an issued certificate, an HTTP-01 key authorization).

use super::{Cluster, StoreDown};
use std::sync::LazyLock;
use std::time::Duration;

/// Deletes the key only while it still holds this holder's value, so a
/// lock that expired and was taken by another instance is not released.
const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

static RELEASE_SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(RELEASE));

fn ms(d: Duration) -> u64 {
    (d.as_millis() as u64).max(1)
}

impl Cluster {
    /// Take the lock `name` for `ttl` (it lapses by itself if this
    /// instance dies); `Ok(false)` while another instance holds it.
    pub async fn try_lock(&self, name: &str, ttl: Duration) -> Result<bool, StoreDown> {
        let key = self.key(format_args!("lock:{name}"));
        let holder = self.instance.clone();
        let mut conn = self.conn();
        let set: Option<String> = self
            .call(async move {
                redis::cmd("SET")
                    .arg(key)
                    .arg(holder)
                    .arg("NX")
                    .arg("PX")
                    .arg(ms(ttl))
                    .query_async(&mut conn)
                    .await
            })
            .await?;
        Ok(set.is_some())
    }

    /// Release the lock `name` if this instance still holds it.
    pub async fn unlock(&self, name: &str) -> Result<(), StoreDown> {
        let key = self.key(format_args!("lock:{name}"));
        let mut inv = RELEASE_SCRIPT.key(key);
        inv.arg(self.instance.clone());
        let mut conn = self.conn();
        self.call(async move { inv.invoke_async::<i64>(&mut conn).await })
            .await
            .map(|_| ())
    }

    /// Store `value` under `name` for `ttl`.
    pub async fn put(&self, name: &str, value: String, ttl: Duration) -> Result<(), StoreDown> {
        let key = self.key(format_args!("kv:{name}"));
        let mut conn = self.conn();
        self.call(async move {
            redis::cmd("SET")
                .arg(key)
                .arg(value)
                .arg("PX")
                .arg(ms(ttl))
                .query_async::<()>(&mut conn)
                .await
        })
        .await
    }

    /// The value under `name`, if any.
    pub async fn fetch(&self, name: &str) -> Result<Option<String>, StoreDown> {
        let key = self.key(format_args!("kv:{name}"));
        let mut conn = self.conn();
        self.call(async move {
            redis::cmd("GET")
                .arg(key)
                .query_async::<Option<String>>(&mut conn)
                .await
        })
        .await
    }

    /// Remove the value under `name`.
    pub async fn remove(&self, name: &str) -> Result<(), StoreDown> {
        let key = self.key(format_args!("kv:{name}"));
        let mut conn = self.conn();
        self.call(async move {
            redis::cmd("DEL")
                .arg(key)
                .query_async::<i64>(&mut conn)
                .await
        })
        .await
        .map(|_| ())
    }
}
