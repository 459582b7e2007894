//! The device seam: what runs one scheduler step of the model.
//!
//! The scheduler owns a `Box<dyn ModelRunner>` and hands it every step's
//! sequences (their tokens, start positions and KV block tables from
//! `kv::BlockPool`); the runner owns the KV storage those block ids index
//! and returns each sequence's last-token logits for sampling. Nothing
//! above this module knows which runner it has.
//!
//! - [`cpu::CpuRunner`]: the engine's own kernels on a thread team (Q4_1
//!   and Q8_0 weights), the default.
//! - [`CandleRunner`]: the candle-core forward pass (any GGUF type candle
//!   reads); used where the CPU kernels do not cover a model's tensor
//!   types, or when `ULTRAFAST_CPU_RUNNER=candle` asks for it.

pub mod cpu;

use crate::error::{EngineError, Result};
use crate::generate::Loaded;
use crate::model::paged::{PagedKv, SeqStep};
use std::sync::Arc;

/// Precision of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvDtype {
    /// Half the memory and attention's bandwidth (the default).
    #[default]
    F16,
    /// Exact (the candle runner always uses f32).
    F32,
}

impl KvDtype {
    /// `"f16"` or `"f32"`.
    pub fn parse(s: &str) -> Option<KvDtype> {
        match s {
            "f16" => Some(KvDtype::F16),
            "f32" => Some(KvDtype::F32),
            _ => None,
        }
    }
}

/// Runs scheduler steps on one device.
pub trait ModelRunner: Send {
    /// Which device and kernels, for logs and metrics (`cpu/avx2`, ...).
    fn describe(&self) -> String;

    /// Run one step: `logits` becomes each sequence's last-position logits
    /// (vocabulary wide, one after another; the buffer is reused from step
    /// to step, since a fresh 200 KB per sequence costs page faults).
    /// `Ok(false)` when `stop(layer)` said to give up before a layer
    /// (nothing is lost: the same tokens run again store the same keys
    /// and values before anything reads them).
    fn step(
        &mut self,
        seqs: &[SeqStep],
        stop: &(dyn Fn(usize) -> bool + Sync),
        logits: &mut Vec<f32>,
    ) -> Result<bool>;

    /// Bytes of KV cache the runner holds.
    fn kv_bytes(&self) -> usize;
}

impl ModelRunner for cpu::CpuRunner {
    fn describe(&self) -> String {
        format!(
            "cpu/{}{} x{} kv {:?}",
            self.isa().name(),
            if self.amx() { "+amx" } else { "" },
            self.threads(),
            self.kv_dtype()
        )
    }

    fn step(
        &mut self,
        seqs: &[SeqStep],
        stop: &(dyn Fn(usize) -> bool + Sync),
        logits: &mut Vec<f32>,
    ) -> Result<bool> {
        cpu::CpuRunner::step(self, seqs, stop, logits)
    }

    fn kv_bytes(&self) -> usize {
        cpu::CpuRunner::kv_bytes(self)
    }
}

/// The candle-core forward pass over a paged cache, on a rayon pool.
pub struct CandleRunner {
    loaded: Arc<Loaded>,
    kv: PagedKv,
    pool: rayon::ThreadPool,
}

impl CandleRunner {
    /// A runner with `num_blocks` blocks of `block_size` slots.
    pub fn new(
        loaded: Arc<Loaded>,
        num_blocks: usize,
        block_size: usize,
        pool: rayon::ThreadPool,
    ) -> Self {
        let kv = PagedKv::new(&loaded.model, num_blocks, block_size);
        CandleRunner { loaded, kv, pool }
    }
}

impl ModelRunner for CandleRunner {
    fn describe(&self) -> String {
        format!("cpu/candle x{}", self.pool.current_num_threads())
    }

    fn step(
        &mut self,
        seqs: &[SeqStep],
        stop: &(dyn Fn(usize) -> bool + Sync),
        logits: &mut Vec<f32>,
    ) -> Result<bool> {
        let (model, kv) = (&self.loaded.model, &mut self.kv);
        let rows = self
            .pool
            .install(|| model.forward_paged_until(kv, seqs, &|l| stop(l)))?;
        logits.clear();
        let Some(rows) = rows else { return Ok(false) };
        for r in rows {
            logits.extend_from_slice(&r);
        }
        Ok(true)
    }

    fn kv_bytes(&self) -> usize {
        self.kv.bytes()
    }
}

/// Threads for the engine's compute: `ULTRAFAST_ENGINE_THREADS`, else
/// `RAYON_NUM_THREADS`, else the CPUs this process may use.
pub fn compute_threads() -> usize {
    ["ULTRAFAST_ENGINE_THREADS", "RAYON_NUM_THREADS"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.parse::<usize>().ok())
        .filter(|n| *n > 0)
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        })
}

/// The CPU runner for `loaded`: the engine's kernels where they cover the
/// model, candle otherwise (the reason is logged). `init` runs on each
/// compute thread first.
pub fn cpu_runner(
    loaded: &Arc<Loaded>,
    num_blocks: usize,
    block_size: usize,
    kv_dtype: KvDtype,
    init: fn(),
) -> Result<Box<dyn ModelRunner>> {
    let threads = compute_threads();
    let forced = std::env::var("ULTRAFAST_CPU_RUNNER").ok();
    let runner: Box<dyn ModelRunner> = match (&loaded.fast, forced.as_deref()) {
        (Ok(w), f) if f != Some("candle") => Box::new(cpu::CpuRunner::new(
            w.clone(),
            num_blocks,
            block_size,
            kv_dtype,
            threads,
            init,
        )?),
        (fast, _) => {
            if let Err(why) = fast {
                log::info!("engine: candle forward pass ({why})");
            }
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("engine-compute-{i}"))
                .start_handler(move |_| init())
                .build()
                .map_err(|e| {
                    EngineError::Invalid(format!("cannot start the engine's threads: {e}"))
                })?;
            Box::new(CandleRunner::new(
                loaded.clone(),
                num_blocks,
                block_size,
                pool,
            ))
        }
    };
    log::info!("engine: runner {}", runner.describe());
    Ok(runner)
}
