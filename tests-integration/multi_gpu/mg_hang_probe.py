"""A job that hangs on purpose, run under its own torchrun by the suite's ``step_watchdog`` and
``collective_timeout`` cases: rank 1 stops taking part, and the job must end with an error that
says where, instead of hanging.

    torchrun --standalone --nproc-per-node 2 mg_hang_probe.py --mode watchdog|collective --device cpu|cuda
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests-integration: quickstart_job

from d9d.mesh import DistributedContext, MeshParameters

HANG_S = 120.0


def _collective(device: str) -> None:
    context = DistributedContext(
        MeshParameters(data_parallel_shard=2),
        device_type="cuda" if device == "cuda" else "cpu",
        timeout=timedelta(seconds=5),
    )
    tensor = torch.ones(1, device=context.device)
    dist.all_reduce(tensor)  # both ranks: communicators are up
    float(tensor)
    if context.rank == 1:
        print("PROBE rank 1 skips the second collective", flush=True)
        time.sleep(HANG_S)
        os._exit(0)
    print("PROBE rank 0 enters the second collective", flush=True)
    dist.all_reduce(tensor)
    float(tensor)  # gloo raises here; NCCL: the watchdog aborts the communicator, so the wait returns
    print("PROBE rank 0: the collective returned without its peer", flush=True)
    # Carry on as a training loop would. With NCCL the watchdog tears the process down (or the next
    # collective on the aborted communicator raises); exiting 0 below means nothing ended the job.
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        dist.all_reduce(tensor)
        float(tensor)
        time.sleep(0.5)
    print("PROBE rank 0 carried on for 60 s after the timeout", flush=True)
    os._exit(0)


def _watchdog(device: str) -> None:
    from quickstart_job import load_quickstart

    from d9d.loop import (
        AutoDataProvider,
        AutoLRSchedulerProvider,
        AutoOptimizerProvider,
        EventBus,
        ProjectConfig,
        StepStarted,
        TrainingConfigurator,
    )

    qs = load_quickstart()
    raw = {
        "mesh": {"data_parallel_shard": 2},
        "trainer": {
            "max_steps": 8,
            "global_batch_size": 64,
            "microbatch_size": 8,
            "logging": {"progress_bar": False},
            "device": device,
            "timeouts": {"step_seconds": 3, "first_step_seconds": 120},
        },
        "optimizer": {"name": "adamw", "lr": 0.003},
        "lr_scheduler": {"name": "constant"},
    }
    config = ProjectConfig.model_validate(raw)
    events = EventBus()
    rank = int(os.environ["RANK"])

    def stall(event: StepStarted) -> None:
        if event.step == 3 and rank == 1:
            print("PROBE rank 1 stalls in step 3", flush=True)
            time.sleep(HANG_S)

    events.subscribe(StepStarted, stall)
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=qs.MLPProvider(),
        task_provider=lambda ctx: qs.RegressionTask(),
        data_provider=AutoDataProvider(
            dataset_factory=lambda dist_context: qs.RegressionDataset(4096, 16),
            collator=qs.RegressionDataset.collate,
            config=config.data,
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
        events=events,
    ).configure()
    trainer.train()
    print("PROBE the stalled run finished without the watchdog", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["watchdog", "collective"], required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.mode == "collective":
        _collective(args.device)
    else:
        _watchdog(args.device)


if __name__ == "__main__":
    main()
