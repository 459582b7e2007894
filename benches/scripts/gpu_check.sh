#!/usr/bin/env bash
# The GPU check (#13), one command on a machine with an NVIDIA GPU:
#   bash benches/scripts/gpu_check.sh          # run (builds first if cargo is here)
#   bash benches/scripts/gpu_check.sh stage    # on a build machine: build and
#                                              # stage what travels in target/gpu-stage/
# It runs, in one go: the kernels' parity against their CPU references on
# SmolLM2-135M's shapes (kernels/examples/gpu_check.rs); the CUDA runner's
# model parity against the reference runner on random weights with those
# shapes and tensor types, and its speed (engine/examples/gpu_model_check.rs);
# and Hugging Face transformers' generate on the same shapes and GPU
# (benches/scripts/gpu_transformers.py, where torch and transformers exist).
# Exit status: 0 passed, 1 a check failed, 2 no GPU (or no NVRTC) here.
set -euo pipefail
cd "$(dirname "$0")/../.."
stage=target/gpu-stage

if [ "${1:-}" = "stage" ]; then
  cargo build --release -p ultrafast-kernels --example gpu_check
  cargo build --release -p ultrafast-engine --example gpu_model_check
  mkdir -p "$stage"
  for b in gpu_check gpu_model_check; do
    cp "target/release/examples/$b" "$stage/$b"
    strip "$stage/$b" 2>/dev/null || true
  done
  ls -l "$stage"
  exit 0
fi

if [ ! -x "$stage/gpu_check" ] || [ ! -x "$stage/gpu_model_check" ]; then
  if command -v cargo >/dev/null 2>&1; then
    bash "$0" stage
  else
    echo "gpu_check: $stage/gpu_check is missing: run 'bash $0 stage' on a machine with Rust and bring $stage along"
    exit 2
  fi
fi

# NVRTC: the toolkit's, else the nvidia-cuda-nvrtc wheel's (system Python or
# this repository's .venv).
if [ -z "${ULTRAFAST_NVRTC_DIR:-}" ]; then
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
           $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null) \
           .venv/lib/python3*/site-packages/nvidia/cu13/lib; do
    if [ -e "$d/libnvrtc.so.13" ]; then export ULTRAFAST_NVRTC_DIR="$d"; break; fi
  done
fi
echo "gpu_check: NVRTC from ${ULTRAFAST_NVRTC_DIR:-the library search path}"
# cuBLAS (prompt GEMMs): the toolkit's or a wheel's libcublas.so.13, found by
# the loader, so its folder goes on LD_LIBRARY_PATH before the checks start.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, s, "lib") for p in nvidia.__path__ for s in ("cu13", "cublas")))' 2>/dev/null); do
  if [ -e "$d/libcublas.so.13" ]; then
    export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "gpu_check: cuBLAS from $d"
    break
  fi
done
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

status=0
timeout 120 "$stage/gpu_check" || status=$?
if [ "$status" -ne 2 ]; then
  s=0
  timeout 120 "$stage/gpu_model_check" || s=$?
  [ "$s" -gt "$status" ] && status=$s
  if python3 -c 'import torch, transformers; assert torch.cuda.is_available()' 2>/dev/null; then
    timeout 120 python3 benches/scripts/gpu_transformers.py || echo "gpu_check: the transformers reference failed"
  else
    echo "gpu_check: no torch/transformers with CUDA here: the transformers reference was not run"
  fi
fi
exit $status
