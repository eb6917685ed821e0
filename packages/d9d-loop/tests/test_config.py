"""Configs are validated whole at load; errors name the offending key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from loop_toy_job import build_trainer, toy_config
from pydantic import ValidationError

from d9d.loop import ProjectConfig, StochasticAdamWConfig

BASE: dict[str, Any] = {"trainer": {"max_steps": 2, "global_batch_size": 8, "microbatch_size": 2}}


def with_(path: str, value: Any) -> dict[str, Any]:
    import copy

    raw = copy.deepcopy(BASE)
    node = raw
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    return raw


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        # a misspelled key deep inside the trainer section
        (with_("trainer.checkpoint", {"every_step": 3}), "trainer.checkpoint.every_step"),
        # a key that belongs to another choice of the optimizer union
        ({**BASE, "optimizer": {"name": "adamw", "state_dtype": "bfloat16"}}, "optimizer.adamw.state_dtype"),
        # an unknown choice
        ({**BASE, "optimizer": {"name": "adafactor"}}, "optimizer"),
        # a wrong type
        (with_("trainer.global_batch_size", "lots"), "trainer.global_batch_size"),
        # a misspelled mesh degree
        ({**BASE, "mesh": {"data_parallel_shards": 2}}, "mesh.data_parallel_shards"),
        # a phase of the LR schedule with an unknown kind
        (
            {**BASE, "lr_scheduler": {"name": "piecewise", "phases": [{"kind": "sawtooth", "steps": 2}]}},
            "lr_scheduler",
        ),
    ],
)
def test_bad_config_error_names_the_key(raw: dict[str, Any], names: str) -> None:
    with pytest.raises(ValidationError) as error:
        ProjectConfig.model_validate(raw)
    assert names in str(error.value).replace("\n  ", "."), str(error.value)


def test_stochastic_adamw_accepts_state_dtype() -> None:
    config = ProjectConfig.model_validate(
        {**BASE, "optimizer": {"name": "stochastic_adamw", "state_dtype": "bfloat16"}}
    )
    assert isinstance(config.optimizer, StochasticAdamWConfig)


def test_global_batch_must_divide_over_data_parallel_and_microbatch() -> None:
    raw = {
        **BASE,
        "mesh": {"data_parallel_shard": 3},
        "trainer": {"max_steps": 2, "global_batch_size": 8, "microbatch_size": 2},
    }
    with pytest.raises(
        ValidationError, match=r"global_batch_size=8 is not divisible by data-parallel size \(3\)"
    ):
        ProjectConfig.model_validate(raw)


def test_run_length_needs_exactly_one_of_steps_and_epochs() -> None:
    with pytest.raises(ValidationError, match="exactly one of 'max_steps' and 'epochs'"):
        ProjectConfig.model_validate({"trainer": {"global_batch_size": 8, "microbatch_size": 2}})


def test_mesh_larger_than_world_fails_before_any_process_group() -> None:
    config = toy_config(mesh={"data_parallel_shard": 4})
    with pytest.raises(ValueError, match=r"mesh needs 4 ranks .* world size is 1"):
        build_trainer(config)
    assert not dist.is_initialized()


def test_from_yaml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("trainer: {max_steps: 2, global_batch_size: 8, microbatch_size: 2, sed: 1}\n")
    with pytest.raises(ValueError, match=r"invalid config .*job.yaml(?s:.*)trainer.sed"):
        ProjectConfig.from_yaml(path)
