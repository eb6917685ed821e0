"""OLMo 2 config.json, read and written (pydantic, the Hugging Face field names)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import TypeAdapter

from d9d.hf._decoder import (
    DecoderConfigWithHeadDim,
    DecoderTensorParallelPlan,
    LayerRecipe,
    LayerTensor,
    TensorParallelRefusal,
    read_config_file,
)
from d9d.hf.olmo2._layer_tensors import olmo2_layer_tensors


class Olmo2Config(DecoderConfigWithHeadDim):
    """config.json of ``model_type: olmo2`` (``Olmo2ForCausalLM`` and its heads).

    Defaults are transformers' (OLMo-2-1124-7B): ``rms_norm_eps`` 1e-5, ``pad_token_id`` 1,
    ``eos_token_id`` 50279. Tensor parallelism is refused: the q/k norms span all heads, so a
    rank holding some heads cannot normalize them alone.
    """

    architecture_prefix: ClassVar[str] = "Olmo2"

    model_type: Literal["olmo2"]
    vocab_size: int = 50304
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 50279
    attention_bias: bool = False

    def layer_recipe(self, index: int) -> LayerRecipe:
        """OLMo 2's layer: ``x + norm(attn(x))`` then ``x + norm(mlp(x))`` (``norm_layout="post"``), the
        q/k norms over the whole projection of all heads, biases on q/k/v/o with ``attention_bias``."""
        return dataclasses.replace(
            super().layer_recipe(index),
            qkv_bias=self.attention_bias,
            o_bias=self.attention_bias,
            qk_norm="all_heads",
            norm_layout="post",
        )

    def tensor_parallel_plan(self) -> DecoderTensorParallelPlan | TensorParallelRefusal | None:
        """A refusal: OLMo 2's q/k norms span all heads, which column-split projections divide over ranks."""
        return TensorParallelRefusal(
            reason="its q/k norms span all heads' channels at once, and a tp rank holds only some heads"
        )

    def layer_tensors(self, index: int) -> list[LayerTensor]:
        """OLMo 2's name table of layer ``index``."""
        del index
        return olmo2_layer_tensors(attention_bias=self.attention_bias)


OLMO2_CONFIG_ADAPTER: TypeAdapter[Olmo2Config] = TypeAdapter(Olmo2Config)


def read_olmo2_config(directory: Path | str) -> Olmo2Config:
    """Reads and validates ``directory/config.json`` as an OLMo 2 config.

    Raises:
        ValueError: Naming the file and every offending field.
    """
    return read_config_file(directory, OLMO2_CONFIG_ADAPTER, what="OLMo 2")
