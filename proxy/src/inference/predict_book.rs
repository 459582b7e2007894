//! The ledger's books: every admitted request that has not finished, kept
//! so that each change (an arrival, a dispatch, a token, a departure) costs
//! O(1) and a prediction's view of the work ahead costs a bounded amount
//! whatever the number of requests.
//!
//! Requests that decode are counted, not listed: per lane rank, a count
//! per bucket of output left (`max_tokens` minus tokens generated), exact
//! up to 16 tokens and in steps of a quarter octave above (a bucket's
//! upper bound is at most 25% above any value in it). The view replays
//! each non-empty bucket as one group holding its upper bound: the
//! approximation only ever counts more output than is left, so it errs
//! late (conservative), by at most a quarter of each decoder's remaining
//! output. Requests still before their first token (queued, or
//! prefilling) are listed in arrival order per rank; the view takes the
//! first [`LISTED`] of them one by one and the rest of each rank as one
//! prompt of their summed tokens (exact in prefill work; it leaves out the
//! decode steps those requests would add between their prompts, so it
//! errs early by at most their count of decoders for the remaining
//! prefill steps; with that many requests ahead, a lane with a target
//! refuses long before). In the request's own lane the view also looks at
//! up to [`LISTED`] requests after it (they count only if running); any
//! further ones fall into the summed rest, an over-count that errs late.
//! The request's own claim never counts, wherever it sits. The view's
//! cost: at most `RANKS * BUCKETS` counters read and `2 * LISTED`
//! entries visited.
//!
//! Fair shares (see `ultrafast_engine::fair`) reorder a lane by tenant, so
//! when other tenants wait in the request's own lane the view counts, in
//! that lane, all of its own tenant's waiting work and of each other
//! tenant `u` at most what VTC serves `u` before it: its own tenant's
//! waiting prompt tokens plus its own, scaled by `u`'s weight over its
//! tenant's, plus one of `u`'s requests (VTC grants whole requests). The
//! approximation leaves out counter gaps from before the request came
//! (errs early for a tenant above others' counters, late for one below)
//! and output charges (others' output makes their counters grow faster:
//! errs late). It visits at most [`LISTED`] tenants; the rest of the lane
//! counts whole.

use super::Work;
use std::collections::{BTreeSet, HashMap};
use std::time::Instant;
use ultrafast_engine::fair::Tenant;

/// Lane ranks told apart (higher ranks count as the last).
pub const RANKS: usize = 8;
/// Output buckets: 17 exact (0..=16), then four a power of two up to 2^40.
const BUCKETS: usize = 17 + 37 * 4;
/// Requests before their first token a view lists one by one.
pub const LISTED: usize = 64;

/// The bucket of `r` output tokens left.
fn bucket(r: usize) -> usize {
    let r = (r as u64).min((1 << 40) - 1);
    if r <= 16 {
        return r as usize;
    }
    let lz = 63 - r.leading_zeros() as u64;
    let frac = (r >> (lz - 2)) & 3;
    (17 + (lz - 4) * 4 + frac) as usize
}

/// The largest value in bucket `b`.
fn upper(b: usize) -> usize {
    if b <= 16 {
        return b;
    }
    let k = (b - 17) as u64;
    let (lz, frac) = (4 + k / 4, k % 4);
    (((4 + frac + 1) << (lz - 2)) - 1) as usize
}

/// A request's rank as an index into the books.
pub fn rank_index(rank: u32) -> usize {
    (rank as usize).min(RANKS - 1)
}

/// One request in the ledger.
#[derive(Debug, Clone, Copy)]
pub struct Entry {
    /// Lane rank.
    pub rank: u32,
    /// Prompt tokens.
    pub prompt: usize,
    /// Most output tokens.
    pub max_out: usize,
    /// Output tokens so far.
    pub generated: usize,
    /// Whether its first token came.
    pub decoding: bool,
    /// Whether the backend holds it.
    pub running: bool,
    /// When it was admitted.
    pub admitted: Instant,
    /// The raw (uncalibrated) prediction it was admitted on, in seconds;
    /// None for a claim before tokenizing (no sample to learn from).
    pub predicted_s: Option<f64>,
    /// Times under this count as it in its calibration sample.
    pub floor_s: f64,
    /// Its tenant's id and weight (fair shares inside a lane).
    pub tenant: u64,
    /// Its tenant's weight.
    pub weight: f64,
}

/// Who asks for a prediction, as a view needs it.
#[derive(Debug, Clone, Copy)]
pub struct Viewer {
    /// Lane rank.
    pub rank: u32,
    /// Its place (id) in arrival order.
    pub place: u64,
    /// The share of `max_tokens` expected as output.
    pub share: f64,
    /// Its tenant's id.
    pub tenant: u64,
    /// Its tenant's weight.
    pub weight: f64,
    /// Its prompt tokens.
    pub prompt: usize,
}

impl Viewer {
    /// A viewer of the anonymous tenant (tests, benches).
    #[cfg(test)]
    pub fn plain(rank: u32, place: u64, share: f64) -> Viewer {
        Viewer {
            rank,
            place,
            share,
            tenant: Tenant::anonymous().id,
            weight: 1.0,
            prompt: 1,
        }
    }
}

/// The waiting work of one tenant in one rank.
#[derive(Debug, Clone, Copy, Default)]
struct TenantSum {
    prompt: u64,
    max_out: u64,
    n: u64,
    weight: f64,
}

impl Entry {
    /// A request just admitted: nothing generated, not yet dispatched.
    pub fn new(rank: u32, prompt: usize, max_out: usize, floor_s: f64) -> Self {
        Entry {
            rank,
            prompt,
            max_out,
            generated: 0,
            decoding: false,
            running: false,
            admitted: Instant::now(),
            predicted_s: None,
            floor_s,
            tenant: Tenant::anonymous().id,
            weight: 1.0,
        }
    }

    /// The same entry for `tenant`.
    pub fn of(self, tenant: &Tenant) -> Self {
        Entry {
            tenant: tenant.id,
            weight: tenant.weight,
            ..self
        }
    }

    fn left(&self) -> usize {
        self.max_out.saturating_sub(self.generated)
    }
}

/// The books (under the ledger's lock).
#[derive(Debug)]
pub struct Books {
    entries: HashMap<u64, Entry>,
    /// Ids before their first token, by rank, in arrival order.
    waiting: [BTreeSet<u64>; RANKS],
    /// Per rank: their prompt tokens and `max_tokens`, summed.
    waiting_sums: [(u64, u64); RANKS],
    /// Per rank: the same by tenant.
    tenants: [HashMap<u64, TenantSum>; RANKS],
    /// Per rank, decoders by bucket of output left.
    decoders: Box<[[u32; BUCKETS]; RANKS]>,
    /// Requests the backend holds.
    running: usize,
    /// Per rank: requests the backend holds, and of those the ones still
    /// before their first token (a worse lane's step in flight delays a
    /// better lane's request too).
    running_by_rank: [(usize, usize); RANKS],
    /// Arrivals (and resizes) so far: a view taken before an arrival is
    /// stale for a new decision.
    pub arrivals: u64,
}

impl Default for Books {
    fn default() -> Self {
        Books {
            entries: HashMap::new(),
            waiting: Default::default(),
            waiting_sums: [(0, 0); RANKS],
            tenants: Default::default(),
            decoders: Box::new([[0; BUCKETS]; RANKS]),
            running: 0,
            running_by_rank: [(0, 0); RANKS],
            arrivals: 0,
        }
    }
}

impl Books {
    /// Requests in the books.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Requests the backend holds (kept, not recounted).
    pub fn running(&self) -> usize {
        self.running
    }

    /// The entry of `id`.
    pub fn get(&self, id: u64) -> Option<&Entry> {
        self.entries.get(&id)
    }

    /// Enter (or replace) `id`.
    pub fn insert(&mut self, id: u64, e: Entry) {
        self.remove(id);
        self.arrivals += 1;
        self.add(id, e);
        self.entries.insert(id, e);
    }

    fn add(&mut self, id: u64, e: Entry) {
        let r = rank_index(e.rank);
        if e.running {
            self.running += 1;
            self.running_by_rank[r].0 += 1;
            self.running_by_rank[r].1 += usize::from(!e.decoding);
        }
        if e.decoding {
            self.decoders[r][bucket(e.left())] += 1;
        } else {
            self.waiting[r].insert(id);
            let s = &mut self.waiting_sums[r];
            s.0 += e.prompt as u64;
            s.1 += e.max_out as u64;
            let t = self.tenants[r].entry(e.tenant).or_default();
            t.prompt += e.prompt as u64;
            t.max_out += e.max_out as u64;
            t.n += 1;
            t.weight = e.weight;
        }
    }

    fn sub(&mut self, id: u64, e: &Entry) {
        let r = rank_index(e.rank);
        if e.running {
            self.running -= 1;
            self.running_by_rank[r].0 -= 1;
            self.running_by_rank[r].1 -= usize::from(!e.decoding);
        }
        if e.decoding {
            let c = &mut self.decoders[r][bucket(e.left())];
            *c = c.saturating_sub(1);
        } else {
            self.waiting[r].remove(&id);
            let s = &mut self.waiting_sums[r];
            s.0 = s.0.saturating_sub(e.prompt as u64);
            s.1 = s.1.saturating_sub(e.max_out as u64);
            if let Some(t) = self.tenants[r].get_mut(&e.tenant) {
                t.prompt = t.prompt.saturating_sub(e.prompt as u64);
                t.max_out = t.max_out.saturating_sub(e.max_out as u64);
                t.n = t.n.saturating_sub(1);
                if t.n == 0 {
                    self.tenants[r].remove(&e.tenant);
                }
            }
        }
    }

    /// Take `id` out.
    pub fn remove(&mut self, id: u64) -> Option<Entry> {
        let e = self.entries.remove(&id)?;
        self.sub(id, &e);
        Some(e)
    }

    /// The backend took `id`.
    pub fn dispatched(&mut self, id: u64) {
        if let Some(e) = self.entries.get_mut(&id) {
            if !e.running {
                e.running = true;
                self.running += 1;
                let r = &mut self.running_by_rank[rank_index(e.rank)];
                r.0 += 1;
                r.1 += usize::from(!e.decoding);
            }
        }
    }

    /// A token of `id`: O(1). Returns the entry as it was before the
    /// token (its `decoding` says whether this was the first).
    pub fn token(&mut self, id: u64) -> Option<Entry> {
        let before = *self.entries.get(&id)?;
        let mut after = before;
        after.generated += 1;
        after.decoding = true;
        // A first token moves the request from the list to the counts;
        // later ones move it between buckets only when the bucket changes.
        if !before.decoding || bucket(before.left()) != bucket(after.left()) {
            self.sub(id, &before);
            // `sub` and `add` count `running` out and in again.
            self.add(id, after);
        }
        self.entries.insert(id, after);
        Some(before)
    }

    /// The decoders of rank `r`, one group per bucket.
    fn decoders_of(&self, r: usize, share: f64, out: &mut Vec<Work>) {
        for (b, &n) in self.decoders[r].iter().enumerate() {
            if n > 0 {
                out.push(Work {
                    rank: r as u32,
                    prefill: 0,
                    output: (upper(b) as f64 * share).max(1.0),
                    running: true,
                    count: n as usize,
                });
            }
        }
    }

    /// Whether tenants other than `tenant` wait in rank `r`.
    fn shared_with_others(&self, r: usize, tenant: u64) -> bool {
        let t = &self.tenants[r];
        t.len() > 1 || (t.len() == 1 && !t.contains_key(&tenant))
    }

    /// The waiting work of rank `r` that fair shares put ahead of `v`
    /// (see the module doc): its own tenant's whole, each other's up to
    /// its allowance, as two summed groups.
    fn fair_lane(&self, r: usize, v: Viewer, out: &mut Vec<Work>) {
        let mut own = self.tenants[r].get(&v.tenant).copied().unwrap_or_default();
        // Its own claim (a place taken before tokenizing) is not ahead.
        if let Some(e) = self.entries.get(&v.place) {
            if !e.decoding && rank_index(e.rank) == r && e.tenant == v.tenant && own.n > 0 {
                own.prompt = own.prompt.saturating_sub(e.prompt as u64);
                own.max_out = own.max_out.saturating_sub(e.max_out as u64);
                own.n -= 1;
            }
        }
        let mine = (own.prompt + v.prompt as u64) as f64 / v.weight.max(1e-9);
        let (mut prompt, mut max_out, mut n) = (0.0, 0.0, 0.0);
        let (mut seen_prompt, mut seen_max, mut seen_n) = (own.prompt, own.max_out, own.n);
        let others = self.tenants[r].iter().filter(|(id, _)| **id != v.tenant);
        for t in others.map(|(_, t)| t).take(LISTED) {
            seen_prompt += t.prompt;
            seen_max += t.max_out;
            seen_n += t.n;
            let one = t.prompt as f64 / t.n.max(1) as f64;
            let allowed = (mine * t.weight + one).min(t.prompt as f64);
            let f = if t.prompt == 0 {
                1.0
            } else {
                allowed / t.prompt as f64
            };
            prompt += allowed;
            max_out += t.max_out as f64 * f;
            n += t.n as f64 * f;
        }
        // Tenants past the listed ones count whole.
        let (all_prompt, all_max) = self.waiting_sums[r];
        let all_n = self.waiting[r].len() as u64;
        prompt += all_prompt.saturating_sub(seen_prompt) as f64;
        max_out += all_max.saturating_sub(seen_max) as f64;
        n += all_n.saturating_sub(seen_n) as f64;
        for (p, m, k) in [
            (own.prompt as f64, own.max_out as f64, own.n as f64),
            (prompt, max_out, n),
        ] {
            if k >= 1.0 || p >= 1.0 {
                out.push(Work {
                    rank: r as u32,
                    prefill: p.ceil().max(1.0) as usize,
                    output: (m * v.share / k.max(1.0)).max(1.0),
                    running: false,
                    count: 1,
                });
            }
        }
    }

    /// The work ahead of a request of `rank` arriving at `place` (see the
    /// module doc), with `share` of `max_tokens` expected as output.
    /// Counted: running requests, better lanes' requests and those of its
    /// own lane that came before it; worse lanes are not (the backend
    /// serves better lanes first), except that their running requests
    /// make up the step in flight on arrival.
    pub fn view(&self, v: Viewer) -> Vec<Work> {
        let (rank, place, share) = (v.rank, v.place, v.share);
        let top = rank_index(rank);
        let mut out = Vec::new();
        let mut listed = 0;
        for r in 0..=top {
            self.decoders_of(r, share, &mut out);
            if r == top && self.shared_with_others(r, v.tenant) {
                self.fair_lane(r, v, &mut out);
                continue;
            }
            let (mut prompt_left, mut max_left) = self.waiting_sums[r];
            let mut n_left = self.waiting[r].len();
            // In its own lane, those before it within the shared budget,
            // then up to as many after it (they count only if running);
            // past both, the rest counts whole (an over-count, erring
            // late). The request itself never counts: its claim may sit in
            // a better lane it was moved down from.
            let (before, after) = if r == top {
                (
                    self.waiting[r].range(..place),
                    self.waiting[r].range(place..),
                )
            } else {
                (self.waiting[r].range(..), self.waiting[r].range(0..0))
            };
            let mut own_seen = false;
            for id in before.take(LISTED - listed).chain(after.take(LISTED)) {
                let Some(e) = self.entries.get(id) else {
                    continue;
                };
                if r < top || *id < place {
                    listed += 1;
                }
                prompt_left = prompt_left.saturating_sub(e.prompt as u64);
                max_left = max_left.saturating_sub(e.max_out as u64);
                n_left -= 1;
                if *id == place {
                    own_seen = true;
                    continue;
                }
                if e.running || e.rank < rank || *id < place {
                    out.push(Work {
                        rank: e.rank,
                        prefill: e.prompt,
                        output: (e.max_out as f64 * share - e.generated as f64).max(1.0),
                        running: e.running,
                        count: 1,
                    });
                }
            }
            let own = self
                .entries
                .get(&place)
                .filter(|e| !own_seen && !e.decoding && rank_index(e.rank) == r && n_left > 0);
            if let Some(e) = own {
                prompt_left = prompt_left.saturating_sub(e.prompt as u64);
                max_left = max_left.saturating_sub(e.max_out as u64);
                n_left -= 1;
            }
            if n_left > 0 {
                // The rest of the rank as one prompt (see the module doc).
                out.push(Work {
                    rank: r as u32,
                    prefill: prompt_left.max(1) as usize,
                    output: (max_left as f64 * share / n_left as f64).max(1.0),
                    running: false,
                    count: 1,
                });
            }
        }
        for (r, &(running, prefilling)) in self.running_by_rank.iter().enumerate().skip(top + 1) {
            // Only the step in flight reads these (the replay skips worse
            // lanes): how many run, and whether one is prefilling.
            for (prefill, count) in [(0, running - prefilling), (1, prefilling)] {
                if count > 0 {
                    out.push(Work {
                        rank: r as u32,
                        prefill,
                        output: 1.0,
                        running: true,
                        count,
                    });
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_bound_their_values_within_a_quarter() {
        let mut last = 0;
        for r in 0..200_000usize {
            let b = bucket(r);
            assert!(b < BUCKETS);
            assert!(b >= last, "buckets are ordered");
            last = b;
            let u = upper(b);
            assert!(u >= r && (u as f64) <= 1.25 * r as f64 + 1e-9 || r <= 16 && u == r);
        }
        assert!(bucket(usize::MAX) < BUCKETS);
        assert_eq!(upper(bucket(17)), 19);
        assert_eq!(upper(bucket(31)), 31);
        assert_eq!(upper(bucket(32)), 39);
    }

    fn entry(rank: u32, prompt: usize, max_out: usize) -> Entry {
        Entry::new(rank, prompt, max_out, 0.0)
    }

    #[test]
    fn tokens_move_requests_from_the_list_to_the_counts() {
        let mut b = Books::default();
        b.insert(1, entry(1, 30, 100));
        b.insert(2, entry(1, 40, 100));
        assert_eq!(b.view(Viewer::plain(1, 3, 1.0)).len(), 2);
        b.dispatched(1);
        assert_eq!(b.running(), 1);
        assert!(!b.token(1).unwrap().decoding);
        assert!(b.token(1).unwrap().decoding);
        let v = b.view(Viewer::plain(1, 3, 1.0));
        let dec: Vec<&Work> = v.iter().filter(|w| w.prefill == 0).collect();
        assert_eq!(dec.len(), 1);
        assert_eq!(dec[0].count, 1);
        assert!(dec[0].output >= 98.0 && dec[0].output <= 98.0 * 1.25);
        assert_eq!(b.running(), 1);
        b.remove(1);
        b.remove(2);
        assert_eq!((b.len(), b.running()), (0, 0));
        assert!(b.view(Viewer::plain(1, 3, 1.0)).is_empty());
        assert!(b.decoders.iter().flatten().all(|&n| n == 0));
    }

    #[test]
    fn fair_shares_put_only_an_allowance_of_other_tenants_ahead() {
        let (heavy, light) = (Tenant::named("heavy", 1.0), Tenant::named("light", 1.0));
        let mut b = Books::default();
        for id in 0..100u64 {
            b.insert(id, entry(1, 100, 20).of(&heavy));
        }
        let prefill = |v: &[Work]| v.iter().map(|w| w.prefill * w.count).sum::<usize>();
        let viewer = |t: &Tenant, prompt| Viewer {
            tenant: t.id,
            weight: t.weight,
            prompt,
            ..Viewer::plain(1, 1000, 1.0)
        };
        // A light tenant's request waits for its own prompt's worth of the
        // heavy tenant's work plus one request, not for all 10,000 tokens.
        assert_eq!(prefill(&b.view(viewer(&light, 50))), 150);
        // The heavy tenant's next request waits for all of its own.
        assert_eq!(prefill(&b.view(viewer(&heavy, 50))), 10_000);
        // With light work waiting, heavy's next counts it up to its
        // allowance (all of it here), and light's own waiting work
        // raises light's allowance of heavy's.
        b.insert(200, entry(1, 40, 20).of(&light));
        assert_eq!(prefill(&b.view(viewer(&heavy, 50))), 10_040);
        assert_eq!(prefill(&b.view(viewer(&light, 50))), 40 + 90 + 100);
        // Weight 3 against 1: the heavier tenant's allowance is three
        // times the prompt tokens.
        let w3 = Tenant::named("light", 3.0);
        let mut c = Books::default();
        for id in 0..100u64 {
            c.insert(id, entry(1, 100, 20).of(&heavy));
        }
        assert_eq!(prefill(&c.view(viewer(&w3, 60))), 60 / 3 + 100);
        // One tenant alone: the plain listed view, as before.
        assert_eq!(prefill(&c.view(viewer(&heavy, 60))), 10_000);
    }

    #[test]
    fn a_view_lists_a_bounded_number_and_sums_the_rest() {
        let mut b = Books::default();
        for id in 0..1000u64 {
            b.insert(id, entry(1, 10, 20));
        }
        let v = b.view(Viewer::plain(1, 1000, 1.0));
        assert_eq!(v.len(), LISTED + 1);
        let tokens: usize = v.iter().map(|w| w.prefill * w.count).sum();
        assert_eq!(tokens, 10_000);
        // A request in the middle counts those before it, itself never,
        // and of those after it all but the ones it looked at (itself and
        // the next LISTED - 1): the rest is the stated over-count.
        let v = b.view(Viewer::plain(1, 500, 1.0));
        let tokens: usize = v.iter().map(|w| w.prefill * w.count).sum();
        assert_eq!(tokens, 10 * (1000 - LISTED));
        // Its claim in a better lane it was moved down from is not ahead
        // of it either.
        let mut c = Books::default();
        c.insert(7, entry(0, 300, 20));
        c.insert(3, entry(0, 40, 20));
        let v = c.view(Viewer::plain(1, 7, 1.0));
        assert_eq!(v.iter().map(|w| w.prefill).sum::<usize>(), 40);
        // Worse lanes are not counted; a later arrival's own lane is.
        assert!(b.view(Viewer::plain(0, 0, 1.0)).is_empty());
    }
}
