"""Host (Python) time of a pipeline step at tiny shapes: CPU ranks joined by gloo.

Every stage is one ``Linear(64, 64)``; a step runs 8 microbatches of 2 rows, so compute is a few
microseconds per action and the step time is almost all host work: splitting the batch, the shape
agreement at the start of the step, building the runner, posting point-to-point ops, the
autograd calls. For every schedule the ranks warm up, then time ``--steps`` steps ``--repeats``
times (a barrier before each repeat); printed per rank: the median over repeats (ms) with the
min-max spread of the step's wall time and of the main thread's CPU time (the host work, without
the sleeps while waiting for a peer), each also per action (step time / actions of the rank,
communication included); then the shape agreement alone, run in a loop: what a step pays for it
(``shape agreement per step``) and the full exchange of specs down the pipeline (``full
exchange``; before the exchange was skipped when nothing changed, the two were the same).

Run:  uv run --no-sync python packages/d9d-pipeline/benchmarks/host_overhead.py [--world-size 2]
      [--steps 50] [--repeats 5] [--profile]

``--profile`` prints rank 0's cProfile (main-thread CPU time) of each schedule's steps (top 25 by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from d9d.mesh.testing import run_distributed
from d9d.pipeline import (
    DualPipeVScheduleConfig,
    Interleaved1F1BScheduleConfig,
    OneFOneBScheduleConfig,
    PipelineExecutor,
    PipelineScheduleConfig,
    ZBVScheduleConfig,
    build_program,
)

WIDTH = 64
MICROBATCHES = 8
ROWS_PER_MICROBATCH = 2
WARMUP_STEPS = 5

SCHEDULES: list[tuple[str, PipelineScheduleConfig]] = [
    ("1f1b", OneFOneBScheduleConfig()),
    ("interleaved_1f1b v=2", Interleaved1F1BScheduleConfig(stages_per_rank=2)),
    ("zbv", ZBVScheduleConfig()),
    ("dualpipev, pairs overlapped", DualPipeVScheduleConfig()),
    ("dualpipev, pairs one after the other", DualPipeVScheduleConfig(overlap=False)),
]


def _timed(fn: Callable[[], Any], *, steps: int, repeats: int) -> tuple[list[float], list[float]]:
    """Wall and main-thread CPU seconds per call of ``fn``, one number per repeat.

    The ranks start each repeat together (a barrier). The thread's CPU time is the host work
    alone: it leaves out the time the thread sleeps waiting for a peer or for another process's
    turn on a core, which on a shared 2-core machine is most of the wall time and most of its noise.
    """
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(repeats):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            fn()
        cpu.append((time.thread_time() - start_cpu) / steps)
        wall.append((time.perf_counter() - start) / steps)
    return wall, cpu


def _rank_main(steps: int, repeats: int, profile: bool) -> list[dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    results: list[dict[str, Any]] = []
    for name, config in SCHEDULES:
        program = build_program(config, num_ranks=world, num_microbatches=MICROBATCHES)
        torch.manual_seed(0)
        modules = [nn.Linear(WIDTH, WIDTH) for _ in range(program.num_stages)]
        executor = PipelineExecutor(program, {s: modules[s] for s in program.stages_of(rank)})
        batch = torch.randn(MICROBATCHES * ROWS_PER_MICROBATCH, WIDTH)

        def loss_fn(out: torch.Tensor, microbatch: int) -> torch.Tensor:
            return out.sum()

        def step(executor: PipelineExecutor = executor, batch: torch.Tensor = batch) -> None:
            executor.step(batch, loss_fn=loss_fn)

        for _ in range(WARMUP_STEPS):
            step()
        step_s, step_cpu_s = _timed(step, steps=steps, repeats=repeats)

        first = batch[:ROWS_PER_MICROBATCH] if 0 in program.stages_of(rank) else None
        # Private seams, on purpose: the benchmark times the shape agreement of a step alone.
        full: Callable[[], None] = lambda ex=executor, mb=first: ex._exchange_shapes(mb, None, None)  # noqa: E731
        per_step_fn = getattr(executor, "_agree_on_shapes", None)
        per_step: Callable[[], None] = (
            full if per_step_fn is None else (lambda f=per_step_fn, mb=first: f(mb, None, None))
        )
        per_step_s, per_step_cpu_s = _timed(per_step, steps=steps, repeats=repeats)
        full_s, full_cpu_s = _timed(full, steps=steps, repeats=repeats)

        profile_text = ""
        if profile and rank == 0:
            dist.barrier()
            prof = cProfile.Profile(time.thread_time)  # host CPU, not waiting
            prof.enable()
            for _ in range(steps):
                step()
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            cumulative = pstats.Stats(prof, stream=text).sort_stats("cumulative")
            cumulative.print_stats("d9d|distributed_c10d|autograd", 30)
            profile_text = text.getvalue()
        elif profile:
            dist.barrier()
            for _ in range(steps):
                step()
        results.append(
            {
                "schedule": name,
                "actions": len(program.actions[rank]),
                "compute": len(program.compute_actions(rank)),
                "step_s": step_s,
                "step_cpu_s": step_cpu_s,
                "per_step_shapes_s": per_step_s,
                "per_step_shapes_cpu_s": per_step_cpu_s,
                "full_exchange_s": full_s,
                "full_exchange_cpu_s": full_cpu_s,
                "profile": profile_text,
            }
        )
    return results


def _ms(values: list[float]) -> str:
    med = statistics.median(values) * 1e3
    return f"{med:7.3f} ms [{min(values) * 1e3:.3f}-{max(values) * 1e3:.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    per_rank: list[list[dict[str, Any]]] = run_distributed(
        _rank_main, args.steps, args.repeats, args.profile, world_size=args.world_size, timeout_s=1800
    )
    print(
        f"{args.world_size} gloo ranks on CPU (1 thread each), Linear({WIDTH}, {WIDTH}) stages, "
        f"{MICROBATCHES} microbatches of {ROWS_PER_MICROBATCH} rows; "
        f"median of {args.repeats} repeats x {args.steps} steps [min-max]"
    )
    for i, (name, _) in enumerate(SCHEDULES):
        print(f"\n{name}")
        for rank, results in enumerate(per_rank):
            r = results[i]
            n = r["actions"]
            wall, cpu = statistics.median(r["step_s"]), statistics.median(r["step_cpu_s"])
            print(
                f"  rank {rank} ({n} actions, {r['compute']} compute): step wall {_ms(r['step_s'])} "
                f"= {wall / n * 1e6:.0f} us/action; host CPU {_ms(r['step_cpu_s'])} "
                f"= {cpu / n * 1e6:.0f} us/action\n"
                f"      shape agreement per step: wall {_ms(r['per_step_shapes_s'])}, "
                f"CPU {_ms(r['per_step_shapes_cpu_s'])}; full exchange: wall {_ms(r['full_exchange_s'])}, "
                f"CPU {_ms(r['full_exchange_cpu_s'])}"
            )
    for i, (name, _) in enumerate(SCHEDULES):
        text = per_rank[0][i]["profile"]
        if text:
            print(f"\n=== rank 0 profile, {name}, {args.steps} steps ===\n{text}")


if __name__ == "__main__":
    main()
