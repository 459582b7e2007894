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
        kernels: &["paged_attention", "attention_merge"],
    },
    Source {
        name: "sample.cu",
        text: include_str!("cu/sample.cu"),
        kernels: &["top_k", "log_norm"],
    },
];

#[cfg(test)]
mod tests {
    use super::SOURCES;

    /// Parameters of each `extern "C"` kernel, counted in its source.
    fn arity(kernel: &str) -> usize {
        for src in SOURCES {
            let sig = format!("void {kernel}(");
            if let Some(at) = src.text.find(&sig) {
                let params = &src.text[at + sig.len()..];
                let params = &params[..params.find(')').unwrap_or(0)];
                return params.split(',').count();
            }
        }
        panic!("kernel {kernel} not found");
    }

    /// Every launcher passes as many arguments as its kernel takes (a
    /// mismatch compiles and launches, and computes garbage on a GPU):
    /// counted in the launchers' text, from the kernel's lookup to its
    /// launch.
    #[test]
    fn launchers_pass_every_kernel_parameter() {
        let text = [include_str!("gpu.rs"), include_str!("prefill.rs")].concat();
        let mut seen = 0;
        for part in text.split("self.func(").skip(1) {
            let name = &part[..part.find(")?").unwrap_or(0)];
            let kernel = match name {
                "format.kernel()" => "gemv_q4_1",
                "format.dequant_kernel()" => "dequant_q4_1",
                quoted => quoted.trim_matches('"'),
            };
            let Some(end) = part.find(".launch(cfg)") else {
                continue;
            };
            let body = &part[..end];
            // A `match` passing one of two values is one argument.
            let args = body.matches(".arg(").count() - body.matches("None => b.arg(").count();
            assert_eq!(args, arity(kernel), "launcher of {kernel}");
            seen += 1;
        }
        assert_eq!(seen, 11, "launchers found");
    }
}
