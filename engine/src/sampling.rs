//! Sampling: greedy, temperature, top-k, top-p with a seeded generator (same
//! seed, same tokens), and stop sequences matched on text across token
//! boundaries (never emitted, and text that may still become a stop
//! sequence is held back until it cannot).

/// How to pick tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p (1.0 = off).
    pub top_p: f32,
    /// Seed of the generator (None: a fresh one per request).
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
        }
    }
}

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
    scratch: Vec<(f32, u32)>,
}

/// Index of the largest logit (the first on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
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
            scratch: Vec::new(),
        }
    }

    /// Pick the next token from `logits`. Nothing sorts the vocabulary:
    /// temperature alone draws from the weights in index order (one pass);
    /// top-k selects its k (`select_nth_unstable`) and sorts only those;
    /// top-p selects a growing head (64, then 8 times more) until it holds
    /// `top_p` of the mass, and sorts only that head.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.temperature <= 0.0 || p.top_k == 1 || logits.is_empty() {
            return argmax(logits);
        }
        let inv_t = 1.0 / p.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // A temperature so small that 1/t overflows is greedy.
        if !max.is_finite() || !inv_t.is_finite() || inv_t > 1e6 {
            return argmax(logits);
        }
        let n = logits.len();
        let weight = |l: f32| ((l - max) * inv_t).exp();
        let top_k = match p.top_k {
            0 => n,
            k => k.min(n),
        };
        if top_k == n && p.top_p >= 1.0 {
            let total: f64 = logits.iter().map(|l| weight(*l) as f64).sum();
            let mut r = self.rng.next_f64() * total;
            let mut last = 0;
            for (i, l) in logits.iter().enumerate() {
                let w = weight(*l) as f64;
                if w > 0.0 {
                    last = i;
                }
                r -= w;
                if r <= 0.0 && w > 0.0 {
                    return i as u32;
                }
            }
            return last as u32;
        }
        self.scratch.clear();
        self.scratch.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, l)| (weight(*l), i as u32)),
        );
        let desc = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0);
        // The mass top-p is measured against: all of it, or the top k's.
        let mut total: f64;
        if top_k < n {
            self.scratch.select_nth_unstable_by(top_k - 1, desc);
            self.scratch.truncate(top_k);
            self.scratch.sort_unstable_by(desc);
            total = self.scratch.iter().map(|e| e.0 as f64).sum();
        } else {
            total = self.scratch.iter().map(|e| e.0 as f64).sum();
            let mut head = 64.min(n);
            loop {
                if head < n {
                    self.scratch.select_nth_unstable_by(head - 1, desc);
                }
                self.scratch[..head].sort_unstable_by(desc);
                let mass: f64 = self.scratch[..head].iter().map(|e| e.0 as f64).sum();
                if head == n || mass >= p.top_p as f64 * total {
                    self.scratch.truncate(head);
                    break;
                }
                head = (head * 8).min(n);
            }
        }
        if p.top_p < 1.0 {
            let want = p.top_p as f64 * total;
            let mut cum = 0.0f64;
            let mut cut = self.scratch.len();
            for (i, e) in self.scratch.iter().enumerate() {
                cum += e.0 as f64;
                if cum >= want {
                    cut = i + 1;
                    break;
                }
            }
            self.scratch.truncate(cut.max(1));
            total = self.scratch.iter().map(|e| e.0 as f64).sum();
        }
        let mut r = self.rng.next_f64() * total;
        let mut last = self.scratch[0].1;
        for e in &self.scratch {
            if e.0 > 0.0 {
                last = e.1;
            }
            r -= e.0 as f64;
            if r <= 0.0 && e.0 > 0.0 {
                return e.1;
            }
        }
        // Rounding left some of `r`: the last token of any weight (never
        // a masked one).
        last
    }
}

/// Finds stop sequences in streamed text.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
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
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
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
        self.held.push_str(piece);
        if let Some((at, which)) = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((self.held.find(s.as_str())?, i)))
            .min()
        {
            let emit = self.held[..at].to_string();
            self.held.clear();
            return StopOutcome {
                emit,
                stopped: true,
                which: Some(which),
            };
        }
        // Hold back the longest suffix that is a prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for k in (1..s.len().min(self.held.len() + 1)).rev() {
                if s.is_char_boundary(k) && self.held.ends_with(&s[..k]) {
                    keep = keep.max(k);
                    break;
                }
            }
        }
        let cut = self.held.len() - keep;
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
}
