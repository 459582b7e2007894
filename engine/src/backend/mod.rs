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

pub mod blocks;
pub mod cpu;
pub mod cuda;
pub mod layout;
pub mod loaded;
pub mod logits;
pub mod probe;
pub mod reference;

use crate::error::{EngineError, Result};
use crate::model::paged::{PagedKv, SeqStep};
use loaded::Loaded;
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

/// Where a model runs: `[models.X] device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// A CUDA GPU when the driver and a device are there and the build can
    /// run the model on it, else the CPU (the choice and its reason are
    /// logged).
    #[default]
    Auto,
    /// The CPU.
    Cpu,
    /// CUDA GPU `N` (`cuda` is GPU 0); no usable GPU is an error.
    Cuda(usize),
}

impl Device {
    /// `auto`, `cpu`, `cuda` or `cuda:N`.
    pub fn parse(s: &str) -> Option<Device> {
        match s {
            "auto" => Some(Device::Auto),
            "cpu" => Some(Device::Cpu),
            "cuda" => Some(Device::Cuda(0)),
            _ => s.strip_prefix("cuda:")?.parse().ok().map(Device::Cuda),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Auto => f.write_str("auto"),
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// The device a model gets for `want`, or why it cannot have it: `auto`
/// takes the first GPU where a driver and a GPU are found (the runner may
/// still fall back, [`runner_for`]), else the CPU, and logs why.
pub fn choose_device(want: Device) -> Result<Device> {
    choose_with(want, ultrafast_kernels::cuda::probe)
}

fn choose_with(
    want: Device,
    probe: impl FnOnce() -> std::result::Result<Vec<ultrafast_kernels::cuda::Gpu>, String>,
) -> Result<Device> {
    match want {
        Device::Cpu => Ok(Device::Cpu),
        Device::Auto => match probe() {
            Ok(gpus) if !gpus.is_empty() => {
                log::info!("engine: device auto found {}", describe_gpus(&gpus));
                Ok(Device::Cuda(gpus[0].index))
            }
            Ok(_) => {
                log::info!("engine: device auto chose cpu: the driver lists no GPU");
                Ok(Device::Cpu)
            }
            Err(why) => {
                log::info!("engine: device auto chose cpu: {why}");
                Ok(Device::Cpu)
            }
        },
        Device::Cuda(n) => {
            let gpus = probe().map_err(|why| {
                EngineError::Invalid(format!("device \"{want}\": no usable GPU: {why}"))
            })?;
            if gpus.get(n).is_none() {
                return Err(EngineError::Invalid(format!(
                    "device \"{want}\": no GPU {n} (found {})",
                    describe_gpus(&gpus)
                )));
            }
            Ok(Device::Cuda(n))
        }
    }
}

/// The runner for `device` (what [`choose_device`] returned): the CUDA
/// runner on `Cuda(n)` once it agrees with the CPU on a probe prompt
/// ([`probe`]), else [`cpu_runner`]. Where the CUDA runner cannot start or
/// disagrees, `fallback` (`device = "auto"`) runs the model on the CPU and
/// logs why; without it (`cuda`), that is the model's start-up error,
/// naming what failed (NVRTC, the GPU, the model's formats, the check).
pub fn runner_for(
    device: Device,
    loaded: &Arc<Loaded>,
    num_blocks: usize,
    block_size: usize,
    kv_dtype: KvDtype,
    init: fn(),
    fallback: bool,
) -> Result<Box<dyn ModelRunner>> {
    let Device::Cuda(n) = device else {
        return cpu_runner(loaded, num_blocks, block_size, kv_dtype, init);
    };
    let started = blocks::FileWeights::read(&loaded.path).and_then(|w| {
        let opts = cuda::CudaOptions::from_env();
        let mut r = cuda::CudaRunner::new(w, n, num_blocks, block_size, opts)?;
        let verdict = probe::agrees_with_cpu(&mut r, loaded, block_size, kv_dtype, init);
        let note = verdict.map_err(EngineError::Invalid)?;
        Ok((r, note))
    });
    match started {
        Ok((r, note)) => {
            log::info!("engine: runner {} {note}", r.describe());
            Ok(Box::new(r))
        }
        Err(e) if fallback => {
            log::warn!("engine: device auto chose cpu: the CUDA runner on cuda:{n}: {e}");
            cpu_runner(loaded, num_blocks, block_size, kv_dtype, init)
        }
        Err(e) => Err(EngineError::Invalid(format!("device \"{device}\": {e}"))),
    }
}

fn describe_gpus(gpus: &[ultrafast_kernels::cuda::Gpu]) -> String {
    gpus.iter()
        .map(|g| {
            format!(
                "cuda:{} {} (sm_{}{})",
                g.index, g.name, g.capability.0, g.capability.1
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Runs scheduler steps on one device.
pub trait ModelRunner: Send {
    /// Which device and kernels, for logs and metrics (`cpu/avx2`, ...).
    fn describe(&self) -> String;

    /// The device it runs on (`cpu`, `cuda:0`), for `/readyz`,
    /// `/v1/models` and metric labels.
    fn device(&self) -> Device {
        Device::Cpu
    }

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

    /// Run one step for sampling: `out` gets what each sequence's
    /// sampler `needs` (see [`logits`]). The default keeps every row
    /// whole, as a runner on the CPU has them anyway; a device runner
    /// copies back only what is needed.
    fn step_for(
        &mut self,
        seqs: &[SeqStep],
        needs: &[logits::Need],
        stop: &(dyn Fn(usize) -> bool + Sync),
        out: &mut logits::StepLogits,
    ) -> Result<bool> {
        if needs.contains(&logits::Need::Every) {
            return Err(EngineError::Invalid(format!(
                "runner {} does not compute every position's logits (prompt scoring)",
                self.describe()
            )));
        }
        if !self.step(seqs, stop, &mut out.full)? {
            return Ok(false);
        }
        let vocab = out.full.len() / seqs.len().max(1);
        out.all_full(seqs.len(), vocab);
        Ok(true)
    }

    /// Bytes of KV cache the runner holds.
    fn kv_bytes(&self) -> usize;

    /// Whether `step_for` serves [`logits::Need::Every`] (every position's
    /// logits, for scoring a prompt).
    fn every_row(&self) -> bool {
        false
    }
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

    fn step_for(
        &mut self,
        seqs: &[SeqStep],
        needs: &[logits::Need],
        stop: &(dyn Fn(usize) -> bool + Sync),
        out: &mut logits::StepLogits,
    ) -> Result<bool> {
        let every: Vec<bool> = needs.iter().map(|n| *n == logits::Need::Every).collect();
        if !self.step_rows(seqs, &every, stop, &mut out.full)? {
            return Ok(false);
        }
        let counts = seqs
            .iter()
            .zip(&every)
            .map(|(s, e)| if *e { s.tokens.len() } else { 1 });
        out.all_full_counted(counts, self.vocab());
        Ok(true)
    }

    fn every_row(&self) -> bool {
        true
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

#[cfg(test)]
mod tests {
    use super::*;
    use ultrafast_kernels::cuda::Gpu;

    fn h200() -> std::result::Result<Vec<Gpu>, String> {
        Ok(vec![Gpu {
            index: 0,
            name: "NVIDIA H200".into(),
            capability: (9, 0),
        }])
    }

    #[test]
    fn devices_parse_and_print() {
        for (s, d) in [
            ("auto", Device::Auto),
            ("cpu", Device::Cpu),
            ("cuda", Device::Cuda(0)),
            ("cuda:3", Device::Cuda(3)),
        ] {
            assert_eq!(Device::parse(s), Some(d));
        }
        for bad in ["", "gpu", "cuda:", "cuda:x", "cuda:-1", "CPU"] {
            assert_eq!(Device::parse(bad), None, "{bad}");
        }
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
    }

    #[test]
    fn auto_and_cuda_take_a_gpu_where_one_is_found_or_say_why_not() {
        let none = || Err("no CUDA driver (libcuda.so.1 not found)".to_string());
        assert_eq!(choose_with(Device::Auto, none).ok(), Some(Device::Cpu));
        assert_eq!(choose_with(Device::Auto, h200).ok(), Some(Device::Cuda(0)));
        assert_eq!(
            choose_with(Device::Auto, || Ok(vec![])).ok(),
            Some(Device::Cpu)
        );
        assert_eq!(choose_with(Device::Cpu, h200).ok(), Some(Device::Cpu));
        let e = choose_with(Device::Cuda(0), none).unwrap_err().to_string();
        assert!(
            e.contains("device \"cuda:0\": no usable GPU: no CUDA driver"),
            "{e}"
        );
        let e = choose_with(Device::Cuda(2), h200).unwrap_err().to_string();
        assert!(
            e.contains("no GPU 2 (found cuda:0 NVIDIA H200 (sm_90))"),
            "{e}"
        );
        assert_eq!(
            choose_with(Device::Cuda(0), h200).ok(),
            Some(Device::Cuda(0))
        );
        // The real probe: whatever this machine has, `auto` never fails.
        assert!(choose_device(Device::Auto).is_ok());
    }
}
