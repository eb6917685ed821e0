"""All-to-all with uneven splits that autograd differentiates (the reverse exchange)."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def _exchange(
    tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], group: ProcessGroup
) -> torch.Tensor:
    output = tensor.new_empty((sum(output_splits), *tensor.shape[1:]))
    dist.all_to_all_single(output, tensor.contiguous(), output_splits, input_splits, group=group)
    return output


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: ProcessGroup,
    ) -> torch.Tensor:
        ctx.output_splits = output_splits
        ctx.input_splits = input_splits
        ctx.group = group
        return _exchange(tensor, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad = _exchange(grad_outputs[0], ctx.input_splits, ctx.output_splits, ctx.group)
        return grad, None, None, None


def all_to_all(
    tensor: torch.Tensor, *, output_splits: list[int], input_splits: list[int], group: ProcessGroup
) -> torch.Tensor:
    """Sends ``input_splits[r]`` rows of ``tensor`` (tensor dim 0) to rank ``r`` of ``group`` and
    receives ``output_splits[r]`` rows from it; backward sends the gradients back the same way.
    """
    return cast(torch.Tensor, _AllToAll.apply(tensor, output_splits, input_splits, group))
