#!/usr/bin/env bash
# Packs FlashAttention 4's wheels for scripts/fa4-gpu.sh: run here (PyPI reachable), once per checkout.
#
# Downloads flash-attn-4, the CuTe DSL and their other dependencies, each pinned to the set that
# passed fa4-gpu.sh's tests on an H100 (2026-12-07), for the GPU machine (CPython 3.12, x86-64
# Linux, CUDA 13), without torch, typing-extensions or cuda-bindings (the machine has them), cuts
# the CUDA 13 library wheel in two and fills the two ignored folders that fa4-gpu.sh's calls carry,
# each small enough to travel with the working tree in one call:
#   .fa4a/  the library wheel's first part
#   .fa4b/  its second part, every other wheel, and fa4-manifest.sha256 (every part and whole wheel)
# Versions can be overridden: FA4_VERSION=... CUTLASS_DSL_VERSION=... bash scripts/fa4-pack.sh
set -euo pipefail
cd "$(dirname "$0")/.."

fa4_version="${FA4_VERSION:-4.0.0b36}"
dsl_version="${CUTLASS_DSL_VERSION:-4.8.1}"
part_size=48M
manifest=fa4-manifest.sha256
big="nvidia_cutlass_dsl_libs_cu13-$dsl_version-"

for ignored in .fa4a .fa4b; do
  git check-ignore -q "$ignored/" || {
    echo "fa4-pack.sh: $ignored/ is not ignored here; add /$ignored/ to .git/info/exclude first" >&2
    exit 1
  }
done

download=$(mktemp -d)
trap 'rm -rf "$download"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --dest "$download" \
  "flash-attn-4==$fa4_version" \
  "nvidia-cutlass-dsl==$dsl_version" \
  "nvidia-cutlass-dsl-libs-base==$dsl_version" \
  "nvidia-cutlass-dsl-libs-core==$dsl_version" \
  "nvidia-cutlass-dsl-libs-cu13==$dsl_version" \
  "apache-tvm-ffi==0.1.15.post2" "quack-kernels==0.6.5" "torch-c-dlpack-ext==0.1.5" "einops==0.8.2" \
  "protobuf==7.36.2"

library=$(ls "$download"/"$big"*.whl)
rm -rf .fa4a .fa4b
mkdir -p .fa4a .fa4b
(cd "$download" && sha256sum -- *.whl >"$manifest")
(cd "$download" && split -b "$part_size" -a 2 "$(basename "$library")" "$(basename "$library").part-")
parts=("$library".part-*)
[ "${#parts[@]}" -eq 2 ] || { echo "fa4-pack.sh: expected 2 parts of $library, got ${#parts[@]}" >&2; exit 1; }
(cd "$download" && sha256sum -- *.part-* >>"$manifest")
mv "${parts[0]}" .fa4a/
mv "${parts[1]}" .fa4b/
rm "$library"
mv "$download"/*.whl "$download/$manifest" .fa4b/
du -sh .fa4a .fa4b
echo "packed flash-attn-4 $fa4_version, CuTe DSL $dsl_version: now the two calls of scripts/fa4-gpu.sh"
