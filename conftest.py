"""Repository-wide pytest setup.

Where no CUDA device is present, Triton kernels run in Triton's CPU interpreter. Triton reads
``TRITON_INTERPRET`` when a function is decorated, so it must be set before any test module
imports Triton (some packages' tests import libraries that import it); d9d-kernels' own
conftest does the same for its tests run alone.

Every test must close the process group it starts: a default group left behind would make the
next test in the same worker fail or, worse, run against a group it did not build (its order
depends on pytest-xdist's scheduling). The autouse fixture below fails the test that leaves one,
by name, and destroys the group so the tests after it run clean.
"""

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _no_process_group_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(f"a process group was open before {request.node.nodeid} started")
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(f"{request.node.nodeid} left a default process group open; close what a test opens")
