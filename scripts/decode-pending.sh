#!/usr/bin/env bash
# The decode step's attention switches (longest_rows_first, on by default; fused_qk_norm_rope, off): their gpu tests, then the
# issue's point (Qwen3-0.6B widths, batch 64, completions to 2048, two waves), the engine alone,
# each switch set in its own process.
#   source .device/setup.sh && bash scripts/decode-pending.sh [PART...]
# PART is `tests` or a switch pair `LONGEST-QK` (`off-off`, `on-off`, `off-on`, `on-on`); with no
# PART it runs all of them. The inner timeouts are 450 s for `tests` (150 kernels, 300 rl: cold, the
# rl test's engines autotune for minutes) and 300 s per pair, so `tests` takes its own 600 s device
# call; then pairs on the same warm machine reuse the first pair's autotuning (about 65 s each on the
# H100 once cached; result.txt keeps the rows that finish):
#   bash scripts/decode-pending.sh tests     then     bash scripts/decode-pending.sh on-off off-off on-off off-off
# Logs go to "$OUT" when set, else ./decode-pending-out; result.txt has the rows.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
out="${OUT:-decode-pending-out}"
mkdir -p "$out"

all_parts=(tests off-off on-off off-on on-on)
parts=("$@")
if [ ${#parts[@]} -eq 0 ]; then
  parts=("${all_parts[@]}")
fi
for part in "${parts[@]}"; do
  known=0
  for candidate in "${all_parts[@]}"; do [ "$part" = "$candidate" ] && known=1; done
  if [ "$known" = 0 ]; then
    echo "decode-pending.sh: unknown part '$part' (${all_parts[*]})" >&2
    exit 2
  fi
done

run_tests() {
  # cold, the rl test's engines autotune per shape: more than 150 s before its first test ends
  (cd packages/d9d-kernels && timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_paged_attention.py tests/test_paged_attention_write.py \
    tests/test_paged_attention_qk_norm_rope.py tests/layers/test_rms_norm.py tests/test_rms_norm_tiles.py) \
    2>&1 | tee "$out/kernels-gpu-tests.log"
  timeout 300 python3 -m pytest -v -m gpu -p no:cacheprovider packages/d9d-rl/tests/test_static_decode.py \
    2>&1 | tee "$out/rl-gpu-tests.log"
}

# the first engine process autotunes (about 200 s); the others reuse Triton's cached results
# (keep TRITON_CACHE_DIR inside the working tree so a second call finds them)
run_switches() {
  local longest="${1%-*}" qk="${1#*-}"
  echo "== longest_rows_first=$longest fused_qk_norm_rope=$qk" | tee -a "$out/result.txt"
  timeout 300 python3 packages/d9d-rl/benchmarks/decode_throughput.py --widths qwen3-0.6b --batches 64 \
    --waves 2 --max-completion 2048 --repeats 2 --sides engine \
    --longest-rows-first "$longest" --fused-qk-norm-rope "$qk" \
    2>&1 | tee "$out/decode-$longest-$qk.log" | grep -E "qwen3-0.6b +64 " | tee -a "$out/result.txt"
}

for part in "${parts[@]}"; do
  case "$part" in
    tests) run_tests ;;
    *) run_switches "$part" ;;
  esac
done
