"""How fast ``d9d.mesh.testing.run_distributed`` starts 4 CPU ranks and runs one all-reduce.

A speed claim belongs here, not in a test: a test asserting wall time fails on a busy machine.

Run: uv run packages/d9d-mesh/benchmarks/rank_startup.py [--repeats 5] [--world-size 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from d9d.mesh.testing import run_distributed


def _rank_and_sum() -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()
    run_distributed(_rank_and_sum, world_size=args.world_size)  # warm-up: the zygote starts once
    times: list[float] = []
    for _ in range(args.repeats):
        start = time.monotonic()
        run_distributed(_rank_and_sum, world_size=args.world_size)
        times.append(time.monotonic() - start)
    print(
        f"{args.world_size} ranks, {args.repeats} runs: median {statistics.median(times):.2f} s, "
        f"min {min(times):.2f} s, max {max(times):.2f} s"
    )


if __name__ == "__main__":
    main()
