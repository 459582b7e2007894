//! CUDA graphs: a decode step's launches captured once per batch-size
//! bucket and replayed with one call, so a step costs one launch of the
//! CPU's time instead of a few hundred. A captured graph keeps the
//! pointers and scalars of its launches, so a replayed step writes its
//! inputs into the same buffers first ([`Gpu::upload_pinned`], through
//! page-locked memory, which the host does not wait for).

// A graph handle is moved to the engine's thread: `unsafe impl Send`.
#![allow(unsafe_code)]

use crate::gpu::{Gpu, Result};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaEvent, CudaGraph, CudaSlice, CudaView, DeviceRepr, PinnedHostSlice};

/// A captured, instantiated graph.
pub struct Graph(CudaGraph);

/// Page-locked host memory the size of one device buffer: a step's input
/// is written here and copied asynchronously (a copy from pageable memory
/// is staged by the driver and holds the host until it is done). Its own
/// event marks the end of its last copy: cudarc records the slice's event
/// only with event tracking on, which `Gpu::open` turns off, so without it
/// a write could overtake a copy still queued (a step that brings nothing
/// back never waits for the stream).
pub struct Pinned<T> {
    host: PinnedHostSlice<T>,
    copied: CudaEvent,
}

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

    /// Page-locked memory of `n` values, zeroed, for uploads into a device
    /// buffer of `n` values.
    pub fn pinned<T: DeviceRepr + Copy + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<Pinned<T>> {
        // SAFETY: the memory is uninitialised until the write below, which
        // zeroes all of it before any read (`ValidAsZeroBits`).
        let mut p = unsafe { self.ctx.alloc_pinned::<T>(n.max(1)) }
            .map_err(|e| format!("pinned alloc: {e:?}"))?;
        let ptr = p.as_mut_ptr().map_err(|e| format!("pinned alloc: {e:?}"))?;
        // SAFETY: `ptr` points at `p.len()` values of this allocation.
        unsafe { std::ptr::write_bytes(ptr, 0, p.len()) };
        // Blocking sync: a wait for it sleeps instead of spinning.
        let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC;
        let copied = self
            .ctx
            .new_event(Some(flags))
            .map_err(|e| format!("pinned event: {e:?}"))?;
        Ok(Pinned { host: p, copied })
    }

    /// `host` into the start of `dev` through `pin` (as long as `dev`):
    /// written into the page-locked buffer, then copied on the stream
    /// without the host waiting. Writing waits first for the buffer's
    /// previous copy (its event), normally long finished by the next step.
    pub fn upload_pinned<T: DeviceRepr + Copy + cudarc::driver::ValidAsZeroBits>(
        &self,
        host: &[T],
        pin: &mut Pinned<T>,
        dev: &mut CudaSlice<T>,
    ) -> Result<()> {
        if host.len() > pin.host.len() || pin.host.len() > dev.len() {
            return Err(format!(
                "pinned copy of {} through {} into {}",
                host.len(),
                pin.host.len(),
                dev.len()
            ));
        }
        pin.copied
            .synchronize()
            .map_err(|e| format!("pinned wait: {e:?}"))?;
        pin.host
            .as_mut_slice()
            .map_err(|e| format!("pinned write: {e:?}"))?[..host.len()]
            .copy_from_slice(host);
        self.stream
            .memcpy_htod(&pin.host, dev)
            .map_err(|e| format!("copy: {e:?}"))?;
        pin.copied
            .record(&self.stream)
            .map_err(|e| format!("pinned event: {e:?}"))
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
