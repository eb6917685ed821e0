"""Shared harness: run a parallelized model and a single-process reference side by side."""

from __future__ import annotations

import copy
import itertools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.parallel import GradientSynchronizer, clip_grad_norm

Batch = tuple[torch.Tensor, ...]

# torch imports its compiler stack lazily, on the first FSDP or DTensor call; importing it here,
# once, before run_distributed forks the ranks saves every rank of every test seconds of work.
torch.compiler.disable(lambda: None)()


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The global value of a (possibly distributed) tensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@dataclass(kw_only=True)
class ReferenceCheck:
    """One comparison of a parallel model against the same model in one process.

    Every rank builds the reference from the same seed, copies it, and ``parallelize``s the
    copy in place. Each step draws one global batch; the reference sees all of it, the parallel
    model sees ``shard_batch(batch)`` split into ``microbatches`` along dim 0 (``loss_fn`` on a
    microbatch is divided by ``microbatches``). The world-averaged parallel loss, every
    gradient, the clipped total norm and the parameters after each AdamW step must match.
    """

    build: Callable[[], nn.Module]
    parallelize: Callable[[nn.Module], None]
    make_batch: Callable[[torch.Generator], Batch]
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor]
    shard_batch: Callable[[Batch], Batch] = lambda batch: batch
    parallel_loss_fn: Callable[[nn.Module, Batch], torch.Tensor] | None = None
    microbatches: int = 1
    steps: int = 3
    max_norm: float = 0.05
    bucket_size_mb: float = 1e-4
    atol: float = 2e-5
    rtol: float = 1e-4
    pp_group: dist.ProcessGroup | None = None
    after_parallelize: Callable[[nn.Module], None] = lambda model: None
    norms: list[float] = field(default_factory=list[float])

    def run(self) -> list[float]:
        torch.manual_seed(1234)
        reference = self.build()
        model = copy.deepcopy(reference)
        self.parallelize(model)
        self.after_parallelize(model)
        sync = GradientSynchronizer(model, bucket_size_mb=self.bucket_size_mb)
        opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        world = dist.get_world_size()
        for step in range(self.steps):
            batch = self.make_batch(torch.Generator().manual_seed(100 + step))
            ref_loss = self.loss_fn(reference, batch)
            ref_loss.backward()

            local = self.shard_batch(batch)
            total = torch.zeros(())
            chunks = [t.chunk(self.microbatches) for t in local]
            for index in range(self.microbatches):
                sync.begin_microbatch(is_last=index == self.microbatches - 1)
                loss_fn = self.parallel_loss_fn or self.loss_fn
                loss = loss_fn(model, tuple(c[index] for c in chunks)) / self.microbatches
                loss.backward()
                total += loss.detach()
            sync.finish()
            dist.all_reduce(total)
            torch.testing.assert_close(total / world, ref_loss.detach(), atol=self.atol, rtol=self.rtol)
            self._compare(reference, model, "grad", step)

            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), self.max_norm)
            norm = clip_grad_norm(list(model.parameters()), self.max_norm, pp_group=self.pp_group)
            torch.testing.assert_close(norm, ref_norm, atol=self.atol, rtol=self.rtol)
            assert ref_norm > self.max_norm, "the test must exercise clipping"
            self.norms.append(float(norm))
            self._compare(reference, model, "clipped grad", step)

            opt_ref.step()
            opt.step()
            opt_ref.zero_grad()
            opt.zero_grad()
            self._compare(reference, model, "param", step)
        sync.close()
        return self.norms

    def _compare(self, reference: nn.Module, model: nn.Module, what: str, step: int) -> None:
        ref_params = dict(reference.named_parameters())
        params = dict(model.named_parameters())
        assert params.keys() == ref_params.keys()
        for name, ref_param in ref_params.items():
            param = params[name]
            if what == "param":
                expected, actual = ref_param.detach(), full(param.detach())
            else:
                assert ref_param.grad is not None and param.grad is not None, name
                expected, actual = ref_param.grad, full(param.grad)
            torch.testing.assert_close(
                actual,
                expected,
                atol=self.atol,
                rtol=self.rtol,
                msg=f"step {step} {what} {name}",
            )


def mlp(sizes: Sequence[int] = (8, 16, 6)) -> nn.Sequential:
    """A small tanh MLP; the default output of 6 shards unevenly over 4 ranks."""
    layers: list[nn.Module] = []
    for index, (a, b) in enumerate(itertools.pairwise(sizes)):
        if index:
            layers.append(nn.Tanh())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)


def regression_batch(generator: torch.Generator, rows: int = 8, inputs: int = 8, outputs: int = 6) -> Batch:
    return torch.randn(rows, inputs, generator=generator), torch.randn(rows, outputs, generator=generator)


def mse(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


@pytest.fixture
def harness() -> ModuleType:
    """This module: ``ReferenceCheck``, ``mlp``, ``regression_batch``, ``mse``, ``full``."""
    return sys.modules[__name__]
