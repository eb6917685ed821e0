"""Runs every op benchmark in one process and writes a Markdown summary.

Run: python packages/d9d-kernels/benchmarks/run_all.py --out DIR   (add --smoke on CPU)
"""

from __future__ import annotations

import sys
import traceback

import bench_adamw
import bench_grouped_mm
import bench_linear_cross_entropy
import bench_paged_attention
import bench_rms_norm
import bench_rope
import bench_swiglu
import torch
from _harness import parse_settings


def main() -> None:
    settings = parse_settings(__doc__ or "")
    if not settings.smoke:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    only = {a for a in sys.argv[1:] if a.startswith("bench_")}
    for module in (
        bench_rms_norm,
        bench_swiglu,
        bench_rope,
        bench_linear_cross_entropy,
        bench_grouped_mm,
        bench_adamw,
        bench_paged_attention,
    ):
        if only and module.__name__ not in only:
            continue
        try:
            module.run(settings)
        except Exception:
            traceback.print_exc()


if __name__ == "__main__":
    main()
