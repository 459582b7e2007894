//! CUDA graphs: a decode step's launches captured once per batch-size
//! bucket and replayed with one call, so a step costs one launch of the
//! CPU's time instead of a few hundred. A captured graph keeps the
//! pointers and scalars of its launches, so a replayed step writes its
//! inputs into the same buffers first ([`Gpu::copy_to`]).

// A graph handle is moved to the engine's thread: `unsafe impl Send`.
#![allow(unsafe_code)]

use crate::gpu::{Gpu, Result};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, CudaView, DeviceRepr};

/// A captured, instantiated graph.
pub struct Graph(CudaGraph);

// SAFETY: CUDA requires that calls on one graph be serialized, not that
// they come from the thread that made it. A `Graph` is owned by one runner
// and used through it, one call at a time; it is not `Sync`, so it is
// never shared between threads.
unsafe impl Send for Graph {}

impl Graph {
    /// Replays it on the GPU's stream.
    pub fn launch(&self) -> Result<()> {
        self.0.launch().map_err(|e| format!("graph launch: {e:?}"))
    }
}

impl Gpu {
    /// Captures what `body` launches on the GPU's stream (nothing runs
    /// then) into a graph. `body` must not allocate, copy or synchronize.
    pub fn capture<T>(&self, body: impl FnOnce() -> Result<T>) -> Result<(Graph, T)> {
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| format!("begin capture: {e:?}"))?;
        let out = body();
        // Ended whatever `body` returned: a stream left capturing refuses
        // everything after.
        let graph = self
            .stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(|e| format!("end capture: {e:?}"));
        // The body's own error first: an invalidated capture follows it.
        let out = out?;
        let graph = graph?;
        let graph = graph.ok_or("the capture recorded nothing")?;
        graph.upload().map_err(|e| format!("graph upload: {e:?}"))?;
        Ok((Graph(graph), out))
    }

    /// Copies `host` into the start of `dev` (queued on the stream).
    pub fn copy_to<T: DeviceRepr>(&self, host: &[T], dev: &mut CudaSlice<T>) -> Result<()> {
        if host.len() > dev.len() {
            return Err(format!("copy of {} into {}", host.len(), dev.len()));
        }
        let mut dst = dev.slice_mut(..host.len());
        self.stream
            .memcpy_htod(host, &mut dst)
            .map_err(|e| format!("copy: {e:?}"))
    }

    /// Copies part of a device buffer back into `host` (waits for it).
    pub fn download_into<T: DeviceRepr>(
        &self,
        dev: &CudaView<'_, T>,
        host: &mut [T],
    ) -> Result<()> {
        if host.len() != dev.len() {
            return Err(format!("download of {} into {}", dev.len(), host.len()));
        }
        self.stream
            .memcpy_dtoh(dev, host)
            .map_err(|e| format!("download: {e:?}"))?;
        // A copy into pageable memory has finished on return; waiting for
        // the stream keeps that true if `host` is ever pinned.
        self.stream
            .synchronize()
            .map_err(|e| format!("synchronize: {e:?}"))
    }
}
