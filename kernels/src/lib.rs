//! ultrafast-kernels: everything of the engine that talks to CUDA, and
//! all of its `unsafe`, behind safe functions.
//!
//! Today that is [`cuda::probe`]: whether a CUDA driver and a GPU are
//! present, found by loading the driver library at run time (so the
//! binary needs no CUDA toolkit to build and runs where there is none).

pub mod cuda;
