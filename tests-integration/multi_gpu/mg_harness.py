"""Device-aware comparison of a parallelized model against the same model in one process.

The packages' own tests (``packages/d9d-parallel/tests/conftest.py``) build everything on the CPU;
this harness does the same on any device: the reference and the parallel copy live on
``device``, batches are drawn on the CPU from a seeded generator and moved there. Every
comparison records its largest absolute difference, so a passing case still reports how close
it was.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.parallel import GradientSynchronizer, clip_grad_norm

Batch = tuple[torch.Tensor, ...]


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The global value of a (possibly distributed) tensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@dataclass(kw_only=True)
class Tolerance:
    """Tolerances of one case and the largest absolute difference seen so far."""

    atol: float = 1e-5
    rtol: float = 1e-4
    max_abs_diff: float = 0.0

    def check(self, actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        """Asserts ``actual`` is close to ``expected`` (both moved to fp32 on one device)."""
        actual = actual.detach().float()
        expected = expected.detach().float().to(actual.device)
        if actual.numel():
            self.max_abs_diff = max(self.max_abs_diff, float((actual - expected).abs().max()))
        torch.testing.assert_close(
            actual, expected, atol=self.atol, rtol=self.rtol, msg=lambda m: f"{what}: {m}"
        )


@dataclass(kw_only=True)
class ReferenceCheck:
    """Runs ``steps`` AdamW steps on a parallel model and its single-process reference.

    Every rank builds the reference from the same seed on ``device`` and parallelizes a deep copy.
    Per step: world-averaged loss, every gradient (after bucketed sync), the distributed clipped
    norm, the clipped gradients and the parameters after the optimizer step must match.
    """

    device: torch.device
    build: Callable[[], nn.Module]
    parallelize: Callable[[nn.Module], None]
    make_batch: Callable[[torch.Generator], Batch]
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor]
    tolerance: Tolerance
    shard_batch: Callable[[Batch], Batch] = lambda batch: batch
    parallel_loss_fn: Callable[[nn.Module, Batch], torch.Tensor] | None = None
    microbatches: int = 1
    steps: int = 3
    max_norm: float = 0.05
    bucket_size_mb: float = 1e-4
    norms: list[float] = field(default_factory=list[float])

    def run(self) -> list[float]:
        torch.manual_seed(1234)
        reference = self.build().to(self.device)
        model = copy.deepcopy(reference)
        self.parallelize(model)
        sync = GradientSynchronizer(model, bucket_size_mb=self.bucket_size_mb)
        opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        world = dist.get_world_size()
        try:
            for step in range(self.steps):
                cpu_batch = self.make_batch(torch.Generator().manual_seed(100 + step))
                batch = tuple(t.to(self.device) for t in cpu_batch)
                ref_loss = self.loss_fn(reference, batch)
                ref_loss.backward()

                local = self.shard_batch(batch)
                total = torch.zeros((), device=self.device)
                chunks = [t.chunk(self.microbatches) for t in local]
                loss_fn = self.parallel_loss_fn or self.loss_fn
                for index in range(self.microbatches):
                    sync.begin_microbatch(is_last=index == self.microbatches - 1)
                    loss = loss_fn(model, tuple(c[index] for c in chunks)) / self.microbatches
                    loss.backward()
                    total += loss.detach()
                sync.finish()
                dist.all_reduce(total)
                self.tolerance.check(total / world, ref_loss, f"step {step} loss")
                self._compare(reference, model, "grad", step)

                ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), self.max_norm)
                norm = clip_grad_norm(list(model.parameters()), self.max_norm)
                self.tolerance.check(norm, ref_norm, f"step {step} grad norm")
                if float(ref_norm) <= self.max_norm:
                    raise AssertionError(f"norm {float(ref_norm)} <= max_norm: the case must clip")
                self.norms.append(float(norm))
                self._compare(reference, model, "clipped grad", step)

                opt_ref.step()
                opt.step()
                opt_ref.zero_grad()
                opt.zero_grad()
                self._compare(reference, model, "param", step)
        finally:
            sync.close()
        return self.norms

    def _compare(self, reference: nn.Module, model: nn.Module, what: str, step: int) -> None:
        ref_params = dict(reference.named_parameters())
        params = dict(model.named_parameters())
        if params.keys() != ref_params.keys():
            raise AssertionError(f"parameter names differ: {sorted(params)} vs {sorted(ref_params)}")
        for name, ref_param in ref_params.items():
            param = params[name]
            if what == "param":
                self.tolerance.check(full(param.detach()), ref_param.detach(), f"step {step} {what} {name}")
                continue
            if ref_param.grad is None or param.grad is None:
                raise AssertionError(f"step {step}: {name} has no gradient")
            self.tolerance.check(full(param.grad), ref_param.grad, f"step {step} {what} {name}")


def rows_of_rank(batch: Batch) -> Batch:
    """This rank's equal share of every tensor's dim 0."""
    return tuple(t.chunk(dist.get_world_size())[dist.get_rank()] for t in batch)
