"""Gemma 3's tensor-parallel plan: Megatron's, with the two feed-forward norms on the sequence slice."""

from __future__ import annotations

from torch.distributed.tensor.parallel import ParallelStyle

from d9d.hf._decoder import DecoderLayer, MegatronDecoderPlan
from d9d.parallel import SequenceParallelNorm


class Gemma3DecoderPlan:
    """``MegatronDecoderPlan`` plus ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm``.

    Every norm of a Gemma 3 layer reads the residual stream or a branch's output, both of which
    are this rank's slice of the sequence between the column- and row-split projections.
    """

    def layer_styles(self, layer: DecoderLayer) -> dict[str, ParallelStyle]:
        """Megatron's styles of ``layer`` and the two feed-forward norms as sequence-parallel norms."""
        return {
            **MegatronDecoderPlan().layer_styles(layer),
            "pre_feedforward_layernorm": SequenceParallelNorm(),
            "post_feedforward_layernorm": SequenceParallelNorm(),
        }
