"""``stochastic_adamw`` with ``offload``: the job trains as on the device and resumes from host state.

The toy job accumulates four microbatches per step and clips at a norm that is active on every
step (the clipping factor reaches the offloaded step as a gradient scale). On CPU the host and the
device are the same memory, but the offloaded moments still go through the streamer's copies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from loop_toy_job import toy_config, train_and_record
from recovery_helpers import run_toy

from d9d.loop import HostOffloadConfig, StochasticAdamWConfig
from d9d.mesh.testing import run_distributed

pytest.importorskip("d9d.kernels")

_OPTIMIZER: dict[str, Any] = {"name": "stochastic_adamw", "lr": 0.01, "state_dtype": "bfloat16"}
_OFFLOADED: dict[str, Any] = {**_OPTIMIZER, "offload": {"chunk_mib": 1}}


def _train(mesh: dict[str, int], optimizer: dict[str, Any]) -> dict[str, Any]:
    config = toy_config(
        mesh=mesh,
        trainer={"gradient_clipping": {"max_norm": 0.05}, "max_steps": 4},
        optimizer=optimizer,
    )
    return train_and_record(config, strategy="fsdp", weighted=True, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("mesh", "world_size"),
    [
        ({}, 1),  # one process
        ({"data_parallel_shard": 2}, 2),  # FSDP: each rank offloads the moments of its shards
    ],
)
def test_offloaded_training_equals_training_with_state_on_the_device(
    mesh: dict[str, int], world_size: int
) -> None:
    on_device = run_distributed(_train, mesh, _OPTIMIZER, world_size=world_size, timeout_s=120)
    offloaded = run_distributed(_train, mesh, _OFFLOADED, world_size=world_size, timeout_s=120)
    for ours, theirs in zip(offloaded, on_device, strict=True):
        assert ours["losses"] == theirs["losses"]
        assert ours["norms"] == theirs["norms"]
        assert max(theirs["norms"]) > 0.05, "clipping must be active for the comparison to mean anything"
        for name, value in theirs["params"].items():
            assert torch.equal(ours["params"][name], value), name


def test_an_offloaded_run_resumes_from_its_checkpoint_as_if_uninterrupted(tmp_path: Path) -> None:
    run = {
        "optimizer": _OFFLOADED,
        "dtype": torch.bfloat16,
        "trainer": {"gradient_clipping": {"max_norm": 0.05}},
    }
    uninterrupted = run_distributed(run_toy, None, max_steps=4, world_size=1, **run)[0]
    first = run_distributed(run_toy, str(tmp_path), max_steps=2, world_size=1, **run)[0]
    resumed = run_distributed(run_toy, str(tmp_path), max_steps=4, world_size=1, **run)[0]
    assert first["error"] is None and resumed["error"] is None, (first["error"], resumed["error"])
    assert resumed["losses"] == uninterrupted["losses"][2:]
    for name, value in uninterrupted["params"].items():
        assert torch.equal(resumed["params"][name], value), name


def test_offload_is_a_section_of_stochastic_adamw_only() -> None:
    config = StochasticAdamWConfig.model_validate({"offload": {}})
    assert config.offload == HostOffloadConfig(chunk_mib=512, resident_mib=0)
    with pytest.raises(ValueError, match="offload"):
        toy_config(optimizer={"name": "adamw", "offload": {}})
    with pytest.raises(ValueError, match="chunk_mib"):
        StochasticAdamWConfig.model_validate({"offload": {"chunk_mib": 0}})
