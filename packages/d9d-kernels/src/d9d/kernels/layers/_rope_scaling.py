"""Rotary-embedding frequency scaling methods (context extension), matching Hugging Face's formulas."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(kw_only=True, frozen=True)
class LinearRopeScaling:
    """Position interpolation: every frequency divided by ``factor`` (``rope_type="linear"``).

    Attributes:
        factor: How many times longer the target context is than the trained one.
    """

    factor: float


@dataclass(kw_only=True, frozen=True)
class NtkRopeScaling:
    """NTK-aware scaling: the base ``theta`` is raised so low frequencies stretch and high ones stay.

    Matches Hugging Face's ``rope_type="dynamic"``. With ``sequence_length`` set, the frequencies are
    fixed, computed once for that length; with None they are recomputed at every forward for the
    longest position seen (``max(position_ids) + 1``, never below ``max_position_embeddings``), as
    Hugging Face's dynamic update does on a freshly built model.

    Attributes:
        factor: Scaling factor.
        max_position_embeddings: Context length the model was trained with.
        sequence_length: Length to compute fixed frequencies for; None means dynamic.
    """

    factor: float
    max_position_embeddings: int
    sequence_length: int | None = None


@dataclass(kw_only=True, frozen=True)
class YarnRopeScaling:
    """YaRN: per-frequency blend of interpolation and extrapolation plus an attention factor.

    Matches Hugging Face's ``rope_type="yarn"``.

    Attributes:
        factor: Scaling factor.
        original_max_position_embeddings: Context length the model was trained with.
        beta_fast: Rotation count bounding the extrapolated (high-frequency) band.
        beta_slow: Rotation count bounding the interpolated (low-frequency) band.
        attention_factor: Multiplier of cos/sin; None derives it from ``factor`` (and the mscales).
        mscale: DeepSeek-style numerator mscale for the derived attention factor.
        mscale_all_dim: DeepSeek-style denominator mscale for the derived attention factor.
        truncate: Round the correction range to whole dims (Hugging Face's default).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(kw_only=True, frozen=True)
class Llama3RopeScaling:
    """Llama-3.1 scaling: low frequencies divided by ``factor``, high ones kept, a smooth ramp between.

    Matches Hugging Face's ``rope_type="llama3"``.

    Attributes:
        factor: Divisor of the low frequencies.
        low_freq_factor: Wavelengths above ``original_max_position_embeddings / low_freq_factor`` are scaled.
        high_freq_factor: Wavelengths below ``original_max_position_embeddings / high_freq_factor`` are kept.
        original_max_position_embeddings: Context length the model was trained with.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(kw_only=True, frozen=True)
class LongRopeScaling:
    """LongRoPE (Phi-3's 128k-context files): a divisor per frequency, one set for short sequences
    and one for long ones, and an attention factor.

    Matches Hugging Face's ``rope_type="longrope"``: a forward whose longest position
    (``max(position_ids) + 1``) fits ``original_max_position_embeddings`` divides the frequencies by
    ``short_factor``, a longer one by ``long_factor``; cos and sin are multiplied by
    ``attention_factor``.

    Attributes:
        short_factor: One divisor per rotation plane (``rotary_dim // 2``), within the original context.
        long_factor: One divisor per rotation plane, past it.
        original_max_position_embeddings: Context length the model was pretrained with.
        attention_factor: Multiplier of cos and sin (Hugging Face derives it from the extension
            factor: ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))``).
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float = 1.0


RopeScaling = LinearRopeScaling | NtkRopeScaling | YarnRopeScaling | Llama3RopeScaling | LongRopeScaling


def _base_inverse_frequencies(rotary_dim: int, theta: float, device: torch.device | None) -> torch.Tensor:
    exponents = (
        torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / rotary_dim
    )
    return 1.0 / (theta**exponents)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(rotations: float, rotary_dim: int, theta: float, max_positions: int) -> float:
    return (rotary_dim * math.log(max_positions / (rotations * 2 * math.pi))) / (2 * math.log(theta))


def _yarn_frequencies(
    scaling: YarnRopeScaling, rotary_dim: int, theta: float, device: torch.device | None
) -> tuple[torch.Tensor, float]:
    if scaling.attention_factor is not None:
        attention_factor = scaling.attention_factor
    elif scaling.mscale and scaling.mscale_all_dim:
        attention_factor = _yarn_mscale(scaling.factor, scaling.mscale) / _yarn_mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    else:
        attention_factor = _yarn_mscale(scaling.factor)
    max_positions = scaling.original_max_position_embeddings
    low = _yarn_correction_dim(scaling.beta_fast, rotary_dim, theta, max_positions)
    high = _yarn_correction_dim(scaling.beta_slow, rotary_dim, theta, max_positions)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoids a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(
        0, 1
    )
    extrapolation_weight = 1 - ramp
    extrapolated = _base_inverse_frequencies(rotary_dim, theta, device)
    interpolated = extrapolated / scaling.factor
    frequencies = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return frequencies, float(attention_factor)


def _llama3_frequencies(
    scaling: Llama3RopeScaling, rotary_dim: int, theta: float, device: torch.device | None
) -> torch.Tensor:
    frequencies = _base_inverse_frequencies(rotary_dim, theta, device)
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelength = old_context / scaling.low_freq_factor
    high_freq_wavelength = old_context / scaling.high_freq_factor
    wavelength = 2 * math.pi / frequencies
    scaled = torch.where(wavelength > low_freq_wavelength, frequencies / scaling.factor, frequencies)
    smooth = (old_context / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(is_medium, smoothed, scaled)


def _longrope_frequencies(
    scaling: LongRopeScaling,
    rotary_dim: int,
    theta: float,
    sequence_length: int | None,
    device: torch.device | None,
) -> torch.Tensor:
    for name, factors in (("short_factor", scaling.short_factor), ("long_factor", scaling.long_factor)):
        if len(factors) != rotary_dim // 2:
            raise ValueError(
                f"LongRoPE's {name} has {len(factors)} values; rotary dim {rotary_dim} needs one per "
                f"rotation plane, {rotary_dim // 2}"
            )
    is_long = sequence_length is not None and sequence_length > scaling.original_max_position_embeddings
    factors = torch.tensor(
        scaling.long_factor if is_long else scaling.short_factor, dtype=torch.float32, device=device
    )
    exponents = (
        torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / rotary_dim
    )
    return 1.0 / (factors * theta**exponents)  # Hugging Face's order of operations, bit for bit


def compute_rope_frequencies(
    rotary_dim: int,
    *,
    theta: float,
    scaling: RopeScaling | None = None,
    sequence_length: int | None = None,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, float]:
    """Computes the inverse frequencies of rotary embeddings and the cos/sin multiplier.

    Args:
        rotary_dim: Number of rotated dims per head (even).
        theta: Base wavelength.
        scaling: Context-extension method; None is plain RoPE.
        sequence_length: Longest sequence in this call, used only by dynamic NTK scaling and
            LongRoPE (None: LongRoPE's short factors).
        device: Where to create the frequencies.

    Returns:
        ``(inverse_frequencies, attention_factor)``: fp32 frequencies of shape ``(rotary_dim // 2,)``
        and the factor cos and sin are multiplied by (1.0 except for YaRN and LongRoPE).

    Raises:
        ValueError: If ``rotary_dim`` is not a positive even number, or LongRoPE's factors do
            not have one value per rotation plane.
    """
    if rotary_dim <= 0 or rotary_dim % 2 != 0:
        raise ValueError(f"rotary_dim={rotary_dim} must be a positive even number")
    match scaling:
        case None:
            return _base_inverse_frequencies(rotary_dim, theta, device), 1.0
        case LinearRopeScaling():
            return _base_inverse_frequencies(rotary_dim, theta, device) / scaling.factor, 1.0
        case NtkRopeScaling():
            length = scaling.sequence_length or sequence_length or scaling.max_position_embeddings
            length = max(length, scaling.max_position_embeddings)
            stretch = scaling.factor * length / scaling.max_position_embeddings - (scaling.factor - 1)
            scaled_theta = theta * stretch ** (rotary_dim / (rotary_dim - 2))
            return _base_inverse_frequencies(rotary_dim, scaled_theta, device), 1.0
        case YarnRopeScaling():
            return _yarn_frequencies(scaling, rotary_dim, theta, device)
        case Llama3RopeScaling():
            return _llama3_frequencies(scaling, rotary_dim, theta, device), 1.0
        case LongRopeScaling():
            frequencies = _longrope_frequencies(scaling, rotary_dim, theta, sequence_length, device)
            return frequencies, scaling.attention_factor
