//! The workload: a multi-tenant chat trace with shared system prompts,
//! Poisson arrivals with bursts. Deterministic from its seed, so every
//! policy of one run sees the same requests at the same times.

/// One request of the trace.
#[derive(Debug, Clone, PartialEq)]
pub struct Req {
    /// Arrival, seconds from the start.
    pub at: f64,
    /// Its tenant.
    pub tenant: usize,
    /// The tenant's system prompt (shared by all its requests).
    pub system: String,
    /// The user turn (its own).
    pub user: String,
    /// Output tokens it asks for (and gets).
    pub max_tokens: usize,
}

impl Req {
    /// Prompt tokens as the edge and the replicas estimate them (four
    /// bytes a token, roles and separators counted).
    pub fn prompt_tokens(&self) -> usize {
        (self.system.len() + self.user.len() + 32).div_ceil(4)
    }

    /// The prompt's bytes as the edge's prefix index renders a chat.
    pub fn rendered(&self) -> Vec<u8> {
        format!("system\0{}\0user\0{}\0", self.system, self.user).into_bytes()
    }
}

/// The trace's shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    /// Mean arrivals per second.
    pub rate: f64,
    /// Seconds of arrivals.
    pub seconds: f64,
    /// Tenants (each with its own system prompt).
    pub tenants: usize,
    /// System prompt tokens.
    pub system_tokens: usize,
    /// User turn tokens, at most (uniform from a quarter of it).
    pub user_tokens: usize,
    /// Output tokens, at most (uniform from a quarter of it).
    pub output_tokens: usize,
    /// Every `burst_every` seconds the rate triples for a second (0: no
    /// bursts); the mean stays `rate`.
    pub burst_every: f64,
    /// The seed.
    pub seed: u64,
}

impl Default for Shape {
    fn default() -> Self {
        Shape {
            rate: 10.0,
            seconds: 30.0,
            tenants: 8,
            system_tokens: 1_000,
            user_tokens: 200,
            output_tokens: 160,
            burst_every: 10.0,
            seed: 1,
        }
    }
}

impl Shape {
    /// Mean prompt and output tokens of a request.
    pub fn means(&self) -> (f64, f64) {
        let user = self.user_tokens as f64 * 0.625;
        let prompt = self.system_tokens as f64 + user + 8.0;
        (prompt, self.output_tokens as f64 * 0.625)
    }
}

/// A small deterministic generator (splitmix64).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeded.
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }

    /// The next 64 bits.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [lo, hi].
    pub fn between(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
}

/// Text of about `tokens` tokens (four bytes each), from `rng`.
fn words(rng: &mut Rng, tokens: usize) -> String {
    const W: [&str; 16] = [
        "the ", "data", "sets", "with", "keys", "many", "more", "than", "what", "runs", "fast",
        "each", "when", "load", "goes", "over",
    ];
    let mut s = String::with_capacity(tokens * 4);
    for _ in 0..tokens {
        s.push_str(W[(rng.next() % 16) as usize]);
    }
    s
}

/// The trace of `shape`.
pub fn generate(shape: &Shape) -> Vec<Req> {
    let mut rng = Rng::new(shape.seed);
    let systems: Vec<String> = (0..shape.tenants.max(1))
        .map(|t| format!("tenant {t}: {}", words(&mut rng, shape.system_tokens)))
        .collect();
    let mut out = Vec::new();
    let mut t = 0.0;
    // Bursts triple the rate for one second in every `burst_every`; the
    // rest runs slower so that the mean stays `rate`.
    let (hi, lo) = if shape.burst_every > 1.0 {
        let calm = (shape.burst_every - 3.0) / (shape.burst_every - 1.0);
        (3.0 * shape.rate, shape.rate * calm.max(0.1))
    } else {
        (shape.rate, shape.rate)
    };
    while t < shape.seconds {
        let bursting = shape.burst_every > 1.0 && t % shape.burst_every < 1.0;
        let rate = if bursting { hi } else { lo };
        t += -(1.0 - rng.unit()).ln() / rate.max(1e-6);
        if t >= shape.seconds {
            break;
        }
        let tenant = (rng.next() % systems.len() as u64) as usize;
        let n = rng.between(shape.user_tokens / 4, shape.user_tokens);
        let user = words(&mut rng, n);
        out.push(Req {
            at: t,
            tenant,
            system: systems[tenant].clone(),
            user,
            max_tokens: rng.between(shape.output_tokens / 4, shape.output_tokens),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trace_is_deterministic_and_near_its_rate() {
        let s = Shape {
            rate: 20.0,
            seconds: 100.0,
            ..Shape::default()
        };
        let a = generate(&s);
        assert_eq!(a, generate(&s));
        let rate = a.len() as f64 / s.seconds;
        assert!((rate - 20.0).abs() < 2.5, "{rate}");
        assert!(a.windows(2).all(|w| w[0].at <= w[1].at));
        let mean_prompt = a.iter().map(Req::prompt_tokens).sum::<usize>() as f64 / a.len() as f64;
        assert!((mean_prompt - s.means().0).abs() < 60.0, "{mean_prompt}");
    }
}
