"""Fixtures shared by the integration tests."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest
from script_runner import start_runner, stop_runner


@pytest.fixture(scope="session")
def torch_runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[str]]:
    """One script runner (see script_runner.py) that imported torch, and the d9d modules that
    scripts asked it to preload, for every script run as ``python SCRIPT``: each run still gets a
    process of its own."""
    process = start_runner(tmp_path_factory.mktemp("torch-runner"))
    yield process
    stop_runner(process)
