"""The ``rope_parameters`` (or legacy ``rope_scaling``) block of a Hugging Face config.json."""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator

from d9d.kernels.layers import (
    LinearRopeScaling,
    Llama3RopeScaling,
    NtkRopeScaling,
    RopeScaling,
    YarnRopeScaling,
)


class _RopeBase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rope_theta: float | None = None
    type: str | None = None  # older configs name the method here instead of in rope_type
    partial_rotary_factor: float | None = None  # transformers 5 writes 1.0 into Phi-3's block

    @field_validator("partial_rotary_factor")
    @classmethod
    def _whole_head(cls, value: float | None) -> float | None:
        if value is not None and value != 1.0:
            raise ValueError(
                f"partial_rotary_factor={value} is not implemented (d9d rotates every channel of a head)"
            )
        return value


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


RopeParameters = Annotated[
    DefaultRopeParameters
    | LinearRopeParameters
    | DynamicRopeParameters
    | YarnRopeParameters
    | Llama3RopeParameters,
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


def rope_scaling_of(parameters: RopeParameters | None, *, max_position_embeddings: int) -> RopeScaling | None:
    """d9d-kernels' scaling object for a config's rope block (None for plain RoPE).

    ``original_max_position_embeddings`` defaults to ``max_position_embeddings``, as in Hugging Face.
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
                or max_position_embeddings,
            )
