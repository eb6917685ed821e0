"""A 2-rank job (under torchrun) whose rank 1 never joins a collective; run by test_nccl_environment.

Rank 0 waits in an all-reduce with a 2 s timeout; rank 1 sleeps far longer than any test waits, so
the job can only end through the timeout.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from d9d.mesh import DistributedContext, MeshParameters

SLEEPER_S = 3600.0
SETUP_TIMEOUT = timedelta(seconds=600)
SKIPPED_COLLECTIVE_TIMEOUT = timedelta(seconds=2)


def main() -> None:
    # Setup (rendezvous, the mesh's groups, one meeting of both ranks) runs under a generous
    # timeout: on a busy machine one rank may get there seconds after the other, which must not
    # be mistaken for the skipped collective below. Only that collective runs under 2 s.
    context = DistributedContext(
        MeshParameters(data_parallel_shard=2), device_type="cpu", timeout=SETUP_TIMEOUT
    )
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    context.set_timeout(SKIPPED_COLLECTIVE_TIMEOUT)
    if context.rank == 1:
        print("JOB rank 1 skips the next collective", flush=True)
        time.sleep(SLEEPER_S)
        return
    print("JOB rank 0 enters the collective alone", flush=True)
    dist.all_reduce(tensor)
    print("JOB rank 0: the collective returned without its peer", flush=True)


if __name__ == "__main__":
    main()
