"""Parameters stored in another dtype than they were built in (``model.master_dtype``)."""

from __future__ import annotations

import torch
from torch import nn


def cast_parameters_(module: nn.Module, dtype: torch.dtype) -> None:
    """Replaces every floating-point parameter of ``module`` with one of ``dtype``, in place.

    Buffers keep their dtype (rotary frequencies, MoE selection biases stay float32), and a
    parameter shared by several modules (a tied head) stays shared. Meant for a model on the
    meta device before it is parallelized and materialized, so nothing is copied.
    """
    replaced: dict[int, nn.Parameter] = {}
    for owner in module.modules():
        for name, parameter in list(owner.named_parameters(recurse=False)):
            if not parameter.is_floating_point() or parameter.dtype == dtype:
                continue
            cast = replaced.get(id(parameter))
            if cast is None:
                cast = replaced[id(parameter)] = nn.Parameter(
                    parameter.detach().to(dtype), requires_grad=parameter.requires_grad
                )
            setattr(owner, name, cast)
