"""Mixed precision on one rank without FSDP: parameters cast for each forward, float32 gradients."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


def _floating_parameters(module: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    return [
        (owner, name, parameter)
        for owner in module.modules()
        for name, parameter in owner.named_parameters(recurse=False)
        if parameter.is_floating_point()
    ]


def cast_parameters_for_compute(module: nn.Module, dtype: torch.dtype) -> list[RemovableHandle]:
    """Runs ``module``'s forward on copies of its floating-point parameters cast to ``dtype``.

    The one-rank counterpart of ``parallelize_fsdp(param_dtype=dtype, reduce_dtype=float32)``
    without FSDP's gathers and copies: a forward pre-hook shadows every floating-point parameter
    of the module and its submodules with ``parameter.to(dtype)`` (an instance attribute; shared
    parameters are cast once), and a forward hook removes the shadows, also when forward raises.
    Autograd keeps the copies that backward needs and sends their gradients, cast back, into the
    parameters' own ``.grad``, so gradients accumulate in the parameters' dtype; optimizers, state
    dicts and checkpoints only ever see the parameters.

    Only for forwards that do not run again in backward (activation checkpointing): a rerun after
    forward would see the parameters, not the copies. Use ``parallelize_fsdp`` there. Compiled
    submodule bodies (regional compilation, hooks left outside) read the copies as graph inputs;
    compiling ``module`` itself, hooks included, is not supported.

    Args:
        module: The module whose forward computes in ``dtype``.
        dtype: The compute dtype (``torch.bfloat16``, say).

    Returns:
        The hooks' handles (``handle.remove()`` undoes it).

    Raises:
        ValueError: If the module has no floating-point parameters.
    """
    if not _floating_parameters(module):
        raise ValueError(
            f"cast_parameters_for_compute: {type(module).__name__} has no floating-point parameters"
        )
    # Looked up at each forward: materializing (to_empty) or re-tying replaces parameter objects.
    shadowed: list[list[tuple[nn.Module, str]]] = []

    def cast_in(_module: nn.Module, _args: Any) -> None:
        copies: dict[int, torch.Tensor] = {}
        names: list[tuple[nn.Module, str]] = []
        shadowed.append(names)  # before casting: a failed cast still gets its shadows removed
        for owner, name, parameter in _floating_parameters(module):
            copy = copies.get(id(parameter))
            if copy is None:
                copy = copies[id(parameter)] = parameter.to(dtype)
            # An instance attribute shadows the registered parameter: forward reads the copy,
            # while named_parameters() and state_dict() still see the parameter itself.
            object.__setattr__(owner, name, copy)
            names.append((owner, name))

    def put_back(_module: nn.Module, _args: Any, _output: Any) -> None:
        for owner, name in shadowed.pop() if shadowed else []:
            owner.__dict__.pop(name, None)

    return [
        module.register_forward_pre_hook(cast_in),
        module.register_forward_hook(put_back, always_call=True),
    ]
