//! ultrafast-kernels: everything of the engine that talks to CUDA, and
//! all of its `unsafe`, behind safe functions.
//!
//! - [`cuda::probe`]: whether a CUDA driver and a GPU are present, found
//!   by loading the driver library at run time (so the binary needs no
//!   CUDA toolkit to build and runs where there is none);
//! - [`sources`]: the kernels' CUDA C, header-free;
//! - [`nvrtc`]: compiling them at run time for the GPU at hand, cached on
//!   disk;
//! - [`reference`]: what each kernel computes, in plain Rust, which the
//!   tests hold both the GPU and the engine's CPU code to;
//! - [`gpu`]: the kernels on a GPU through cudarc, behind launchers that
//!   check shapes; [`prefill`]: prompt GEMMs through cuBLAS on
//!   bfloat16 weights; [`graph`]: CUDA graphs of whole decode steps.

pub mod cuda;
pub mod gpu;
pub mod graph;
pub mod nvrtc;
pub mod prefill;
pub mod reference;
pub mod sources;
