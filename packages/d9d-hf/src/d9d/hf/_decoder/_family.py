"""What a model family gives the decoder core: the ``DecoderFamily`` protocol and its name table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Self

from d9d.hf._decoder._decoder_layer import DecoderLayer
from d9d.hf._decoder._spec import DecoderSpec
from d9d.hf._decoder._tensor_parallel_plan import DecoderTensorParallelPlan, TensorParallelRefusal
from d9d.hf._head import HeadName
from d9d.kernels.layers import AttentionBackend, AttentionBackendName


@dataclass(kw_only=True, frozen=True)
class TensorName:
    """One decoder-layer tensor: its Hugging Face name and d9d's, both relative to the layer.

    Attributes:
        hf: The name under ``{prefix}layers.{index}.`` in a transformers checkpoint.
        d9d: The name under ``model.layers.{index}.`` in the d9d model.
    """

    hf: str
    d9d: str


@dataclass(kw_only=True, frozen=True)
class StackedExperts:
    """One d9d ``(experts, in, out)`` tensor stored by transformers as one ``(out, in)`` per expert.

    Attributes:
        hf: The per-expert names, in expert order, relative to the layer.
        d9d: The stacked tensor's name, relative to the layer.
    """

    hf: tuple[str, ...]
    d9d: str


@dataclass(kw_only=True, frozen=True)
class FusedTensor:
    """One Hugging Face tensor that d9d holds as several, cut along dim 0 (a fused QKV or gate/up).

    Loading splits ``hf`` into the ``d9d`` tensors (a ``ChunkMapper``); export joins them back in
    the same order (a ``ConcatenateMapper``), so the checkpoint keeps its fused layout.

    Attributes:
        hf: The fused tensor's name, relative to the layer.
        d9d: The separate tensors' names, relative to the layer, in the fused tensor's order.
        sizes: Each d9d tensor's size along dim 0 (they sum to the fused tensor's).
    """

    hf: str
    d9d: tuple[str, ...]
    sizes: tuple[int, ...]


@dataclass(kw_only=True, frozen=True)
class InterleavedTensor:
    """One Hugging Face tensor whose last dim interleaves several d9d tensors, element by element.

    GPT-OSS's ``mlp.experts.gate_up_proj`` ``(E, H, 2I)`` holds the gate at ``[..., 0::2]`` and up
    at ``[..., 1::2]``. Loading de-interleaves it (a ``ReshapeMapper`` to ``(*leading, -1, n)``, a
    ``ChunkMapper`` along the new last dim, a reshape back per part); export interleaves the
    parts back (the reverse, through a ``ConcatenateMapper``).

    Attributes:
        hf: The interleaved tensor's name, relative to the layer.
        d9d: The separate tensors' names, relative to the layer, in their interleaving order.
        leading: The sizes of every dim before the interleaved last one (``(E, H)`` for a weight,
            ``(E,)`` for a bias).
    """

    hf: str
    d9d: tuple[str, ...]
    leading: tuple[int, ...]


LayerTensor = TensorName | StackedExperts | FusedTensor | InterleavedTensor
"""An entry of a family's name table."""


class DecoderFamily(Protocol):
    """A model family, as implemented by its config.json model (one pydantic class per ``model_type``).

    The core owns everything a decoder-only family shares (backbone, stage layout, heads, stage
    loading, tied stages, the shared part of tensor parallelism, parallelize recipe, model
    provider); a family gives only what differs: its numbers, its decoder layer, its tensor
    names, its layers' tensor-parallel plan and its config export. ``d9d.hf``'s dispatch module
    lists the families in one discriminated union.
    """

    @property
    def model_type(self) -> str:
        """config.json's ``model_type``: the family's name in messages."""
        ...

    def decoder_spec(self) -> DecoderSpec:
        """The resolved numbers the core builds the model from."""
        ...

    def tensor_parallel_plan(self) -> DecoderTensorParallelPlan | TensorParallelRefusal | None:
        """How a decoder layer splits under ``tensor_parallel > 1``; None for a family without a plan.

        A family without one is refused under tensor parallelism before any weight is built,
        naming its ``model_type`` (its layers' modules would otherwise stay unsplit); a family
        that cannot split returns a ``TensorParallelRefusal``, whose reason the refusal states.
        """
        ...

    def build_decoder_layer(
        self, index: int, *, attention_backend: AttentionBackend | AttentionBackendName | None
    ) -> DecoderLayer:
        """Decoder layer ``index`` (its window, dense or sparse feed-forward, biases)."""
        ...

    def layer_tensors(self, index: int) -> Sequence[LayerTensor]:
        """The name table of layer ``index``: every tensor of the layer, HF name and d9d name."""
        ...

    def hf_architecture(self, head: HeadName) -> str:
        """The transformers class name written into an export's ``architectures`` for ``head``."""
        ...

    def to_json_dict(self) -> dict[str, Any]:
        """The config.json content as transformers reads it."""
        ...

    def with_num_labels(self, num_labels: int) -> Self:
        """A copy whose sequence-classification head has ``num_labels`` classes."""
        ...

    def with_pad_token_id(self, pad_token_id: int) -> Self:
        """A copy whose ``pad_token_id`` is ``pad_token_id``; raises ``ValueError`` outside the vocabulary."""
        ...

    def with_output_router_logits(self, enabled: bool) -> Self:
        """A copy whose training objective has (``enabled``) or lacks the load-balancing loss.

        Raises ``ValueError`` for a family without a router.
        """
        ...
