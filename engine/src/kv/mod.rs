//! The paged KV cache's bookkeeping: a pool of fixed-size blocks, per-
//! sequence block tables that give their blocks back on `Drop`, and prefix
//! caching by chained hashes of full blocks (a repeated system prompt maps to
//! the same blocks; unreferenced cached blocks are evicted least recently
//! used first). The tensors that hold the keys and values are indexed by the
//! block ids handed out here.

pub mod block_pool;

pub use block_pool::{BlockPool, PoolStats, SeqBlocks};
