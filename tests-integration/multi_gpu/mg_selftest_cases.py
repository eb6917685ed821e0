"""The harness's own cases (``--selftest`` only): a failure on one rank must end the run, not hang it."""

from __future__ import annotations

import torch.distributed as dist
from mg_case_env import Case, CaseEnv


def _one_rank_fails(env: CaseEnv) -> str:
    """Rank 1 fails before a collective that rank 0 then waits in for good (what a failed check does)."""
    del env
    if dist.get_rank() == 1:
        raise AssertionError("rank 1's check failed")
    dist.barrier()
    return "rank 0 passed the barrier"


CASES = [Case(name="one_rank_fails", run=_one_rank_fails)]
