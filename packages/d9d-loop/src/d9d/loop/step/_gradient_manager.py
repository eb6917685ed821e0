"""Gradient accumulation, synchronization by placements, loss-weight scaling and clipping."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from d9d.loop.config._trainer import GradientClippingConfig
from d9d.loop.step._device_scalars import device_scalar
from d9d.parallel import GradientClip, GradientSynchronizer, gradient_clip


class GradientManager:
    """Owns what happens to gradients between the first backward and the optimizer step.

    Microbatch backward passes accumulate ``loss_weight * loss / microbatches``; reductions run
    only on the last microbatch (overlapped with its backward by d9d-parallel's synchronizer) and
    average over the data-parallel ranks. ``finish`` then corrects the scale so that the gradient
    is that of ``sum(weight * loss) / sum(weight)`` over every microbatch of every rank.
    """

    def __init__(
        self,
        *,
        stages: Sequence[nn.Module],
        data_parallel_size: int,
        bucket_size_mb: float,
        clipping: GradientClippingConfig,
        pp_group: ProcessGroup | None,
        norm_duplicates: Sequence[nn.Parameter] = (),
    ) -> None:
        # Parameter objects are fixed once the stages are materialized: list them once, not per step.
        self._parameters = [p for stage in stages for p in stage.parameters()]
        self._dp = data_parallel_size
        self._clipping = clipping
        self._pp_group = pp_group
        self._norm_duplicates = list(norm_duplicates)  # counted once elsewhere, clipped alike
        self._pending_scale: float | torch.Tensor = 1.0
        self._synchronizers = [GradientSynchronizer(stage, bucket_size_mb=bucket_size_mb) for stage in stages]

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter of the local stages."""
        return self._parameters

    def begin_microbatch(self, *, is_last: bool, stage_position: int | None = None) -> None:
        """Call before each microbatch's backward (of one local stage, or of all of them)."""
        if stage_position is not None:
            self._synchronizers[stage_position].begin_microbatch(is_last)
            return
        for synchronizer in self._synchronizers:
            synchronizer.begin_microbatch(is_last)

    def finish(self, *, global_weight: float | torch.Tensor, microbatches_per_rank: int) -> None:
        """Waits for the reductions and notes the scale that makes the gradients a weighted mean.

        Runners back-propagate ``weight * loss / microbatches_per_rank``, which is already exact
        when every microbatch weighs 1; otherwise the gradients still need the factor
        ``data_parallel * microbatches_per_rank / global_weight``, applied by ``clip()`` in the
        same multi-tensor multiplication as the clipping (one pass over the gradients). A device
        scalar ``global_weight`` is used there without being read on the host.
        """
        for synchronizer in self._synchronizers:
            synchronizer.finish()
        self._pending_scale = self._dp * microbatches_per_rank / global_weight

    def clip(self, *, in_place: bool = True) -> GradientClip:
        """Computes the norm with the pending scale, and the factor that scales and clips.

        Args:
            in_place: Multiply the gradients by the factor now (one multi-tensor kernel); False
                leaves them as they are, for an optimizer that applies the factor as it reads them.

        Returns:
            The norm of the correctly scaled gradients before clipping (a device scalar) and the
            factor (None when it is 1 or already applied).
        """
        scale, self._pending_scale = self._pending_scale, 1.0
        clip = gradient_clip(
            self.parameters(),
            self._clipping.max_norm,
            norm_type=self._clipping.norm_type,
            pp_group=self._pp_group,
            grad_scale=scale,
            exclude_from_norm=self._norm_duplicates,
        )
        if in_place and clip.factor is not None:
            clip.apply()
            return GradientClip(clip.norm, None)
        return clip

    def close(self) -> None:
        """Removes gradient hooks."""
        for synchronizer in self._synchronizers:
            synchronizer.close()


def all_reduce_sum_on_device(
    values: Sequence[float | torch.Tensor], group: ProcessGroup | None, device: torch.device
) -> torch.Tensor:
    """Sums a few scalars over ``group`` in one collective (float64 for exact counts), unread.

    Returns:
        The sums as a float64 vector on ``device`` (on an accelerator nothing waits for them; read
        them with the other figures of the step in one copy).
    """
    if device.type == "cpu":
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
    else:
        tensor = torch.stack([device_scalar(v, device=device, dtype=torch.float64) for v in values])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, group=group)
    return tensor
