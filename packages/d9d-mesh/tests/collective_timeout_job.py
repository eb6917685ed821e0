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
    # Both ranks meet once in a group of their own with a generous timeout: on a busy machine one
    # rank may reach this line seconds after the other, which the 2 s group must not mistake for
    # the skipped collective below.
    patient = dist.new_group(timeout=timedelta(seconds=600))
    dist.all_reduce(tensor, group=patient)
    if context.rank == 1:
        print("JOB rank 1 skips the next collective", flush=True)
        time.sleep(SLEEPER_S)
        return
    print("JOB rank 0 enters the collective alone", flush=True)
    dist.all_reduce(tensor)
    print("JOB rank 0: the collective returned without its peer", flush=True)


if __name__ == "__main__":
    main()
