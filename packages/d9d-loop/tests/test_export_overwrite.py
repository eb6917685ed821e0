"""Export into an existing directory: refused with advice that works, replaced with overwrite=True."""

from __future__ import annotations

from pathlib import Path

import pytest
from loop_toy_job import build_trainer, toy_config

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
