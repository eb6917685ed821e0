"""Streaming conversion vs a naive load-everything-then-save conversion: peak memory and wall time.

Builds a synthetic Hugging Face style checkpoint (several ~1 GiB safetensors files with an index;
per layer: per-expert weights, an attention weight, a norm; layers straddle file boundaries as
in real checkpoints), then converts it with rename + transpose + stack mappers, each conversion
in a fresh subprocess so that peak resident memory (``VmHWM``) belongs to that conversion
alone. Both conversions run in the same session, alternating, after the source has been read
once so that both start with it in the page cache.

Run from the repository root:

    uv run --frozen python packages/d9d-state-mappers/benchmarks/convert_benchmark.py

It needs about 3x the checkpoint size of free disk under --workdir (default /tmp) and, for the
naive conversion, about 2x the checkpoint size of free memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

MIB = 2**20
GIB = 2**30


def _layer_names(layer: int, experts: int) -> list[str]:
    p = f"model.layers.{layer}."
    return [p + f"mlp.experts.{e}.weight" for e in range(experts)] + [p + "attn.weight", p + "norm.weight"]


def generate(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import save_file

    source = Path(args.workdir) / "source"
    if source.exists():
        shutil.rmtree(source)
    source.mkdir(parents=True)
    shapes = {
        "expert": (args.inter, args.hidden),
        "attn": (args.attn_out, args.hidden),
        "norm": (args.hidden,),
    }
    expert_bytes = args.inter * args.hidden * 4
    layer_bytes = args.experts * expert_bytes + args.attn_out * args.hidden * 4 + args.hidden * 4
    limit = int(args.file_gib * GIB)
    layers = max(1, round(args.files * limit / layer_bytes))
    generator = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    file_sizes: list[int] = []

    def flush() -> None:
        nonlocal pending, pending_bytes
        name = f"model-{len(file_sizes) + 1:05d}.safetensors"
        save_file(pending, source / name)
        weight_map.update(dict.fromkeys(pending, name))
        file_sizes.append((source / name).stat().st_size)
        pending, pending_bytes = {}, 0

    for layer in range(layers):
        for name in _layer_names(layer, args.experts):
            kind = "expert" if ".experts." in name else name.rsplit(".", 2)[-2]
            tensor = torch.randn(shapes[kind], generator=generator)
            if pending and pending_bytes + tensor.nbytes > limit:
                flush()
            pending[name] = tensor
            pending_bytes += tensor.nbytes
    flush()
    # File order differs from name order; the index is what places tensors.
    (source / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    (source / "layout.json").write_text(
        json.dumps({"layers": layers, "experts": args.experts, "files": file_sizes})
    )


def _targets(layer: int) -> dict[str, str]:
    p, q = f"model.layers.{layer}.", f"layers.{layer}."
    return {
        "experts": q + "experts",
        "attn": p + "attn.weight",
        "attn_t": q + "attn.weight_t",
        "norm": p + "norm.weight",
    }


def run_streaming(args: argparse.Namespace, source: Path, target: Path, layout: dict[str, int]) -> None:
    from d9d.state_mappers import (
        ParallelMapper,
        RenameMapper,
        StackMapper,
        TransposeMapper,
        convert_checkpoint,
    )

    groups = []
    for layer in range(layout["layers"]):
        names = _layer_names(layer, layout["experts"])
        t = _targets(layer)
        groups += [
            StackMapper(names[: layout["experts"]], t["experts"]),
            TransposeMapper(t["attn"], target=t["attn_t"]),
            RenameMapper(t["norm"], f"layers.{layer}.norm.weight"),
        ]
    convert_checkpoint(
        source,
        target,
        ParallelMapper(groups),
        max_shard_size_bytes=int(args.file_gib * GIB),
        show_progress=False,
    )


def run_naive(args: argparse.Namespace, source: Path, target: Path, layout: dict[str, int]) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(source.glob("*.safetensors")):
        state.update(load_file(file))
    out: dict[str, torch.Tensor] = {}
    for layer in range(layout["layers"]):
        names = _layer_names(layer, layout["experts"])
        t = _targets(layer)
        out[t["experts"]] = torch.stack([state[n] for n in names[: layout["experts"]]])
        out[t["attn_t"]] = state[t["attn"]].T.contiguous()
        out[f"layers.{layer}.norm.weight"] = state[t["norm"]]
    target.mkdir(parents=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in out.items():
        if shards[-1] and size + tensor.nbytes > args.file_gib * GIB:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, target / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (target / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


def _peak_rss() -> int:
    """Peak resident memory of this process in bytes.

    ``VmHWM`` is the high-water mark of this process image alone; ``ru_maxrss`` would also
    count the parent's memory at fork time, which Linux carries across ``exec``.
    """
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(args: argparse.Namespace) -> None:
    """One conversion in this (fresh) process; prints a JSON line with its measurements."""
    # Imports happen before measuring, for both variants alike: the numbers are the conversion's.
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401

    import d9d.state_mappers  # noqa: F401

    source = Path(args.workdir) / "source"
    target = Path(args.workdir) / f"out-{args.child}"
    layout = json.loads((source / "layout.json").read_text())
    baseline = _peak_rss()
    cpu_start = os.times()
    start = time.perf_counter()
    (run_streaming if args.child == "streaming" else run_naive)(args, source, target, layout)
    wall = time.perf_counter() - start
    cpu_end = os.times()
    cpu = (cpu_end.user - cpu_start.user) + (cpu_end.system - cpu_start.system)
    peak = _peak_rss()
    print(
        json.dumps(
            {"variant": args.child, "wall_s": wall, "cpu_s": cpu, "peak_rss": peak, "baseline_rss": baseline}
        )
    )


def _spawn(args: argparse.Namespace, variant: str) -> dict[str, float]:
    target = Path(args.workdir) / f"out-{variant}"
    shutil.rmtree(target, ignore_errors=True)
    command = [sys.executable, __file__, "--child", variant, *args.forward]
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _compare_outputs(workdir: Path) -> int:
    import torch

    from d9d.state_mappers import SafetensorsCheckpoint

    a = SafetensorsCheckpoint(workdir / "out-streaming")
    b = SafetensorsCheckpoint(workdir / "out-naive")
    if a.specs != b.specs:
        raise SystemExit("outputs differ in names, shapes or dtypes")
    for name in a.specs:
        if not torch.equal(a.read(name), b.read(name)):
            raise SystemExit(f"outputs differ in tensor {name!r}")
    return len(a.specs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/d9d-state-mappers-bench")
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--file-gib", type=float, default=1.0)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=2048)
    parser.add_argument("--attn-out", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    parser.add_argument("--reuse", action="store_true", help="reuse a source kept by an earlier --keep run")
    parser.add_argument("--child", choices=["streaming", "naive"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.forward = [a for a in sys.argv[1:] if a not in ("--keep", "--reuse")]
    if args.child:
        child(args)
        return
    workdir = Path(args.workdir)
    started = time.perf_counter()
    if not (args.reuse and (workdir / "source" / "layout.json").exists()):
        generate(args)
    layout = json.loads((workdir / "source" / "layout.json").read_text())
    print(
        f"source: {len(layout['files'])} files, {sum(layout['files']) / GIB:.2f} GiB, largest "
        f"{max(layout['files']) / MIB:.0f} MiB; {layout['layers']} layers x {layout['experts']} experts "
        f"(generated in {time.perf_counter() - started:.0f} s)"
    )
    for file in sorted((workdir / "source").glob("*.safetensors")):  # warm the page cache for both
        with file.open("rb") as f:
            while f.read(64 * MIB):
                pass
    if args.repeats == 0:
        return
    runs: dict[str, list[dict[str, float]]] = {"naive": [], "streaming": []}
    for repeat in range(args.repeats):
        order = ["naive", "streaming"] if repeat % 2 == 0 else ["streaming", "naive"]
        for variant in order:
            runs[variant].append(_spawn(args, variant))
            r = runs[variant][-1]
            print(
                f"  {variant:9s} run {repeat + 1}: {r['wall_s']:6.1f} s wall, {r['cpu_s']:6.1f} s CPU, "
                f"peak RSS {r['peak_rss'] / MIB:6.0f} MiB"
            )
    checked = _compare_outputs(workdir)
    largest = max(layout["files"])
    print(f"\noutputs identical ({checked} tensors)\n")
    print("| conversion | wall time (median) | CPU time (median) | peak RSS (max) | RSS after imports |")
    print("|---|---|---|---|---|")
    for variant in ("naive", "streaming"):
        wall = statistics.median(r["wall_s"] for r in runs[variant])
        cpu = statistics.median(r["cpu_s"] for r in runs[variant])
        peak = max(r["peak_rss"] for r in runs[variant])
        base = max(r["baseline_rss"] for r in runs[variant])
        print(f"| {variant} | {wall:.1f} s | {cpu:.1f} s | {peak / MIB:.0f} MiB | {base / MIB:.0f} MiB |")
    stream_peak = max(r["peak_rss"] for r in runs["streaming"])
    budget = 1.25 * largest + 300 * MIB
    ratio = statistics.median(r["wall_s"] for r in runs["streaming"]) / statistics.median(
        r["wall_s"] for r in runs["naive"]
    )
    print(
        f"\nstreaming peak {stream_peak / MIB:.0f} MiB vs budget 1.25 x largest file + 300 MiB = "
        f"{budget / MIB:.0f} MiB: {'OK' if stream_peak <= budget else 'OVER'}"
    )
    print(f"streaming / naive wall time: {ratio:.2f} (target <= 1.10): {'OK' if ratio <= 1.10 else 'OVER'}")
    if not args.keep:
        shutil.rmtree(workdir)
    os.sync()


if __name__ == "__main__":
    main()
