"""Export into an existing directory: refused with advice that works, replaced with overwrite=True."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
from loop_toy_job import build_trainer, toy_config

from d9d.loop import ExportTargetError, check_export_target, is_d9d_export
from d9d.mesh.testing import run_distributed


def _export_twice(directory: str) -> list[str]:
    trainer = build_trainer(toy_config(trainer={"max_steps": 1}))
    trainer.train()
    target = Path(directory) / "export"
    trainer.export(target)
    with pytest.raises(FileExistsError, match=r"(?i)pass overwrite=True"):
        trainer.export(target)
    trainer.export(target, overwrite=True)  # the advice of the error is accepted
    trainer.close()
    trainer.dist_context.close()
    return sorted(p.name for p in Path(directory).iterdir())


def test_export_takes_overwrite(tmp_path: Path) -> None:
    assert run_distributed(_export_twice, str(tmp_path), world_size=1)[0] == ["export"]


def test_an_export_is_marked_and_a_later_one_may_replace_it(tmp_path: Path) -> None:
    run_distributed(_export_twice, str(tmp_path), world_size=1)
    assert is_d9d_export(tmp_path / "export")
    assert check_export_target(tmp_path / "export") is True


@pytest.mark.parametrize(
    ("contents", "replace_other", "expected"),
    [
        (None, False, False),  # absent: nothing to replace
        ([], False, False),  # empty: nothing to replace
        (["notes.txt"], True, True),  # the user opted in to losing other files
        (["notes.txt"], False, ExportTargetError),  # a user's files: refused, kept
    ],
)
def test_check_export_target_refuses_a_users_directory(
    tmp_path: Path, contents: list[str] | None, replace_other: bool, expected: bool | type[Exception]
) -> None:
    target = tmp_path / "out"
    if contents is not None:
        target.mkdir()
        for name in contents:
            (target / name).write_text("mine")
    if isinstance(expected, bool):
        assert check_export_target(target, replace_other=replace_other) is expected
    else:
        with pytest.raises(expected, match=r"not a d9d export.*nothing was trained or written"):
            check_export_target(target, replace_other=replace_other)
        assert (target / "notes.txt").read_text() == "mine"


def _export_over(directory: str, replace_other: bool) -> str | None:
    mesh = {"data_parallel_shard": dist.get_world_size()}
    trainer = build_trainer(toy_config(trainer={"max_steps": 1}, mesh=mesh))
    target = Path(directory) / "export"
    try:
        trainer.export(target, overwrite=True, replace_other=replace_other)
    except ExportTargetError as e:
        return str(e)
    finally:
        trainer.close()
        trainer.dist_context.close()
    return None


def test_overwrite_never_deletes_a_users_files(tmp_path: Path) -> None:
    # `Trainer.export(..., overwrite=True)` used to replace any directory: a user's files were gone.
    target = tmp_path / "export"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    error = run_distributed(_export_over, str(tmp_path), False, world_size=2)[0]
    assert error is not None
    assert f"export target {target} is a non-empty directory that is not a d9d export" in error
    assert "(notes.txt)" in error and "nothing was written or deleted" in error
    assert (target / "notes.txt").read_text() == "mine"
    # the explicit opt-in replaces it
    assert run_distributed(_export_over, str(tmp_path), True, world_size=1)[0] is None
    assert is_d9d_export(target) and not (target / "notes.txt").exists()


def test_a_file_added_to_a_previous_export_is_named_and_kept(tmp_path: Path) -> None:
    # A marker without a file list let overwrite delete what the user added to an export.
    run_distributed(_export_twice, str(tmp_path), world_size=1)
    target = tmp_path / "export"
    (target / "README.md").write_text("my model card")
    added = r"a d9d export holding files d9d did not write \(README\.md\)"
    with pytest.raises(ExportTargetError, match=added):
        check_export_target(target)
    error = run_distributed(_export_over, str(tmp_path), False, world_size=1)[0]
    assert error is not None and "(README.md)" in error
    assert (target / "README.md").read_text() == "my model card"
    # without the added file the previous export is replaced as before
    (target / "README.md").unlink()
    assert run_distributed(_export_over, str(tmp_path), False, world_size=1)[0] is None
