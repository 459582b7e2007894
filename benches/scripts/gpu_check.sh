#!/usr/bin/env bash
# The GPU check (#13, #45), one command on a machine with an NVIDIA GPU:
#   bash benches/scripts/gpu_check.sh          # run (builds first if cargo is here)
#   bash benches/scripts/gpu_check.sh stage    # on a build machine: build and
#                                              # stage what travels in target/gpu-stage/
# It needs only the NVIDIA driver: NVRTC and cuBLAS come from a CUDA toolkit
# or from the machine's Python wheels (nvidia-cuda-nvrtc, nvidia-cublas).
# Stages, each its own process (gpu_stages.sh: a CUDA error is sticky, so
# one fault must not take the other stages' results with it; a failed stage
# runs again with CUDA_LAUNCH_BLOCKING=1):
#   kernels       every kernel against its CPU reference on SmolLM2-135M's
#                 shapes (kernels/examples/gpu_check.rs)
#   model         the CUDA runner against the reference runner, prompts
#                 through the GEMV and decode steps through graphs, random
#                 weights of SmolLM2's shapes and tensor types
#   graphs        a decode step through its graph = the same step direct,
#                 bit for bit
#   cublas        prompts through cuBLAS (bf16), at cuBLAS's tolerance
#   batch         three sequences in one step, device candidates and scores
#   speed         prefill, single-stream and 64-stream decode
#   transformers  Hugging Face transformers on the same shapes and GPU
# (the engine stages are engine/examples/gpu_model_check.rs). One summary
# table at the end, all within GPU_CHECK_BUDGET_S (280 s by default). Exit
# status: 0 passed, 1 a stage failed, 2 no GPU here.
set -uo pipefail
cd "$(dirname "$0")/../.."
stage_dir=target/gpu-stage

if [ "${1:-}" = "stage" ]; then
  set -e
  cargo build --release -p ultrafast-kernels --example gpu_check
  cargo build --release -p ultrafast-engine --example gpu_model_check
  mkdir -p "$stage_dir"
  for b in gpu_check gpu_model_check; do
    cp "target/release/examples/$b" "$stage_dir/$b"
    strip "$stage_dir/$b" 2>/dev/null || true
  done
  ls -l "$stage_dir"
  du -sh "$stage_dir"
  exit 0
fi

if [ ! -x "$stage_dir/gpu_check" ] || [ ! -x "$stage_dir/gpu_model_check" ]; then
  if command -v cargo >/dev/null 2>&1; then
    bash "$0" stage || exit 1
  else
    echo "gpu_check: $stage_dir/gpu_check is missing: run 'bash $0 stage' on a machine with Rust and bring $stage_dir along"
    exit 2
  fi
fi

# The driver: the loader's, else where containers and driver installers
# put it (libcuda.so.1 outside the loader's path is common in containers).
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then
  for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu \
           /usr/lib64 /run/nvidia/driver/usr/lib/x86_64-linux-gnu /usr/lib/wsl/lib; do
    if [ -e "$d/libcuda.so.1" ]; then
      export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      echo "gpu_check: driver library from $d"
      break
    fi
  done
fi
driver=""
if [ -r /proc/driver/nvidia/version ]; then
  driver=$(sed -n 's/.*Kernel Module *\([0-9][0-9.]*\).*/\1/p' /proc/driver/nvidia/version | head -1)
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader || true
  [ -z "$driver" ] && driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
fi
echo "gpu_check: driver ${driver:-unknown}"
# NVRTC 13 makes code for CUDA 13, which needs a driver of the R580 series
# or newer: say so at once rather than as a load failure later.
if [ -n "$driver" ] && [ "${driver%%.*}" -lt 580 ] 2>/dev/null; then
  echo "gpu_check: WARNING: driver $driver is older than 580; CUDA 13's NVRTC output may not load (use the nvidia-cuda-nvrtc-cu12 wheel's libnvrtc there)"
fi

# NVRTC: the toolkit's, else the nvidia-cuda-nvrtc wheel's (system Python or
# this repository's .venv).
wheel_dirs() {
  python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, s, "lib") for p in nvidia.__path__ for s in ("cu13", "cuda_nvrtc", "cublas")))' 2>/dev/null
}
if [ -z "${ULTRAFAST_NVRTC_DIR:-}" ]; then
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $(wheel_dirs) \
           .venv/lib/python3*/site-packages/nvidia/cu13/lib; do
    if [ -e "$d/libnvrtc.so.13" ]; then export ULTRAFAST_NVRTC_DIR="$d"; break; fi
  done
fi
if [ -n "${ULTRAFAST_NVRTC_DIR:-}" ]; then
  echo "gpu_check: NVRTC $(basename "$(readlink -f "$ULTRAFAST_NVRTC_DIR/libnvrtc.so.13")") from $ULTRAFAST_NVRTC_DIR"
else
  echo "gpu_check: NVRTC from the library search path"
fi
# cuBLAS (prompt GEMMs): the toolkit's or a wheel's libcublas.so.13, found by
# the loader, so its folder goes on LD_LIBRARY_PATH before the stages start.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $(wheel_dirs); do
  if [ -e "$d/libcublas.so.13" ]; then
    export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "gpu_check: cuBLAS $(basename "$(readlink -f "$d/libcublas.so.13")") from $d"
    break
  fi
done

# The wheels' own versions, where the libraries came from wheels (their
# files carry no version in the name).
for py in python3 .venv/bin/python; do
  command -v "$py" >/dev/null 2>&1 || continue
  "$py" - <<'PY' 2>/dev/null || true
import importlib.metadata as m, sys
for d in sorted(m.distributions(), key=lambda d: d.metadata["Name"].lower()):
    n = d.metadata["Name"]
    if n.lower().startswith(("nvidia-", "torch", "transformers")):
        print(f"gpu_check: wheel {n} {d.version} ({sys.executable})")
PY
done

. "$(dirname "$0")/gpu_stages.sh"
stage kernels 60 "$stage_dir/gpu_check"
if [ "$GPU_CHECK_STATUS" -eq 2 ]; then
  skip model "no GPU (the kernels stage said why)"
else
  for s in model graphs cublas batch; do
    stage "$s" 45 "$stage_dir/gpu_model_check" "$s"
  done
  stage speed 60 "$stage_dir/gpu_model_check" speed
  if python3 -c 'import torch, transformers; assert torch.cuda.is_available()' 2>/dev/null; then
    stage transformers 90 python3 benches/scripts/gpu_transformers.py
  else
    skip transformers "no torch/transformers with CUDA here"
  fi
fi
summary
exit "$GPU_CHECK_STATUS"
