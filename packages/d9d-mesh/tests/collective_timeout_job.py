"""A 2-rank job (under torchrun) whose rank 1 never joins a collective; run by test_nccl_environment.

Rank 0 waits in an all-reduce with the context's 2 s timeout; rank 1 sleeps far longer than any
test waits, so the job can only end through the timeout.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from d9d.mesh import DistributedContext, MeshParameters

SLEEPER_S = 3600.0


def main() -> None:
    context = DistributedContext(
        MeshParameters(data_parallel_shard=2), device_type="cpu", timeout=timedelta(seconds=2)
    )
    tensor = torch.ones(1)
    dist.all_reduce(tensor)  # both ranks: the group works
    if context.rank == 1:
        print("JOB rank 1 skips the next collective", flush=True)
        time.sleep(SLEEPER_S)
        return
    print("JOB rank 0 enters the collective alone", flush=True)
    dist.all_reduce(tensor)
    print("JOB rank 0: the collective returned without its peer", flush=True)


if __name__ == "__main__":
    main()
