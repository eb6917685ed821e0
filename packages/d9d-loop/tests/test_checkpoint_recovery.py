"""A damaged newest checkpoint never ends a run: resume verifies it and falls back to an older one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from recovery_helpers import checkpoints, run_toy

from d9d.mesh.testing import run_distributed


@pytest.fixture(scope="module")
def six_steps() -> dict[str, Any]:
    """The uninterrupted 6-step run (no checkpoints) the resumed runs must equal bit for bit."""
    return run_distributed(run_toy, None, max_steps=6, world_size=1)[0]


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _delete(path: Path) -> None:
    path.unlink()


def _shard(step_dir: Path) -> Path:
    return step_dir / "__0_0.distcp"


def _metadata(step_dir: Path) -> Path:
    return step_dir / ".metadata"


@pytest.mark.parametrize(
    ("damage", "file_of"),
    [
        (_truncate, _shard),  # a truncated tensor shard (used to end in a bare EOFError)
        (_truncate, _metadata),  # a truncated .metadata (used to end in an UnpicklingError)
        (_delete, _shard),  # a deleted shard
    ],
)
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    tmp_path: Path, six_steps: dict[str, Any], damage: Callable[[Path], None], file_of: Callable[[Path], Path]
) -> None:
    reference = six_steps
    run_distributed(run_toy, str(tmp_path), max_steps=4, world_size=1)
    assert checkpoints(tmp_path) == ["step_000000002", "step_000000003", "step_000000004"]
    damaged = file_of(tmp_path / "step_000000004")
    damage(damaged)

    resumed = run_distributed(run_toy, str(tmp_path), max_steps=6, world_size=1)[0]

    assert resumed["error"] is None
    assert any(str(damaged) in w and "trying an older one" in w for w in resumed["warnings"]), resumed[
        "warnings"
    ]
    assert resumed["losses"] == reference["losses"][3:]  # steps 3, 4, 5: bit-exact from step 3's checkpoint
    for name, value in reference["params"].items():
        assert torch.equal(resumed["params"][name], value), name
    # the damaged one is set aside (kept for inspection); keep_last counts only usable ones
    assert checkpoints(tmp_path) == [
        "step_000000004",
        "step_000000004.damaged",
        "step_000000005",
        "step_000000006",
    ]


def test_when_no_checkpoint_is_usable_the_error_lists_each_and_why(tmp_path: Path) -> None:
    run_distributed(run_toy, str(tmp_path), max_steps=2, world_size=1)
    _truncate(_shard(tmp_path / "step_000000002"))
    _delete(_metadata(tmp_path / "step_000000001"))

    resumed = run_distributed(run_toy, str(tmp_path), max_steps=4, world_size=1)[0]

    error = resumed["error"]
    assert error is not None and error.startswith("NoUsableCheckpointError: no usable checkpoint"), error
    assert f"{tmp_path / 'step_000000002' / '__0_0.distcp'} has " in error
    assert f"{tmp_path / 'step_000000001' / '.metadata'} is missing" in error
    assert checkpoints(tmp_path) == ["step_000000001", "step_000000002"]  # nothing renamed or deleted


def _flip_a_weight(step_dir: Path, weight: torch.Tensor) -> Path:
    """Overwrites the first float of ``weight`` in the shard with NaN bytes (4 flipped bytes)."""
    shard = _shard(step_dir)
    data = bytearray(shard.read_bytes())
    needle = weight.contiguous().view(torch.uint8).numpy().tobytes()
    at = data.find(needle)
    assert at >= 0, "the weight's bytes were not found in the shard"
    data[at : at + 4] = b"\xff\xff\xff\x7f"
    shard.write_bytes(bytes(data))
    return shard


def test_flipped_bytes_are_found_by_checksums_when_enabled(tmp_path: Path) -> None:
    first = run_distributed(run_toy, str(tmp_path), max_steps=4, world_size=1)[0]
    shard = _flip_a_weight(tmp_path / "step_000000004", first["params"]["fc2.weight"])

    resumed = run_distributed(
        run_toy, str(tmp_path), max_steps=5, checkpoint={"verify": "checksums"}, world_size=1
    )[0]

    assert resumed["error"] is None
    assert any(str(shard) in w and "CRC-32" in w for w in resumed["warnings"]), resumed["warnings"]
    assert len(resumed["losses"]) == 2  # steps 3 and 4, from step 3's checkpoint


@pytest.mark.parametrize("policy", ["stop", "rollback"])
def test_non_finite_weights_in_the_newest_checkpoint_fall_back_to_an_older_one(
    tmp_path: Path, six_steps: dict[str, Any], policy: str
) -> None:
    # With `verify: sizes` a NaN written into the newest checkpoint used to fail every restart
    # (stop), or be reloaded again and again (rollback), never trying the older good one.
    reference = six_steps
    first = run_distributed(run_toy, str(tmp_path), max_steps=4, world_size=1)[0]
    shard = _flip_a_weight(tmp_path / "step_000000004", first["params"]["fc2.weight"])

    resumed = run_distributed(
        run_toy, str(tmp_path), max_steps=6, trainer={"nonfinite": {"policy": policy}}, world_size=1
    )[0]

    assert resumed["error"] is None, resumed["error"]
    warning = next(w for w in resumed["warnings"] if "non-finite weights" in w)
    assert str(tmp_path / "step_000000004") in warning and "fc2.weight: 1 non-finite" in warning
    assert str(shard) in warning and "trainer.checkpoint.verify: checksums" in warning
    assert "trying an older one" in warning
    assert resumed["losses"] == reference["losses"][3:]  # from step 3's checkpoint, bit-exact
    assert "step_000000004.damaged" in checkpoints(tmp_path)


def test_four_ranks_fall_back_together(tmp_path: Path, six_steps: dict[str, Any]) -> None:
    mesh = {"data_parallel_shard": 4}
    reference = six_steps
    run_distributed(run_toy, str(tmp_path), max_steps=4, mesh=mesh, world_size=4, timeout_s=240)
    _truncate(tmp_path / "step_000000004" / "__2_0.distcp")
    resumed = run_distributed(
        run_toy,
        str(tmp_path),
        max_steps=6,
        checkpoint={"verify": "checksums"},
        mesh=mesh,
        world_size=4,
        timeout_s=240,
    )
    for rank in resumed:
        assert rank["error"] is None
        torch.testing.assert_close(
            torch.tensor(rank["losses"]), torch.tensor(reference["losses"][3:]), rtol=1e-5, atol=1e-7
        )
    assert any("__2_0.distcp" in w for w in resumed[0]["warnings"])


def test_an_empty_newest_step_folder_is_skipped_with_a_warning_naming_it(tmp_path: Path) -> None:
    # An empty step_N (no manifest, no .metadata: a copy that never arrived, a folder made by
    # hand) made every resume fail with a 32-line FileNotFoundError from DCP.
    reference = run_distributed(run_toy, None, max_steps=4, world_size=1)[0]
    run_distributed(run_toy, str(tmp_path), max_steps=2, world_size=1)
    empty = tmp_path / "step_000000003"
    empty.mkdir()

    resumed = run_distributed(run_toy, str(tmp_path), max_steps=4, world_size=1)[0]

    assert resumed["error"] is None, resumed["error"]
    warning = next(w for w in resumed["warnings"] if str(empty) in w)
    assert "neither d9d_manifest.json nor .metadata" in warning and "trying an older one" in warning
    assert resumed["losses"] == reference["losses"][2:]  # steps 2 and 3, from step 2's checkpoint
    assert "step_000000003.damaged" in checkpoints(tmp_path)
