"""The ``rope_parameters`` (or legacy ``rope_scaling``) block of a Hugging Face config.json."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field

from d9d.kernels.layers import (
    LinearRopeScaling,
    Llama3RopeScaling,
    LongRopeScaling,
    NtkRopeScaling,
    RopeScaling,
    YarnRopeScaling,
)


class _RopeBase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rope_theta: float | None = None
    type: str | None = None  # older configs name the method here instead of in rope_type
    partial_rotary_factor: float | None = None  # the rotated fraction of a head; a family's config checks it


class DefaultRopeParameters(_RopeBase):
    """Plain RoPE."""

    rope_type: Literal["default"] = "default"


class LinearRopeParameters(_RopeBase):
    """Position interpolation."""

    rope_type: Literal["linear"]
    factor: float


class DynamicRopeParameters(_RopeBase):
    """Dynamic NTK scaling (recomputed for sequences longer than ``max_position_embeddings``)."""

    rope_type: Literal["dynamic"]
    factor: float
    original_max_position_embeddings: int | None = None


class YarnRopeParameters(_RopeBase):
    """YaRN; unset fields take Hugging Face's defaults."""

    rope_type: Literal["yarn"]
    factor: float
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None


class Llama3RopeParameters(_RopeBase):
    """Llama-3.1 frequency scaling."""

    rope_type: Literal["llama3"]
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int | None = None


class LongRopeParameters(_RopeBase):
    """LongRoPE (Phi-3's 128k-context files); unset fields take Hugging Face's defaults."""

    rope_type: Literal["longrope"]
    short_factor: list[float]
    long_factor: list[float]
    factor: float | None = None
    attention_factor: float | None = None
    original_max_position_embeddings: int | None = None


RopeParameters = Annotated[
    DefaultRopeParameters
    | LinearRopeParameters
    | DynamicRopeParameters
    | YarnRopeParameters
    | Llama3RopeParameters
    | LongRopeParameters,
    Field(discriminator="rope_type"),
]


def with_rope_type(value: object) -> object:
    """Adds ``rope_type`` to a raw rope block that names its method only in legacy ``type``."""
    if not isinstance(value, dict):
        return value
    fields = cast(dict[str, Any], value)
    if "rope_type" in fields:
        return fields
    return {**fields, "rope_type": fields.get("type", "default")}


def _longrope(
    parameters: LongRopeParameters,
    *,
    max_position_embeddings: int,
    original_max_position_embeddings: int | None,
) -> LongRopeScaling:
    """Hugging Face's defaults: the original context from the block, else the config's top-level
    field; the extension factor from the block, else the ratio of the two contexts; the attention
    factor from the block, else ``sqrt(1 + ln(factor) / ln(original context))`` (1 without extension)."""
    original = (
        parameters.original_max_position_embeddings
        or original_max_position_embeddings
        or max_position_embeddings
    )
    factor = parameters.factor if parameters.factor is not None else max_position_embeddings / original
    attention_factor = parameters.attention_factor
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRopeScaling(
        short_factor=tuple(parameters.short_factor),
        long_factor=tuple(parameters.long_factor),
        original_max_position_embeddings=original,
        attention_factor=attention_factor,
    )


def rope_scaling_of(
    parameters: RopeParameters | None,
    *,
    max_position_embeddings: int,
    original_max_position_embeddings: int | None = None,
) -> RopeScaling | None:
    """d9d-kernels' scaling object for a config's rope block (None for plain RoPE).

    A block's ``original_max_position_embeddings`` defaults to the config's top-level field of
    that name (``original_max_position_embeddings``, which Phi-3's files carry), else to
    ``max_position_embeddings``, as in Hugging Face.
    """
    match parameters:
        case None | DefaultRopeParameters():
            return None
        case LinearRopeParameters():
            return LinearRopeScaling(factor=parameters.factor)
        case DynamicRopeParameters():
            return NtkRopeScaling(factor=parameters.factor, max_position_embeddings=max_position_embeddings)
        case YarnRopeParameters():
            return YarnRopeScaling(
                factor=parameters.factor,
                original_max_position_embeddings=parameters.original_max_position_embeddings
                or max_position_embeddings,
                beta_fast=32.0 if parameters.beta_fast is None else parameters.beta_fast,
                beta_slow=1.0 if parameters.beta_slow is None else parameters.beta_slow,
                attention_factor=parameters.attention_factor,
                mscale=parameters.mscale,
                mscale_all_dim=parameters.mscale_all_dim,
                truncate=True if parameters.truncate is None else parameters.truncate,
            )
        case Llama3RopeParameters():
            return Llama3RopeScaling(
                factor=parameters.factor,
                low_freq_factor=parameters.low_freq_factor,
                high_freq_factor=parameters.high_freq_factor,
                original_max_position_embeddings=parameters.original_max_position_embeddings
                or original_max_position_embeddings
                or max_position_embeddings,
            )
        case LongRopeParameters():
            return _longrope(
                parameters,
                max_position_embeddings=max_position_embeddings,
                original_max_position_embeddings=original_max_position_embeddings,
            )
