"""Repository-wide pytest setup.

Where no CUDA device is present, Triton kernels run in Triton's CPU interpreter. Triton reads
``TRITON_INTERPRET`` when a function is decorated, so it must be set before any test module
imports Triton (some packages' tests import libraries that import it); d9d-kernels' own
conftest does the same for its tests run alone.

Every test must close the process group it starts: a default group left behind would make the
next test in the same worker fail or, worse, run against a group it did not build (its order
depends on pytest-xdist's scheduling). The autouse fixture below fails the test that leaves one,
by name, and destroys the group so the tests after it run clean.

The suite runs on as many pytest-xdist workers as the machine has cores (README), and most tests
start more processes (ranks, scripts, torchrun). Each process keeps to one intra-op thread unless
``OMP_NUM_THREADS`` says otherwise: with the cores oversubscribed, torch's thread pool waits for
its descheduled threads at every parallel operation, and a tiny model's step takes many times as
long (the classification example's short run: 11 s alone, 73 to 103 s beside the other worker).
The environment variable reaches every process the tests start; ranks forked by
``d9d.mesh.testing`` set one thread themselves.
"""

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _no_process_group_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    # only a group opened at import or by a module- or session-scoped fixture reaches this: a
    # test's own leftover is destroyed at its teardown below
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(f"a process group was open before {request.node.nodeid} started")
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(f"{request.node.nodeid} left a default process group open; close what a test opens")
