//! The host side of a CUDA step: the flat arrays a step uploads for the
//! kernels of `ultrafast_kernels` to index (token ids, positions, KV slots,
//! each row's sequence, the block tables padded to one width, each
//! sequence's last row), and the batch-size bucket of a decode-only step,
//! whose rows are padded to the bucket so that one captured CUDA graph per
//! bucket serves every batch up to its size.
//!
//! [`super::reference::ReferenceRunner`] executes exactly this layout on
//! the CPU, so the scheduler's tests cover it without a GPU.

use crate::error::{EngineError, Result};
use crate::model::paged::SeqStep;

/// Batch sizes a decode-only step is padded to (one CUDA graph each).
pub const BUCKETS: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];

/// The block-table width a decode step of `max_blocks` runs its graph
/// with: the next power of two (at least 8), so that a few graphs per
/// bucket serve every length; None above `cap` (the most blocks a
/// sequence can hold), where the step runs without a graph.
pub fn graph_width(max_blocks: usize, cap: usize) -> Option<usize> {
    (max_blocks <= cap).then(|| max_blocks.next_power_of_two().max(8).min(cap))
}

/// One step's arrays, row-major over the step's rows (tokens).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepLayout {
    /// Token id of each row (padding rows: 0).
    pub tokens: Vec<u32>,
    /// Position of each row in its sequence.
    pub positions: Vec<i32>,
    /// KV slot each row writes: block id * block size + offset.
    pub slots: Vec<i32>,
    /// Index of each row's block table (its sequence in the step).
    pub qseq: Vec<i32>,
    /// Block tables, `max_blocks` per sequence, padded with the scratch
    /// block.
    pub tables: Vec<i32>,
    /// Entries per block table.
    pub max_blocks: usize,
    /// Each real sequence's last row (where its logits come from).
    pub last: Vec<usize>,
    /// The bucket of a decode-only step (rows padded to it); None for a
    /// step with a prompt chunk, which runs without a graph.
    pub bucket: Option<usize>,
}

impl StepLayout {
    /// The layout of `seqs` over a pool of `num_blocks` blocks of
    /// `block_size` slots. Block `num_blocks` is the scratch block: the
    /// cache holds one more than the pool, and padding rows write and read
    /// only there.
    pub fn build(seqs: &[SeqStep], block_size: usize, num_blocks: usize) -> Result<StepLayout> {
        let scratch = num_blocks as i32;
        let decode_only = !seqs.is_empty() && seqs.iter().all(|s| s.tokens.len() == 1);
        let bucket = if decode_only {
            BUCKETS.iter().copied().find(|b| *b >= seqs.len())
        } else {
            None
        };
        let mut max_blocks = 1;
        for s in seqs {
            let end = s.start + s.tokens.len();
            let need = end.div_ceil(block_size);
            if need > s.blocks.len() || s.tokens.is_empty() {
                return Err(EngineError::Invalid(format!(
                    "a sequence of {end} positions has {} blocks of {block_size}",
                    s.blocks.len()
                )));
            }
            if let Some(b) = s.blocks[..need].iter().find(|b| **b as usize >= num_blocks) {
                return Err(EngineError::Invalid(format!(
                    "block {b} outside the pool of {num_blocks}"
                )));
            }
            max_blocks = max_blocks.max(need);
        }
        let mut l = StepLayout {
            tokens: Vec::new(),
            positions: Vec::new(),
            slots: Vec::new(),
            qseq: Vec::new(),
            tables: Vec::new(),
            max_blocks,
            last: Vec::new(),
            bucket,
        };
        for (i, s) in seqs.iter().enumerate() {
            let need = (s.start + s.tokens.len()).div_ceil(block_size);
            l.tables.extend(s.blocks[..need].iter().map(|b| *b as i32));
            l.tables.resize((i + 1) * max_blocks, scratch);
            for (j, t) in s.tokens.iter().enumerate() {
                let pos = s.start + j;
                l.tokens.push(*t);
                l.positions.push(pos as i32);
                l.slots.push(
                    s.blocks[pos / block_size] as i32 * block_size as i32
                        + (pos % block_size) as i32,
                );
                l.qseq.push(i as i32);
            }
            l.last.push(l.tokens.len() - 1);
        }
        if let Some(b) = bucket {
            // Padding rows: their own all-scratch table, position 0, the
            // scratch block's first slot; their outputs are never read.
            let pad_seq = seqs.len() as i32;
            l.tables.resize((seqs.len() + 1) * max_blocks, scratch);
            while l.tokens.len() < b {
                l.tokens.push(0);
                l.positions.push(0);
                l.slots.push(scratch * block_size as i32);
                l.qseq.push(pad_seq);
            }
        }
        Ok(l)
    }

    /// The block tables padded with the scratch block to `width` entries
    /// each (at least `max_blocks`), as a captured graph reads them: its
    /// attention launch keeps the width it was captured with.
    pub fn widen(&mut self, width: usize, scratch: i32) {
        if width <= self.max_blocks {
            return;
        }
        let tables = std::mem::take(&mut self.tables);
        for t in tables.chunks(self.max_blocks) {
            self.tables.extend_from_slice(t);
            self.tables
                .extend(std::iter::repeat_n(scratch, width - self.max_blocks));
        }
        self.max_blocks = width;
    }

    /// Rows the kernels run (real and padding).
    pub fn rows(&self) -> usize {
        self.tokens.len()
    }

    /// Rows that belong to real sequences (the rest is bucket padding).
    pub fn real_rows(&self) -> usize {
        self.last.last().map_or(0, |r| r + 1)
    }

    /// Block table of row `r`'s sequence.
    pub fn table(&self, r: usize) -> &[i32] {
        let s = self.qseq[r] as usize;
        &self.tables[s * self.max_blocks..][..self.max_blocks]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq<'a>(tokens: &'a [u32], start: usize, blocks: &'a [u32]) -> SeqStep<'a> {
        SeqStep {
            tokens,
            start,
            blocks,
        }
    }

    #[test]
    fn a_prefill_chunk_and_a_decode_lay_out_slots_tables_and_last_rows() {
        let l =
            StepLayout::build(&[seq(&[5, 6, 7], 14, &[3, 9]), seq(&[8], 4, &[1])], 16, 10).unwrap();
        assert_eq!(l.tokens, vec![5, 6, 7, 8]);
        assert_eq!(l.positions, vec![14, 15, 16, 4]);
        assert_eq!(l.slots, vec![3 * 16 + 14, 3 * 16 + 15, 9 * 16, 16 + 4]);
        assert_eq!(l.qseq, vec![0, 0, 0, 1]);
        assert_eq!(l.max_blocks, 2);
        assert_eq!(l.tables, vec![3, 9, 1, 10]);
        assert_eq!(l.last, vec![2, 3]);
        assert_eq!((l.real_rows(), l.bucket), (4, None));
    }

    #[test]
    fn decode_steps_pad_to_their_bucket_on_the_scratch_block() {
        let blocks: Vec<Vec<u32>> = (0..5).map(|i| vec![i]).collect();
        let toks = [1u32];
        let seqs: Vec<SeqStep> = blocks.iter().map(|b| seq(&toks, 3, b)).collect();
        let l = StepLayout::build(&seqs, 16, 8).unwrap();
        assert_eq!(l.bucket, Some(8));
        assert_eq!((l.rows(), l.real_rows()), (8, 5));
        assert_eq!(l.table(7), &[8]);
        assert!(l.slots[5..].iter().all(|s| *s == 8 * 16));
        assert_eq!(l.last, vec![0, 1, 2, 3, 4]);
        assert_eq!(graph_width(1, 512), Some(8));
        assert_eq!(graph_width(9, 512), Some(16));
        assert_eq!(graph_width(300, 300), Some(300));
        assert_eq!(graph_width(301, 300), None);
        let mut wide = l.clone();
        wide.widen(4, 8);
        assert_eq!(wide.max_blocks, 4);
        assert_eq!(wide.table(1), &[1, 8, 8, 8]);
        assert_eq!(wide.table(7), &[8, 8, 8, 8]);
        assert_eq!(wide.tables.len(), 6 * 4);
        assert_eq!(
            (wide.slots, wide.positions),
            (l.slots.clone(), l.positions.clone())
        );
        // Above the largest bucket: no graph, no padding.
        let many: Vec<SeqStep> = (0..65).map(|_| seq(&toks, 0, &blocks[0])).collect();
        let l = StepLayout::build(&many, 16, 8).unwrap();
        assert_eq!((l.bucket, l.rows()), (None, 65));
    }

    #[test]
    fn tables_that_do_not_cover_the_step_or_leave_the_pool_are_refused() {
        assert!(StepLayout::build(&[seq(&[1, 2], 15, &[0])], 16, 4).is_err());
        assert!(StepLayout::build(&[seq(&[1], 0, &[4])], 16, 4).is_err());
        assert!(StepLayout::build(&[seq(&[], 0, &[0])], 16, 4).is_err());
    }
}
