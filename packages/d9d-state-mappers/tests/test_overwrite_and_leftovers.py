"""Overwriting reports what happened, and a killed write's hidden directory does not stay forever."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file
from torch import nn

from d9d.state_mappers import identity_mapper_from_module, save_module_state


def _model() -> nn.Module:
    return nn.Linear(3, 2)


def test_overwrite_replaces_an_existing_file_without_claiming_nothing_was_written(tmp_path: Path) -> None:
    # the target is an existing regular file: it used to be replaced, then reported as a failure
    target = tmp_path / "model"
    target.write_text("old")
    model = _model()
    save_module_state(target, model, identity_mapper_from_module(model), overwrite=True, show_progress=False)
    assert target.is_dir()
    loaded = {k: v for f in target.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert sorted(loaded) == ["bias", "weight"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no hidden leftovers


def test_overwrite_replaces_an_existing_checkpoint_directory(tmp_path: Path) -> None:
    model = _model()
    mapper = identity_mapper_from_module(model)
    save_module_state(tmp_path / "out", model, mapper, show_progress=False)
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        save_module_state(tmp_path / "out", model, mapper, show_progress=False)
    save_module_state(tmp_path / "out", model, mapper, overwrite=True, show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_leftovers_of_a_killed_earlier_write_are_removed_on_the_next_save(tmp_path: Path) -> None:
    # what a conversion killed by SIGKILL leaves: a hidden partial directory beside the target
    stale = tmp_path / ".out.partial-0123456789ab"
    stale.mkdir()
    (stale / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 16)
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    model = _model()
    save_module_state(tmp_path / "out", model, identity_mapper_from_module(model), show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_partial_directory_newer_than_this_process_is_left_alone(tmp_path: Path) -> None:
    # possibly another process's write in progress: not ours to remove
    fresh = tmp_path / ".out.partial-fedcba987654"
    fresh.mkdir()
    model = _model()
    save_module_state(tmp_path / "out", model, identity_mapper_from_module(model), show_progress=False)
    assert fresh.is_dir()
