"""The trainer end to end on the toy job: equivalence across layouts, events, export, checkpoints."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from loop_toy_job import assert_same_run, build_trainer, full_parameters, toy_config, train_and_record
from safetensors.torch import load_file

from d9d.loop import (
    CheckpointSaved,
    EventBus,
    ForwardBackwardFinished,
    ModelReady,
    OptimizerStepFinished,
    StepFinished,
    StepStarted,
    TrainingFinished,
)
from d9d.mesh.testing import run_distributed


def _train(mesh: dict[str, int], strategy: str, weighted: bool, clip: float | None) -> dict[str, Any]:
    config = toy_config(mesh=mesh, trainer={"gradient_clipping": {"max_norm": clip}, "max_steps": 4})
    return train_and_record(config, strategy=strategy, weighted=weighted)


@pytest.mark.parametrize(
    ("mesh", "strategy", "weighted", "clip"),
    [
        # FSDP over 2 ranks, microbatches weighted by sample count, clipping active
        ({"data_parallel_shard": 2}, "fsdp", True, 0.05),
        # DDP-style replicate over 2 ranks, equal microbatch weights
        ({"data_parallel_replicate": 2}, "replicate", False, None),
        # HSDP 2x2 on 4 ranks
        ({"data_parallel_replicate": 2, "data_parallel_shard": 2}, "hsdp", False, 1.0),
    ],
)
def test_layouts_match_the_single_process_run(
    mesh: dict[str, int], strategy: str, weighted: bool, clip: float | None
) -> None:
    world = 1
    for degree in mesh.values():
        world *= degree
    reference = run_distributed(_train, {}, strategy, weighted, clip, world_size=1)[0]
    results = run_distributed(_train, mesh, strategy, weighted, clip, world_size=world, timeout_s=240)
    for result in results:
        assert_same_run(result, reference)


def _events_and_export(directory: str) -> tuple[list[str], list[str]]:
    seen: list[str] = []
    events = EventBus()
    for event_type in (
        ModelReady,
        StepStarted,
        ForwardBackwardFinished,
        OptimizerStepFinished,
        StepFinished,
        CheckpointSaved,
        TrainingFinished,
    ):
        events.subscribe(event_type, lambda e: seen.append(type(e).__name__))
    config = toy_config(
        trainer={
            "max_steps": 2,
            "checkpoint": {"directory": f"{directory}/ckpt", "every_steps": 1, "asynchronous": True},
            "logging": {
                "progress_bar": False,
                "tracker": {"name": "jsonl", "path": f"{directory}/metrics.jsonl"},
            },
        },
        mesh={"data_parallel_shard": 2},
    )
    trainer = build_trainer(config, events=events)
    trainer.train()
    # when train() returns, every rank sees the last asynchronous save published
    # (the job's lock, .d9d-lock, is there too until the trainer closes)
    listed = sorted(p.name for p in (Path(directory) / "ckpt").iterdir() if p.name.startswith("step_"))
    trainer.export(Path(directory) / "export")
    params = full_parameters(trainer)
    if trainer.dist_context.is_main_process:
        exported: dict[str, torch.Tensor] = {}
        for file in (Path(directory) / "export").glob("*.safetensors"):
            exported.update(load_file(str(file)))
        assert sorted(exported) == sorted(params)
        for name, value in params.items():
            assert torch.equal(exported[name], value), name
    trainer.close()  # the trainer owns the context it built: this releases it too
    return seen, listed


def test_events_fire_in_order_and_async_checkpoints_and_export_work(tmp_path: Path) -> None:
    results = run_distributed(_events_and_export, str(tmp_path), world_size=2, timeout_s=240)
    seen = results[0][0]
    assert [listed for _, listed in results] == [["step_000000001", "step_000000002"]] * 2
    step_events = ["StepStarted", "ForwardBackwardFinished", "OptimizerStepFinished", "StepFinished"]
    assert seen == [
        "ModelReady",
        *step_events,
        *step_events,
        "CheckpointSaved",  # the asynchronous save of step 1, made visible before step 2's starts
        "CheckpointSaved",
        "TrainingFinished",
    ]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000000001", "step_000000002"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert {"loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "mae"} <= set(records[0])


def _resume_twice(directory: str) -> tuple[list[float], list[float]]:
    base = {
        "checkpoint": {"directory": directory, "every_steps": 2, "keep_last": 1},
        "logging": {"progress_bar": False},
    }
    first = build_trainer(toy_config(trainer={**base, "max_steps": 4}))
    losses_a: list[float] = []
    first.events.subscribe(ForwardBackwardFinished, lambda e: losses_a.append(e.loss))
    first.train()
    first.close()
    second = build_trainer(toy_config(trainer={**base, "max_steps": 6}))
    losses_b: list[float] = []
    second.events.subscribe(ForwardBackwardFinished, lambda e: losses_b.append(e.loss))
    second.train()
    assert second.step == 6
    second.close()
    return losses_a, losses_b


def test_a_longer_run_continues_from_the_last_checkpoint(tmp_path: Path) -> None:
    losses_a, losses_b = run_distributed(_resume_twice, str(tmp_path), world_size=1)[0]
    assert len(losses_a) == 4
    assert len(losses_b) == 2  # steps 4 and 5 only
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000006"]  # keep_last=1


def _hung_collective() -> None:
    import torch.distributed as dist

    from d9d.loop import StepFailedError

    config = toy_config(mesh={"data_parallel_replicate": 2})
    trainer = build_trainer(config, strategy="replicate")
    # short only now: configure()'s collectives on a busy machine may take longer than 2 s
    trainer.dist_context.set_timeout(timedelta(seconds=2))
    if trainer.dist_context.rank == 1:
        return  # rank 1 never joins the step's collectives
    with pytest.raises(StepFailedError, match=r"step 0 failed on rank 0"):
        trainer.train()
    del dist


def test_a_hung_collective_fails_the_step_naming_step_and_rank() -> None:
    run_distributed(_hung_collective, world_size=2, timeout_s=120)


def _losses(mesh: dict[str, int], directory: str | None, max_steps: int) -> list[float]:
    trainer_section: dict[str, Any] = {"max_steps": max_steps}
    if directory is not None:
        trainer_section["checkpoint"] = {"directory": directory, "every_steps": 3}
    trainer = build_trainer(toy_config(mesh=mesh, trainer=trainer_section), strategy="fsdp")
    losses: list[float] = []
    trainer.events.subscribe(ForwardBackwardFinished, lambda e: losses.append(e.loss))
    trainer.train()
    trainer.close()  # the trainer owns the context it built: this releases it too
    return losses


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"data_parallel_shard": 2}, {"data_parallel_shard": 4}),  # resume on more ranks
        ({"data_parallel_shard": 4}, {}),  # resume on a single process
    ],
)
def test_resume_reshards_onto_another_mesh(
    tmp_path: Path, first: dict[str, int], second: dict[str, int]
) -> None:
    def world(mesh: dict[str, int]) -> int:
        return max(1, *mesh.values()) if mesh else 1

    reference = run_distributed(_losses, {}, None, 6, world_size=1)[0]
    run_distributed(_losses, first, str(tmp_path), 3, world_size=world(first), timeout_s=240)
    resumed = run_distributed(_losses, second, str(tmp_path), 6, world_size=world(second), timeout_s=240)[0]
    assert len(resumed) == 3  # steps 3, 4, 5 only
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(reference[3:]), rtol=1e-5, atol=1e-7)


def _ownership() -> tuple[bool, bool, bool]:
    import torch.distributed as dist

    from d9d.mesh import DistributedContext

    config = toy_config()
    # built from mesh parameters: the trainer owns the context and releases it on close
    with build_trainer(config) as trainer:
        trainer.train()
    owned_released = not dist.is_initialized()
    trainer.close()  # idempotent
    # a context the user passes in stays the user's
    context = DistributedContext(config.mesh, device_type="cpu")
    from loop_toy_job import ToyDataset, ToyProvider, ToyTask, collate

    from d9d.loop import (
        AutoDataProvider,
        AutoLRSchedulerProvider,
        AutoOptimizerProvider,
        TrainingConfigurator,
    )

    class TaskProvider:
        def build(self, context: object) -> ToyTask:
            return ToyTask()

    borrowed = TrainingConfigurator(
        dist_context=context,
        parameters=config.trainer,
        model_provider=ToyProvider(),
        task_provider=TaskProvider(),
        data_provider=AutoDataProvider(
            dataset_factory=lambda d: ToyDataset(), collator=collate, config=config.data
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    borrowed.train()
    borrowed.close()
    borrowed_kept = dist.is_initialized()
    context.close()
    return owned_released, borrowed_kept, not dist.is_initialized()


def test_whoever_creates_the_context_closes_it() -> None:
    # In this process (a world of one the context starts itself), so closing is observable.
    assert _ownership() == (True, True, True)
