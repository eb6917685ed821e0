"""Several linear layers applied to one input (q/k/v, gate/up), as one call a mode can see."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.overrides import handle_torch_function, has_torch_function


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
