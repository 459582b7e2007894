//! The CUDA C sources of the engine's kernels, each with the shared
//! prelude in front, and the kernels each one defines. They are compiled
//! at start by [`crate::nvrtc`] for the GPU's compute capability; what
//! each kernel computes is written down in Rust in [`crate::reference`].

/// Shared definitions (types, f16 conversions, warp reductions).
pub const PRELUDE: &str = include_str!("cu/prelude.cuh");

/// One source file.
#[derive(Debug, Clone, Copy)]
pub struct Source {
    /// File name under `kernels/src/cu/`.
    pub name: &'static str,
    /// Its text (without the prelude).
    pub text: &'static str,
    /// The `extern "C"` kernels it defines.
    pub kernels: &'static [&'static str],
}

impl Source {
    /// The text NVRTC compiles: the prelude, then the file.
    pub fn full(&self) -> String {
        format!("{PRELUDE}\n{}", self.text)
    }
}

/// Every kernel source.
pub const SOURCES: [Source; 7] = [
    Source {
        name: "gemv.cu",
        text: include_str!("cu/gemv.cu"),
        kernels: &[
            "gemv_q4_1",
            "gemv_q8_0",
            "gemv_q4_k",
            "gemv_q6_k",
            "dequant_q4_1",
            "dequant_q8_0",
            "dequant_q4_k",
            "dequant_q6_k",
            "to_bf16",
        ],
    },
    Source {
        name: "norm.cu",
        text: include_str!("cu/norm.cu"),
        kernels: &["rmsnorm_residual"],
    },
    Source {
        name: "rope.cu",
        text: include_str!("cu/rope.cu"),
        kernels: &["rope"],
    },
    Source {
        name: "silu.cu",
        text: include_str!("cu/silu.cu"),
        kernels: &["silu_mul"],
    },
    Source {
        name: "kv.cu",
        text: include_str!("cu/kv.cu"),
        kernels: &["kv_write"],
    },
    Source {
        name: "attention.cu",
        text: include_str!("cu/attention.cu"),
        kernels: &["paged_attention"],
    },
    Source {
        name: "sample.cu",
        text: include_str!("cu/sample.cu"),
        kernels: &["top_k"],
    },
];
