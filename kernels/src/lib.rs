//! ultrafast-kernels: CUDA kernel sources behind a typed registry.
