"""The multi-rank suite's harness on two CPU ranks: ranks agree on what they saw, and one failed rank
ends the run instead of hanging its peers."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from test_multi_gpu_suite import _case_lines, _run_suite

from d9d.mesh.testing import run_distributed

MULTI_GPU = Path(__file__).resolve().parent / "multi_gpu"
NAMES = ["step_000000006", "step_000000012"]


def _late_rank_one(directory: Path) -> None:
    """Rank 1 looks only once rank 0 could have deleted step 12 (bounded: rank 0 must not be able to)."""
    import torch.distributed as dist

    if dist.get_rank() != 1:
        return
    give_up = time.monotonic() + 3.0
    while (directory / NAMES[1]).exists() and time.monotonic() < give_up:
        time.sleep(0.01)


def _list_then_drop(directory: str) -> list[str]:
    if str(MULTI_GPU) not in sys.path:
        sys.path.insert(0, str(MULTI_GPU))
    from mg_loop_cases import checked_then_dropped

    path = Path(directory)
    checked_then_dropped(path, NAMES, before_listing=lambda: _late_rank_one(path))
    return sorted(p.name for p in path.iterdir())


def test_a_late_rank_lists_the_checkpoints_before_rank_0_drops_the_newest(tmp_path: Path) -> None:
    # The async_checkpoint case's flake: rank 0 listed, then deleted step 12 while rank 1 had not
    # listed yet; rank 1 then saw only step 6 ("async checkpoints on disk: ['step_000000006']").
    for name in NAMES:
        (tmp_path / name).mkdir()
    after = run_distributed(_list_then_drop, str(tmp_path), world_size=2)
    assert after == [[NAMES[0]], [NAMES[0]]]


def test_a_case_failing_on_one_rank_ends_the_run_instead_of_hanging_the_other(tmp_path: Path) -> None:
    # Rank 1 fails before a barrier that rank 0 then waits in; the run used to hang rank 0 there.
    # Rank 1 waits out the whole straggler timeout (rank 0 never reports), so it sets this test's
    # length; a few seconds still leave the ranks' skew at the status group's setup far behind.
    try:
        result = _run_suite(
            tmp_path, "--device", "cpu", "--selftest", "--straggler-timeout", "8", timeout_s=240
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError("the suite hung after one rank failed") from e
    assert result.returncode != 0
    lines = _case_lines(result)
    assert any(
        "one_rank_fails: FAIL" in line and "rank 1 failed: AssertionError: rank 1's check failed" in line
        for line in lines
    ), result.stdout[-2000:] + result.stderr[-2000:]
    assert "ranks diverged" in (tmp_path / "summary.md").read_text()
