"""d9d-loop jobs on two ranks: the quickstart, DCP resume onto another layout, async checkpoints,
and hung jobs that must end with an error naming where (in a separate torchrun, since they end
their processes)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from mg_case_env import Case, CaseEnv

HERE = Path(__file__).resolve().parent
INTEGRATION = HERE.parent
STEPS = 12
_LAUNCH_VARS = re.compile(
    r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_.*|"
    r"MASTER_ADDR|MASTER_PORT|TORCHELASTIC_.*|TORCH_NCCL_ASYNC_ERROR_HANDLING)$"
)


def clean_env() -> dict[str, str]:
    """This process's environment without the variables torchrun set for it."""
    return {k: v for k, v in os.environ.items() if not _LAUNCH_VARS.match(k)}


def run_quickstart(config: dict[str, Any]) -> dict[str, Any]:
    """tests-integration/quickstart_job.py's run (imported on first use: d9d.loop is slow to import)."""
    if str(INTEGRATION) not in sys.path:
        sys.path.insert(0, str(INTEGRATION))
    from quickstart_job import run_quickstart as run

    return run(config)


def _config(env: CaseEnv, mesh: dict[str, int], checkpoint: dict[str, Any] | None = None) -> dict[str, Any]:
    if str(INTEGRATION) not in sys.path:
        sys.path.insert(0, str(INTEGRATION))
    from quickstart_job import quickstart_config

    trainer: dict[str, Any] = {"max_steps": STEPS, "device": env.device_type}
    if checkpoint is not None:
        trainer["checkpoint"] = checkpoint
    return quickstart_config(mesh=mesh, trainer=trainer)


def _single_process_losses(env: CaseEnv, config: dict[str, Any]) -> list[float]:
    """Rank 0 trains ``config`` in a fresh one-process job; every rank gets its losses."""
    result: list[Any] = [None]
    if dist.get_rank() == 0:
        out = env.scratch / "single_process.json"
        code = (
            "import json, sys; sys.path.insert(0, sys.argv[1]); "
            "from quickstart_job import run_quickstart; r = run_quickstart(json.loads(sys.argv[2])); "
            "open(sys.argv[3], 'w').write(json.dumps(r['losses']))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code, str(INTEGRATION), json.dumps(config), str(out)],
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        result[0] = json.loads(out.read_text()) if done.returncode == 0 else done.stderr[-2000:]
    dist.broadcast_object_list(result, src=0)
    if not isinstance(result[0], list):
        raise AssertionError(f"the single-process run failed:\n{result[0]}")
    return [float(x) for x in result[0]]


def _quickstart(env: CaseEnv) -> str:
    reference = _single_process_losses(env, _config(env, {}))
    losses = run_quickstart(_config(env, {"data_parallel_shard": 2}))["losses"]
    env.tolerance.check(torch.tensor(losses), torch.tensor(reference), "loss curve")
    return f"{STEPS} steps, dp_shard=2 vs one process, final loss {losses[-1]:.5f}"


def _drop_newest(directory: Path) -> None:
    """Keeps only the step-6 checkpoint, so the next run resumes half-way.

    Every rank must be done looking at the directory first: a rank that listed it after rank 0's
    ``rmtree`` saw only the step-6 checkpoint (the NCCL suite's async_checkpoint flake).
    """
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory / f"step_{STEPS:09d}")
    dist.barrier()


def checked_then_dropped(
    directory: Path, expected: list[str], before_listing: Callable[[], None] = lambda: None
) -> None:
    """Every rank lists ``directory`` and raises unless it holds ``expected``; then the newest goes.

    The listings are gathered, so all ranks fail together (none waits for a peer that raised).
    """
    before_listing()
    saved = sorted(p.name for p in directory.iterdir())
    listings: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(listings, saved)
    wrong = {rank: listing for rank, listing in enumerate(listings) if listing != expected}
    if wrong:
        raise AssertionError(f"checkpoints on disk by rank, expected {expected}: {wrong}")
    _drop_newest(directory)


def _compare_resumed(env: CaseEnv, resumed: dict[str, Any], full_run: dict[str, Any]) -> None:
    if resumed["start_step"] != STEPS // 2:
        raise AssertionError(f"resumed from step {resumed['start_step']}, expected {STEPS // 2}")
    env.tolerance.check(
        torch.tensor(resumed["losses"]), torch.tensor(full_run["losses"][STEPS // 2 :]), "resumed losses"
    )
    for name, value in full_run["params"].items():
        env.tolerance.check(resumed["params"][name], value, f"final {name}")


def _dcp_resume_other_layout(env: CaseEnv) -> str:
    directory = env.scratch / "dcp"
    checkpoint = {"directory": str(directory), "every_steps": STEPS // 2, "keep_last": 2}
    full_run = run_quickstart(_config(env, {"data_parallel_shard": 2}, checkpoint))
    _drop_newest(directory)
    resumed = run_quickstart(_config(env, {"data_parallel_replicate": 2}, checkpoint))
    _compare_resumed(env, resumed, full_run)
    return "saved under dp_shard=2 (FSDP) at step 6, resumed under dp_replicate=2 to step 12"


def _async_checkpoint(env: CaseEnv) -> str:
    sync_dir, async_dir = env.scratch / "sync", env.scratch / "async"
    every = STEPS // 2
    sync_run = run_quickstart(
        _config(env, {"data_parallel_shard": 2}, {"directory": str(sync_dir), "every_steps": every})
    )
    checkpoint = {"directory": str(async_dir), "every_steps": every, "asynchronous": True}
    async_run = run_quickstart(_config(env, {"data_parallel_shard": 2}, checkpoint))
    env.tolerance.check(torch.tensor(async_run["losses"]), torch.tensor(sync_run["losses"]), "async vs sync")
    checked_then_dropped(async_dir, [f"step_{every:09d}", f"step_{STEPS:09d}"])
    resumed = run_quickstart(_config(env, {"data_parallel_shard": 2}, checkpoint))
    _compare_resumed(env, resumed, sync_run)
    return "dcp.async_save every 6 steps; resumed from the async step-6 checkpoint"


def _probe(env: CaseEnv, mode: str, expect: list[str], limit_s: float) -> str:
    """Rank 0 runs the hanging job under its own torchrun; it must fail fast, naming where."""
    result: list[Any] = [None]
    if dist.get_rank() == 0:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(HERE / "mg_hang_probe.py"), "--mode", mode, "--device", env.device_type,
        ]  # fmt: skip
        start = time.monotonic()
        try:
            done = subprocess.run(
                command, env=clean_env(), capture_output=True, text=True, timeout=limit_s, check=False
            )
            elapsed = time.monotonic() - start
            output = done.stdout + done.stderr
            (env.scratch / f"{mode}_probe.log").write_text(output)
            missing = [p for p in expect if not re.search(p, output)]
            if done.returncode == 0:
                result[0] = f"FAIL: the hung job exited 0 after {elapsed:.0f} s"
            elif missing:
                result[0] = f"FAIL: exit {done.returncode} after {elapsed:.0f} s; output lacks {missing}"
            else:
                first = next((m.group(0) for p in expect if (m := re.search(p + ".{0,160}", output))), "")
                result[0] = f"exit {done.returncode} after {elapsed:.0f} s: {first.strip()}"
        except subprocess.TimeoutExpired:
            result[0] = f"FAIL: still hung after {limit_s:.0f} s"
    dist.broadcast_object_list(result, src=0)
    detail = str(result[0])
    if detail.startswith("FAIL"):
        raise AssertionError(detail)
    return detail


def _step_watchdog(env: CaseEnv) -> str:
    return _probe(env, "watchdog", [r"step 3 did not finish within 3 s on rank \d"], limit_s=150)


def _collective_timeout(env: CaseEnv) -> str:
    # gloo raises in the caller ("Timed out ... all_reduce" traceback); NCCL's watchdog ends the
    # process with "Watchdog caught collective operation timeout: WorkNCCL(... OpType=ALLREDUCE".
    return _probe(env, "collective", [r"(?i)time(d)? ?out", r"(?i)all_?reduce"], limit_s=150)


CASES = [
    Case(name="quickstart_dp_shard_2", run=_quickstart),
    Case(name="dcp_resume_other_layout", run=_dcp_resume_other_layout),
    Case(name="async_checkpoint", run=_async_checkpoint),
    Case(name="step_watchdog", run=_step_watchdog),
    Case(name="collective_timeout", run=_collective_timeout),
]
