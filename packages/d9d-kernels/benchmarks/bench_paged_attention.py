"""Decode attention over a paged KV pool: d9d's kernel against the gather + SDPA path, Qwen3 shapes.

For each model shape, batch and context (every row holds ``context`` tokens in shuffled 16-token
blocks), it times one layer's decode attention two ways: ``paged_decode_attention`` reading the
pool in place, and what the rollout engine did before it (gather each row's slots into a
contiguous copy with ``keys[read]``, then SDPA with a bool mask and ``enable_gqa``). It prints the
GPU time of each (profiler, median wall time beside it), their ratio, and the kernel's achieved
bandwidth: bytes = keys + values read once + query and output, against the H200's 4.8 TB/s.

Then a ragged sweep, the rollout engine's case: rows part-way through their completions (a
``LOW``-token prompt and a completion drawn from 64 to ``HIGH - LOW`` tokens, ``--ragged LOW HIGH``;
``--uniform-ragged``: lengths uniform over ``LOW .. HIGH``), seeded, in a block table as wide as
``HIGH``, each row writing its new key and value. It gives the kernel's GPU time for each split
count of ``--splits`` (programs per (row, kv head)) beside the count ``splits_for`` picks, each with
the rows started in order and longest first (``row_order``), so a change of the heuristic can be
decided from one call; ``--tiles`` adds launch shapes of the split kernel (``BLOCK_N x warps x
stages``) to time beside the default. Each time is the median of ``--repeats`` rounds that
alternate the launches, the L2 cache flushed before every call.

Run: python packages/d9d-kernels/benchmarks/bench_paged_attention.py --out DIR
     (--quick: tiny shapes on CPU; with TRITON_INTERPRET=1 the kernel runs in Triton's interpreter)
     ... --ragged-only --batches 64 256 --ragged 512 2560 --splits 1 2 3 4 5 --tiles 64x4x3 128x8x2
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from _harness import Result, Settings, attempt, gpu_kernel_ms, settings_for

from d9d.kernels import KernelBackend, paged_decode_attention
from d9d.kernels._backend import triton_interpreter_enabled
from d9d.kernels._paged_attention_inputs import PagedDecodeInputs

H200_GBS = 4800.0
PAGE_SIZE = 16


@dataclass(kw_only=True, frozen=True)
class Shape:
    """One layer's attention heads."""

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int


@dataclass(kw_only=True)
class Row:
    """One (shape, batch, context) point of the sweep."""

    model: str
    batch: int
    context: int
    kernel_ms: float | None
    gather_ms: float | None
    kernel_wall_ms: float | None
    gather_wall_ms: float | None
    speedup: float | None
    kernel_gbs: float | None
    roofline_pct: float | None
    max_abs_diff: float
    note: str


@dataclass(kw_only=True, frozen=True)
class Pool:
    """A paged pool holding ``batch`` rows of ``context`` tokens, and one decode step's inputs."""

    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    table: torch.Tensor
    lengths: torch.Tensor
    read: torch.Tensor
    mask: torch.Tensor


def make_pool(shape: Shape, batch: int, context: int, device: str) -> Pool:
    blocks = -(-context // PAGE_SIZE)
    slots = batch * blocks * PAGE_SIZE
    gen = torch.Generator(device=device).manual_seed(0)
    table = torch.randperm(batch * blocks, device=device, generator=gen).view(batch, blocks).to(torch.int32)
    positions = torch.arange(blocks * PAGE_SIZE, device=device)
    read = table.long()[:, positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
    return Pool(
        query=torch.randn(batch, shape.q_heads, shape.head_dim, device=device, dtype=torch.bfloat16),
        keys=torch.randn(slots, shape.kv_heads, shape.head_dim, device=device, dtype=torch.bfloat16),
        values=torch.randn(slots, shape.kv_heads, shape.head_dim, device=device, dtype=torch.bfloat16),
        table=table,
        lengths=torch.full((batch,), context, dtype=torch.int32, device=device),
        read=read,
        mask=(positions < context)[None, None, None, :].expand(batch, 1, 1, -1),
    )


def gather_then_sdpa(pool: Pool, scale: float) -> Callable[[], object]:
    """The engine's former path: a contiguous copy of every row's slots, then masked SDPA."""

    def fn() -> torch.Tensor:
        keys, values = pool.keys[pool.read], pool.values[pool.read]  # (batch, slots, kv_heads, dim)
        out = F.scaled_dot_product_attention(
            pool.query[:, :, None],
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=pool.mask,
            scale=scale,
            enable_gqa=True,
        )
        return out[:, :, 0]

    return fn


def paged_kernel(pool: Pool, scale: float, backend: KernelBackend) -> Callable[[], object]:
    def fn() -> torch.Tensor:
        return paged_decode_attention(
            pool.query, pool.keys, pool.values, pool.table, pool.lengths,
            page_size=PAGE_SIZE, softmax_scale=scale, backend=backend,
        )  # fmt: skip

    return fn


def _gpu_ms(result: Result) -> float | None:
    return result.extra.get("GPU ms", result.ms) if result.ms is not None else None


def measure_point(shape: Shape, batch: int, context: int, device: str, backend: KernelBackend) -> Row:
    pool = make_pool(shape, batch, context, device)
    scale = shape.head_dim**-0.5
    kernel = attempt("paged kernel", lambda: paged_kernel(pool, scale, backend), device)
    gather = attempt("gather + SDPA", lambda: gather_then_sdpa(pool, scale), device)
    kernel_ms, gather_ms = _gpu_ms(kernel), _gpu_ms(gather)
    diff = (paged_kernel(pool, scale, backend)() - gather_then_sdpa(pool, scale)()).float().abs().max()
    element = pool.keys.element_size()
    kv_bytes = batch * context * shape.kv_heads * 2 * shape.head_dim * element
    io_bytes = batch * shape.q_heads * 2 * shape.head_dim * element
    gbs = (kv_bytes + io_bytes) / (kernel_ms * 1e-3) / 1e9 if kernel_ms else None
    return Row(
        model=shape.name,
        batch=batch,
        context=context,
        kernel_ms=kernel_ms,
        gather_ms=gather_ms,
        kernel_wall_ms=kernel.ms,
        gather_wall_ms=gather.ms,
        speedup=gather_ms / kernel_ms if kernel_ms and gather_ms else None,
        kernel_gbs=gbs,
        roofline_pct=100 * gbs / H200_GBS if gbs else None,
        max_abs_diff=diff.item(),
        note="; ".join(n for n in (kernel.note, gather.note) if n),
    )


def _cell(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def print_table(rows: list[Row]) -> None:
    columns = ["model", "batch", "context", "kernel GPU ms", "gather+SDPA GPU ms", "speedup", "kernel GB/s"]
    columns += ["% of 4.8 TB/s", "kernel wall ms", "gather wall ms", "max abs diff", "note"]
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|")
    for r in rows:
        cells = [r.model, str(r.batch), str(r.context), _cell(r.kernel_ms), _cell(r.gather_ms)]
        cells += [_cell(r.speedup, 2), _cell(r.kernel_gbs, 0), _cell(r.roofline_pct, 1)]
        cells += [_cell(r.kernel_wall_ms), _cell(r.gather_wall_ms), _cell(r.max_abs_diff, 4), r.note]
        print("| " + " | ".join(cells) + " |")


def run(settings: Settings) -> list[Row]:
    """The sweep (tiny CPU shapes with ``settings.smoke``); prints the table and writes its JSON."""
    if settings.smoke:
        backend = KernelBackend.TRITON if triton_interpreter_enabled() else KernelBackend.REFERENCE
        shapes = [Shape(name="tiny", q_heads=4, kv_heads=2, head_dim=16)]
        batches, contexts = (1, 3), (24, 40)
    else:
        backend = KernelBackend.AUTO
        shapes = [
            Shape(name="Qwen3-0.6B", q_heads=16, kv_heads=8, head_dim=128),
            Shape(name="Qwen3-8B", q_heads=32, kv_heads=8, head_dim=128),
        ]
        batches, contexts = (1, 8, 32, 64, 128, 256), (512, 1024, 2560)
    print(f"\n### paged decode attention, bf16, page {PAGE_SIZE}, backend {backend.value}")
    rows = [
        measure_point(s, b, c, settings.device, backend) for s in shapes for b in batches for c in contexts
    ]
    print_table(rows)
    (settings.out / "paged_attention.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return rows


def ragged_pool(
    shape: Shape, batch: int, low: int, high: int, device: str, *, rollout: bool, seed: int = 0
) -> PagedDecodeInputs:
    """A decode step's inputs over a pool whose rows hold ``low .. high`` tokens (seeded draws).

    ``rollout``: each row is a ``low``-token prompt part-way through a completion drawn from 64 to
    ``high - low`` tokens (uniformly along it), as the rows of a continuously batched rollout are;
    otherwise lengths are uniform over ``low .. high``. Each row writes its new key and value, as a
    decode step does.
    """
    blocks = -(-high // PAGE_SIZE)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if rollout:
        completion = torch.randint(64, max(65, high - low + 1), (batch,), generator=gen)
        lengths = (low + (torch.rand(batch, generator=gen) * completion).long()).to(torch.int32)
    else:
        lengths = torch.randint(low, high + 1, (batch,), generator=gen, dtype=torch.int32)
    table = torch.randperm(batch * blocks, generator=gen).view(batch, blocks).to(torch.int32)
    positions = lengths.long() - 1
    write_slots = table.gather(1, (positions // PAGE_SIZE)[:, None])[:, 0].long() * PAGE_SIZE
    slots = batch * blocks * PAGE_SIZE
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def heads(rows: int, count: int) -> torch.Tensor:
        return torch.randn(rows, count, shape.head_dim, device=device, dtype=dtype)

    return PagedDecodeInputs(
        query=heads(batch, shape.q_heads),
        key_cache=heads(slots, shape.kv_heads),
        value_cache=heads(slots, shape.kv_heads),
        block_table=table.to(device),
        lengths=lengths.to(device),
        page_size=PAGE_SIZE,
        softmax_scale=shape.head_dim**-0.5,
        sliding_window=None,
        sinks=None,
        new_key=heads(batch, shape.kv_heads),
        new_value=heads(batch, shape.kv_heads),
        write_slots=(write_slots + positions % PAGE_SIZE).to(device),
    )


@dataclass(frozen=True)
class Tile:
    """The split kernel's launch shape: positions per step, warps, software-pipeline stages."""

    block_n: int
    num_warps: int
    num_stages: int

    @staticmethod
    def parse(text: str) -> Tile:
        block_n, warps, stages = (int(part) for part in text.split("x"))
        return Tile(block_n, warps, stages)

    def __str__(self) -> str:
        return f"{self.block_n}x{self.num_warps}x{self.num_stages}"


@dataclass(frozen=True)
class Launch:
    """One way to launch the kernel: its tile, its split count, rows started longest first or not."""

    tile: Tile
    splits: int
    longest_first: bool


def ragged_sweep(
    shape: Shape,
    batches: list[int],
    low: int,
    high: int,
    splits: list[int],
    tiles: list[Tile],
    device: str,
    *,
    rollout: bool,
    repeats: int,
) -> None:
    """Prints the kernel's GPU time per launch tile, split count and row order at ragged lengths, the
    median of ``repeats`` rounds that alternate the launches, with the L2 cache flushed before every
    call (a decode step's other kernels evict the pool from it). On CPU it checks the launches agree."""
    from d9d.kernels._triton.paged_attention_kernels import paged_decode_attention_kernel
    from d9d.kernels._triton.paged_attention_op import block_size, splits_for

    kind = "rollout rows" if rollout else "uniform"
    print(f"\n### ragged lengths {low}..{high} ({kind}), {shape.name} heads, page {PAGE_SIZE}, L2 flushed")
    columns = "tile (BLOCK_N x warps x stages) | splits | longest first | picked | kernel GPU us | spread"
    print(f"| batch | mean length | {columns} | GB/s | % of 4.8 TB/s | max abs diff to the default |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    flush = torch.empty(512 * 2**20 if device == "cuda" else 1, dtype=torch.uint8, device=device)
    for batch in batches:
        inputs = ragged_pool(shape, batch, low, high, device, rollout=rollout)
        ordered = PagedDecodeInputs(
            **{**inputs.__dict__, "row_order": torch.argsort(inputs.lengths, descending=True).to(torch.int32)}
        )
        kv_bytes = (
            int(inputs.lengths.sum()) * shape.kv_heads * 2 * shape.head_dim * inputs.key_cache.element_size()
        )
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 132
        default = Tile(block_size(inputs.query.dtype), 4, 2)
        picked = {
            first: splits_for(
                batch * shape.kv_heads, inputs.capacity, default.block_n, multiprocessors=sms, ordered=first
            )
            for first in (False, True)
        }
        launches = [
            Launch(tile, count, first)
            for tile in dict.fromkeys([default, *tiles])
            for count in sorted({*splits, *picked.values()})
            for first in (False, True)
        ]

        def run(
            launch: Launch, x: PagedDecodeInputs = inputs, y: PagedDecodeInputs = ordered
        ) -> torch.Tensor:
            t = launch.tile
            return paged_decode_attention_kernel(
                y if launch.longest_first else x, launch.splits, t.block_n, num_warps=t.num_warps,
                num_stages=t.num_stages,
            )  # fmt: skip

        reference = run(Launch(default, 1, False))
        diffs = {launch: (run(launch) - reference).float().abs().max().item() for launch in launches}
        times: dict[Launch, list[float]] = {launch: [] for launch in launches}
        for _ in range(repeats if device == "cuda" else 0):
            for launch in launches:
                times[launch].append(
                    1e3
                    * gpu_kernel_ms(lambda a=launch: run(a), 10, before=flush.zero_, kernels="paged_decode")
                )
        mean = float(inputs.lengths.float().mean())
        for launch in launches:
            us = statistics.median(times[launch]) if times[launch] else None
            spread = f"{min(times[launch]):.1f}-{max(times[launch]):.1f}" if times[launch] else "n/a"
            gbs = kv_bytes / (us * 1e-6) / 1e9 if us else None
            share = 100 * gbs / H200_GBS if gbs else None
            mark = "yes" if launch.splits == picked[launch.longest_first] and launch.tile == default else ""
            print(
                f"| {batch} | {mean:.0f} | {launch.tile} | {launch.splits} | "
                f"{'yes' if launch.longest_first else ''} | {mark} | {_cell(us, 1)} | {spread} | "
                f"{_cell(gbs, 0)} | {_cell(share, 1)} | {diffs[launch]:.4f} |",
                flush=True,
            )
        del inputs, ordered
        if device == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", "--smoke", action="store_true", help="tiny CPU shapes: checks the script")
    parser.add_argument("--out", type=Path, default=Path("benchmark-results"), help="folder for the JSON")
    parser.add_argument("--ragged", type=int, nargs=2, default=[512, 2560], metavar=("LOW", "HIGH"))
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256], help="the ragged sweep's")
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    parser.add_argument("--ragged-only", action="store_true", help="skip the uniform-length sweep")
    parser.add_argument(
        "--uniform-ragged",
        action="store_true",
        help="ragged lengths uniform over LOW..HIGH, not rollout rows (a LOW-token prompt part-way "
        "through a completion of 64..HIGH-LOW tokens)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds of the ragged sweep")
    parser.add_argument(
        "--tiles",
        type=Tile.parse,
        nargs="+",
        default=[],
        metavar="NxWxS",
        help="launch shapes the ragged sweep also times beside the default (BLOCK_N x warps x stages)",
    )
    args = parser.parse_args()
    settings = settings_for(smoke=args.quick, out=args.out)
    if settings.smoke:
        if triton_interpreter_enabled():
            tiny = Shape(name="tiny", q_heads=4, kv_heads=2, head_dim=16)
            ragged_sweep(tiny, [3], 5, 70, [1, 3], [Tile(16, 2, 1)], settings.device, rollout=True, repeats=1)
        if not args.ragged_only:
            run(settings)
        return
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if not args.ragged_only:
        run(settings)
    for shape in (Shape(name="Qwen3-0.6B", q_heads=16, kv_heads=8, head_dim=128),):
        ragged_sweep(
            shape, args.batches, *args.ragged, args.splits, args.tiles, settings.device,
            rollout=not args.uniform_ragged, repeats=args.repeats,
        )  # fmt: skip


if __name__ == "__main__":
    main()
