//! Shared request rates and token budgets: every check of one admission
//! decision runs in one Lua script, atomically and all or nothing (a
//! refused check takes nothing from the others), on Redis's own clock
//! (`TIME`), so instances with skewed clocks still share one limit.
//!
//! - A request rate is GCRA: the key holds the theoretical arrival time
//!   (TAT, microseconds). A request is allowed when
//!   `TAT - period * (burst - 1) <= now`, and moves the TAT one period on;
//!   the key expires when the TAT has passed (a fresh key is the same
//!   state).
//! - A token budget is a bucket: a hash of level and update time, refilled
//!   at `tokens_per_min / 60` per second up to the burst. A reservation
//!   takes its worst case now; `refund` gives back what was not used (never
//!   past the burst) or takes the overshoot (the level goes negative, the
//!   key's next request waits), as the in-memory budget does.
//!
//! Numbers cross into Lua as strings and back with `%.17g`, since Lua's
//! default conversion keeps 14 digits and a microsecond clock has 16.

use super::{Cluster, StoreDown};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

/// One check of a decision.
#[derive(Debug, Clone, PartialEq)]
pub enum Check {
    /// A request rate: one request against `key`.
    Rate {
        /// Redis key.
        key: String,
        /// Sustained requests per second.
        per_s: f64,
        /// Requests allowed at once.
        burst: u32,
    },
    /// A token reservation of `tokens` against `key`.
    Tokens {
        /// Redis key.
        key: String,
        /// Refill in tokens per second.
        per_s: f64,
        /// Bucket size.
        burst: u64,
        /// Tokens taken.
        tokens: u64,
    },
}

impl Check {
    /// Its Redis key.
    pub fn into_key(self) -> String {
        match self {
            Check::Rate { key, .. } | Check::Tokens { key, .. } => key,
        }
    }
}

/// KEYS: one per check. ARGV: per check, kind ("r" or "t") and three
/// numbers (rate: period in us, burst, unused; tokens: per second, burst,
/// tokens). Returns {0, 0} when all pass, else {index (1-based), wait us}.
const DECIDE: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local n = #KEYS
local new = {}
local function num(x) return string.format('%.17g', x) end
-- TTLs in ms as integers, at most 30 days (a slower limit's key may then
-- expire early, which only forgets a very old request).
local function ttl(ms) return string.format('%d', math.max(1000, math.min(ms, 2592000000))) end
for i = 1, n do
  local kind = ARGV[(i - 1) * 4 + 1]
  local a = tonumber(ARGV[(i - 1) * 4 + 2])
  local b = tonumber(ARGV[(i - 1) * 4 + 3])
  local c = tonumber(ARGV[(i - 1) * 4 + 4])
  if kind == 'r' then
    local tat = tonumber(redis.call('GET', KEYS[i]) or now)
    if tat < now then tat = now end
    local allow_at = tat - a * (b - 1)
    if now < allow_at then return {i, math.ceil(allow_at - now)} end
    new[i] = tat + a
  else
    local st = redis.call('HMGET', KEYS[i], 'l', 't')
    local level = tonumber(st[1]) or b
    local at = tonumber(st[2]) or now
    if level < b and now > at then level = math.min(b, level + (now - at) * a / 1000000) end
    if level < c then return {i, math.ceil((c - level) / a * 1000000)} end
    new[i] = level - c
  end
end
for i = 1, n do
  local kind = ARGV[(i - 1) * 4 + 1]
  local a = tonumber(ARGV[(i - 1) * 4 + 2])
  local b = tonumber(ARGV[(i - 1) * 4 + 3])
  if kind == 'r' then
    redis.call('SET', KEYS[i], num(new[i]), 'PX', ttl((new[i] - now) / 1000 + 1000))
  else
    redis.call('HSET', KEYS[i], 'l', num(new[i]), 't', num(now))
    redis.call('PEXPIRE', KEYS[i], ttl((b - new[i]) / a * 1000 + 1000))
  end
end
return {0, 0}
"#;

/// KEYS[1]: a bucket. ARGV: per second, burst, delta (a refund when
/// positive, capped at the burst; an overshoot taken when negative).
const REFUND: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local a = tonumber(ARGV[1])
local b = tonumber(ARGV[2])
local d = tonumber(ARGV[3])
local st = redis.call('HMGET', KEYS[1], 'l', 't')
local level = tonumber(st[1]) or b
local at = tonumber(st[2]) or now
if level < b and now > at then level = math.min(b, level + (now - at) * a / 1000000) end
level = level + d
if d > 0 and level > b then level = b end
redis.call('HSET', KEYS[1], 'l', string.format('%.17g', level), 't', string.format('%.17g', now))
redis.call('PEXPIRE', KEYS[1], string.format('%d', math.max(1000, math.min((b - level) / a * 1000 + 1000, 2592000000))))
return 0
"#;

static DECIDE_SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(DECIDE));
static REFUND_SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(REFUND));

/// The longest wait a refusal reports.
const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);

impl Cluster {
    /// One admission decision: Ok(None) when every check passes (and each
    /// took its share), Ok(Some((i, wait))) when check `i` refused (and
    /// none took anything), Err when the store did not answer in time.
    pub async fn decide(
        self: &Arc<Self>,
        checks: &[Check],
    ) -> Result<Option<(usize, Duration)>, StoreDown> {
        if checks.is_empty() {
            return Ok(None);
        }
        let mut inv = DECIDE_SCRIPT.prepare_invoke();
        for c in checks {
            match c {
                Check::Rate { key, per_s, burst } => {
                    inv.key(key).arg("r").arg(1e6 / per_s).arg(*burst).arg(0);
                }
                Check::Tokens {
                    key,
                    per_s,
                    burst,
                    tokens,
                } => {
                    inv.key(key).arg("t").arg(*per_s).arg(*burst).arg(*tokens);
                }
            }
        }
        let mut conn = self.conn();
        let started = Instant::now();

        let r: (i64, i64) = self
            .call(async move { inv.invoke_async(&mut conn).await })
            .await?;
        self.metrics
            .decision
            .observe(started.elapsed().as_secs_f64());
        Ok(match r {
            (0, _) => None,
            (i, wait_us) => {
                let wait = Duration::from_micros(wait_us.max(1) as u64).min(MAX_WAIT);
                Some(((i - 1).max(0) as usize, wait))
            }
        })
    }

    /// Give `delta` tokens back to a bucket (negative: take the
    /// overshoot). Fire and forget: a refund lost while the store is down
    /// only leaves the bucket emptier until it refills.
    pub fn refund(self: &Arc<Self>, key: String, per_s: f64, burst: u64, delta: f64) {
        if delta == 0.0 || !self.is_up() {
            return;
        }
        let c = self.clone();
        self.rt.spawn(async move {
            let mut conn = c.conn();
            let mut inv = REFUND_SCRIPT.prepare_invoke();
            inv.key(key).arg(per_s).arg(burst).arg(delta);

            let _ = c
                .call(async move { inv.invoke_async::<i64>(&mut conn).await })
                .await;
        });
    }
}
