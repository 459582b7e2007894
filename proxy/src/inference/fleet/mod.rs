//! The latency promise across a fleet: a prediction per member, a request
//! placed on the member with the most headroom against its targets, and a
//! refusal at once only when no member can meet them.
//!
//! Each member of an upstream pool routed with `lb = "predicted_latency"`
//! has a [`Latency`] of its own: the step model and ledger the in-process
//! engine has, learned online from that member's streams (inter-token gaps
//! at its concurrency, first tokens) and calibrated by its own errors, so
//! a member that turns slow is predicted slow within a few hundred tokens
//! and its calibration factor rises with its first late first token. All
//! start from the pool's priors (the model's `prefill_tokens_per_s`,
//! `decode_tokens_per_s`, and `member_slots`).
//!
//! A decision ([`Fleet::place`]) scores at most `k` members drawn at random
//! (power of k choices) plus the members the prefix index says hold the
//! longest prefix of the prompt (at most [`HIT_CANDIDATES`]): each score is
//! the member's calibrated TTFT prediction for the prompt tokens it would
//! really prefill (past its prefix hit), and its predicted inter-token gap.
//! No lock is held across members: each prediction takes its member's
//! ledger lock for the view alone. The best member is the one that meets
//! both targets with the most TTFT headroom, then the most TPOT headroom;
//! ties (within 2%) go to the fuller prefix hit, then to the lower load. The request then takes its place on that member (viewed and
//! replayed again, atomically with other arrivals there); if the member
//! filled meanwhile, the next best is tried. The cost of a decision is
//! bounded by `k + HIT_CANDIDATES` predictions whatever the fleet's size.
//!
//! What a member reports (vLLM's `num_requests_waiting`, scraped as for
//! `queue_aware`) counts too: waiting requests the edge did not send there
//! (another gateway's, a direct client's) are work ahead that the ledger
//! cannot see, added to the prediction at the member's idle cost of a
//! prompt like this one.
//!
//! `lb = "load_prefix"` is the baseline the benchmark compares against:
//! llm-d's default scoring (a prefix-cache score plus queue and KV-usage
//! scores over every member), with the pool's ordinary admission.

pub mod admit;
pub mod prefix;

use super::predict::{Latency, Ticket, Verdict};
use crate::admission::clock::{Clock, MonotonicClock};
use parking_lot::Mutex;
use prefix::PrefixIndex;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use ultrafast_engine::fair::Tenant;

/// Prefix-hit holders scored beside the `k` random members.
pub const HIT_CANDIDATES: usize = 2;

/// Predictions within this fraction of each other are a tie (then the
/// prefix hit and the load decide).
const TIE: f64 = 0.02;

/// How a fleet picks its member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// By predicted headroom against the request's targets (and refusal
    /// when no member meets them).
    PredictedLatency,
    /// llm-d's default scorer: prefix hit, queue and KV usage (baseline).
    LoadPrefix,
}

/// A fleet's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetSpec {
    /// The policy.
    pub policy: Policy,
    /// Members drawn at random and scored per decision.
    pub k: usize,
    /// Tokens per prefix block (vLLM's default block is 16).
    pub block_tokens: usize,
    /// Prompt tokens a member's prefix cache holds (its KV capacity).
    pub capacity_tokens: usize,
    /// Sequences a member runs at once (its `max_num_seqs`).
    pub slots: usize,
    /// Tokens a member's step takes at most (its
    /// `max_num_batched_tokens`; None: whole prompts).
    pub chunk: Option<usize>,
    /// Prior prefill speed of a member, tokens/s.
    pub prefill_tps: f64,
    /// Prior decode speed of a member, tokens/s of one stream.
    pub decode_tps: f64,
    /// Calibration window.
    pub window: Duration,
}

/// One member's model.
#[derive(Debug)]
pub struct Replica {
    /// Its address.
    pub addr: SocketAddr,
    /// Its id in the prefix index.
    pub id: u32,
    /// Its latency model and ledger.
    pub latency: Arc<Latency>,
}

/// The replicas of one member set, in the members' order.
#[derive(Debug)]
pub struct Aligned {
    /// One per member.
    pub replicas: Vec<Arc<Replica>>,
    by_id: HashMap<u32, usize>,
}

/// What the fleet reads of a member at decision time.
#[derive(Debug, Clone, Copy, Default)]
pub struct Reported {
    /// It may take new requests (healthy, not ejected, not drained).
    pub up: bool,
    /// Requests in flight to it from this edge.
    pub outstanding: u64,
    /// Its own figures, when fresh: waiting requests and KV usage (0..1).
    pub scraped: Option<(u64, f64)>,
}

/// What one decision asks.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    /// Lane rank.
    pub rank: u32,
    /// Prompt tokens.
    pub prompt: usize,
    /// Most output tokens (all choices).
    pub max_out: usize,
    /// Time-to-first-token target left (None: none).
    pub ttft: Option<Duration>,
    /// Inter-token target (None: none).
    pub tpot: Option<Duration>,
    /// Better lanes' reserved shares (see `Latency::admit`).
    pub reserved: &'a [(u32, f64)],
    /// Who asks.
    pub tenant: &'a Tenant,
    /// The prompt's prefix blocks (`prefix::blocks`).
    pub blocks: &'a [u64],
}

/// A placed request.
#[derive(Debug)]
pub struct Placed {
    /// The member's index in the member set.
    pub index: usize,
    /// Its address.
    pub addr: SocketAddr,
    /// The request's place in the member's ledger.
    pub ticket: Ticket,
    /// The member's calibrated TTFT prediction.
    pub predicted: Duration,
    /// Its predicted inter-token gap.
    pub tpot: Duration,
    /// Prompt tokens the member is taken to hold already.
    pub hit_tokens: usize,
}

/// Why no member took a request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Refused {
    /// The best TTFT prediction among the members scored.
    pub predicted: Duration,
    /// The best inter-token prediction among them.
    pub tpot: Duration,
    /// Whether it was the inter-token target that no member met.
    pub on_tpot: bool,
    /// The best prediction among them for an idle member (whether the
    /// target is attainable at all).
    pub idle: Duration,
    /// Members scored.
    pub scored: usize,
}

/// A candidate's score.
#[derive(Debug, Clone, Copy)]
struct Scored {
    index: usize,
    hit: usize,
    prefill: usize,
    ttft: Duration,
    tpot: Duration,
    /// The part of `ttft` from work the member reports and the ledger
    /// does not hold.
    unseen: Duration,
    meets: bool,
    load: usize,
    /// The TTFT prediction without its floor (the ranking's).
    rank_s: f64,
}

/// The fleet of one upstream model.
#[derive(Debug)]
pub struct Fleet {
    spec: FleetSpec,
    /// Every member's model by address, kept across member-set changes.
    known: Mutex<HashMap<SocketAddr, Arc<Replica>>>,
    index: Mutex<PrefixIndex>,
    rng: AtomicU64,
    next_id: AtomicU32,
    clock: Arc<dyn Clock>,
}

impl Fleet {
    /// A fleet with `spec`.
    pub fn new(spec: FleetSpec) -> Self {
        Self::with_clock(spec, Arc::new(MonotonicClock))
    }

    /// A fleet on `clock` (the discrete-event simulation).
    pub fn with_clock(spec: FleetSpec, clock: Arc<dyn Clock>) -> Self {
        Fleet {
            spec,
            known: Mutex::default(),
            index: Mutex::default(),
            rng: AtomicU64::new(0x9e37_79b9_7f4a_7c15),
            next_id: AtomicU32::new(0),
            clock,
        }
    }

    /// Its settings.
    pub fn spec(&self) -> &FleetSpec {
        &self.spec
    }

    /// The replicas of a member set given by its addresses, in its order
    /// (callers keep the result while the set is current: the upstream
    /// backend beside the pool's membership it was built for). Members that
    /// stay keep their models; members that left are forgotten, with their
    /// prefixes.
    pub fn align(&self, addrs: &[SocketAddr]) -> Arc<Aligned> {
        let mut known = self.known.lock();
        let replicas: Vec<Arc<Replica>> = addrs
            .iter()
            .map(|a| {
                known
                    .entry(*a)
                    .or_insert_with(|| Arc::new(self.replica(*a)))
                    .clone()
            })
            .collect();
        let gone: Vec<u32> = known
            .iter()
            .filter(|(a, _)| !addrs.contains(a))
            .map(|(_, r)| r.id)
            .collect();
        known.retain(|a, _| addrs.contains(a));
        drop(known);
        if !gone.is_empty() {
            let mut ix = self.index.lock();
            for id in gone {
                ix.remove(id);
            }
        }
        let by_id = replicas
            .iter()
            .enumerate()
            .map(|(i, r)| (r.id, i))
            .collect();
        Arc::new(Aligned { replicas, by_id })
    }

    fn replica(&self, addr: SocketAddr) -> Replica {
        let s = &self.spec;
        let latency = Latency::new(true, s.slots, s.chunk, s.prefill_tps, s.decode_tps)
            .with_clock(self.clock.clone())
            .calibrated_over(s.window);
        Replica {
            addr,
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            latency: Arc::new(latency),
        }
    }

    /// The next random number (xorshift; no lock).
    fn random(&self) -> u64 {
        let mut x = self.rng.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng.store(x, Ordering::Relaxed);
        x
    }

    /// The members a decision scores: the prefix-hit holders (longest
    /// first), then `k` others drawn at random among the members up (all
    /// of them when there are few).
    fn candidates(
        &self,
        aligned: &Aligned,
        report: &dyn Fn(usize) -> Reported,
        blocks: &[u64],
    ) -> Vec<(usize, usize)> {
        let n = aligned.replicas.len();
        let mut out: Vec<(usize, usize)> = Vec::with_capacity(self.spec.k + HIT_CANDIDATES);
        if !blocks.is_empty() {
            let hits = self.index.lock().lookup(blocks);
            for (id, hit) in hits {
                if out.len() == HIT_CANDIDATES {
                    break;
                }
                if let Some(&i) = aligned.by_id.get(&id) {
                    if report(i).up {
                        out.push((i, hit));
                    }
                }
            }
        }
        let k = self.spec.k.max(1);
        if n <= k + out.len() {
            for i in 0..n {
                if !out.iter().any(|c| c.0 == i) && report(i).up {
                    out.push((i, 0));
                }
            }
            return out;
        }
        let want = out.len() + k;
        // Bounded draws: a fleet mostly down falls back to a scan.
        for _ in 0..4 * k {
            if out.len() == want {
                return out;
            }
            let i = (self.random() % n as u64) as usize;
            if !out.iter().any(|c| c.0 == i) && report(i).up {
                out.push((i, 0));
            }
        }
        for i in 0..n {
            if out.len() == want {
                break;
            }
            if !out.iter().any(|c| c.0 == i) && report(i).up {
                out.push((i, 0));
            }
        }
        out
    }

    /// Score one candidate.
    fn score(
        &self,
        aligned: &Aligned,
        (index, hit_blocks): (usize, usize),
        report: Reported,
        ask: &Ask<'_>,
    ) -> Scored {
        let r = &aligned.replicas[index];
        let hit = (hit_blocks * self.spec.block_tokens).min(ask.prompt.saturating_sub(1));
        let prefill = ask.prompt - hit;
        let sc = r
            .latency
            .score(None, ask.rank, prefill, ask.ttft, ask.tenant);
        let unseen = self.unseen(r, report, prefill, sc.in_ledger);
        let ttft = sc.ttft + unseen;
        let tpot = sc.tpot;
        let meets = ask.ttft.is_none_or(|t| ttft <= t) && ask.tpot.is_none_or(|t| tpot <= t);
        Scored {
            index,
            hit,
            prefill,
            ttft,
            tpot,
            unseen,
            meets,
            load: sc.in_ledger + report.outstanding as usize,
            rank_s: sc.rank_s + unseen.as_secs_f64(),
        }
    }

    /// Work a member reports waiting that this edge did not send it, at
    /// its idle cost of a prompt like this one.
    fn unseen(&self, r: &Replica, report: Reported, prefill: usize, ours: usize) -> Duration {
        let Some((waiting, _)) = report.scraped else {
            return Duration::ZERO;
        };
        // Of this edge's requests there, those beyond the member's slots
        // are the ones in its queue.
        let ours_waiting = ours.saturating_sub(self.spec.slots) as u64;
        let extra = waiting.saturating_sub(ours_waiting).min(1024);
        if extra == 0 {
            return Duration::ZERO;
        }
        // Waiting requests take free slots in turn: only those beyond the
        // member's slots delay this one by a whole prefill each.
        r.latency.idle(None, prefill) * extra as u32 / self.spec.slots.max(1) as u32
    }

    /// Place a request on the member with the most headroom, or refuse it
    /// when none meets its targets. `report(i)` tells what is known of
    /// member `i` now.
    pub fn place(
        &self,
        aligned: &Aligned,
        report: &dyn Fn(usize) -> Reported,
        ask: &Ask<'_>,
    ) -> Result<Placed, Refused> {
        let cands = self.candidates(aligned, report, ask.blocks);
        let mut scored: Vec<Scored> = cands
            .into_iter()
            .map(|c| self.score(aligned, c, report(c.0), ask))
            .collect();
        let refused = |scored: &[Scored]| {
            let best = scored.iter().map(|s| s.ttft).min().unwrap_or(Duration::MAX);
            let best_tpot = scored.iter().map(|s| s.tpot).min().unwrap_or(Duration::MAX);
            let ttft_ok = ask.ttft.is_none_or(|t| best <= t);
            let idle = scored
                .iter()
                .map(|s| aligned.replicas[s.index].latency.idle(None, s.prefill))
                .min()
                .unwrap_or(Duration::MAX);
            Refused {
                predicted: best.min(Duration::from_secs(86_400)),
                tpot: best_tpot.min(Duration::from_secs(86_400)),
                on_tpot: ttft_ok,
                idle: idle.min(Duration::from_secs(86_400)),
                scored: scored.len(),
            }
        };
        scored.sort_by(|a, b| better(a, b));
        for s in scored.iter().filter(|s| s.meets) {
            let r = &aligned.replicas[s.index];
            // The ledger checks its own part against what the unseen work
            // leaves of the target.
            let left = ask.ttft.map(|t| t.saturating_sub(s.unseen));
            let (v, ticket) = r.latency.admit(
                None,
                ask.rank,
                s.prefill,
                ask.max_out,
                left,
                ask.reserved,
                None,
                ask.tenant,
            );
            if let (Verdict::Admit(p), Some(ticket)) = (v, ticket) {
                if !ask.blocks.is_empty() {
                    let cap = self.spec.capacity_tokens / self.spec.block_tokens.max(1);
                    self.index.lock().insert(r.id, ask.blocks, cap);
                }
                return Ok(Placed {
                    index: s.index,
                    addr: r.addr,
                    ticket,
                    predicted: p + s.unseen,
                    tpot: s.tpot,
                    hit_tokens: s.hit,
                });
            }
        }
        Err(refused(&scored))
    }

    /// The member llm-d's default scorer picks (the baseline policy): the
    /// highest sum of a prefix-cache score (the share of the prompt's
    /// blocks it holds), a queue score (1 for the least waiting, 0 for the
    /// most) and a KV score (1 - usage), over every member up. Records the
    /// prompt's blocks as sent there.
    pub fn pick_load_prefix(
        &self,
        aligned: &Aligned,
        report: &dyn Fn(usize) -> Reported,
        blocks: &[u64],
        tried: &[usize],
    ) -> Option<usize> {
        let hits = if blocks.is_empty() {
            Vec::new()
        } else {
            self.index.lock().lookup(blocks)
        };
        let n = aligned.replicas.len();
        let reports: Vec<Reported> = (0..n).map(report).collect();
        let queue = |r: &Reported| r.scraped.map_or(r.outstanding, |(w, _)| w + r.outstanding);
        let (lo, hi) = reports
            .iter()
            .filter(|r| r.up)
            .map(queue)
            .fold((u64::MAX, 0), |(l, h), q| (l.min(q), h.max(q)));
        let start = (self.random() % n.max(1) as u64) as usize;
        let mut best: Option<(f64, usize)> = None;
        for k in 0..n {
            let i = (start + k) % n;
            let r = &reports[i];
            if !r.up || tried.contains(&i) {
                continue;
            }
            let id = aligned.replicas[i].id;
            let hit = hits.iter().find(|h| h.0 == id).map_or(0, |h| h.1);
            let prefix = hit as f64 / blocks.len().max(1) as f64;
            let q = if hi > lo {
                1.0 - (queue(r) - lo) as f64 / (hi - lo) as f64
            } else {
                1.0
            };
            let kv = 1.0 - r.scraped.map_or(0.0, |(_, kv)| kv);
            // llm-d's default weights: prefix 3, queue 2, KV 2.
            let score = 3.0 * prefix + 2.0 * q + 2.0 * kv;
            if best.is_none_or(|(b, _)| score > b) {
                best = Some((score, i));
            }
        }
        let (_, i) = best?;
        if !blocks.is_empty() {
            let cap = self.spec.capacity_tokens / self.spec.block_tokens.max(1);
            self.index
                .lock()
                .insert(aligned.replicas[i].id, blocks, cap);
        }
        Some(i)
    }

    /// Blocks indexed for the member at `addr` (admin view, tests).
    pub fn held(&self, addr: SocketAddr) -> usize {
        let id = self.known.lock().get(&addr).map(|r| r.id);
        id.map_or(0, |id| self.index.lock().held_by(id))
    }

    /// Each known member's address, its prior-corrected cost (step time of
    /// one stream, seconds) and its lane-1 calibration factor (admin view).
    pub fn members(&self) -> Vec<(SocketAddr, f64, f64, usize)> {
        self.known
            .lock()
            .values()
            .map(|r| {
                let c = r.latency.cost(None);
                (
                    r.addr,
                    c.step(1),
                    r.latency.correction(1),
                    r.latency.load().0,
                )
            })
            .collect()
    }
}

/// What is known of pool member `m` at `now_ms` (`stale_ms`: how old its
/// scraped figures may be; None: they are not read).
pub fn report(m: &crate::upstream::Member, now_ms: u64, stale_ms: Option<u64>) -> Reported {
    Reported {
        up: m.available(now_ms),
        outstanding: m.outstanding(),
        scraped: stale_ms.and_then(|s| m.state.load.fresh(now_ms, s)),
    }
}

/// The prefix blocks of a prompt as an upstream member's cache would
/// hold them: the conversation's roles and texts in order (a chat), or
/// the text.
pub fn prompt_blocks(prompt: &ultrafast_engine::api::Prompt, block_tokens: usize) -> Vec<u64> {
    use ultrafast_engine::api::Prompt;
    let limit = prefix::MAX_BLOCKS * block_tokens.max(1) * 4;
    match prompt {
        Prompt::Chat(m) => {
            let mut p = Vec::new();
            for x in m {
                if p.len() >= limit {
                    break;
                }
                p.extend_from_slice(x.role.as_bytes());
                p.push(0);
                p.extend_from_slice(x.content.as_bytes());
                p.push(0);
            }
            p.truncate(limit);
            prefix::blocks(&p, block_tokens)
        }
        Prompt::Text(t) => prefix::blocks(&t.as_bytes()[..t.len().min(limit)], block_tokens),
        Prompt::Tokens(_) => Vec::new(),
    }
}

/// The order of candidates: those that meet their targets first; then
/// the most TTFT headroom (the lower prediction, unfloored: a prefix hit
/// shows there); within [`TIE`] of each other, the most TPOT headroom
/// (within [`TIE`] too), the fuller prefix hit, then less load.
fn better(a: &Scored, b: &Scored) -> std::cmp::Ordering {
    use std::cmp::Ordering::*;
    if a.meets != b.meets {
        return if a.meets { Less } else { Greater };
    }
    let near = |x: f64, y: f64| (x - y).abs() <= TIE * x.max(y);
    let (x, y) = (a.rank_s, b.rank_s);
    if !near(x, y) {
        return x.total_cmp(&y);
    }
    let (p, q) = (a.tpot.as_secs_f64(), b.tpot.as_secs_f64());
    if !near(p, q) {
        return p.total_cmp(&q);
    }
    b.hit.cmp(&a.hit).then(a.load.cmp(&b.load))
}

#[cfg(test)]
mod tests;
