//! Prompts on tensor cores: each weight matrix dequantized once, at load,
//! into bfloat16 ([`Gpu::dequant_bf16`]), a prompt's activations rounded to
//! bfloat16 ([`Gpu::to_bf16`]), and cuBLAS `gemm_ex` with f32 accumulation
//! and output ([`Gpu::gemm_bf16`]). Decode stays on the GEMV over the
//! file's blocks, which reads 3-4x fewer bytes per weight.

// cuBLAS calls and kernel launches are `unsafe`; each block says why it
// holds.
#![allow(unsafe_code)]

use crate::gpu::{Gpu, Result};
use crate::reference::Format;
use cudarc::cublas::sys as blas;
use cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};

impl Gpu {
    /// Whether prompt GEMMs can run here (cuBLAS loaded).
    pub fn has_gemm(&self) -> bool {
        self.blas.is_some()
    }

    /// `dequant_*` ([`crate::reference::dequant_bf16`]): a new row-major
    /// bfloat16 copy of the GGUF blocks `w`.
    pub fn dequant_bf16(
        &self,
        format: Format,
        w: &CudaSlice<u8>,
        rows: usize,
        cols: usize,
    ) -> Result<CudaSlice<u16>> {
        let blocks = cols / format.per_block();
        if !cols.is_multiple_of(format.per_block())
            || w.len() < rows * blocks * format.block_bytes()
        {
            return Err(format!("dequant shapes: {rows}x{cols}"));
        }
        let mut out = self.zeros::<u16>(rows * cols)?;
        let f = self.func(format.dequant_kernel())?;
        // 256 threads: each holds 32 weights in registers, more than a
        // block of 1024 may have.
        let cfg = LaunchConfig {
            grid_dim: ((rows * cols / 32).div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (r, c) = (rows as i32, cols as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(w).arg(&mut out).arg(&r).arg(&c);
        // SAFETY: the argument list matches the kernel's signature; `out`
        // holds rows * cols values and `w` the blocks checked above.
        unsafe { b.launch(cfg) }.map_err(|e| format!("dequant: {e:?}"))?;
        Ok(out)
    }

    /// `to_bf16`: the first `n` values of `x` into `out`.
    pub fn to_bf16(
        &self,
        x: &CudaView<'_, f32>,
        out: &mut CudaViewMut<'_, u16>,
        n: usize,
    ) -> Result<()> {
        if x.len() < n || out.len() < n {
            return Err(format!("to_bf16 shapes: {n}"));
        }
        let f = self.func("to_bf16")?;
        let cfg = LaunchConfig::for_num_elems(n as u32);
        let nn = n as i32;
        let mut b = self.stream.launch_builder(f);
        b.arg(x).arg(out).arg(&nn);
        // SAFETY: as in `dequant_bf16`.
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(|e| format!("to_bf16: {e:?}"))
    }

    /// [`crate::reference::gemm_bf16`] through cuBLAS: `y (+)= W x` for
    /// `tokens` rows of bfloat16 `x` against row-major bfloat16 `w`
    /// (`rows` x `cols`), f32 accumulation and output.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_bf16(
        &self,
        w: &CudaSlice<u16>,
        x: &CudaView<'_, u16>,
        y: &mut CudaViewMut<'_, f32>,
        rows: usize,
        cols: usize,
        tokens: usize,
        acc: bool,
    ) -> Result<()> {
        let handle = *self.blas.as_ref().ok_or("cuBLAS is not loaded")?.handle();
        if w.len() < rows * cols
            || x.len() < tokens * cols
            || y.len() < tokens * rows
            || tokens == 0
        {
            return Err(format!("gemm shapes: {rows}x{cols}, {tokens} tokens"));
        }
        // Column-major terms: Y^T (rows x tokens) = W (as W^T's transpose,
        // cols x rows with ld cols) times X^T (cols x tokens, ld cols).
        let (alpha, beta) = (1.0f32, if acc { 1.0f32 } else { 0.0 });
        let (wp, _w) = w.device_ptr(&self.stream);
        let (xp, _x) = x.device_ptr(&self.stream);
        let (yp, _y) = y.device_ptr_mut(&self.stream);
        let (m, n, k) = (rows as i32, tokens as i32, cols as i32);
        // SAFETY: the pointers are live device buffers of the sizes checked
        // above; alpha and beta are host values that outlive the call; the
        // handle runs on this GPU's stream.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                handle,
                blas::cublasOperation_t::CUBLAS_OP_T,
                blas::cublasOperation_t::CUBLAS_OP_N,
                m,
                n,
                k,
                (&alpha as *const f32).cast(),
                wp as *const _,
                blas::cudaDataType::CUDA_R_16BF,
                k,
                xp as *const _,
                blas::cudaDataType::CUDA_R_16BF,
                k,
                (&beta as *const f32).cast(),
                yp as *mut _,
                blas::cudaDataType::CUDA_R_32F,
                m,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
            )
        }
        .map_err(|e| format!("gemm: {e:?}"))
    }
}
