"""Every d9d parallelism on two ranks, each case matched against one process.

    torchrun --nproc-per-node 2 tests-integration/multi_gpu/nccl_suite.py \
        [--device cuda|cpu] [--only NAME[,NAME...]] --out DIR

One rank per GPU with NCCL (``--device cuda``, the default where CUDA exists), or CPU ranks with
gloo. fp32 with TF32 off. Each case prints ``CASE name: PASS|FAIL (detail, max abs diff, time)``;
a failing case does not stop the others, a hung one ends the run after ``--case-timeout`` seconds
(recorded as a failure). Ranks exchange each case's outcome over a gloo group of their own: a rank
that finished a case waits at most ``--straggler-timeout`` seconds for the others, then records the
case as failed and ends the run (torchrun ends the ranks still inside it, e.g. in a collective the
failed rank never joined), instead of hanging them. ``DIR`` receives summary.json, summary.md and
each rank's log of tracebacks; the exit status is non-zero if any case failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from mg_case_env import Case, CaseEnv
from mg_harness import Tolerance
from mg_loop_cases import CASES as LOOP_CASES
from mg_parallel_cases import CASES as PARALLEL_CASES
from mg_pipeline_cases import CASES as PIPELINE_CASES
from mg_selftest_cases import CASES as SELFTEST_CASES

# What scripts/multi-gpu.sh exports, also for a direct torchrun: NVLink multicast stays off.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ALL_CASES: list[Case] = [*PARALLEL_CASES, *PIPELINE_CASES, *LOOP_CASES]
# fp32 with TF32 off: GPU results differ from one process only by reduction order.
TOLERANCES = {"cuda": Tolerance(atol=5e-5, rtol=2e-4), "cpu": Tolerance(atol=2e-5, rtol=1e-4)}


@dataclass(kw_only=True)
class CaseResult:
    name: str
    status: str
    detail: str
    max_abs_diff: float
    seconds: float

    def line(self) -> str:
        return (
            f"CASE {self.name}: {self.status} ({self.detail}, max abs diff {self.max_abs_diff:.3g}, "
            f"{self.seconds:.1f} s)"
        )


class Summary:
    """The run's record, kept on every rank; rank 0 rewrites it after every case so a killed run keeps
    its results, and any rank that ends the run writes it last."""

    def __init__(self, out: Path, header: dict[str, str], *, writer: bool) -> None:
        self._out = out
        self._header = header
        self._writer = writer
        self.results: list[CaseResult] = []

    def add(self, result: CaseResult) -> None:
        self.results.append(result)
        if self._writer:
            print(result.line(), flush=True)
            self.write()

    def write(self, note: str = "") -> None:
        failed = [r.name for r in self.results if r.status != "PASS"]
        data = {**self._header, "note": note, "failed": failed, "cases": [asdict(r) for r in self.results]}
        (self._out / "summary.json").write_text(json.dumps(data, indent=2))
        lines = [f"# d9d multi-rank suite: {self._header['device']}", ""]
        lines += [f"- {k}: {v}" for k, v in self._header.items()]
        lines += ["", "| case | result | max abs diff | seconds | detail |", "|---|---|---|---|---|"]
        for r in self.results:
            lines.append(f"| {r.name} | {r.status} | {r.max_abs_diff:.3g} | {r.seconds:.1f} | {r.detail} |")
        if note:
            lines += ["", note]
        (self._out / "summary.md").write_text("\n".join(lines) + "\n")


def _select(cases: list[Case], only: str | None, device: str, world: int) -> list[Case]:
    chosen = [c for c in cases if c.needs_world == world and (device == "cuda" or not c.cuda_only)]
    if only:
        wanted = [w.strip() for w in only.split(",") if w.strip()]
        chosen = [c for c in chosen if any(c.name == w or c.name.startswith(w) for w in wanted)]
        if not chosen:
            raise SystemExit(f"--only {only!r} matches no case of {[c.name for c in cases]}")
    return chosen


def _short(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".replace("\n", " ")
    return text if len(text) < 300 else text[:297] + "..."


def _run_case(case: Case, env: CaseEnv, log: Path) -> tuple[bool, str]:
    try:
        return True, case.run(env)
    except Exception as error:
        with log.open("a") as f:
            f.write(f"=== {case.name}\n{traceback.format_exc()}\n")
        return False, _short(error)


def _exchange(
    outcome: tuple[bool, str, float], world: int, group: dist.ProcessGroup
) -> list[tuple[bool, str, float]] | None:
    """Every rank's outcome of a case; None when some rank did not finish it within the group's timeout."""
    outcomes: list[tuple[bool, str, float] | None] = [None] * world
    try:
        dist.all_gather_object(outcomes, outcome, group=group)
    except RuntimeError:  # gloo: "Timed out waiting ... for recv"
        return None
    return [o for o in outcomes if o is not None]


def _end_run(summary: Summary, result: CaseResult, note: str) -> None:
    """Records a case that left ranks behind and ends this rank; torchrun then ends the others."""
    print(result.line(), flush=True)
    summary.results.append(result)
    summary.write(note=note)
    os._exit(2)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--only", default=None, help="comma-separated case names or name prefixes")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--case-timeout", type=float, default=240.0)
    parser.add_argument(
        "--straggler-timeout",
        type=float,
        default=60.0,
        help="seconds a rank that finished a case waits for the others before ending the run",
    )
    parser.add_argument("--selftest", action="store_true", help="run only the harness's own cases")
    args = parser.parse_args()
    for name, value in NCCL_ENV.items():
        os.environ.setdefault(name, value)
    device_type: str = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(seconds=args.case_timeout))
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.case_timeout))
    torch.set_float32_matmul_precision("highest")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"rank{rank}.log"
    log.write_text("")
    # Outcomes travel on their own gloo group: a rank that failed early must not issue a collective
    # on the group its peers are still using inside the case (NCCL would pair it with theirs).
    status_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.straggler_timeout))
    cases = _select(SELFTEST_CASES if args.selftest else ALL_CASES, args.only, device_type, world)
    header = {
        "device": f"{world} x {torch.cuda.get_device_name(device) if device_type == 'cuda' else 'CPU'}",
        "backend": dist.get_backend(),
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device_type == "cuda" else "-",
    }
    summary = Summary(out, header, writer=rank == 0)

    failed = 0
    for case in cases:
        scratch = out / "scratch" / case.name
        if rank == 0:
            scratch.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        tolerance = TOLERANCES[device_type]
        env = CaseEnv(
            device=device, scratch=scratch, tolerance=Tolerance(atol=tolerance.atol, rtol=tolerance.rtol)
        )
        start = time.monotonic()

        def hung(case: Case = case, start: float = start) -> None:
            # A collective that never completes: record it and end this rank (torchrun ends the rest).
            result = CaseResult(
                name=case.name, status="FAIL", detail=f"hung on rank {rank}; ended by the case timeout",
                max_abs_diff=float("nan"), seconds=time.monotonic() - start,
            )  # fmt: skip
            _end_run(
                summary, result, f"Run ended at {case.name}: hung past --case-timeout {args.case_timeout} s."
            )

        timer = threading.Timer(args.case_timeout, hung)
        timer.daemon = True
        timer.start()
        ok, detail = _run_case(case, env, log)
        if device_type == "cuda":
            torch.cuda.synchronize()
        everyone = _exchange((ok, detail, env.tolerance.max_abs_diff), world, status_group)
        timer.cancel()
        if everyone is None:
            state = "passed" if ok else f"failed: {detail}"
            _end_run(
                summary,
                CaseResult(
                    name=case.name,
                    status="FAIL",
                    detail=f"rank {rank} {state}; another rank did not finish within "
                    f"--straggler-timeout {args.straggler_timeout} s (ended)",
                    max_abs_diff=env.tolerance.max_abs_diff,
                    seconds=time.monotonic() - start,
                ),
                f"Run ended at {case.name}: ranks diverged.",
            )
            return 2  # not reached: _end_run ends the process
        bad = [(r, o) for r, o in enumerate(everyone) if not o[0]]
        passed = not bad
        failed += not passed
        summary.add(
            CaseResult(
                name=case.name,
                status="PASS" if passed else "FAIL",
                detail=everyone[0][1] if passed else "; ".join(f"rank {r}: {o[1]}" for r, o in bad),
                max_abs_diff=max(o[2] for o in everyone),
                seconds=time.monotonic() - start,
            )
        )
    if rank == 0:
        summary.write(note=f"{len(cases) - failed} of {len(cases)} cases passed.")
        print(f"SUITE {len(cases) - failed}/{len(cases)} passed; summary in {out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
