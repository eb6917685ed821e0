"""What a tracker records about a run besides its metrics: config, mesh, versions, git revision."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from d9d.loop.config._trainer import TrainerConfig
from d9d.mesh import MeshParameters

_PACKAGES = (
    "d9d",
    "d9d-mesh",
    "d9d-parallel",
    "d9d-pipeline",
    "d9d-state-mappers",
    "d9d-kernels",
    "d9d-loop",
    "d9d-hf",
    "d9d-rl",
    "torch",
    "triton",
    "transformers",
)


def run_metadata(*, trainer: TrainerConfig, mesh: MeshParameters) -> dict[str, Any]:
    """The run's metadata as JSON-ready values: trainer config, mesh, versions, git revision."""
    return {
        "trainer": trainer.model_dump(mode="json"),
        "mesh": mesh.model_dump(mode="json"),
        "versions": package_versions(),
        "git_revision": git_revision(Path.cwd()),
    }


def package_versions() -> dict[str, str]:
    """Versions of Python and of the installed d9d packages and their main dependencies."""
    versions = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def git_revision(directory: Path) -> str | None:
    """The commit checked out where the job runs (``+dirty`` with local changes); None outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+dirty" if status.strip() else head
