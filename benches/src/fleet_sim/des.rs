//! The discrete-event mode: the same replicas in virtual time, no sockets,
//! with ultrafast's own placement and prediction code deciding
//! (`inference::fleet` for `predicted_latency` and `load_prefix`, the
//! model-level `inference::predict::Latency` for the admission of the
//! other policies, as ultrafast admits for them). Round robin, least
//! outstanding, prefix affinity and queue-aware are the edge's balancers
//! restated over the simulation's members (their choice only; what they
//! read, in-flight counts and scraped queues, is the same).
//!
//! Every decision is timed on the wall clock, so the run also measures
//! what a decision costs at 100 or 1,000 members.

use super::replica::{Out, Replica, Seq, StepModel};
use super::trace::{Req, Rng};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use ultrafast::admission::clock::ManualClock;
use ultrafast::inference::fleet::{
    prefix, Aligned, Ask, Fleet, FleetSpec, Policy as FleetPolicy, Reported,
};
use ultrafast::inference::predict::{Latency, Ticket, Verdict};
use ultrafast_engine::fair::Tenant;

/// A routing policy under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Round robin.
    RoundRobin,
    /// Fewest in flight from the edge.
    LeastOutstanding,
    /// A bounded-load hash of the conversation prefix.
    PrefixAffinity,
    /// The members' scraped queues plus in-flight.
    QueueAware,
    /// llm-d's default scorer (prefix + queue + KV).
    LoadPrefix,
    /// ultrafast's prediction per member.
    PredictedLatency,
}

impl Policy {
    /// Every policy, in the order reports list them.
    pub const ALL: [Policy; 6] = [
        Policy::RoundRobin,
        Policy::LeastOutstanding,
        Policy::PrefixAffinity,
        Policy::QueueAware,
        Policy::LoadPrefix,
        Policy::PredictedLatency,
    ];

    /// Its config name.
    pub fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::LeastOutstanding => "least_outstanding",
            Policy::PrefixAffinity => "prefix_affinity",
            Policy::QueueAware => "queue_aware",
            Policy::LoadPrefix => "load_prefix",
            Policy::PredictedLatency => "predicted_latency",
        }
    }

    /// By its config name.
    pub fn parse(s: &str) -> Option<Policy> {
        Policy::ALL.into_iter().find(|p| p.name() == s)
    }
}

/// Something that happens to the fleet mid-run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Change {
    /// Replica `i` runs at `speed` from then on.
    Speed(usize, f64),
    /// Replica `i` is drained: no new requests, its streams finish.
    Drain(usize),
}

/// One run's setup.
#[derive(Debug, Clone)]
pub struct Setup {
    /// Each replica's speed.
    pub speeds: Vec<f64>,
    /// The replicas' step model at speed 1.
    pub model: StepModel,
    /// The TTFT target (the standard lane's, as the edge would hold it).
    pub ttft: Duration,
    /// Members scored per decision (predicted latency).
    pub k: usize,
    /// How often members' figures are read.
    pub scrape_every: f64,
    /// Changes, by time.
    pub changes: Vec<(f64, Change)>,
    /// Whether the baselines admit on the pool's model, as ultrafast did
    /// before per-member prediction (else they admit every request, as
    /// llm-d and nginx do).
    pub pool_admission: bool,
}

/// What happened to one request.
#[derive(Debug, Clone, Copy, Default)]
pub struct Outcome {
    /// Arrival (s).
    pub at: f64,
    /// Admitted (else refused at once).
    pub admitted: bool,
    /// Time to first token (s), when it came.
    pub ttft: Option<f64>,
    /// End to end (s), when it finished.
    pub e2e: Option<f64>,
    /// Output tokens.
    pub tokens: usize,
    /// The replica it went to.
    pub replica: usize,
}

/// One run's results.
#[derive(Debug, Clone)]
pub struct Run {
    /// The policy.
    pub policy: Policy,
    /// Every request's outcome, in trace order.
    pub outcomes: Vec<Outcome>,
    /// Wall-clock cost of each routing decision (µs).
    pub decide_us: Vec<f64>,
    /// Prompt tokens the replicas' caches saved, as a share of all.
    pub cache_share: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// A replica's step ends.
    Step(usize),
    /// A request arrives.
    Arrive(usize),
    /// The members are scraped.
    Scrape,
    /// A change applies.
    Change(usize),
}

/// Virtual seconds as an ordered key (ns).
fn key(t: f64) -> u64 {
    (t.max(0.0) * 1e9) as u64
}

struct Live {
    ticket: Option<Ticket>,
    last: Option<f64>,
    at: f64,
}

/// Run `trace` on `setup` under `policy`.
pub fn run(setup: &Setup, trace: &[Req], policy: Policy) -> Run {
    let n = setup.speeds.len();
    let clock = Arc::new(ManualClock::new());
    let mut reps: Vec<Replica> = setup
        .speeds
        .iter()
        .map(|&s| Replica::new(setup.model, s))
        .collect();
    let addrs: Vec<SocketAddr> = (0..n)
        .map(|i| SocketAddr::from(([10, (i >> 16) as u8, (i >> 8) as u8, i as u8], 8000)))
        .collect();
    let m = setup.model;
    let (prefill_tps, decode_tps) = (1.0 / m.per_prompt_token_s, 1.0 / (m.fixed_s + m.per_seq_s));
    let fleet = Fleet::with_clock(
        FleetSpec {
            policy: if policy == Policy::LoadPrefix {
                FleetPolicy::LoadPrefix
            } else {
                FleetPolicy::PredictedLatency
            },
            k: setup.k,
            block_tokens: m.block_tokens,
            capacity_tokens: m.kv_tokens,
            slots: m.slots,
            chunk: Some(m.chunk),
            prefill_tps,
            decode_tps,
            window: Duration::from_secs(30),
        },
        clock.clone(),
    );
    let aligned: Arc<Aligned> = fleet.align(&addrs);
    // The pool-level model ultrafast admits the other policies on.
    let pool = Arc::new(
        Latency::new(true, 1 << 20, None, prefill_tps, decode_tps)
            .with_clock(clock.clone())
            .calibrated_over(Duration::from_secs(30)),
    );
    let tenant = Tenant::anonymous();
    let mut heap: BinaryHeap<Reverse<(u64, Ev)>> = BinaryHeap::new();
    for (i, r) in trace.iter().enumerate() {
        heap.push(Reverse((key(r.at), Ev::Arrive(i))));
    }
    for (i, (at, _)) in setup.changes.iter().enumerate() {
        heap.push(Reverse((key(*at), Ev::Change(i))));
    }
    heap.push(Reverse((0, Ev::Scrape)));
    let end = trace.last().map_or(0.0, |r| r.at);
    let mut stepping = vec![false; n];
    let mut pending: Vec<Vec<Out>> = vec![Vec::new(); n];
    let mut drained = vec![false; n];
    let mut outstanding = vec![0u64; n];
    let mut scraped: Vec<Option<(u64, f64)>> = vec![None; n];
    let mut live: HashMap<u64, Live> = HashMap::new();
    let mut outcomes = vec![Outcome::default(); trace.len()];
    let mut decide_us = Vec::with_capacity(trace.len());
    let mut rr = 0usize;
    let mut rng = Rng::new(7);
    let mut now = 0.0f64;
    while let Some(Reverse((k, ev))) = heap.pop() {
        let t = k as f64 / 1e9;
        if t > now {
            clock.advance(Duration::from_secs_f64(t - now));
            now = t;
        }
        match ev {
            Ev::Scrape => {
                for i in 0..n {
                    let (w, _) = reps[i].counts();
                    scraped[i] = Some((w as u64, reps[i].kv_usage()));
                }
                if now < end + 60.0 {
                    heap.push(Reverse((key(now + setup.scrape_every), Ev::Scrape)));
                }
            }
            Ev::Change(c) => match setup.changes[c].1 {
                Change::Speed(i, s) => reps[i].speed = s,
                Change::Drain(i) => drained[i] = true,
            },
            Ev::Arrive(i) => {
                let r = &trace[i];
                outcomes[i].at = r.at;
                let report = |j: usize| Reported {
                    up: !drained[j],
                    outstanding: outstanding[j],
                    scraped: scraped[j],
                };
                let blocks = prefix::blocks(&r.rendered(), m.block_tokens);
                let prompt = r.prompt_tokens();
                let started = Instant::now();
                let placed: Option<(usize, Option<Ticket>)> = match policy {
                    Policy::PredictedLatency => {
                        let ask = Ask {
                            rank: 1,
                            prompt,
                            max_out: r.max_tokens,
                            ttft: Some(setup.ttft),
                            tpot: None,
                            reserved: &[],
                            tenant: &tenant,
                            blocks: &blocks,
                        };
                        fleet
                            .place(&aligned, &report, &ask)
                            .ok()
                            .map(|p| (p.index, Some(p.ticket)))
                    }
                    other => {
                        let (v, ticket) = if setup.pool_admission {
                            pool.admit(
                                None,
                                1,
                                prompt,
                                r.max_tokens,
                                Some(setup.ttft),
                                &[],
                                None,
                                &tenant,
                            )
                        } else {
                            (Verdict::Admit(Duration::ZERO), None)
                        };
                        match v {
                            Verdict::Busy(_) => None,
                            _ => {
                                let up: Vec<usize> = (0..n).filter(|&j| !drained[j]).collect();
                                let j = match other {
                                    Policy::LoadPrefix => fleet
                                        .pick_load_prefix(&aligned, &report, &blocks, &[])
                                        .unwrap_or(up[0]),
                                    _ => choose(
                                        other,
                                        &up,
                                        &outstanding,
                                        &scraped,
                                        &mut rr,
                                        r,
                                        &mut rng,
                                    ),
                                };
                                Some((j, ticket))
                            }
                        }
                    }
                };
                decide_us.push(started.elapsed().as_secs_f64() * 1e6);
                let Some((j, ticket)) = placed else {
                    continue;
                };
                outcomes[i].admitted = true;
                outcomes[i].replica = j;
                if let Some(t) = &ticket {
                    t.dispatched();
                }
                outstanding[j] += 1;
                live.insert(
                    i as u64,
                    Live {
                        ticket,
                        last: None,
                        at: now,
                    },
                );
                reps[j].submit(Seq::new(i as u64, prompt, blocks, r.max_tokens));
                if !stepping[j] {
                    stepping[j] = true;
                    heap.push(Reverse((key(now), Ev::Step(j))));
                }
            }
            Ev::Step(j) => {
                // The step that ends now: its tokens are seen now.
                for Out::Token { id, first, last } in std::mem::take(&mut pending[j]) {
                    let Some(l) = live.get_mut(&id) else {
                        continue;
                    };
                    if let Some(t) = &l.ticket {
                        let gap = l.last.map(|p| Duration::from_secs_f64(now - p));
                        let alone = first.then(|| Duration::from_secs_f64(now - l.at));
                        t.token(gap, alone);
                    }
                    l.last = Some(now);
                    let o = &mut outcomes[id as usize];
                    o.tokens += 1;
                    if first {
                        o.ttft = Some(now - l.at);
                    }
                    if last {
                        o.e2e = Some(now - l.at);
                        outstanding[j] = outstanding[j].saturating_sub(1);
                        if let Some(t) = live.remove(&id).and_then(|l| l.ticket) {
                            t.finish(o.tokens);
                        }
                    }
                }
                // Then the next step.
                match reps[j].step() {
                    None => stepping[j] = false,
                    Some((dur, out)) => {
                        pending[j] = out;
                        heap.push(Reverse((key(now + dur), Ev::Step(j))));
                    }
                }
            }
        }
    }
    let (saved, prefilled): (u64, u64) = reps
        .iter()
        .fold((0, 0), |(s, p), r| (s + r.saved, p + r.prefilled));
    Run {
        policy,
        outcomes,
        decide_us,
        cache_share: saved as f64 / (saved + prefilled).max(1) as f64,
    }
}

/// The member a baseline balancer picks among `up`.
fn choose(
    policy: Policy,
    up: &[usize],
    outstanding: &[u64],
    scraped: &[Option<(u64, f64)>],
    rr: &mut usize,
    r: &Req,
    rng: &mut Rng,
) -> usize {
    match policy {
        Policy::RoundRobin => {
            *rr += 1;
            up[*rr % up.len()]
        }
        Policy::LeastOutstanding => least(up, |j| outstanding[j] as f64, rng),
        Policy::QueueAware => least(
            up,
            // The edge's queue-aware score (`upstream::load::score`).
            |j| match scraped[j] {
                Some((w, kv)) => (w + outstanding[j]) as f64 + 2.0 * kv,
                None => outstanding[j] as f64,
            },
            rng,
        ),
        Policy::PrefixAffinity => {
            // A hash of the conversation before its last message (the
            // tenant's system prompt), walked with bounded load (1.25x the
            // mean in flight), as the edge's consistent-hash ring does.
            let total: u64 = up.iter().map(|&j| outstanding[j]).sum();
            let bound = ((total + 1) as f64 * 1.25 / up.len() as f64).ceil() as u64;
            let h = ultrafast::hash::hash_bytes(r.system.as_bytes()) as usize;
            (0..up.len())
                .map(|k| up[(h + k) % up.len()])
                .find(|&j| outstanding[j] < bound.max(1))
                .unwrap_or(up[h % up.len()])
        }
        Policy::LoadPrefix | Policy::PredictedLatency => up[0],
    }
}

/// The member of `up` with the least `score`, ties at random.
fn least(up: &[usize], score: impl Fn(usize) -> f64, rng: &mut Rng) -> usize {
    let start = (rng.next() % up.len() as u64) as usize;
    let mut best = (f64::INFINITY, up[start]);
    for k in 0..up.len() {
        let j = up[(start + k) % up.len()];
        let s = score(j);
        if s < best.0 {
            best = (s, j);
        }
    }
    best.1
}
