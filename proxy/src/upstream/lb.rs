//! Load-balancing policies. Each picks a member index given the members'
//! live state, a request hash (used by `consistent_hash`) and the members
//! already tried by this request (never picked again on a retry).
//!
//! Design: all policies are lock-free. Round robin walks a precomputed smooth
//! weighted schedule (nginx's sequence, computed once at load) with one
//! atomic counter; least-outstanding and peak-EWMA read per-member atomics;
//! the consistent-hash ring is immutable after load. When no member is
//! available (all down or ejected) every policy falls back to ignoring health
//! rather than failing outright, as nginx does when all servers are marked
//! down: a possibly-wrong health verdict should not turn into a full outage.

use super::{Member, MemberState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub use crate::hash::{hash_bytes, mix64, HashKey};

/// A load-balancing policy with its state.
#[derive(Debug)]
pub enum Balancer {
    /// Smooth weighted round robin.
    RoundRobin {
        /// Member indices in smooth-WRR order.
        schedule: Vec<usize>,
        /// Position in the schedule.
        next: AtomicU64,
    },
    /// Fewest requests in flight per unit of weight.
    LeastOutstanding {
        /// Rotates the starting point so ties spread out.
        next: AtomicU64,
    },
    /// Ketama-style ring with bounded load.
    ConsistentHash {
        /// Sorted (point, member) pairs.
        ring: Vec<(u64, usize)>,
        /// Max load as a factor of the average (e.g. 1.25).
        load_factor: f64,
    },
    /// Power of two choices on latency EWMA times outstanding.
    PeakEwma {
        /// Random state.
        rng: AtomicU64,
    },
    /// Fewest waiting (as the members report it) plus in flight, with KV
    /// usage as a cost; least outstanding for a member whose figures are
    /// stale.
    QueueAware {
        /// Rotates the starting point so ties spread out.
        next: AtomicU64,
        /// Figures older than this (ms) are not used.
        stale_ms: u64,
    },
}

const VNODES_PER_WEIGHT: usize = 100;

impl Balancer {
    /// Smooth weighted round robin.
    pub fn round_robin(members: &[Member]) -> Self {
        // nginx's smooth WRR: each step add weight to current, pick the max,
        // subtract the total. Yields an interleaved sequence (a,b,a,c,a,b...).
        let total: i64 = members.iter().map(|m| m.weight as i64).sum();
        let mut cur = vec![0i64; members.len()];
        let mut schedule = Vec::with_capacity(total as usize);
        for _ in 0..total {
            let mut best = 0;
            for (i, m) in members.iter().enumerate() {
                cur[i] += m.weight as i64;
                if cur[i] > cur[best] {
                    best = i;
                }
            }
            cur[best] -= total;
            schedule.push(best);
        }
        Balancer::RoundRobin {
            schedule,
            next: AtomicU64::new(0),
        }
    }

    /// A consistent-hash ring over `members`.
    pub fn consistent_hash(members: &[Member], load_factor: f64) -> Self {
        let mut ring = Vec::new();
        for (i, m) in members.iter().enumerate() {
            for v in 0..(m.weight as usize * VNODES_PER_WEIGHT) {
                // Points depend only on the member's own address, so adding
                // a member leaves every other member's points where they
                // were (and the addresses of one DNS name stay distinct).
                let point = hash_bytes(format!("{}#{v}", m.addr).as_bytes());
                ring.push((point, i));
            }
        }
        ring.sort_unstable();
        Balancer::ConsistentHash { ring, load_factor }
    }

    /// Pick a member, never one in `tried`.
    pub fn select(
        &self,
        members: &[Member],
        hash: u64,
        tried: &[usize],
        now: u64,
    ) -> Option<usize> {
        let ok = |i: usize| !tried.contains(&i) && members[i].available(now);
        self.pick(members, hash, &ok).or_else(|| {
            // Panic mode: ignore health, keep only the "not tried" rule.
            let untried = |i: usize| !tried.contains(&i);
            self.pick(members, hash, &untried)
        })
    }

    fn pick(&self, members: &[Member], hash: u64, ok: &dyn Fn(usize) -> bool) -> Option<usize> {
        let n = members.len();
        if n == 0 {
            return None;
        }
        match self {
            Balancer::RoundRobin { schedule, next } => {
                let start = next.fetch_add(1, Ordering::Relaxed) as usize;
                (0..schedule.len())
                    .map(|k| schedule[(start + k) % schedule.len()])
                    .find(|&i| ok(i))
            }
            Balancer::LeastOutstanding { next } => {
                let start = next.fetch_add(1, Ordering::Relaxed) as usize;
                let mut best: Option<(u64, usize)> = None;
                for k in 0..n {
                    let i = (start + k) % n;
                    if !ok(i) {
                        continue;
                    }
                    let score = outstanding_score(&members[i]);
                    if best.is_none_or(|(b, _)| score < b) {
                        best = Some((score, i));
                    }
                }
                best.map(|(_, i)| i)
            }
            Balancer::ConsistentHash {
                ring, load_factor, ..
            } => {
                if ring.is_empty() {
                    return None;
                }
                let total: u64 = members.iter().map(|m| m.outstanding()).sum();
                // Bounded load (Mirrokni et al.): a member is full above
                // ceil(c * (total + 1) / n); the key then walks on.
                let cap = ((total + 1) as f64 * load_factor / n as f64).ceil() as u64;
                let start = ring.partition_point(|(p, _)| *p < hash);
                let mut fallback = None;
                for k in 0..ring.len() {
                    let i = ring[(start + k) % ring.len()].1;
                    if !ok(i) {
                        continue;
                    }
                    if members[i].outstanding() < cap {
                        return Some(i);
                    }
                    fallback.get_or_insert(i);
                }
                fallback
            }
            Balancer::QueueAware { next, stale_ms } => {
                let start = next.fetch_add(1, Ordering::Relaxed) as usize;
                let now = super::now_ms();
                let candidates = (0..n).map(|k| (start + k) % n).filter(|&i| ok(i));
                let figures: Vec<_> = candidates
                    .map(|i| (i, members[i].state.load.fresh(now, *stale_ms)))
                    .collect();
                if figures.iter().any(|(_, f)| f.is_none()) {
                    // Scores from figures and from in-flight counts alone
                    // do not compare: one stale member turns the pick into
                    // least outstanding for all.
                    return figures
                        .iter()
                        .min_by_key(|(i, _)| outstanding_score(&members[*i]))
                        .map(|(i, _)| *i);
                }
                figures
                    .iter()
                    .filter_map(|(i, f)| {
                        f.map(|(w, kv)| (*i, super::load::score(&members[*i], w, kv)))
                    })
                    .min_by(|a, b| a.1.total_cmp(&b.1))
                    .map(|(i, _)| i)
            }
            Balancer::PeakEwma { rng } => {
                // Two random available members, without collecting them: start
                // at two random offsets and take the first available index.
                let r = mix64(rng.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed));
                let from = |start: usize, skip: Option<usize>| {
                    (0..n)
                        .map(|k| (start + k) % n)
                        .find(|&i| ok(i) && Some(i) != skip)
                };
                let a = from((r % n as u64) as usize, None)?;
                match from(((r >> 32) % n as u64) as usize, Some(a)) {
                    None => Some(a),
                    Some(b) => Some(if cost(&members[a]) <= cost(&members[b]) {
                        a
                    } else {
                        b
                    }),
                }
            }
        }
    }
}

/// Least outstanding's score: in flight (plus this one) per unit of
/// weight, in integers.
fn outstanding_score(m: &Member) -> u64 {
    (m.outstanding() + 1) * 1_000_000 / m.weight.max(1) as u64
}

/// Cost of sending one more request to `m`: latency estimate times load.
fn cost(m: &Member) -> f64 {
    // An unmeasured member costs a nominal 1 ms so it gets tried.
    let ewma = match m.ewma_ns() {
        0 => 1_000_000.0,
        v => v as f64,
    };
    ewma * (m.outstanding() + 1) as f64 / m.weight.max(1) as f64
}

/// Time constant of the EWMA decay.
const EWMA_TAU_MS: f64 = 10_000.0;

/// Fold one observed latency into the member's peak-EWMA: a slower sample is
/// taken at once (react to trouble immediately), a faster one decays in.
pub fn update_peak_ewma(m: &MemberState, latency: Duration, now: u64) {
    let rtt = latency.as_nanos().min(u64::MAX as u128) as u64;
    let old = m.ewma_ns.load(Ordering::Relaxed);
    let last = m.ewma_stamp_ms.swap(now, Ordering::Relaxed);
    let new = if old == 0 || rtt > old {
        rtt
    } else {
        let w = (-((now.saturating_sub(last)) as f64) / EWMA_TAU_MS).exp();
        (old as f64 * w + rtt as f64 * (1.0 - w)) as u64
    };
    m.ewma_ns.store(new, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(n: usize) -> Vec<Member> {
        (0..n)
            .map(|i| {
                let addr = format!("127.0.0.1:{}", 10000 + i);
                Member {
                    addr: addr.parse().unwrap(),
                    label: addr,
                    weight: 1,
                    state: std::sync::Arc::new(MemberState::new(
                        crate::upstream::metrics::MemberMetrics::detached(),
                    )),
                }
            })
            .collect()
    }

    #[test]
    fn smooth_wrr_interleaves_by_weight() {
        let mut ms = members(3);
        ms[0].weight = 5;
        let b = Balancer::round_robin(&ms);
        let picks: Vec<usize> = (0..7).map(|_| b.select(&ms, 0, &[], 0).unwrap()).collect();
        assert_eq!(picks.iter().filter(|&&i| i == 0).count(), 5);
        // Smooth: the heavy member never runs more than 3 in a row.
        assert_eq!(picks, vec![0, 0, 1, 0, 2, 0, 0]);
    }

    #[test]
    fn consistent_hash_moves_about_one_nth_of_keys() {
        let four = members(4);
        let five = members(5);
        let a = Balancer::consistent_hash(&four, 100.0);
        let b = Balancer::consistent_hash(&five, 100.0);
        let keys = 10_000u64;
        let moved = (0..keys)
            .map(|k| hash_bytes(&k.to_le_bytes()))
            .filter(|h| a.select(&four, *h, &[], 0) != b.select(&five, *h, &[], 0))
            .count();
        let frac = moved as f64 / keys as f64;
        assert!((0.12..0.28).contains(&frac), "moved {frac}");
    }

    #[test]
    fn tried_members_are_skipped() {
        let ms = members(2);
        let b = Balancer::LeastOutstanding {
            next: AtomicU64::new(0),
        };
        assert_eq!(b.select(&ms, 0, &[0], 0), Some(1));
        assert_eq!(b.select(&ms, 0, &[0, 1], 0), None);
    }
}
