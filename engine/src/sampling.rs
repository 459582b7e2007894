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

    /// Pick the next token from `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.temperature <= 0.0 || p.top_k == 1 || logits.is_empty() {
            return argmax(logits);
        }
        let t = p.temperature;
        self.scratch.clear();
        self.scratch
            .extend(logits.iter().enumerate().map(|(i, l)| (*l / t, i as u32)));
        let keep = if p.top_k > 0 {
            p.top_k.min(self.scratch.len())
        } else {
            self.scratch.len()
        };
        if keep < self.scratch.len() {
            self.scratch
                .select_nth_unstable_by(keep - 1, |a, b| b.0.total_cmp(&a.0));
            self.scratch.truncate(keep);
        }
        self.scratch.sort_unstable_by(|a, b| b.0.total_cmp(&a.0));
        let max = self.scratch[0].0;
        let mut total = 0.0f64;
        for e in self.scratch.iter_mut() {
            e.0 = ((e.0 - max) as f64).exp() as f32;
            total += e.0 as f64;
        }
        if p.top_p < 1.0 {
            let mut cum = 0.0f64;
            let mut cut = self.scratch.len();
            for (i, e) in self.scratch.iter().enumerate() {
                cum += e.0 as f64 / total;
                if cum >= p.top_p as f64 {
                    cut = i + 1;
                    break;
                }
            }
            self.scratch.truncate(cut.max(1));
            total = self.scratch.iter().map(|e| e.0 as f64).sum();
        }
        let mut r = self.rng.next_f64() * total;
        for e in &self.scratch {
            r -= e.0 as f64;
            if r <= 0.0 {
                return e.1;
            }
        }
        self.scratch[self.scratch.len() - 1].1
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
