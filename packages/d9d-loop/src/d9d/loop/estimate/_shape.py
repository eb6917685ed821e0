"""What a model provider states about its model for the memory estimate: shapes, not weights."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class LinearShape:
    """One linear layer's weight, as LoRA and the estimate see it.

    Attributes:
        name: Its qualified name in the model, ``{layer}`` standing for the decoder layer index
            (``model.layers.{layer}.self_attn.q_proj``); LoRA's ``target`` is searched in it.
        in_features: Input width.
        out_features: Output width.
        count: Matrices of this shape under the name (the experts of a grouped MoE weight).
        expert: Routed experts: sharded over ``expert_parallel`` ranks, not FSDP's.
    """

    name: str
    in_features: int
    out_features: int
    count: int = 1
    expert: bool = False

    @property
    def numel(self) -> int:
        """Elements of the weight (all ``count`` matrices)."""
        return self.in_features * self.out_features * self.count


@dataclass(kw_only=True, frozen=True)
class ModelMemoryShape:
    """A decoder model's numbers that its training memory follows, and how it computes.

    Attributes:
        num_layers: Decoder layers.
        hidden_size: Model width.
        vocab_size: Rows of the embedding and the LM head.
        num_heads: Query heads.
        num_kv_heads: Key/value heads.
        head_dim: Per-head size.
        ffn_width: Feed-forward width each token runs through: the intermediate size, or
            experts per token times an expert's width (plus a shared expert's).
        experts_per_token: Routed experts per token (0: a dense model).
        layer_linears: Each decoder layer's linear weights.
        layer_other_parameters: Each layer's remaining parameter elements (norms, biases, router).
        head: The LM head's weight; None when it shares the embedding's.
        other_parameters: Parameter elements outside the layers besides the embedding and
            the head (the final norm).
        storage_bytes: Bytes per element the parameters are stored, trained and stepped in
            (the master dtype).
        compute_bytes: Bytes per element of forward and backward (the compute dtype).
        activation_checkpointing: Every decoder layer recomputes its forward in backward.
        last_stage_weight: The extra cost of the last pipeline stage in layers (it gets fewer).
        head_chunk_tokens: Tokens per chunk of logits that the LM head's loss computes at a
            time, given the microbatch's tokens and the vocabulary rows on the rank (d9d-hf
            states d9d-kernels' ``linear_cross_entropy_chunk_tokens``); None: all the logits at
            once (an unfused head).
    """

    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_width: int
    experts_per_token: int = 0
    layer_linears: tuple[LinearShape, ...]
    layer_other_parameters: int = 0
    head: LinearShape | None
    other_parameters: int = 0
    storage_bytes: int
    compute_bytes: int
    activation_checkpointing: bool
    last_stage_weight: float = 0.0
    head_chunk_tokens: Callable[[int, int], int] | None = None

    @property
    def embedding_parameters(self) -> int:
        """Elements of the token embedding."""
        return self.vocab_size * self.hidden_size
