//! Sampling: greedy, temperature, top-k, top-p with a seeded generator (same
//! seed, same tokens), and stop sequences matched on text across token
//! boundaries (never emitted, and text that may still become a stop
//! sequence is held back until it cannot).

pub use crate::api::SamplingParams;

/// splitmix64: small, fast, and good enough for sampling.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A per-request sampler.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// How many times each token was generated (frequency and presence
    /// penalties), kept only when a penalty needs it.
    counts: std::collections::HashMap<u32, u32>,
    /// Tokens of the prompt and the output (the repetition penalty),
    /// filled from the prompt at the first step that needs it.
    seen: Option<std::collections::HashSet<u32>>,
}

/// Index of the largest logit (the first on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    // Two passes that vectorize beat one with a dependent compare.
    let max = ops::max(logits);
    logits.iter().position(|v| *v == max).unwrap_or(0) as u32
}

impl Sampler {
    /// A sampler for `params`.
    pub fn new(params: SamplingParams) -> Self {
        let seed = params.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0x5eed)
        });
        Sampler {
            params,
            rng: Rng(seed),
            counts: std::collections::HashMap::new(),
            seen: None,
        }
    }

    /// Change `logits` as the request asks, before any grammar mask, in
    /// this order: `logit_bias` added; the repetition penalty on tokens of
    /// the prompt and the output (`tokens`, all of them so far: read once,
    /// then kept up by `accepted`); the frequency and presence penalties
    /// on the output's tokens. `min_p` comes after the mask
    /// ([`Sampler::cut`]). Nothing happens for a request that asks none of
    /// these.
    pub fn adjust(&mut self, logits: &mut [f32], tokens: &[u32]) {
        let p = &self.params;
        if !p.adjusts_logits() {
            return;
        }
        let n = logits.len();
        for &(t, b) in &p.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        if p.repetition_penalty != 1.0 {
            let r = p.repetition_penalty;
            let seen = self
                .seen
                .get_or_insert_with(|| tokens.iter().copied().collect());
            for &t in seen.iter() {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / r } else { *l * r };
                }
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            for (&t, &c) in &self.counts {
                if (t as usize) < n {
                    logits[t as usize] -= p.frequency_penalty * c as f32 + p.presence_penalty;
                }
            }
        }
    }

    /// `min_p`, after any grammar mask: drop the logits below the
    /// likeliest plus `temperature * ln(min_p)` (the same tokens as vLLM's
    /// cut of the tempered probabilities below `min_p` times the largest).
    pub fn cut(&self, logits: &mut [f32]) {
        let p = &self.params;
        if p.min_p <= 0.0 || p.temperature <= 0.0 {
            return;
        }
        let max = ops::max(logits);
        if max.is_finite() {
            let cut = max + p.temperature * p.min_p.ln();
            for l in logits.iter_mut() {
                if *l < cut {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// Note that `token` was generated (what the penalties count).
    pub fn accepted(&mut self, token: u32) {
        let p = &self.params;
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            *self.counts.entry(token).or_insert(0) += 1;
        }
        if let Some(seen) = self.seen.as_mut() {
            seen.insert(token);
        }
    }

    /// Pick the next token from `logits`. Nothing sorts the vocabulary:
    /// the weights come from one vectorized `exp` pass; temperature alone
    /// draws from them in index order; top-k selects its k
    /// (`select_nth_unstable`) and sorts only those; top-p alone finds the
    /// nucleus through a histogram of log-weights (every token above the
    /// bin where the mass reaches `top_p` is in; only that bin's tokens
    /// are sorted, to cut it exactly).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.temperature <= 0.0 || p.top_k == 1 || logits.is_empty() {
            return argmax(logits);
        }
        let inv_t = 1.0 / p.temperature;
        let max = ops::max(logits);
        // A temperature so small that 1/t overflows is greedy.
        if !max.is_finite() || !inv_t.is_finite() || inv_t > 1e6 {
            return argmax(logits);
        }
        let n = logits.len();
        let top_k = match p.top_k {
            0 => n,
            k => k.min(n),
        };
        let (top_p, u) = (p.top_p, self.rng.next_f64());
        SCRATCH.with(|s| {
            let s = &mut *s.borrow_mut();
            s.weights(logits, max, inv_t);
            if top_k < n {
                s.top_k(top_k, top_p, u)
            } else if top_p < 1.0 {
                s.nucleus(logits, max, inv_t, top_p, u)
            } else {
                ops::block_sums(&s.w, &mut s.sums);
                let mut r = u * s.sums.iter().sum::<f64>();
                s.pick(&mut r).unwrap_or_else(|| s.last_weighted())
            }
        })
    }
}

impl Sampler {
    /// Some(k) when this sampler draws only from the k largest logits
    /// (k at most `max`; 1 for greedy), so that candidates serve it
    /// exactly ([`Sampler::sample_top`]); None when it needs them all.
    pub fn needs_top(&self, max: usize) -> Option<usize> {
        let p = &self.params;
        // Penalties, bias and min_p change the row before anything picks
        // (a scored sequence's candidates come with its row's normaliser:
        // `Need::Scored`).
        if p.adjusts_logits() {
            return None;
        }
        let inv_t = 1.0 / p.temperature;
        if p.temperature <= 0.0 || p.top_k == 1 || !inv_t.is_finite() || inv_t > 1e6 {
            return Some(1);
        }
        (p.top_k > 1 && p.top_k <= max).then_some(p.top_k)
    }

    /// Pick the next token from the largest logits as (token, logit),
    /// largest first: at least the k of [`Sampler::needs_top`]. The same
    /// token, and the same draws of the generator, as [`Sampler::sample`]
    /// on the whole row.
    pub fn sample_top(&mut self, cands: &[(u32, f32)]) -> u32 {
        let p = &self.params;
        let Some(&(best, max)) = cands.first() else {
            return 0;
        };
        let inv_t = 1.0 / p.temperature;
        if p.temperature <= 0.0
            || p.top_k == 1
            || !max.is_finite()
            || !inv_t.is_finite()
            || inv_t > 1e6
        {
            return best;
        }
        let k = match p.top_k {
            0 => cands.len(),
            k => k.min(cands.len()),
        };
        let (top_p, u) = (p.top_p, self.rng.next_f64());
        SCRATCH.with(|s| {
            let s = &mut *s.borrow_mut();
            s.pairs.clear();
            s.pairs.extend(cands[..k].iter().map(|(t, l)| (*l, *t)));
            // The weights through the same vectorized `exp` as a whole row.
            s.cand.clear();
            s.cand.extend(s.pairs.iter().map(|p| p.0));
            s.w.resize(k, 0.0);
            ops::scaled_exp(&s.cand, max, inv_t, &mut s.w);
            for (pair, w) in s.pairs.iter_mut().zip(&s.w) {
                pair.0 = *w;
            }
            s.pairs.sort_unstable_by(|a, b| b.0.total_cmp(&a.0));
            s.cut_and_draw(top_p, u)
        })
    }
}

use crate::simd::ops;

/// Log-weight bins per unit (e-fold) of the nucleus histogram.
const BINS_PER_UNIT: f32 = 32.0;
/// Bins in all: the last holds every weight below e^-64 of the largest.
const BINS: usize = 2048;

thread_local! {
    /// The sampling buffers of this thread (the engine thread samples every
    /// sequence of a step, one after another).
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Buffers reused across calls, so a sampled token allocates nothing.
#[derive(Default)]
struct Scratch {
    /// Weight of each token, `e^((logit - max) / t)`; 0 for masked ones.
    w: Vec<f32>,
    /// Histogram bin of each token (top-p).
    bin: Vec<u16>,
    /// Mass of each bin (top-p).
    mass: Vec<f64>,
    /// Candidates as (weight, token).
    pairs: Vec<(f32, u32)>,
    /// Sums of `w` by blocks of `ops::SUM_BLOCK`.
    sums: Vec<f64>,
    /// Candidates' logits (`Sampler::sample_top`).
    cand: Vec<f32>,
}

impl Scratch {
    fn weights(&mut self, logits: &[f32], max: f32, inv_t: f32) {
        self.w.resize(logits.len(), 0.0);
        ops::scaled_exp(logits, max, inv_t, &mut self.w);
    }

    /// Top-k (then top-p within it): select k, sort those, cut, draw.
    fn top_k(&mut self, k: usize, top_p: f32, u: f64) -> u32 {
        self.pairs.clear();
        let w = &self.w;
        self.pairs
            .extend(w.iter().enumerate().map(|(i, w)| (*w, i as u32)));
        let desc = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0);
        self.pairs.select_nth_unstable_by(k - 1, desc);
        self.pairs.truncate(k);
        self.pairs.sort_unstable_by(desc);
        self.cut_and_draw(top_p, u)
    }

    /// `pairs` (heaviest first): cut to `top_p` of their mass, then draw.
    fn cut_and_draw(&mut self, top_p: f32, u: f64) -> u32 {
        let mut total: f64 = self.pairs.iter().map(|e| e.0 as f64).sum();
        if top_p < 1.0 {
            let cut = cut_at(&self.pairs, top_p as f64 * total, 0.0);
            self.pairs.truncate(cut);
            total = self.pairs.iter().map(|e| e.0 as f64).sum();
        }
        draw(self.pairs.iter().copied(), u * total)
    }

    /// Top-p alone. Bins follow the log-weight, so every token of a bin
    /// weighs at least as much as every token of a later bin: the nucleus
    /// is all bins before the one where the mass reaches `top_p`, plus the
    /// heaviest of that bin's tokens until it does.
    fn nucleus(&mut self, logits: &[f32], max: f32, inv_t: f32, top_p: f32, u: f64) -> u32 {
        self.bin.resize(logits.len(), 0);
        self.mass.clear();
        // Four interleaved histograms, so that runs of tokens in one bin
        // (most of the tail) do not wait on each other's additions.
        self.mass.resize(4 * BINS, 0.0);
        // NaN and -inf land in the last bin, weighing 0.
        ops::log_bins(
            logits,
            max,
            inv_t * BINS_PER_UNIT,
            (BINS - 1) as u16,
            &mut self.bin,
        );
        for (i, (b, w)) in self.bin.iter().zip(&self.w).enumerate() {
            self.mass[(i & 3) * BINS + *b as usize] += *w as f64;
        }
        for b in 0..BINS {
            self.mass[b] += self.mass[BINS + b] + self.mass[2 * BINS + b] + self.mass[3 * BINS + b];
        }
        self.mass.truncate(BINS);
        // Summed in the order the walk below adds, so the walk reaches it.
        let total: f64 = self.mass.iter().sum();
        let want = top_p as f64 * total;
        let (mut before, mut edge) = (0.0f64, BINS - 1);
        for (b, m) in self.mass.iter().enumerate() {
            if before + m >= want {
                edge = b;
                break;
            }
            before += m;
        }
        self.pairs.clear();
        self.pairs.extend(
            self.bin
                .iter()
                .zip(&self.w)
                .enumerate()
                .filter(|(_, (b, _))| **b as usize == edge)
                .map(|(i, (_, w))| (*w, i as u32)),
        );
        self.pairs.sort_unstable_by(|a, b| b.0.total_cmp(&a.0));
        let cut = cut_at(&self.pairs, want, before);
        self.pairs.truncate(cut);
        let inside: f64 = before + self.pairs.iter().map(|e| e.0 as f64).sum::<f64>();
        // The bins before the edge, in index order, then the edge's kept
        // tokens (the rest weigh nothing from here on).
        ops::keep_below(&mut self.w, &self.bin, edge as u16);
        ops::block_sums(&self.w, &mut self.sums);
        let mut r = u * inside;
        if let Some(t) = self.pick(&mut r) {
            return t;
        }
        let mut last = None;
        walk(self.pairs.iter().copied(), &mut r, &mut last)
            .or(last)
            .unwrap_or_else(|| self.last_weighted())
    }

    /// The token where `r` runs out, walking `w` in index order: whole
    /// blocks by their sums (`sums`), then one block token by token. None
    /// when rounding leaves some of `r` (taken off by then).
    fn pick(&self, r: &mut f64) -> Option<u32> {
        for (b, s) in self.sums.iter().enumerate() {
            if *r - s > 0.0 {
                *r -= s;
                continue;
            }
            let start = b * ops::SUM_BLOCK;
            let end = (start + ops::SUM_BLOCK).min(self.w.len());
            for (i, w) in self.w[start..end].iter().enumerate() {
                if *w > 0.0 {
                    *r -= *w as f64;
                    if *r <= 0.0 {
                        return Some((start + i) as u32);
                    }
                }
            }
        }
        None
    }

    /// The last token of any weight (never a masked one): where rounding
    /// left some of the draw.
    fn last_weighted(&self) -> u32 {
        self.w.iter().rposition(|w| *w > 0.0).unwrap_or(0) as u32
    }
}

/// How many of `sorted` (heaviest first) to keep so that `before` plus
/// their mass reaches `want`: at least one.
fn cut_at(sorted: &[(f32, u32)], want: f64, before: f64) -> usize {
    let mut cum = before;
    for (i, e) in sorted.iter().enumerate() {
        cum += e.0 as f64;
        if cum >= want {
            return i + 1;
        }
    }
    sorted.len().max(1)
}

/// The candidate where `r` runs out, walking `(weight, token)` in order;
/// rounding that leaves some of `r` picks the last token of any weight
/// (never a masked one).
fn draw(cands: impl Iterator<Item = (f32, u32)>, mut r: f64) -> u32 {
    let mut last = None;
    walk(cands, &mut r, &mut last).or(last).unwrap_or(0)
}

/// Takes each candidate's weight off `r`; the token where it runs out, if
/// it does. `last` keeps the last token of any weight seen.
fn walk(
    cands: impl Iterator<Item = (f32, u32)>,
    r: &mut f64,
    last: &mut Option<u32>,
) -> Option<u32> {
    for (w, t) in cands {
        if w > 0.0 {
            *last = Some(t);
            *r -= w as f64;
            if *r <= 0.0 {
                return Some(t);
            }
        }
    }
    None
}

/// Finds stop sequences in streamed text. Each stop string's matcher (a
/// Knuth-Morris-Pratt table) is built once, with the request; every piece
/// of text is then scanned once, byte by byte, in time linear in its
/// length (times the number of stops, which the API layer bounds), never
/// rescanning what came before. The first stop string to complete ends
/// the text (as a streaming engine sees it).
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<Stop>,
    held: String,
    /// Bytes stepped through stop matchers in all, for the test that the
    /// work is linear in the text.
    #[cfg(test)]
    work: usize,
}

/// One stop string: its bytes, its failure table and how much of it the
/// text's end matches now.
#[derive(Debug, Clone)]
struct Stop {
    pat: Vec<u8>,
    fail: Vec<usize>,
    at: usize,
}

impl Stop {
    fn new(s: &str) -> Self {
        let pat = s.as_bytes().to_vec();
        let mut fail = vec![0; pat.len()];
        let mut k = 0;
        for i in 1..pat.len() {
            while k > 0 && pat[i] != pat[k] {
                k = fail[k - 1];
            }
            if pat[i] == pat[k] {
                k += 1;
            }
            fail[i] = k;
        }
        Stop { pat, fail, at: 0 }
    }

    /// Feed one byte; true when the whole string has just matched.
    fn step(&mut self, b: u8) -> bool {
        while self.at > 0 && self.pat[self.at] != b {
            self.at = self.fail[self.at - 1];
        }
        if self.pat[self.at] == b {
            self.at += 1;
        }
        if self.at == self.pat.len() {
            self.at = self.fail[self.at - 1];
            return true;
        }
        false
    }
}

/// What to do with a piece of text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopOutcome {
    /// Text that is safe to send.
    pub emit: String,
    /// A stop sequence was found: end the stream (the stop text is not sent).
    pub stopped: bool,
    /// Which (its index among the non-empty stop strings).
    pub which: Option<usize>,
}

impl StopMatcher {
    /// A matcher for these stop strings (empty strings ignored).
    pub fn new(stops: &[String]) -> Self {
        StopMatcher {
            stops: stops
                .iter()
                .filter(|s| !s.is_empty())
                .map(|s| Stop::new(s))
                .collect(),
            held: String::new(),
            #[cfg(test)]
            work: 0,
        }
    }

    /// Feed decoded text.
    pub fn push(&mut self, piece: &str) -> StopOutcome {
        if self.stops.is_empty() {
            return StopOutcome {
                emit: piece.to_string(),
                stopped: false,
                which: None,
            };
        }
        let start = self.held.len();
        self.held.push_str(piece);
        #[cfg(test)]
        {
            self.work += (self.held.len() - start) * self.stops.len();
        }
        for (i, &b) in self.held.as_bytes()[start..].iter().enumerate() {
            for (which, stop) in self.stops.iter_mut().enumerate() {
                if stop.step(b) {
                    let at = start + i + 1 - stop.pat.len();
                    let emit = self.held[..at].to_string();
                    self.held.clear();
                    self.stops.iter_mut().for_each(|s| s.at = 0);
                    return StopOutcome {
                        emit,
                        stopped: true,
                        which: Some(which),
                    };
                }
            }
        }
        // Hold back the longest end of the text that begins some stop
        // string (a stop string starts on a character boundary, so does
        // the cut).
        let keep = self.stops.iter().map(|s| s.at).max().unwrap_or(0);
        let mut cut = self.held.len() - keep;
        while !self.held.is_char_boundary(cut) {
            cut -= 1;
        }
        let emit = self.held[..cut].to_string();
        self.held.drain(..cut);
        StopOutcome {
            emit,
            stopped: false,
            which: None,
        }
    }

    /// End of generation: whatever is held is plain text.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_give_the_tokens_of_the_whole_row() {
        let mut rng = Rng(3);
        for (t, k, p) in [
            (0.0, 0, 1.0),
            (0.8, 1, 1.0),
            (0.8, 40, 1.0),
            (1.3, 7, 0.6),
            (0.5, 64, 0.9),
        ] {
            let params = SamplingParams {
                temperature: t,
                top_k: k,
                top_p: p,
                seed: Some(11),
                ..SamplingParams::default()
            };
            let (mut whole, mut top) = (Sampler::new(params.clone()), Sampler::new(params));
            let want = whole.needs_top(64).expect("served by candidates");
            for _ in 0..200 {
                let row: Vec<f32> = (0..3000)
                    .map(|_| (rng.next_f64() * 12.0 - 6.0) as f32)
                    .collect();
                let cands = ultrafast_kernels::reference::top_k(&row, want);
                assert_eq!(whole.sample(&row), top.sample_top(&cands));
            }
        }
        let needs = |t: f32, k: usize, p: f32| {
            Sampler::new(SamplingParams {
                temperature: t,
                top_k: k,
                top_p: p,
                seed: None,
                ..SamplingParams::default()
            })
            .needs_top(64)
        };
        assert_eq!(needs(0.7, 0, 0.9), None, "top-p alone needs the whole row");
        assert_eq!(needs(0.7, 0, 1.0), None);
        assert_eq!(needs(0.7, 65, 1.0), None);
        assert_eq!(needs(0.0, 0, 1.0), Some(1));
    }

    fn logits() -> Vec<f32> {
        (0..100).map(|i| ((i * 37 % 100) as f32) / 10.0).collect()
    }

    #[test]
    fn greedy_and_degenerate_settings_pick_the_argmax() {
        let l = logits();
        let best = argmax(&l);
        for p in [
            SamplingParams {
                temperature: 0.0,
                ..Default::default()
            },
            SamplingParams {
                top_k: 1,
                seed: Some(1),
                ..Default::default()
            },
            SamplingParams {
                top_p: 1e-6,
                seed: Some(1),
                ..Default::default()
            },
        ] {
            let mut s = Sampler::new(p);
            assert!((0..50).all(|_| s.sample(&l) == best));
        }
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_bounds_the_choice() {
        let l = logits();
        let p = SamplingParams {
            temperature: 1.5,
            top_k: 5,
            seed: Some(42),
            ..Default::default()
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p.clone());
            (0..200).map(|_| s.sample(&l)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p);
            (0..200).map(|_| s.sample(&l)).collect()
        };
        assert_eq!(a, b);
        let mut top5: Vec<u32> = (0..100u32).collect();
        top5.sort_by(|x, y| l[*y as usize].total_cmp(&l[*x as usize]));
        top5.truncate(5);
        assert!(a.iter().all(|t| top5.contains(t)));
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert!(
            distinct.len() >= 3,
            "temperature 1.5 should spread over the top 5"
        );
    }

    /// The softmax of `l / t`, by the definition.
    fn softmax(l: &[f32], t: f32) -> Vec<f64> {
        let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f64> = l.iter().map(|x| (((x - max) / t) as f64).exp()).collect();
        let sum: f64 = w.iter().sum();
        w.iter().map(|x| x / sum).collect()
    }

    #[test]
    fn sampling_follows_the_distribution_without_sorting_it() {
        // A vocabulary-sized row, with a clear head and a long tail.
        let l: Vec<f32> = (0..49_152u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) >> 7) % 1000) as f32 / 90.0)
            .collect();
        let probs = softmax(&l, 0.8);
        let mut order: Vec<usize> = (0..l.len()).collect();
        order.sort_by(|a, b| probs[*b].total_cmp(&probs[*a]));
        // Temperature alone: frequencies of the top tokens match.
        let mut s = Sampler::new(SamplingParams {
            temperature: 0.8,
            seed: Some(7),
            ..Default::default()
        });
        let n = 20_000;
        let mut hits = std::collections::HashMap::new();
        for _ in 0..n {
            *hits.entry(s.sample(&l) as usize).or_insert(0usize) += 1;
        }
        for &i in &order[..3] {
            let f = *hits.get(&i).unwrap_or(&0) as f64 / n as f64;
            assert!(
                (f - probs[i]).abs() < 0.01 + probs[i] * 0.15,
                "token {i}: {f} vs {}",
                probs[i]
            );
        }
        // Top-p: only the nucleus (the smallest head holding p of the mass;
        // tokens tied with its last one may stand in for it).
        let mut cum = 0.0;
        let last = order
            .iter()
            .find(|i| {
                cum += probs[**i];
                cum >= 0.95
            })
            .map_or(0.0, |i| probs[*i]);
        let nucleus: std::collections::HashSet<usize> = (0..l.len())
            .filter(|i| probs[*i] >= last * (1.0 - 1e-6))
            .collect();
        let mut s = Sampler::new(SamplingParams {
            temperature: 0.8,
            top_p: 0.95,
            seed: Some(9),
            ..Default::default()
        });
        for _ in 0..2_000 {
            let t = s.sample(&l) as usize;
            assert!(
                nucleus.contains(&t),
                "{t} outside the nucleus of {}",
                nucleus.len()
            );
        }
        // Masked logits are never drawn.
        let mut m = l.clone();
        for x in m.iter_mut().skip(10) {
            *x = f32::NEG_INFINITY;
        }
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: Some(3),
            ..Default::default()
        });
        assert!((0..500).all(|_| s.sample(&m) < 10));
    }

    #[test]
    fn top_p_cuts_inside_a_histogram_bin_exactly() {
        // The first four tokens share the first log-weight bin; with these
        // weights the nucleus of 0.45 is tokens 0 and 1 only.
        let mut l = vec![5.0f32, 4.999, 4.998, 4.997];
        l.extend(std::iter::repeat_n(-20.0f32, 1000));
        l.push(f32::NAN);
        let probs = softmax(&l[..l.len() - 1], 1.0);
        assert!(probs[0] + probs[1] >= 0.45 && probs[0] < 0.45);
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.45,
            seed: Some(11),
            ..Default::default()
        });
        let mut seen = [0usize; 2];
        for _ in 0..2_000 {
            let t = s.sample(&l) as usize;
            assert!(t < 2, "{t} is outside the nucleus {{0, 1}}");
            seen[t] += 1;
        }
        // Renormalized inside the nucleus: about half each.
        assert!(seen.iter().all(|n| (800..1200).contains(n)), "{seen:?}");
    }

    #[test]
    fn stop_sequences_across_token_boundaries_are_not_emitted() {
        let mut m = StopMatcher::new(&["o w".to_string()]);
        assert_eq!(
            m.push("Hel"),
            StopOutcome {
                emit: "Hel".into(),
                stopped: false,
                which: None
            }
        );
        assert_eq!(
            m.push("lo"),
            StopOutcome {
                emit: "l".into(),
                stopped: false,
                which: None
            },
            "holds back \"o\""
        );
        assert_eq!(
            m.push(" wo"),
            StopOutcome {
                emit: String::new(),
                stopped: true,
                which: Some(0)
            }
        );
        let mut m = StopMatcher::new(&["END".to_string()]);
        let mut out = String::new();
        for p in ["ab", "E", "N", "x", "y"] {
            let o = m.push(p);
            assert!(!o.stopped);
            out.push_str(&o.emit);
        }
        out.push_str(&m.finish());
        assert_eq!(out, "abENxy", "a false start is released");
    }

    #[test]
    fn stops_are_found_across_pieces_with_overlaps_and_multibyte_text() {
        let stops: Vec<String> = ["aab", "é!", "xyz"].map(String::from).to_vec();
        // Every way of cutting the text into pieces finds the same stop at
        // the same place.
        let text = "caaaxé aaab tail";
        for cut in 0..text.len() {
            if !text.is_char_boundary(cut) {
                continue;
            }
            let mut m = StopMatcher::new(&stops);
            let mut out = String::new();
            let mut which = None;
            for p in [&text[..cut], &text[cut..]] {
                let o = m.push(p);
                out.push_str(&o.emit);
                if o.stopped {
                    which = o.which;
                    break;
                }
            }
            assert_eq!((out.as_str(), which), ("caaaxé a", Some(0)), "cut at {cut}");
        }
        let mut m = StopMatcher::new(&stops);
        let o = m.push("ab é!");
        assert_eq!(
            (o.emit.as_str(), o.stopped, o.which),
            ("ab ", true, Some(1))
        );
    }

    #[test]
    fn a_long_stream_against_many_near_matching_stops_is_released_whole() {
        // 64 stops of 256 bytes that almost match everywhere (the old
        // matcher rescanned its held text for every stop on every token).
        let stops: Vec<String> = (0..64)
            .map(|i| format!("{}{i:03}", "a".repeat(253)))
            .collect();
        let mut m = StopMatcher::new(&stops);
        let mut sent = 0;
        for _ in 0..20_000 {
            sent += m.push("aaaa").emit.len();
        }
        assert_eq!(sent + m.finish().len(), 80_000);
        assert!(sent >= 80_000 - 256, "{sent}");
        // Each new byte stepped once per stop: nothing held is read again
        // (the old matcher searched its held text anew on every token).
        assert_eq!(m.work, 80_000 * 64);
    }

    #[test]
    fn adjustments_follow_their_order_and_semantics() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            logit_bias: vec![(0, 5.0), (99, 1.0)],
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            repetition_penalty: 2.0,
            ..SamplingParams::default()
        });
        assert_eq!(s.needs_top(64), None, "a biased row is sampled whole");
        s.accepted(1);
        s.accepted(1);
        s.accepted(2);
        let mut l = vec![1.0, 4.0, -2.0, 3.0];
        // Prompt token 3: repetition only; 1 and 2 also counted.
        s.adjust(&mut l, &[3, 1, 1, 2]);
        // 0: bias only (not seen): 1 + 5.
        assert_eq!(l[0], 6.0);
        // 1: seen twice: 4 / 2 - (0.5 * 2 + 0.25).
        assert_eq!(l[1], 2.0 - 1.25);
        // 2: negative, seen once: -2 * 2 - 0.75.
        assert_eq!(l[2], -4.0 - 0.75);
        // 3: in the prompt: 3 / 2.
        assert_eq!(l[3], 1.5);
    }

    #[test]
    fn min_p_cuts_below_its_share_of_the_likeliest_after_temperature() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 2.0,
            min_p: 0.5,
            ..SamplingParams::default()
        });
        // ln(0.5) * 2 = -1.386: logits below max - 1.386 go.
        let mut l = vec![0.0, -1.0, -1.5, -10.0];
        s.adjust(&mut l, &[]);
        s.cut(&mut l);
        assert_eq!(l[0], 0.0);
        assert_eq!(l[1], -1.0);
        assert_eq!(l[2], f32::NEG_INFINITY);
        assert_eq!(l[3], f32::NEG_INFINITY);
        // Nothing asked, nothing changed, and candidates still serve it.
        let mut plain = Sampler::new(SamplingParams::default());
        let mut l = vec![0.0, -1.0];
        plain.adjust(&mut l, &[0, 1]);
        assert_eq!(l, vec![0.0, -1.0]);
        assert_eq!(
            Sampler::new(SamplingParams {
                top_k: 5,
                ..SamplingParams::default()
            })
            .needs_top(64),
            Some(5)
        );
    }
}
