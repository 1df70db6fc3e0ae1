#!/usr/bin/env bash
# The GPU check of the fused AdaLN kernels, in one run on a machine with an NVIDIA GPU (under 8 minutes: each
# step has its own timeout):
#   1. the kernel correctness tests, compiled (TRITON_INTERPRET unset), against the eager reference;
#   2. the bandwidth benchmark (B = 2, per-sample and per-token, bytes the kernels really move, the HBM peak of the
#      exact device name) against eager PyTorch, torch.compile and Liger-Kernel's LayerNorm where it is installed;
#   3. a short training step of a small Wan (diffusers) with fused vs reference AdaLN;
#   4. the trainer itself (TorchBackend through the launcher: FSDP2, fused AdaLN, torch.compile of the blocks, flash
#      attention; context 2 when two GPUs are there) on a 4-layer TI2V-5B / A14B: step time, MFU and peak memory
#      beside `wanloom compile`'s estimate of the same job (benchmarks/gpu_train_step.py).
# Prints one report; nothing is written outside $OUT (default: a temporary folder).
#
# Machines without network (the device machines): prepare the missing wheels here once, then carry .whl/:
#   benchmarks/gpu_device_check.sh --fetch-wheels      # pip download for CPython 3.12 / manylinux into .whl/
#   benchmarks/gpu_device_check.sh                     # on the GPU machine, from the repository root
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl}
# Packages the trainer's torch path needs that a plain CUDA PyTorch image may lack (pydantic for the config,
# diffusers for the model, liger-kernel as a baseline).
PACKAGES=(pydantic pydantic-core annotated-types typing-inspection diffusers liger-kernel)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  mkdir -p "$WHEELS"
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$WHEELS" "${PACKAGES[@]}"
  exit 0
fi

command -v nvidia-smi >/dev/null || { echo "gpu_device_check: no nvidia-smi: this needs an NVIDIA GPU" >&2; exit 1; }
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
unset TRITON_INTERPRET
export PYTHONPATH=operator:trainer_images PYTHONDONTWRITEBYTECODE=1

echo "== device"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
  torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, "SMs")'

missing=()
for pkg in pydantic diffusers liger_kernel; do
  "$PY" -c "import $pkg" 2>/dev/null || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "== installing ${missing[*]} from $WHEELS"
  if [[ -d "$WHEELS" ]]; then
    "$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELS" "${PACKAGES[@]}" ||
      echo "gpu_device_check: some wheels did not install; the sections that need them say so"
  else
    echo "gpu_device_check: $WHEELS is missing (run --fetch-wheels where pip reaches PyPI, then carry it)"
  fi
fi

echo "== 1. kernel correctness, compiled"
timeout 180 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" tests/trainer/kernels/test_adaln_triton.py \
  -m "not exhaustive" 2>&1 | tail -n 15 | tee "$OUT/correctness.txt" || true

echo "== 2./3. bandwidth and training step"
timeout 270 "$PY" benchmarks/adaln_kernels.py --gpu-only --train-step --dims 5120 3072 \
  --tokens 16384 65536 75600 --batch 2 2>&1 | tee "$OUT/benchmark.md"
echo "== 4. the trainer's step beside wanloom compile's estimate"
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
step() { timeout 240 "$PY" benchmarks/gpu_train_step.py --json "$@" 2>&1 | tail -n 3 | tee -a "$OUT/train_step.jsonl" || true; }
step --variant wan2.2-ti2v-5b --layers 4 --shape 33x480x832 --adaln fused --compile
step --variant wan2.2-t2v-a14b --layers 2 --shape 81x480x832 --adaln fused
if ((gpus >= 2)); then
  step --variant wan2.2-t2v-a14b --layers 2 --shape 81x480x832 --adaln fused --gpus 2 --context 2
else
  echo "(one GPU: context parallelism needs two; skipped)"
fi
echo "== report in $OUT"
