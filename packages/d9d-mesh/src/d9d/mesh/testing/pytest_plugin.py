"""Opt-in pytest plugin: starts the test zygote after collection.

Installing d9d-mesh changes nobody's pytest; a project whose tests call ``run_distributed`` after
running autograd in the test process activates this plugin itself, with ``-p
d9d.mesh.testing.pytest_plugin`` in its pytest options (or ``pytest_plugins`` in its root
``conftest.py``). See ``_zygote``: the zygote keeps ``run_distributed`` working after tests ran
autograd in the parent (PyTorch forbids autograd in children forked after that).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from d9d.mesh.testing._runner import handle_zygote_request
from d9d.mesh.testing._zygote import ZYGOTE_ENV, start_zygote, stop_zygote

_STASH_ATTRIBUTE = "_d9d_mesh_zygote"


def _nothing() -> None:
    pass


def pytest_collection_finish(session: Any) -> None:
    """Forks the zygote once every test module is imported and before any test runs."""
    if ZYGOTE_ENV in os.environ:
        return
    # torch imports its compiler stack lazily on first use (FSDP, DTensor); importing it once
    # here spares every forked rank of every test that cost.
    disabled: Any = torch.compiler.disable(_nothing)
    disabled()
    pid, path = start_zygote(handle_zygote_request)
    setattr(session.config, _STASH_ATTRIBUTE, (pid, path))
    os.environ[ZYGOTE_ENV] = path


def pytest_unconfigure(config: Any) -> None:
    """Stops the zygote."""
    running: tuple[int, str] | None = getattr(config, _STASH_ATTRIBUTE, None)
    if running is not None:
        stop_zygote(*running)
        os.environ.pop(ZYGOTE_ENV, None)
