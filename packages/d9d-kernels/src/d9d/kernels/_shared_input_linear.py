"""Several linear layers applied to one input (q/k/v, gate/up), as one call a mode can see."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.overrides import handle_torch_function, has_torch_function

from d9d.kernels._swiglu import swiglu


def shared_input_linear(input: torch.Tensor, linears: Sequence[nn.Module]) -> tuple[torch.Tensor, ...]:
    """``tuple(linear(input) for linear in linears)``: the projections of one input.

    Each module runs as it would alone (a LoRA or FP8 replacement of an ``nn.Linear`` included),
    so training is unchanged. The call is a torch function of ``input``: an active
    ``TorchFunctionMode`` sees it whole and may compute it another way; ``FewRowsLinearMode`` runs
    the products of a few rows through plain ``nn.Linear`` modules in one kernel launch.

    Args:
        input: ``(..., k)``.
        linears: Modules taking ``input`` (each ``nn.Linear`` or a replacement of one).

    Returns:
        Each module's output, in order.
    """
    # Dynamo's has_torch_function looks at the arguments only; the mode check makes a compiled
    # region hand the call to an active mode as eager code does
    if has_torch_function((input,)) or torch._C._is_torch_function_mode_enabled():  # pyright: ignore[reportPrivateUsage]
        return handle_torch_function(shared_input_linear, (input,), input, linears)
    return tuple(linear(input) for linear in linears)


def swiglu_projection(input: torch.Tensor, gate: nn.Module, up: nn.Module) -> torch.Tensor:
    """``swiglu(gate(input), up(input))``: a SwiGLU feed-forward's input side, as one call a mode can see.

    Without a mode it is ``shared_input_linear`` of the two modules and the ``swiglu`` op.
    ``FewRowsLinearMode`` (grouping projections) computes the activation of a few rows through
    plain ``nn.Linear`` modules in one kernel launch that writes neither product.

    Args:
        input: ``(..., k)``.
        gate: The gate projection (``nn.Linear`` or a replacement of one).
        up: The up projection, of the gate's output width.

    Returns:
        ``silu(gate(input)) * up(input)``.
    """
    if has_torch_function((input,)) or torch._C._is_torch_function_mode_enabled():  # pyright: ignore[reportPrivateUsage]
        return handle_torch_function(swiglu_projection, (input,), input, gate, up)
    gated, upped = shared_input_linear(input, (gate, up))
    return swiglu(gated, upped)
