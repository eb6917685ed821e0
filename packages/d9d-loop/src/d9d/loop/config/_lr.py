"""Learning-rate schedules: a warm-up followed by a list of phases."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_FRACTION_TOLERANCE = 1e-6


class _PhaseBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int | None = Field(default=None, ge=1)
    """Length in optimizer steps; exactly one of ``steps`` and ``fraction`` (of the whole run)."""
    fraction: float | None = Field(default=None, gt=0, le=1)

    @model_validator(mode="after")
    def _one_length(self) -> _PhaseBase:
        if (self.steps is None) == (self.fraction is None):
            raise ValueError("a phase needs exactly one of 'steps' and 'fraction'")
        return self

    def length(self, total_steps: int) -> int:
        """Length of this phase in steps for a run of ``total_steps``."""
        if self.steps is not None:
            return self.steps
        return max(round((self.fraction or 0.0) * total_steps), 1)


class ConstantPhase(_PhaseBase):
    """Holds the multiplier at ``factor``."""

    kind: Literal["constant"] = "constant"
    factor: float = Field(default=1.0, ge=0)


class LinearPhase(_PhaseBase):
    """Moves the multiplier linearly from the previous phase's end to ``end_factor``."""

    kind: Literal["linear"] = "linear"
    end_factor: float = Field(default=0.0, ge=0)


class CosinePhase(_PhaseBase):
    """Half-cosine from the previous phase's end to ``end_factor``."""

    kind: Literal["cosine"] = "cosine"
    end_factor: float = Field(default=0.0, ge=0)


class ExponentialPhase(_PhaseBase):
    """Geometric decay from the previous phase's end to ``end_factor`` (> 0)."""

    kind: Literal["exponential"] = "exponential"
    end_factor: float = Field(default=0.01, gt=0)


LRPhaseConfig = Annotated[
    ConstantPhase | LinearPhase | CosinePhase | ExponentialPhase, Field(discriminator="kind")
]


class WarmupConfig(BaseModel):
    """Linear warm-up from ``start_factor`` to 1; ``steps`` or ``fraction`` of the run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int | None = Field(default=None, ge=0)
    fraction: float | None = Field(default=None, ge=0, le=1)
    start_factor: float = Field(default=0.0, ge=0, le=1)

    @model_validator(mode="after")
    def _at_most_one_length(self) -> WarmupConfig:
        if self.steps is not None and self.fraction is not None:
            raise ValueError(
                f"warmup has both 'steps' ({self.steps}) and 'fraction' ({self.fraction}); give one"
            )
        return self

    def length(self, total_steps: int) -> int:
        """Warm-up length in steps."""
        if self.steps is not None:
            return self.steps
        if self.fraction is not None:
            return round(self.fraction * total_steps)
        return 0


class PiecewiseLRSchedulerConfig(BaseModel):
    """Warm-up then phases; after the last phase the multiplier stays at its end value."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Literal["piecewise"] = "piecewise"
    warmup: WarmupConfig = WarmupConfig()
    phases: list[LRPhaseConfig] = Field(default_factory=lambda: [ConstantPhase(fraction=1.0)])

    @model_validator(mode="after")
    def _fractions_cover_the_run(self) -> PiecewiseLRSchedulerConfig:
        if "phases" not in self.model_fields_set and self.warmup.fraction:
            # the default phase fills what the warm-up leaves of the run
            rest = ConstantPhase(fraction=max(1.0 - self.warmup.fraction, _FRACTION_TOLERANCE))
            object.__setattr__(self, "phases", [rest])
        fractions = [p.fraction for p in self.phases if p.fraction is not None]
        total = sum(fractions) + (self.warmup.fraction or 0.0)
        all_fractions = len(fractions) == len(self.phases) and self.warmup.steps is None
        if total > 1.0 + _FRACTION_TOLERANCE or (all_fractions and abs(total - 1.0) > _FRACTION_TOLERANCE):
            raise ValueError(
                f"phases: the fractions of the run (warmup.fraction and each phase's fraction) sum to "
                f"{total:g}; they must sum to 1 (at most 1 when some lengths are given in steps)"
            )
        return self

    def check_run_length(self, total_steps: int) -> None:
        """Raises if the warm-up is longer than a run of ``total_steps`` steps."""
        warmup = self.warmup.length(total_steps)
        if warmup > total_steps:
            raise ValueError(
                f"lr_scheduler.warmup.steps={warmup} is longer than the run ({total_steps} steps)"
            )


class ConstantLRSchedulerConfig(BaseModel):
    """The optimizer's learning rate, unchanged."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Literal["constant"] = "constant"


LRSchedulerConfig = Annotated[
    PiecewiseLRSchedulerConfig | ConstantLRSchedulerConfig, Field(discriminator="name")
]
