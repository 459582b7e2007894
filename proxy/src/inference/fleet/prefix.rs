//! An approximate index of the prompt prefixes each member of a fleet
//! holds in its KV cache: what the edge sent there recently.
//!
//! A prompt is cut into blocks of `block_tokens` tokens (estimated at four
//! bytes a token, as the upstream path sizes prompts) and each block is
//! named by a hash chained over every block before it, as vLLM's prefix
//! cache names its blocks: two prompts share a block hash only if they
//! share everything up to its end. The index maps a block hash to the
//! members that received it most recently (at most [`HOLDERS`]), and each
//! member keeps its blocks in the order it received them, bounded by its
//! KV capacity in blocks: beyond it the least recently sent block is
//! forgotten, as the member's own LRU would evict it.
//!
//! Lookup walks a prompt's blocks from the first and reports, for each
//! member holding the first block, how many leading blocks it holds: a
//! cost of at most `blocks * HOLDERS` map reads, whatever the fleet's size.
//! The index is approximate by design: a member may have evicted sooner
//! (other traffic, preemption) or kept longer; calibration absorbs the
//! difference, and the replay counts only the prompt tokens past the hit.

use std::collections::{HashMap, VecDeque};

/// Most members listed for one block: the index points at the members
/// most recently sent a prefix, which is where a request should go back.
pub const HOLDERS: usize = 4;

/// Longest prompt indexed, in blocks (a longer one is indexed by its head):
/// bounds the work of a lookup and an insert.
pub const MAX_BLOCKS: usize = 512;

/// Bytes a token is taken to cover.
const BYTES_PER_TOKEN: usize = 4;

/// The chained block hashes of a prompt's bytes (at most [`MAX_BLOCKS`];
/// a trailing partial block is not a block, as in vLLM).
pub fn blocks(bytes: &[u8], block_tokens: usize) -> Vec<u64> {
    let size = block_tokens.max(1) * BYTES_PER_TOKEN;
    let mut out = Vec::with_capacity((bytes.len() / size).min(MAX_BLOCKS));
    let mut h = 0x243f_6a88_85a3_08d3u64;
    for chunk in bytes.chunks_exact(size).take(MAX_BLOCKS) {
        h = crate::hash::hash_bytes(chunk) ^ crate::hash::mix64(h);
        out.push(h);
    }
    out
}

/// One member's blocks, oldest first (an entry whose tick no longer
/// matches the index's was sent again later: skipped when it comes up).
#[derive(Debug, Default)]
struct Held {
    order: VecDeque<(u64, u64)>,
    live: usize,
}

/// The index (one per fleet, behind its own short lock).
#[derive(Debug, Default)]
pub struct PrefixIndex {
    /// Block hash → (member id, tick of its latest send), newest last.
    map: HashMap<u64, Vec<(u32, u64)>>,
    held: HashMap<u32, Held>,
    tick: u64,
}

impl PrefixIndex {
    /// For each member that holds the prompt's first block, how many of
    /// its leading `blocks` it holds (most first).
    pub fn lookup(&self, blocks: &[u64]) -> Vec<(u32, usize)> {
        let Some(first) = blocks.first().and_then(|b| self.map.get(b)) else {
            return Vec::new();
        };
        let mut out: Vec<(u32, usize)> = first.iter().map(|&(m, _)| (m, 1)).collect();
        for (id, hit) in &mut out {
            for b in &blocks[1..] {
                let held = self
                    .map
                    .get(b)
                    .is_some_and(|hs| hs.iter().any(|(m, _)| m == id));
                if !held {
                    break;
                }
                *hit += 1;
            }
        }
        out.sort_by_key(|&(_, hit)| std::cmp::Reverse(hit));
        out
    }

    /// `member` was sent a prompt of `blocks`; it holds at most
    /// `capacity` blocks.
    pub fn insert(&mut self, member: u32, blocks: &[u64], capacity: usize) {
        let capacity = capacity.max(1);
        for &b in blocks {
            self.tick += 1;
            let tick = self.tick;
            let hs = self.map.entry(b).or_default();
            let fresh = match hs.iter().position(|(m, _)| *m == member) {
                Some(i) => {
                    hs.remove(i);
                    false
                }
                None => true,
            };
            hs.push((member, tick));
            let mut dropped = None;
            if hs.len() > HOLDERS {
                dropped = Some(hs.remove(0).0);
            }
            if let Some(d) = dropped {
                if let Some(h) = self.held.get_mut(&d) {
                    h.live = h.live.saturating_sub(1);
                }
            }
            let h = self.held.entry(member).or_default();
            h.order.push_back((b, tick));
            if fresh {
                h.live += 1;
            }
        }
        self.evict(member, capacity);
    }

    /// Forget `member`'s oldest blocks past `capacity` (and stale order
    /// entries, so its queue stays within twice its capacity).
    fn evict(&mut self, member: u32, capacity: usize) {
        let Some(h) = self.held.get_mut(&member) else {
            return;
        };
        while h.live > capacity || h.order.len() > 2 * capacity + 64 {
            let Some((b, tick)) = h.order.pop_front() else {
                break;
            };
            let Some(hs) = self.map.get_mut(&b) else {
                continue;
            };
            let Some(i) = hs.iter().position(|&(m, t)| m == member && t == tick) else {
                // Sent again later (or dropped as a holder): not this entry's.
                continue;
            };
            hs.remove(i);
            h.live = h.live.saturating_sub(1);
            if hs.is_empty() {
                self.map.remove(&b);
            }
        }
    }

    /// Forget a member (it left the fleet).
    pub fn remove(&mut self, member: u32) {
        if let Some(h) = self.held.remove(&member) {
            for (b, _) in h.order {
                if let Some(hs) = self.map.get_mut(&b) {
                    hs.retain(|(m, _)| *m != member);
                    if hs.is_empty() {
                        self.map.remove(&b);
                    }
                }
            }
        }
    }

    /// Blocks `member` is taken to hold.
    pub fn held_by(&self, member: u32) -> usize {
        self.held.get(&member).map_or(0, |h| h.live)
    }

    /// Block hashes indexed (all members).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether nothing is indexed.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(system: &str, user: &str) -> Vec<u8> {
        format!("system\0{system}\0user\0{user}\0").into_bytes()
    }

    #[test]
    fn a_shared_prefix_hits_where_it_was_sent() {
        let sys = "You are a careful assistant. ".repeat(20);
        let a = blocks(&prompt(&sys, &"first question ".repeat(10)), 16);
        let b = blocks(&prompt(&sys, &"another question entirely ".repeat(10)), 16);
        assert!(a.len() >= 8);
        let mut ix = PrefixIndex::default();
        ix.insert(7, &a, 1000);
        let hits = ix.lookup(&b);
        assert_eq!(hits.len(), 1);
        assert_eq!(hits[0].0, 7);
        // The system prompt's full blocks, not the differing tail.
        let common = sys.len() / 64;
        assert!(hits[0].1 >= common && hits[0].1 < b.len(), "{hits:?}");
        assert!(ix.lookup(&blocks(&prompt("other", "x"), 16)).is_empty());
    }

    #[test]
    fn capacity_evicts_the_least_recently_sent() {
        let mut ix = PrefixIndex::default();
        let old = blocks(&[b'a'; 64 * 10], 16);
        let new = blocks(&[b'b'; 64 * 10], 16);
        ix.insert(1, &old, 12);
        ix.insert(1, &new, 12);
        assert_eq!(ix.held_by(1), 12);
        // The newest prompt is held whole, the oldest lost its head (and
        // with it every hit: a chain starts at the first block).
        assert_eq!(ix.lookup(&new), vec![(1, 10)]);
        assert!(ix.lookup(&old).is_empty());
        // Sending the old one again refreshes it.
        ix.insert(1, &old, 12);
        assert_eq!(ix.lookup(&old), vec![(1, 10)]);
        assert_eq!(ix.held_by(1), 12);
    }

    #[test]
    fn holders_are_bounded_and_members_can_leave() {
        let mut ix = PrefixIndex::default();
        let p = blocks(&[b'z'; 64 * 3], 16);
        for m in 0..10 {
            ix.insert(m, &p, 100);
        }
        let hits = ix.lookup(&p);
        assert_eq!(hits.len(), HOLDERS);
        assert!(hits.iter().all(|&(m, n)| m >= 6 && n == 3), "{hits:?}");
        assert_eq!(ix.held_by(0), 0);
        ix.remove(9);
        assert!(ix.lookup(&p).iter().all(|&(m, _)| m != 9));
        for m in 0..10 {
            ix.remove(m);
        }
        assert!(ix.is_empty());
    }

    #[test]
    fn a_huge_prompt_is_indexed_by_its_head() {
        let b = blocks(&vec![b'q'; 64 * (MAX_BLOCKS + 100)], 16);
        assert_eq!(b.len(), MAX_BLOCKS);
    }
}
