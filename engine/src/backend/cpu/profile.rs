//! Wall time per phase of the CPU runner's steps, for measuring where a
//! step goes (`ULTRAFAST_PHASE_TIMES=1`; off, it costs one relaxed load
//! per phase). Thread 0 reads the clock after each phase's barrier, so a
//! phase's time includes waiting for the slowest thread.

use super::team::Ctx;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// Embedding rows.
pub const EMBED: usize = 0;
/// RMSNorm and quantization (both norms of every layer).
pub const NORM: usize = 1;
/// The Q|K|V product.
pub const QKV: usize = 2;
/// Biases, RoPE, the K/V write.
pub const ROPE_KV: usize = 3;
/// Attention.
pub const ATTENTION: usize = 4;
/// Quantization of the attention output.
pub const QUANT: usize = 5;
/// The output projection.
pub const WO: usize = 6;
/// The gate|up product.
pub const GATE_UP: usize = 7;
/// SiLU-and-multiply with quantization.
pub const SILU: usize = 8;
/// The down projection.
pub const DOWN: usize = 9;
/// The final norm.
pub const HEAD_NORM: usize = 10;
/// The output head.
pub const HEAD: usize = 11;
/// Phase names, by index.
pub const NAMES: [&str; 12] = [
    "embed",
    "norm+quant",
    "qkv",
    "rope+kv write",
    "attention",
    "quant attn",
    "wo",
    "gate|up",
    "silu*up+quant",
    "down",
    "final norm",
    "head",
];

static ON: AtomicBool = AtomicBool::new(false);
static NS: [AtomicU64; 12] = [const { AtomicU64::new(0) }; 12];

/// Turn the timer on or off.
pub fn enable(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// Nanoseconds per phase since the last call (and reset them).
pub fn take() -> [u64; 12] {
    let mut out = [0; 12];
    for (o, n) in out.iter_mut().zip(&NS) {
        *o = n.swap(0, Ordering::Relaxed);
    }
    out
}

/// Thread 0's clock through one step.
pub struct Clock(Option<Instant>);

impl Clock {
    /// Start timing (thread 0, timer on) or not.
    pub fn start(ctx: &Ctx) -> Clock {
        Clock((ctx.tid == 0 && ON.load(Ordering::Relaxed)).then(Instant::now))
    }

    /// Charge the time since the last tick to `phase`.
    pub fn tick(&mut self, _ctx: &Ctx, phase: usize) {
        if let Some(t) = self.0.as_mut() {
            let now = Instant::now();
            NS[phase].fetch_add((now - *t).as_nanos() as u64, Ordering::Relaxed);
            *t = now;
        }
    }
}
