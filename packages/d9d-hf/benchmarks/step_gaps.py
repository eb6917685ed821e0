"""Where the GPU waits for the host: the idle gaps of a Chrome trace and what the host did in them.

Reads a trace written by ``torch.profiler`` (for example ``train_throughput.py --trace T``, which
writes ``T.rank<R>.json``), merges the GPU's kernel, copy and memset intervals, and prints the
busy and idle time of the traced window, then the longest gaps: when each starts (ms after the
first GPU activity), how long it lasts, and the host-side operators and CUDA runtime calls that
began inside it, most frequent first.

    python3 packages/d9d-hf/benchmarks/step_gaps.py T.rank0.json --top 12 --min-us 200
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_CATEGORIES = frozenset({"cpu_op", "cuda_runtime", "user_annotation", "python_function"})


@dataclass(frozen=True)
class Interval:
    start: float
    end: float


@dataclass(frozen=True)
class HostEvent:
    name: str
    category: str
    start: float
    duration: float


@dataclass(frozen=True)
class Gap:
    start: float
    end: float
    host: tuple[HostEvent, ...]

    @property
    def duration(self) -> float:
        return self.end - self.start


def merged_busy(intervals: list[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    merged: list[Interval] = []
    for interval in sorted(intervals, key=lambda i: i.start):
        if merged and interval.start <= merged[-1].end:
            last = merged[-1]
            merged[-1] = Interval(last.start, max(last.end, interval.end))
        else:
            merged.append(interval)
    return merged


def gaps_between(busy: list[Interval], host: list[HostEvent], min_us: float) -> list[Gap]:
    """Idle stretches of at least ``min_us`` between busy intervals, with the host events begun in them."""
    host_sorted = sorted(host, key=lambda e: e.start)
    gaps: list[Gap] = []
    cursor = 0
    for before, after in itertools.pairwise(busy):
        if after.start - before.end < min_us:
            continue
        while cursor < len(host_sorted) and host_sorted[cursor].start < before.end:
            cursor += 1
        inside: list[HostEvent] = []
        index = cursor
        while index < len(host_sorted) and host_sorted[index].start < after.start:
            inside.append(host_sorted[index])
            index += 1
        gaps.append(Gap(before.end, after.start, tuple(inside)))
    return gaps


def read_trace(path: Path) -> tuple[list[Interval], list[HostEvent]]:
    """The GPU intervals and the host events (microseconds) of a Chrome trace."""
    data: Any = json.loads(path.read_text())
    events: list[dict[str, Any]] = data["traceEvents"] if isinstance(data, dict) else data
    gpu: list[Interval] = []
    host: list[HostEvent] = []
    for event in events:
        if event.get("ph") != "X":
            continue
        category = str(event.get("cat", ""))
        start, duration = float(event["ts"]), float(event.get("dur", 0.0))
        if category in GPU_CATEGORIES:
            gpu.append(Interval(start, start + duration))
        elif category in HOST_CATEGORIES:
            host.append(HostEvent(str(event.get("name", "")), category, start, duration))
    return gpu, host


def summarize(path: Path, *, top: int, min_us: float, names: int) -> str:
    """The printed report for one trace."""
    gpu, host = read_trace(path)
    if not gpu:
        return f"{path}: no GPU activity in the trace"
    busy = merged_busy(gpu)
    origin = busy[0].start
    wall = busy[-1].end - origin
    busy_us = sum(i.end - i.start for i in busy)
    gaps = gaps_between(busy, host, min_us)
    lines = [
        f"{path}: GPU window {wall / 1e3:.1f} ms, busy {busy_us / 1e3:.1f} ms, idle "
        f"{(wall - busy_us) / 1e3:.1f} ms ({1 - busy_us / wall:.1%}); {len(gaps)} gaps >= {min_us:.0f} us "
        f"sum {sum(g.duration for g in gaps) / 1e3:.1f} ms",
    ]
    for gap in sorted(gaps, key=lambda g: g.duration, reverse=True)[:top]:
        counts = Counter(f"{e.category}:{e.name[:60]}" for e in gap.host)
        blocked = [e for e in gap.host if e.category == "cuda_runtime" and e.duration > 0.5 * gap.duration]
        lines.append(
            f"  at {(gap.start - origin) / 1e3:8.2f} ms  {gap.duration / 1e3:6.2f} ms  "
            f"{len(gap.host)} host events"
            + (f"; host blocked in {blocked[0].name} {blocked[0].duration / 1e3:.2f} ms" if blocked else "")
        )
        for name, count in counts.most_common(names):
            lines.append(f"      {count:5d} x {name}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=12, help="longest gaps to list")
    parser.add_argument("--min-us", type=float, default=200.0, help="shortest gap counted")
    parser.add_argument("--names", type=int, default=6, help="host event names listed per gap")
    args = parser.parse_args()
    for path in args.traces:
        print(summarize(path, top=args.top, min_us=args.min_us, names=args.names), flush=True)


if __name__ == "__main__":
    main()
