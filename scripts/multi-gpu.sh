#!/usr/bin/env bash
# The multi-GPU set on one host with 2 GPUs (one rank per GPU, NCCL), then the single-GPU tests.
#   source .device/setup.sh && bash scripts/multi-gpu.sh
# Logs and the suite's summary (summary.md / summary.json) go to "$OUT" when set, else ./multi-gpu-out.
set -uo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast stays off, for this shell and every child process.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
out="${OUT:-multi-gpu-out}"
mkdir -p "$out/suite"
nvidia-smi -L 2>&1 | tee "$out/nvidia-smi.txt"

timeout 420 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
  tests-integration/multi_gpu/nccl_suite.py --device cuda --out "$out/suite" --case-timeout 180 \
  2>&1 | tee "$out/suite.log"
suite=${PIPESTATUS[0]}

# The suite ran just above; pytest runs the other GPU tests (and skips nothing it can run).
timeout 240 python3 -m pytest -m "gpu or multi_gpu" -p no:cacheprovider \
  --deselect tests-integration/test_multi_gpu_suite.py::test_nccl_suite_on_two_gpus \
  packages/d9d-kernels/tests packages/d9d-pipeline/tests/test_gpu.py \
  packages/d9d-parallel/tests/test_context_parallel_gpu.py tests-integration/test_multi_gpu_suite.py \
  2>&1 | tee "$out/pytest.log"
tests=${PIPESTATUS[0]}

echo "suite exit $suite, pytest exit $tests" | tee "$out/result.txt"
[ "$suite" -eq 0 ] && [ "$tests" -eq 0 ]
