#!/usr/bin/env bash
# Builds DeepEP (deep_ep, for d9d-parallel's DeepEPTokenDispatcher) from a source archive in
# .deepep/ on the GPU machine, offline, into /tmp/site-deepep (put it on PYTHONPATH).
#
# Here (once): a DeepEP source archive (.tar.gz) goes into .deepep/ (ignored: listed in
# .git/info/exclude, never committed). PyPI's deep-ep 1.0.0 sdist is NOT enough: it lacks every
# header (csrc/*.hpp, csrc/kernels/*.cuh), so `check` rejects it and names what is missing; use a
# complete DeepEP 1.x source tree (a release archive of the repository) instead.
#
# On the GPU machine (carry .device and .deepep), from the repository root:
#   source .device/setup.sh && bash scripts/build-deepep.sh start        # build in the background
#   source .device/setup.sh && bash scripts/build-deepep.sh wait 540     # wait, log tail, import check
#   source .device/setup.sh && bash scripts/build-deepep.sh test         # the 2-GPU test, the benchmark
# `build` builds in the foreground; `check` (anywhere) only picks and checks the archive.
#
# DeepEP >= 1.1 builds its intranode (NVLink) kernels alone when it finds no NVSHMEM; that is all
# the dispatcher uses (the GPUs of one host), compiles fastest and needs no NVSHMEM, so NVSHMEM is
# hidden from its setup.py unless DEEPEP_NVSHMEM=1 (then NVSHMEM_DIR comes from the pip package
# nvidia-nvshmem-cu13). An archive without that switch (1.0.x) is built against the pip NVSHMEM.
# Environment: MAX_JOBS (default: all cores), TORCH_CUDA_ARCH_LIST (default 9.0, Hopper).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"

work=/tmp/deepep-build
site=/tmp/site-deepep
log=/tmp/deepep-build.log
pidfile=/tmp/deepep-build.pid
statusfile=/tmp/deepep-build.status
out="${OUT:-deepep-out}"

die() {
  echo "build-deepep.sh: $*" >&2
  exit 1
}

# Prints the project-relative "#include "..."" targets of $1's csrc/ that resolve nowhere.
missing_headers() {
  local root=$1 file dir target
  while IFS= read -r file; do
    dir=$(dirname "$file")
    grep -ho '^[[:space:]]*#[[:space:]]*include[[:space:]]*"[^"]*"' "$file" | sed 's/.*"\(.*\)"/\1/' |
      while IFS= read -r target; do
        [ -f "$dir/$target" ] || [ -f "$root/csrc/$target" ] || echo "${file#"$root"/} -> $target"
      done
  done < <(find "$root/csrc" -type f \( -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' -o -name '*.hpp' -o -name '*.h' \))
}

# Unpacks the first complete archive of .deepep/ into $work/src (prints its name), or fails.
unpack() {
  local archive root rejected=0
  rm -rf "$work" && mkdir -p "$work"
  for archive in .deepep/*.tar.gz .deepep/*.tgz; do
    [ -f "$archive" ] || continue
    rm -rf "$work/unpack" && mkdir -p "$work/unpack"
    tar xzf "$archive" -C "$work/unpack" || die "could not unpack $archive"
    root=$(dirname "$(find "$work/unpack" -maxdepth 2 -name setup.py | head -1)")
    if [ ! -f "$root/setup.py" ] || [ ! -d "$root/csrc" ]; then
      echo "skip $archive: no setup.py and csrc/ (not DeepEP's source)" >&2
      rejected=1
      continue
    fi
    local missing
    missing=$(missing_headers "$root")
    if [ -n "$missing" ]; then
      echo "skip $archive: incomplete source, these includes resolve to no file:" >&2
      echo "$missing" | sed 's/^/    /' | head -40 >&2
      rejected=1
      continue
    fi
    mv "$root" "$work/src"
    echo "$archive"
    return 0
  done
  [ "$rejected" -eq 1 ] && die "no complete DeepEP source archive in .deepep/ (see above)"
  die "no .deepep/*.tar.gz here: carry [\".device\", \".deepep\"]"
}

build() {
  local archive
  archive=$(unpack) || exit 1
  echo "source: $archive"
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  nvcc --version | tail -2
  cd "$work/src" || die "no $work/src"
  if grep -q DISABLE_NVSHMEM setup.py && [ "${DEEPEP_NVSHMEM:-0}" != 1 ]; then
    echo "mode: intranode only (NVSHMEM hidden from setup.py)"
    unset NVSHMEM_DIR
    export DEEPEP_HIDE_NVSHMEM=1
  else
    NVSHMEM_DIR=$(python3 -c 'import nvidia.nvshmem as m, os; print(os.path.dirname(m.__file__) if m.__file__ else list(m.__path__)[0])') ||
      die "this archive needs NVSHMEM and the nvidia-nvshmem-cu13 package is not importable"
    export NVSHMEM_DIR
    echo "mode: with NVSHMEM from $NVSHMEM_DIR"
    ls "$NVSHMEM_DIR/lib" 2>&1 | head -20
  fi
  echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS"
  # setup.py build_ext, run from Python so that NVSHMEM's pip package can be hidden from it.
  python3 - <<'EOF' || die "build failed"
import importlib.util
import os
import runpy
import sys

if os.environ.get("DEEPEP_HIDE_NVSHMEM") == "1":
    real = importlib.util.find_spec
    importlib.util.find_spec = lambda name, package=None: (
        None if name.startswith("nvidia.nvshmem") else real(name, package)
    )
sys.argv = ["setup.py", "build_ext", "--inplace"]
runpy.run_path("setup.py", run_name="__main__")
EOF
  rm -rf "$site" && mkdir -p "$site"
  cp -r deep_ep "$site"/ && cp deep_ep_cpp*.so "$site"/ || die "no deep_ep/ or deep_ep_cpp*.so after the build"
  echo "installed into $site:"
  ls "$site"
}

import_check() {
  cd / && PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" python3 -c 'import torch, deep_ep; print("import deep_ep: ok", deep_ep.__file__)'
}

case "${1:-}" in
  check)
    unpack
    ;;
  build)
    build
    import_check
    ;;
  start)
    [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null && die "a build is running already (pid $(cat "$pidfile"))"
    mkdir -p "$work" && rm -f "$statusfile"
    # The build outlives this call: it runs a copy of this script, and of .deepep, from /tmp.
    rm -rf /tmp/deepep-run && mkdir -p /tmp/deepep-run && cp -r scripts .deepep /tmp/deepep-run/ ||
      die "no .deepep/ here: carry [\".device\", \".deepep\"]"
    (cd /tmp/deepep-run && setsid nohup bash -c 'bash scripts/build-deepep.sh build; echo $? >'"$statusfile" \
      >"$log" 2>&1 </dev/null & echo $! >"$pidfile")
    sleep 5
    echo "started (pid $(cat "$pidfile")), log $log:"
    tail -n 20 "$log"
    ;;
  wait)
    limit=${2:-540}
    waited=0
    while [ ! -f "$statusfile" ] && [ "$waited" -lt "$limit" ]; do
      sleep 10
      waited=$((waited + 10))
    done
    tail -n 60 "$log" 2>/dev/null || echo "no log at $log: run start first (on this machine, while warm)"
    if [ ! -f "$statusfile" ]; then
      echo "still building after ${waited}s; call wait again"
      exit 2
    fi
    echo "build exit $(cat "$statusfile")"
    import_check
    ;;
  test)
    mkdir -p "$out"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    timeout 330 python3 -m pytest -p no:cacheprovider -m multi_gpu -rs -q \
      packages/d9d-parallel/tests/test_deep_ep_gpu.py 2>&1 | tee "$out/pytest.log"
    tests=${PIPESTATUS[0]}
    timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
      packages/d9d-parallel/benchmarks/moe_dispatch.py 2>&1 | tee "$out/bench.log"
    bench=${PIPESTATUS[0]}
    echo "pytest exit $tests, benchmark exit $bench" | tee "$out/result.txt"
    [ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
    ;;
  *)
    die "usage: build-deepep.sh check | build | start | wait [seconds] | test"
    ;;
esac
