//! Block pool with prefix caching.
//!
//! Design: one `Mutex` around plain vectors (the scheduler thread is the only
//! frequent user, so the lock is uncontended). Every block is in exactly one
//! state: free (no content worth keeping), in use (refcount > 0), or cached
//! (refcount 0 but holding a full block whose content hash is registered,
//! reusable until evicted). Allocation takes a free block, else evicts the
//! least recently used cached one. Complexity: allocation and release are
//! O(log n) (the LRU is a `BTreeMap` keyed by a use counter); prefix lookup
//! is one hash probe per full block.
//!
//! A hash hit is never trusted alone: two different prompts whose 64-bit
//! chained hashes collide must not share KV (the bug class of vLLM's
//! CVE-2025-25183). Each registered block keeps its own tokens and a link
//! to the exact registration of the block before it (block id and a
//! registration number that changes whenever a block is reused), so a hit
//! is taken only when the tokens are equal and the chain before it is the
//! very chain just matched: by induction the whole prefix is equal.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

/// Counts of blocks by state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    /// Blocks referenced by at least one sequence.
    pub used: usize,
    /// Blocks with nothing to keep.
    pub free: usize,
    /// Unreferenced blocks kept for prefix reuse.
    pub cached: usize,
    /// Full blocks found in the prefix cache so far.
    pub hits: u64,
    /// Full prompt blocks that had to be computed.
    pub misses: u64,
}

#[derive(Debug)]
struct Inner {
    refcount: Vec<u32>,
    free: Vec<u32>,
    hash_of: Vec<Option<u64>>,
    /// The tokens of each registered block, compared on every hash hit.
    tokens_of: Vec<Option<Box<[u32]>>>,
    /// The registration (block, epoch) before each registered block.
    parent_of: Vec<Option<(u32, u64)>>,
    /// Registration number of each block's current content.
    epoch: Vec<u64>,
    next_epoch: u64,
    by_hash: HashMap<u64, u32>,
    lru: BTreeMap<u64, u32>,
    lru_key: Vec<Option<u64>>,
    tick: u64,
    hits: u64,
    misses: u64,
}

impl Inner {
    fn take_block(&mut self) -> Option<u32> {
        if let Some(b) = self.free.pop() {
            return Some(b);
        }
        let (&key, &b) = self.lru.iter().next()?;
        self.lru.remove(&key);
        self.lru_key[b as usize] = None;
        if let Some(h) = self.hash_of[b as usize].take() {
            self.by_hash.remove(&h);
        }
        self.tokens_of[b as usize] = None;
        self.parent_of[b as usize] = None;
        Some(b)
    }

    /// The registration link of block `b` as a parent.
    fn link(&self, b: u32) -> (u32, u64) {
        (b, self.epoch[b as usize])
    }

    /// The cached block holding exactly `tokens` after `parent` (None for
    /// the first block), found by hash `h` and then checked.
    fn lookup(&self, h: u64, tokens: &[u32], parent: Option<(u32, u64)>) -> Option<u32> {
        let b = *self.by_hash.get(&h)?;
        let same = self.tokens_of[b as usize].as_deref() == Some(tokens)
            && self.parent_of[b as usize] == parent;
        same.then_some(b)
    }

    fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    fn acquire_cached(&mut self, b: u32) {
        if let Some(k) = self.lru_key[b as usize].take() {
            self.lru.remove(&k);
        }
        self.refcount[b as usize] += 1;
    }

    fn release(&mut self, b: u32) {
        let rc = &mut self.refcount[b as usize];
        *rc = rc.saturating_sub(1);
        if *rc > 0 {
            return;
        }
        if self.hash_of[b as usize].is_some() {
            self.tick += 1;
            self.lru.insert(self.tick, b);
            self.lru_key[b as usize] = Some(self.tick);
        } else {
            self.free.push(b);
        }
    }
}

/// A pool of `num_blocks` blocks of `block_size` token slots.
#[derive(Debug, Clone)]
pub struct BlockPool {
    inner: Arc<Mutex<Inner>>,
    block_size: usize,
    num_blocks: usize,
    hash: Hasher,
}

/// The chained block hash: previous hash and the block's tokens.
pub type Hasher = fn(u64, &[u32]) -> u64;

/// One sequence's block table; its blocks go back to the pool on drop.
#[derive(Debug)]
pub struct SeqBlocks {
    pool: BlockPool,
    blocks: Vec<u32>,
    /// Chained hashes of the full blocks registered so far.
    hashes: Vec<u64>,
    /// Prompt tokens whose keys and values are already in cached blocks.
    pub cached_tokens: usize,
}

fn chain(prev: u64, tokens: &[u32]) -> u64 {
    // FNV-1a over the previous hash and the tokens, then a final mix.
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ prev.rotate_left(17);
    for t in tokens {
        for b in t.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x100_0000_01b3);
        }
    }
    h ^ (h >> 29)
}

impl BlockPool {
    /// A pool of `num_blocks` blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self::with_hasher(num_blocks, block_size, chain)
    }

    /// A pool with another block hash: tests force collisions with it.
    pub fn with_hasher(num_blocks: usize, block_size: usize, hash: Hasher) -> Self {
        let n = num_blocks;
        BlockPool {
            inner: Arc::new(Mutex::new(Inner {
                refcount: vec![0; n],
                free: (0..n as u32).rev().collect(),
                hash_of: vec![None; n],
                tokens_of: vec![None; n],
                parent_of: vec![None; n],
                epoch: vec![0; n],
                next_epoch: 0,
                by_hash: HashMap::new(),
                lru: BTreeMap::new(),
                lru_key: vec![None; n],
                tick: 0,
                hits: 0,
                misses: 0,
            })),
            block_size: block_size.max(1),
            num_blocks: n,
            hash,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A poisoned lock only means a panic elsewhere mid-update of plain
        // counters; the data is still consistent enough to keep serving.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Total blocks.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks needed for `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Counts by state.
    pub fn stats(&self) -> PoolStats {
        let g = self.lock();
        let used = g.refcount.iter().filter(|r| **r > 0).count();
        PoolStats {
            used,
            free: g.free.len(),
            cached: g.lru.len(),
            hits: g.hits,
            misses: g.misses,
        }
    }

    /// Blocks for a new sequence holding `prompt`: the longest prefix of full
    /// blocks already cached is shared (at least one prompt token is always
    /// left to compute, for its logits), the rest is allocated. None when the
    /// pool cannot hold it now (nothing is taken then).
    pub fn allocate(&self, prompt: &[u32]) -> Option<SeqBlocks> {
        self.allocate_reusing(prompt, true)
    }

    /// [`allocate`](Self::allocate), sharing cached blocks only when
    /// `reuse` (a prompt whose every position is computed shares none).
    pub fn allocate_reusing(&self, prompt: &[u32], reuse: bool) -> Option<SeqBlocks> {
        let bs = self.block_size;
        let need = self.blocks_for(prompt.len().max(1));
        let mut g = self.lock();
        let mut matched = Vec::new();
        let mut hashes = Vec::new();
        let mut prev = 0u64;
        let reusable = match reuse {
            true => prompt.len().saturating_sub(1) / bs,
            false => 0,
        };
        let mut parent = None;
        for i in 0..reusable {
            let tokens = &prompt[i * bs..(i + 1) * bs];
            let h = (self.hash)(prev, tokens);
            match g.lookup(h, tokens, parent) {
                Some(b) => {
                    parent = Some(g.link(b));
                    matched.push(b);
                    hashes.push(h);
                    prev = h;
                }
                None => break,
            }
        }
        if need - matched.len()
            > g.available()
                - matched
                    .iter()
                    .filter(|b| g.lru_key[**b as usize].is_some())
                    .count()
        {
            return None;
        }
        for &b in &matched {
            g.acquire_cached(b);
        }
        g.hits += matched.len() as u64;
        g.misses += (prompt.len() / bs).saturating_sub(matched.len()) as u64;
        let mut blocks = matched.clone();
        for _ in matched.len()..need {
            let b = g.take_block()?;
            g.refcount[b as usize] = 1;
            blocks.push(b);
        }
        drop(g);
        Some(SeqBlocks {
            pool: self.clone(),
            blocks,
            hashes,
            cached_tokens: matched.len() * bs,
        })
    }

    /// Grow `seq` to hold `len` tokens. False (and nothing taken) if the
    /// pool cannot.
    pub fn grow(&self, seq: &mut SeqBlocks, len: usize) -> bool {
        let need = self.blocks_for(len);
        if need <= seq.blocks.len() {
            return true;
        }
        let mut g = self.lock();
        if need - seq.blocks.len() > g.available() {
            return false;
        }
        while seq.blocks.len() < need {
            match g.take_block() {
                Some(b) => {
                    g.refcount[b as usize] = 1;
                    seq.blocks.push(b);
                }
                None => return false,
            }
        }
        true
    }

    /// Register the full blocks of `tokens` (the sequence's tokens so far,
    /// computed) for prefix reuse by later sequences.
    pub fn seal(&self, seq: &mut SeqBlocks, tokens: &[u32]) {
        let bs = self.block_size;
        let full = (tokens.len() / bs).min(seq.blocks.len());
        let mut g = self.lock();
        let mut prev = seq.hashes.last().copied().unwrap_or(0);
        for i in seq.hashes.len()..full {
            let own = &tokens[i * bs..(i + 1) * bs];
            let h = (self.hash)(prev, own);
            let b = seq.blocks[i];
            // A block is registered only behind its own registered parent
            // (a parent left out by a collision leaves its children out),
            // so a later hit can check the whole chain.
            let parent = match i {
                0 => Some(None),
                _ => {
                    let p = seq.blocks[i - 1];
                    (g.hash_of[p as usize] == Some(prev)).then(|| Some(g.link(p)))
                }
            };
            if let Some(parent) = parent {
                if g.hash_of[b as usize].is_none() && !g.by_hash.contains_key(&h) {
                    g.next_epoch += 1;
                    let e = g.next_epoch;
                    g.epoch[b as usize] = e;
                    g.hash_of[b as usize] = Some(h);
                    g.tokens_of[b as usize] = Some(own.into());
                    g.parent_of[b as usize] = parent;
                    g.by_hash.insert(h, b);
                }
            }
            seq.hashes.push(h);
            prev = h;
        }
    }
}

impl SeqBlocks {
    /// Block ids in order.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }
}

impl Drop for SeqBlocks {
    fn drop(&mut self) {
        let mut g = self.pool.lock();
        for &b in &self.blocks {
            g.release(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_prefix_is_computed_once() {
        let pool = BlockPool::new(16, 4);
        let system: Vec<u32> = (0..12).collect();
        let mut a_prompt = system.clone();
        a_prompt.extend([100, 101]);
        let mut a = pool.allocate(&a_prompt).unwrap();
        assert_eq!(a.cached_tokens, 0);
        pool.seal(&mut a, &a_prompt);
        let mut b_prompt = system.clone();
        b_prompt.extend([200]);
        let b = pool.allocate(&b_prompt).unwrap();
        assert_eq!(b.cached_tokens, 12, "three full blocks reused");
        assert_eq!(&b.blocks()[..3], &a.blocks()[..3]);
        drop(a);
        drop(b);
        let s = pool.stats();
        assert_eq!(s.used, 0);
        assert_eq!(s.free + s.cached, 16);
        // Cached blocks are still reusable after everyone left...
        let c = pool.allocate(&b_prompt).unwrap();
        assert_eq!(c.cached_tokens, 12);
        drop(c);
        // ...and are evicted when the pool needs the room.
        let big: Vec<u32> = (1000..1064).collect();
        let d = pool.allocate(&big).unwrap();
        assert_eq!(d.blocks().len(), 16);
        drop(d);
        assert_eq!(pool.stats().used, 0);
    }

    #[test]
    fn colliding_hashes_never_share_blocks() {
        // Every block hashes alike: each hit must be refused by its tokens
        // or by the chain before it.
        let pool = BlockPool::with_hasher(32, 4, |_, _| 42);
        let a_prompt: Vec<u32> = (0..9).collect();
        let mut a = pool.allocate(&a_prompt).unwrap();
        pool.seal(&mut a, &a_prompt);
        let b_prompt: Vec<u32> = (100..109).collect();
        let b = pool.allocate(&b_prompt).unwrap();
        assert_eq!(b.cached_tokens, 0, "different tokens under one hash");
        assert!(b.blocks().iter().all(|x| !a.blocks().contains(x)));
        // Same first block, different second: only the first is shared.
        let mut c_prompt: Vec<u32> = (0..4).collect();
        c_prompt.extend([7, 7, 7, 7, 1]);
        let c = pool.allocate(&c_prompt).unwrap();
        assert_eq!(c.cached_tokens, 4);
        assert_eq!(c.blocks()[0], a.blocks()[0]);
        assert_ne!(c.blocks()[1], a.blocks()[1]);
        // The identical prompt reuses its first block; its second collided
        // with the first on registration, so it is computed again: correct,
        // only not cached.
        let d = pool.allocate(&a_prompt).unwrap();
        assert_eq!(d.cached_tokens, 4);
        assert_eq!(d.blocks()[0], a.blocks()[0]);
    }

    #[test]
    fn a_reused_parent_block_invalidates_its_children() {
        // A hash of the block's own tokens only: the chain before a block
        // is then told apart by the parent link alone.
        fn own(_: u64, t: &[u32]) -> u64 {
            t.iter()
                .fold(7, |h, x| h.wrapping_mul(31).wrapping_add(*x as u64))
        }
        let pool = BlockPool::with_hasher(4, 2, own);
        let a_prompt = vec![1, 2, 3, 4, 5];
        let mut a = pool.allocate(&a_prompt).unwrap();
        pool.seal(&mut a, &a_prompt);
        let (a0, a1) = (a.blocks()[0], a.blocks()[1]);
        drop(a);
        // Fill the free list, so the next block comes from evicting a0.
        let x = pool.allocate(&[50]).unwrap();
        let y = pool.allocate(&[51]).unwrap();
        let mut c = pool.allocate(&[6, 6]).unwrap();
        assert_eq!(c.blocks(), &[a0], "the oldest cached block is reused");
        pool.seal(&mut c, &[6, 6]);
        drop((x, y));
        // [6,6] now lives in a0's id, and a1 ([3,4]) still names a0 as its
        // parent: it followed [1,2], not [6,6].
        let d = pool.allocate(&[6, 6, 3, 4, 9]).unwrap();
        assert_eq!(d.cached_tokens, 2);
        assert_ne!(d.blocks()[1], a1);
    }

    #[test]
    fn a_request_that_cannot_fit_takes_nothing() {
        let pool = BlockPool::new(4, 4);
        let a = pool.allocate(&[1; 9]).unwrap();
        assert!(pool.allocate(&[2; 9]).is_none());
        assert_eq!(pool.stats().used, 3);
        drop(a);
        assert_eq!(pool.stats().free, 4);
    }
}

#[cfg(test)]
mod props {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        /// A prompt: a shared prefix of `shared` blocks' worth, then `own` tokens.
        Add {
            shared: usize,
            own: usize,
            salt: u32,
        },
        Drop(usize),
        Grow(usize, usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0usize..4, 0usize..9, 0u32..3).prop_map(|(shared, own, salt)| Op::Add { shared, own, salt }),
            2 => (0usize..16).prop_map(Op::Drop),
            1 => (0usize..16, 1usize..8).prop_map(|(i, n)| Op::Grow(i, n)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

        /// No block leaks or is shared wrongly; counts always add up; the
        /// pool is whole again when every sequence is gone.
        #[test]
        fn block_pool_invariants(ops in proptest::collection::vec(op(), 1..80), collide in any::<bool>()) {
            let bs = 4;
            // Half the cases hash every block alike: sharing must still
            // follow content alone.
            let pool = if collide {
                BlockPool::with_hasher(24, bs, |_, t| t.len() as u64)
            } else {
                BlockPool::new(24, bs)
            };
            let mut seqs: Vec<(SeqBlocks, Vec<u32>)> = Vec::new();
            for op in ops {
                match op {
                    Op::Add { shared, own, salt } => {
                        let mut p: Vec<u32> = (0..(shared * bs) as u32).collect();
                        p.extend((0..own as u32).map(|i| 10_000 + salt * 100 + i));
                        if p.is_empty() { p.push(7); }
                        if let Some(mut s) = pool.allocate(&p) {
                            prop_assert!(s.cached_tokens < p.len());
                            prop_assert_eq!(s.blocks().len(), pool.blocks_for(p.len()));
                            pool.seal(&mut s, &p);
                            seqs.push((s, p));
                        }
                    }
                    Op::Drop(i) => {
                        if !seqs.is_empty() {
                            let k = i % seqs.len();
                            seqs.remove(k);
                        }
                    }
                    Op::Grow(i, n) => {
                        if !seqs.is_empty() {
                            let k = i % seqs.len();
                            let (s, p) = &mut seqs[k];
                            let len = p.len() + n;
                            if pool.grow(s, len) {
                                p.extend((0..n as u32).map(|x| 50_000 + x));
                                prop_assert!(s.blocks().len() >= pool.blocks_for(len));
                            }
                        }
                    }
                }
                // Every block's refcount equals the tables that hold it, and
                // a block is shared only for identical full-block content.
                let mut holders: HashMap<u32, Vec<usize>> = HashMap::new();
                for (i, (s, _)) in seqs.iter().enumerate() {
                    for (j, b) in s.blocks().iter().enumerate() {
                        holders.entry(*b).or_default().push(i * 1000 + j);
                    }
                }
                let g = pool.lock();
                for (b, hs) in &holders {
                    prop_assert_eq!(g.refcount[*b as usize] as usize, hs.len());
                    if hs.len() > 1 {
                        let contents: Vec<&[u32]> = hs.iter().map(|h| {
                            let (i, j) = (h / 1000, h % 1000);
                            let p = &seqs[i].1;
                            &p[j * bs..((j + 1) * bs).min(p.len())]
                        }).collect();
                        prop_assert!(contents.windows(2).all(|w| w[0] == w[1]), "block {} shared by different content", b);
                    }
                }
                let used = g.refcount.iter().filter(|r| **r > 0).count();
                prop_assert_eq!(used, holders.len());
                prop_assert_eq!(used + g.free.len() + g.lru.len(), 24);
                drop(g);
            }
            seqs.clear();
            let s = pool.stats();
            prop_assert_eq!(s.used, 0);
            prop_assert_eq!(s.free + s.cached, 24);
        }
    }
}
