"""FSDP on stages with a split backward: one gradient reduction after the stage's last ``W``.

``fully_shard`` (FSDP2) reduce-scatters a module's gradients when gradients reach the module's
inputs. In a split backward that is the input pass (``I``), before the weight pass (``W``) has
produced the weight gradients. On such a stage the executor turns FSDP's reduction into a step of
its own, with FSDP's public controls:

- before the step, each FSDP root of the stage switches to manual backward finalization;
- every backward part (``B``, ``I``, ``W``) runs with gradient synchronization off and without
  resharding after backward: the gathered parameters accumulate the unreduced gradients of every
  microbatch;
- before each ``W`` the stage's FSDP modules are gathered (a no-op unless a forward in between
  resharded them): ``W`` accumulates into the parameters the stage holds at that moment, which
  must be the gathered ones its graph was built with (on the first stage ``W`` is the whole
  backward and also reads the weights);
- after the stage's last backward part of the step, gradient synchronization and resharding are
  turned back on and each root finalizes once: one reduce-scatter (and, under HSDP, one
  all-reduce) per parameter group, then the parameters are resharded.

Manual finalization (``FSDPModule.finalize_backward``) is newer than torch 2.11. Where torch
lacks it, such a stage runs its backward whole in ``I`` and its ``W`` actions do nothing: FSDP
then reduces in the stage's last ``I`` as in a schedule without split backward. The results are
the same; that stage loses the overlap the split buys (the executor warns once).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

from torch import nn
from torch.distributed.fsdp import FSDPModule

from d9d.pipeline._actions import ActionKind
from d9d.pipeline._program import PipelineProgram


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    """Every FSDP module in ``module`` (itself included), each once."""
    found: dict[int, FSDPModule] = {}
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            found.setdefault(id(sub), sub)
    return list(found.values())


def _outermost(module: nn.Module, found: dict[int, FSDPModule]) -> None:
    if isinstance(module, FSDPModule):
        found.setdefault(id(module), module)
        return
    for child in module.children():
        _outermost(child, found)


def manual_finalization_available() -> bool:
    """Whether this torch's FSDP can finalize backward on request (needed for split backward)."""
    return all(
        hasattr(FSDPModule, name)
        for name in ("set_manual_backward_finalization", "finalize_backward", "reset_iter_state")
    )


def whole_backward_stages(program: PipelineProgram, rank: int, stages: Mapping[int, nn.Module]) -> list[int]:
    """Stages of ``rank`` whose split backward runs whole in ``I`` (FSDP without manual finalization)."""
    if manual_finalization_available():
        return []
    split = {
        a.stage
        for a in program.actions[rank]
        if a.kind in (ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)
    }
    return [stage for stage in sorted(split) if fsdp_modules(stages[stage])]


def warn_whole_backward(stages: list[int]) -> None:
    """Warns that ``stages`` lose the split of their backward (torch without manual finalization)."""
    if stages:
        warnings.warn(
            f"stages {stages} hold FSDP (fully_shard) modules and this torch lacks "
            "FSDPModule.finalize_backward: their backward runs whole in the input pass (I) and their "
            "weight passes (W) do nothing. Gradients are correct; the zero-bubble overlap is lost "
            "there. Upgrade torch to split them",
            stacklevel=3,
        )


class ShardedSplitBackward:
    """Holds back FSDP's gradient reduction on one stage while its backward is split.

    Args:
        module: The stage module; its FSDP modules are found once here.
    """

    def __init__(self, module: nn.Module) -> None:
        self._modules = fsdp_modules(module)
        roots: dict[int, FSDPModule] = {}
        _outermost(module, roots)
        self._roots = list(roots.values())
        self._holding = False

    def begin(self) -> None:
        """Before the step's first action: the step's backward parts will not reduce."""
        if not self._modules:
            return
        for root in self._roots:
            root.set_manual_backward_finalization(True)
        self._holding = True

    def before_backward(self, *, weight: bool) -> None:
        """Before a backward part: no reduction, no resharding; gathers the weights for ``W``.

        Args:
            weight: Whether the part is a weight backward (``W``), which needs the gathered
                parameters registered on the stage.
        """
        if not self._holding:
            return
        for module in self._modules:
            # Set on every part: a gradient synchronizer may have turned it on for the "last" one.
            module.set_requires_gradient_sync(False, recurse=False)
            module.set_reshard_after_backward(False, recurse=False)
        if weight:  # all gathers in flight at once; each a no-op where still gathered
            handles = [module.unshard(async_op=True) for module in self._modules]
            for handle in handles:
                if handle is not None:
                    handle.wait()

    def finish(self) -> None:
        """After the stage's last backward part of the step: reduce once and reshard."""
        if not self._holding:
            return
        self._holding = False
        self._restore()
        for root in self._roots:
            root.finalize_backward()
            root.set_manual_backward_finalization(False)

    def abort(self) -> None:
        """After a failed step: drops FSDP's half-done backward state and its gradients."""
        if not self._holding:
            return
        self._holding = False
        self._restore()
        for root in self._roots:
            root.reset_iter_state()
            root.set_manual_backward_finalization(False)

    def _restore(self) -> None:
        for module in self._modules:
            module.set_requires_gradient_sync(True, recurse=False)
            module.set_reshard_after_backward(True, recurse=False)
