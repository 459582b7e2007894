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

use super::Work;
use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

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

    /// The work ahead of a request of `rank` arriving at `place` (see the
    /// module doc), with `share` of `max_tokens` expected as output.
    /// Counted: running requests, better lanes' requests and those of its
    /// own lane that came before it; worse lanes are not (the backend
    /// serves better lanes first), except that their running requests
    /// make up the step in flight on arrival.
    pub fn view(&self, rank: u32, place: u64, share: f64) -> Vec<Work> {
        let top = rank_index(rank);
        let mut out = Vec::new();
        let mut listed = 0;
        for r in 0..=top {
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
        assert_eq!(b.view(1, 3, 1.0).len(), 2);
        b.dispatched(1);
        assert_eq!(b.running(), 1);
        assert!(!b.token(1).unwrap().decoding);
        assert!(b.token(1).unwrap().decoding);
        let v = b.view(1, 3, 1.0);
        let dec: Vec<&Work> = v.iter().filter(|w| w.prefill == 0).collect();
        assert_eq!(dec.len(), 1);
        assert_eq!(dec[0].count, 1);
        assert!(dec[0].output >= 98.0 && dec[0].output <= 98.0 * 1.25);
        assert_eq!(b.running(), 1);
        b.remove(1);
        b.remove(2);
        assert_eq!((b.len(), b.running()), (0, 0));
        assert!(b.view(1, 3, 1.0).is_empty());
        assert!(b.decoders.iter().flatten().all(|&n| n == 0));
    }

    #[test]
    fn a_view_lists_a_bounded_number_and_sums_the_rest() {
        let mut b = Books::default();
        for id in 0..1000u64 {
            b.insert(id, entry(1, 10, 20));
        }
        let v = b.view(1, 1000, 1.0);
        assert_eq!(v.len(), LISTED + 1);
        let tokens: usize = v.iter().map(|w| w.prefill * w.count).sum();
        assert_eq!(tokens, 10_000);
        // A request in the middle counts those before it, itself never,
        // and of those after it all but the ones it looked at (itself and
        // the next LISTED - 1): the rest is the stated over-count.
        let v = b.view(1, 500, 1.0);
        let tokens: usize = v.iter().map(|w| w.prefill * w.count).sum();
        assert_eq!(tokens, 10 * (1000 - LISTED));
        // Its claim in a better lane it was moved down from is not ahead
        // of it either.
        let mut c = Books::default();
        c.insert(7, entry(0, 300, 20));
        c.insert(3, entry(0, 40, 20));
        let v = c.view(1, 7, 1.0);
        assert_eq!(v.iter().map(|w| w.prefill).sum::<usize>(), 40);
        // Worse lanes are not counted; a later arrival's own lane is.
        assert!(b.view(0, 0, 1.0).is_empty());
    }
}
