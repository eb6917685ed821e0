"""The one place that names every model family: config.json's ``model_type`` picks the family.

``DecoderConfig`` is the discriminated union of the families' config.json models; pydantic picks
the member from ``model_type``. ``as_family`` is the exhaustive ``match`` over that union: a
member added to the union and not handled there is a type error, and each branch proves (to the
type checker) that its config fits the core's ``DecoderFamily`` protocol. Nothing else in d9d.hf
imports a family folder; no registry, no import for a side effect.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, assert_never

from pydantic import Field, TypeAdapter

from d9d.hf._decoder import DecoderFamily, read_config_file
from d9d.hf.deepseek_v3 import DeepseekV3Config
from d9d.hf.gemma3 import Gemma3TextConfig
from d9d.hf.gpt_oss import GptOssConfig
from d9d.hf.granite import GraniteConfig
from d9d.hf.llama import LlamaConfig
from d9d.hf.mistral import MistralConfig
from d9d.hf.olmo2 import Olmo2Config
from d9d.hf.phi3 import Phi3Config
from d9d.hf.qwen2 import Qwen2Config
from d9d.hf.qwen3 import Qwen3DenseConfig, Qwen3MoeConfig

AnyDecoderConfig = (
    Qwen3DenseConfig
    | Qwen3MoeConfig
    | LlamaConfig
    | Qwen2Config
    | MistralConfig
    | GraniteConfig
    | Olmo2Config
    | Phi3Config
    | Gemma3TextConfig
    | GptOssConfig
    | DeepseekV3Config
)
"""Every family's config.json model (a new family adds its own here and in ``as_family``)."""

DecoderConfig = Annotated[AnyDecoderConfig, Field(discriminator="model_type")]
"""A config.json of any supported family, told apart by ``model_type``."""

DECODER_CONFIG_ADAPTER: TypeAdapter[AnyDecoderConfig] = TypeAdapter(DecoderConfig)

SUPPORTED_MODEL_TYPES = (
    "qwen3",
    "qwen3_moe",
    "llama",
    "qwen2",
    "mistral",
    "granite",
    "olmo2",
    "phi3",
    "gemma3_text",
    "gpt_oss",
    "deepseek_v3",
)
"""The ``model_type`` values d9d.hf reads."""


def as_family(config: AnyDecoderConfig) -> DecoderFamily:
    """``config`` as the core's ``DecoderFamily`` (every family's config model implements it)."""
    match config:
        case Qwen3DenseConfig() | Qwen3MoeConfig():
            return config
        case LlamaConfig():
            return config
        case Qwen2Config():
            return config
        case MistralConfig():
            return config
        case GraniteConfig():
            return config
        case Olmo2Config():
            return config
        case Phi3Config():
            return config
        case Gemma3TextConfig():
            return config
        case GptOssConfig():
            return config
        case DeepseekV3Config():
            return config
        case _:
            assert_never(config)


def read_decoder_config(directory: Path | str) -> DecoderFamily:
    """Reads and validates ``directory/config.json`` as the config of whichever family it names.

    Raises:
        FileNotFoundError: If there is no config.json.
        ValueError: Naming the file and every offending field: a ``model_type`` d9d does not
            support, an unknown field, a value d9d does not implement.
    """
    what = "/".join(SUPPORTED_MODEL_TYPES)
    return as_family(read_config_file(directory, DECODER_CONFIG_ADAPTER, what=f"model_type {what}"))
