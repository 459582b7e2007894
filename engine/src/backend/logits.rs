//! What a step hands to sampling. A sampler that draws from the k largest
//! logits (greedy is k = 1) needs only those: a runner whose logits live on
//! a device picks them there and copies back k pairs instead of the whole
//! vocabulary ([`Need::Top`]). A grammar mask, top-p alone or temperature
//! alone needs every logit ([`Need::Full`]); a prompt chunk that does not
//! end its prompt needs none ([`Need::Nothing`]). A prompt being scored
//! (`echo` with `logprobs`) needs the row of every position it computes
//! ([`Need::Every`]), which only a runner that says so
//! ([`ModelRunner::every_row`](super::ModelRunner::every_row)) serves.
//! Runners on the CPU keep every row whole, which serves the other needs.

/// Largest k a sampler asks for as candidates (the device's top-k takes
/// one pass over the vocabulary per candidate).
pub const MAX_TOP: usize = 64;

/// What one sequence's sampler needs from this step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Nothing: the step does not end the sequence's prompt.
    Nothing,
    /// The whole vocabulary's logits.
    Full,
    /// The k largest logits, largest first (ties: the smaller token id).
    Top(usize),
    /// `Top(k)` and the row's log-normaliser (`ln Σ e^x`): a sequence that
    /// reports log-probabilities and samples from candidates gets its
    /// scores without its row leaving the device.
    Scored(usize),
    /// Whole rows for every token of the step, in order (the last one is
    /// the row a sampler reads when the step ends the prompt).
    Every,
}

impl Need {
    /// The candidates it asks for (0 for none or a whole row).
    pub fn k(&self) -> usize {
        match *self {
            Need::Top(k) | Need::Scored(k) => k,
            _ => 0,
        }
    }
}

/// Where one sequence's logits are in [`StepLogits`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowAt {
    /// Not computed.
    Nothing,
    /// A whole row starting at this offset of `full`.
    Full(usize),
    /// `top[start..end]`.
    Top(usize, usize),
    /// `n` whole rows, one per token of the step, from this offset of
    /// `full`.
    Every(usize, usize),
}

/// One step's logits, each sequence's row either whole or as candidates;
/// buffers reused from step to step.
#[derive(Debug, Default)]
pub struct StepLogits {
    /// Whole rows, one after another.
    pub full: Vec<f32>,
    /// Candidates as (token, logit), largest first within a sequence.
    pub top: Vec<(u32, f32)>,
    /// Where each sequence's row is, in the step's order.
    pub rows: Vec<RowAt>,
    /// Each row's log-normaliser, where [`Need::Scored`] asked (NaN
    /// elsewhere).
    pub norms: Vec<f32>,
}

/// One sequence's logits, as sampling reads them.
#[derive(Debug)]
pub enum Row<'a> {
    /// Every logit (a grammar mask may still be applied in place).
    Full(&'a mut [f32]),
    /// The largest ones, largest first.
    Top(&'a [(u32, f32)]),
    /// The largest ones and the row's log-normaliser ([`Need::Scored`]).
    Scored(&'a [(u32, f32)], f32),
}

impl StepLogits {
    /// Every sequence's row whole, as a CPU runner leaves them in `full`.
    pub fn all_full(&mut self, seqs: usize, vocab: usize) {
        self.top.clear();
        self.rows.clear();
        self.norms.clear();
        self.rows.extend((0..seqs).map(|i| RowAt::Full(i * vocab)));
    }

    /// Whole rows in `full`, `counts[i]` of them for sequence i (one: its
    /// last token's; more: [`Need::Every`]).
    pub fn all_full_counted(&mut self, counts: impl Iterator<Item = usize>, vocab: usize) {
        self.top.clear();
        self.rows.clear();
        self.norms.clear();
        let mut at = 0;
        for n in counts {
            self.rows.push(match n {
                1 => RowAt::Full(at),
                n => RowAt::Every(at, n),
            });
            at += n * vocab;
        }
    }

    /// Sequence `i`'s row (None when it was not computed): for
    /// [`RowAt::Every`], its last token's.
    pub fn row(&mut self, i: usize, vocab: usize) -> Option<Row<'_>> {
        match *self.rows.get(i)? {
            RowAt::Nothing => None,
            RowAt::Full(at) => self.full.get_mut(at..at + vocab).map(Row::Full),
            RowAt::Top(a, b) => {
                let top = self.top.get(a..b)?;
                match self.norms.get(i).copied().filter(|n| !n.is_nan()) {
                    Some(n) => Some(Row::Scored(top, n)),
                    None => Some(Row::Top(top)),
                }
            }
            RowAt::Every(at, n) => self
                .full
                .get_mut(at + (n - 1) * vocab..at + n * vocab)
                .map(Row::Full),
        }
    }

    /// Every row of sequence `i`'s tokens in this step, one after another
    /// (one row unless it asked for [`Need::Every`]).
    pub fn every(&self, i: usize, vocab: usize) -> Option<&[f32]> {
        match *self.rows.get(i)? {
            RowAt::Full(at) => self.full.get(at..at + vocab),
            RowAt::Every(at, n) => self.full.get(at..at + n * vocab),
            RowAt::Nothing | RowAt::Top(..) => None,
        }
    }

    /// Serves `needs` from whole rows (`rows[i]` is sequence i's logits):
    /// whole rows are copied, candidates picked on the host. What a device
    /// runner does on its device, for runners that test its contract.
    pub fn from_rows<'r>(&mut self, needs: &[Need], rows: impl Iterator<Item = &'r [f32]>) {
        self.full.clear();
        self.top.clear();
        self.rows.clear();
        self.norms.clear();
        for (need, row) in needs.iter().zip(rows) {
            self.norms.push(match need {
                Need::Scored(_) => ultrafast_kernels::reference::log_norm(row),
                _ => f32::NAN,
            });
            let at = match *need {
                Need::Nothing => RowAt::Nothing,
                // Only the last row came: a runner that serves `Every`
                // does not come here (the default `step_for` refuses it).
                Need::Full | Need::Every => {
                    let at = self.full.len();
                    self.full.extend_from_slice(row);
                    RowAt::Full(at)
                }
                Need::Top(k) | Need::Scored(k) => {
                    let a = self.top.len();
                    self.top.extend(ultrafast_kernels::reference::top_k(row, k));
                    RowAt::Top(a, self.top.len())
                }
            };
            self.rows.push(at);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scored_candidates_carry_the_rows_log_normaliser() {
        let rows = [[0.5f32, 2.0, -1.0, 2.0], [1.0, 0.0, 3.0, -2.0]];
        let mut l = StepLogits::default();
        l.from_rows(
            &[Need::Scored(1), Need::Top(1)],
            rows.iter().map(|r| &r[..]),
        );
        let want = (0.5f64.exp() + 2.0 * 2f64.exp() + (-1f64).exp()).ln() as f32;
        match l.row(0, 4) {
            Some(Row::Scored(c, n)) => {
                assert_eq!(c, &[(1, 2.0)]);
                assert!((n - want).abs() < 1e-6, "{n} vs {want}");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(l.row(1, 4), Some(Row::Top(_))));
    }

    #[test]
    fn rows_are_served_whole_as_candidates_or_not_at_all() {
        let rows = [[0.5f32, 2.0, -1.0, 2.0], [1.0, 0.0, 3.0, -2.0], [0.0; 4]];
        let mut l = StepLogits::default();
        l.from_rows(
            &[Need::Top(2), Need::Full, Need::Nothing],
            rows.iter().map(|r| &r[..]),
        );
        match l.row(0, 4) {
            Some(Row::Top(c)) => assert_eq!(c, &[(1, 2.0), (3, 2.0)]),
            other => panic!("{other:?}"),
        }
        match l.row(1, 4) {
            Some(Row::Full(r)) => assert_eq!(r, &[1.0, 0.0, 3.0, -2.0]),
            other => panic!("{other:?}"),
        }
        assert!(l.row(2, 4).is_none());
        assert!(l.row(3, 4).is_none());
        l.full = rows.concat();
        l.all_full(3, 4);
        assert!(matches!(l.row(2, 4), Some(Row::Full(r)) if r == [0.0; 4]));
    }
}
