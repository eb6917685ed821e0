#!/usr/bin/env bash
# FlashAttention 4 (flash-attn-4 + nvidia-cutlass-dsl[cu13]) on a GPU machine without a package
# registry: the wheels travel in two consecutive calls, since one call carries at most 64 MiB.
#
# Here (once per checkout): `bash scripts/fa4-pack.sh` downloads the pinned wheels into two ignored
# folders, .fa4a/ and .fa4b/ (listed in .git/info/exclude), each under 50 MiB: the 88 MiB
# nvidia_cutlass_dsl_libs_cu13 wheel is cut in two, and .fa4b/fa4-manifest.sha256 holds the sha256
# of every part and every whole wheel.
#
# On the GPU machine, two calls in a row (its /tmp survives while it stays warm, about 30 s):
#   source .device/setup.sh && bash scripts/fa4-gpu.sh stage-a           (carry .device, .fa4a)
#   source .device/setup.sh && bash scripts/fa4-gpu.sh install-and-test  (carry .device, .fa4b)
# `install` in place of install-and-test only installs, for a second call that goes straight to
# `gemma`. While that machine is still warm, `test` (the GPU tests, plus the small-shape backend
# agreement tests) and `bench` rerun one half on the installed wheels, and `gemma` times
# Gemma-3-1B's rows: ROUNDS (default 1; 100 to 140 s a round on an H100) alternating rounds of d9d
# with its default attention without the extra (`flex_attention`), d9d with `flash_attention_4`,
# and transformers compiled, each its own process.
# Logs go to "$OUT" when set, else ./fa4-gpu-out.
set -uo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast stays off, for this shell and every child process.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
# Compiled kernels persist on disk, so the benchmark reuses what the tests compiled (0 turns it off).
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="${FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED:-1}"
export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-cache

parts=/tmp/fa4parts
site=/tmp/site-fa4
manifest=fa4-manifest.sha256
out="${OUT:-fa4-gpu-out}"

die() {
  echo "fa4-gpu.sh: $*" >&2
  exit 1
}

stage_a() {
  [ -d .fa4a ] || die "no .fa4a/ in this checkout: run stage-a with carry [\".device\", \".fa4a\"]"
  rm -rf "$parts" && mkdir -p "$parts" && cp .fa4a/* "$parts"/ || die "could not copy .fa4a/ to $parts"
  ls -l "$parts"
  echo "stage-a done: $(ls "$parts" | wc -l) files in $parts; run install-and-test (carry .fa4b) next, now"
}

# Joins the split wheels, checks every file against the manifest and installs them all into $site.
install() {
  [ -f ".fa4b/$manifest" ] || die "no .fa4b/$manifest here: run install-and-test with carry [\".device\", \".fa4b\"]"
  mkdir -p "$parts" && cp .fa4b/* "$parts"/ || die "could not copy .fa4b/ to $parts"
  local missing=() name
  while read -r _ name; do
    # A whole wheel that is listed in parts is made below; everything else must be here already.
    grep -q " $name.part-aa\$" "$parts/$manifest" && continue
    [ -f "$parts/$name" ] || missing+=("$name")
  done <"$parts/$manifest"
  if [ "${#missing[@]}" -gt 0 ]; then
    die "missing from $parts: ${missing[*]}
  stage-a did not run on this machine: run 'bash scripts/fa4-gpu.sh stage-a' (carry .device, .fa4a)
  in the call just before this one, while the machine is still warm."
  fi
  local first
  for first in "$parts"/*.whl.part-aa; do
    [ -e "$first" ] || continue
    cat "${first%.part-aa}".part-* >"${first%.part-aa}" || die "could not join ${first%.part-aa}"
  done
  (cd "$parts" && sha256sum -c --quiet "$manifest") || die "checksums differ from $manifest"
  rm -rf "$site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$parts"/*.whl \
    || die "pip install into $site failed"
}

# PYTHONPATH entries do not run .pth files, so the path that nvidia_cutlass_dsl_packages.pth would
# add (where the `cutlass` package lives) is spelt out.
use_site() {
  [ -d "$site/flash_attn/cute" ] || die "no $site/flash_attn/cute: run stage-a and install-and-test first"
  export PYTHONPATH="$site:$site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
  python3 -c "
import importlib.metadata as m, torch, flash_attn.cute, cutlass
print('flash_attn.cute', m.version('flash-attn-4'), 'from', flash_attn.cute.__file__)
print('nvidia-cutlass-dsl', m.version('nvidia-cutlass-dsl'), 'torch', torch.__version__,
      torch.cuda.get_device_name(), torch.cuda.get_device_capability())
" 2>&1 | tee "$out/import.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || die "import flash_attn.cute failed (see above)"
}

# install, logged, then use_site; ends the script if the install failed.
install_and_use() {
  install 2>&1 | tee "$out/install.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
  use_site
}

gpu_tests=packages/d9d-kernels/tests/layers/test_flash_attention_gpu.py

run_tests() {
  timeout 320 python3 -m pytest -p no:cacheprovider -v -s -rs "$@" 2>&1 | tee "$out/pytest.log"
  return "${PIPESTATUS[0]}"
}

run_bench() {
  timeout 220 python3 packages/d9d-kernels/benchmarks/layers/bench_flash_attention.py \
    --out "$out/bench_flash_attention.json" 2>&1 | tee "$out/bench.log"
  return "${PIPESTATUS[0]}"
}

run_gemma() {
  local round row rows=(
    "--impl d9d_compile --d9d-state bfloat16 --attention-backend flex_attention"
    "--impl d9d_compile --d9d-state bfloat16 --attention-backend flash_attention_4"
    "--impl hf_compile"
  )
  for round in $(seq "${ROUNDS:-1}"); do
    for row in "${rows[@]}"; do
      echo "== round $round: $row"
      # shellcheck disable=SC2086 # each row is a list of flags
      timeout 240 python3 packages/d9d-hf/benchmarks/train_throughput.py --model gemma3_1b --warmup 3 \
        --steps 5 --json "$out/gemma.jsonl" $row
    done
  done 2>&1 | tee "$out/gemma.log"
}

mkdir -p "$out"
case "${1:-}" in
  stage-a)
    stage_a
    ;;
  install-and-test)
    nvidia-smi -L 2>&1 | tee "$out/nvidia-smi.txt"
    install_and_use
    run_tests "$gpu_tests"
    tests=$?
    run_bench
    bench=$?
    echo "pytest exit $tests, bench exit $bench" | tee "$out/result.txt"
    [ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
    ;;
  install)
    # install-and-test without the tests and the benchmark, for a call that times the model next.
    install_and_use
    ;;
  test)
    # Also the small-shape agreement of every installed backend with eager (head_dim 64, MHA/GQA/MQA).
    use_site && run_tests "$gpu_tests" packages/d9d-kernels/tests/layers/test_attention_backends.py
    ;;
  bench)
    use_site && run_bench
    ;;
  gemma)
    use_site && run_gemma
    ;;
  *)
    die "usage: bash scripts/fa4-gpu.sh stage-a | install-and-test | install | test | bench | gemma"
    ;;
esac
