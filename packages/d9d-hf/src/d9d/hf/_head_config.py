"""The ``heads:`` list of the ``model:`` section: several heads on one backbone, each with its
loss weight and metrics."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from d9d.hf._decoder import ClassificationHeadSpec, HeadSpec, LanguageModelHeadSpec

ClassificationMetric = Literal["accuracy", "f1", "auroc"]
"""``accuracy`` (top-1), ``f1`` (macro precision, recall and F1, ``MulticlassScores``), ``auroc``
(two classes only: of the second class's probability, ``BinaryAUROC``)."""


class CausalLMHeadConfig(BaseModel):
    """``{kind: causal_lm, name: lm, loss_weight: 1.0}``: next-token prediction.

    Its loss is the mean over the microbatch's target tokens; its metric ``<name>/loss`` the mean
    per-token loss over the logged steps (all ranks, weighted by target tokens).

    Attributes:
        kind: The discriminator.
        name: The head's name (output key, metric prefix).
        loss_weight: Its factor in the job's loss (the weighted sum over heads).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["causal_lm"] = "causal_lm"
    name: str = Field(default="lm", pattern=r"^[A-Za-z0-9_-]+$")
    loss_weight: float = Field(default=1.0, ge=0.0)

    def spec(self) -> LanguageModelHeadSpec:
        """The core's description of this head."""
        return LanguageModelHeadSpec(name=self.name)


class ClassificationHeadConfig(BaseModel):
    """``{kind: classification, name: sentiment, num_labels: 2}``: one label per row.

    Its loss is the cross-entropy mean over the microbatch's rows; its metrics are reported as
    ``<name>/loss`` and ``<name>/<metric>`` (accumulated on every rank, summed across ranks).

    Attributes:
        kind: The discriminator.
        name: The head's name (output key, label key, metric prefix, export file name).
        num_labels: Number of classes.
        loss_weight: Its factor in the job's loss (the weighted sum over heads).
        metrics: Metrics beside the loss.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["classification"] = "classification"
    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$")
    num_labels: int = Field(ge=2)
    loss_weight: float = Field(default=1.0, ge=0.0)
    metrics: tuple[ClassificationMetric, ...] = ("accuracy",)

    @model_validator(mode="after")
    def _auroc_is_binary(self) -> ClassificationHeadConfig:
        if "auroc" in self.metrics and self.num_labels != 2:
            raise ValueError(f"head {self.name!r}: auroc needs num_labels 2, got {self.num_labels}")
        return self

    def spec(self) -> ClassificationHeadSpec:
        """The core's description of this head."""
        return ClassificationHeadSpec(name=self.name, num_labels=self.num_labels)


HeadConfig = Annotated[CausalLMHeadConfig | ClassificationHeadConfig, Field(discriminator="kind")]
"""One entry of ``model.heads`` (``kind`` picks the head)."""


def head_specs(heads: tuple[HeadConfig, ...]) -> list[HeadSpec]:
    """The core's descriptions of the configured heads, in order."""
    return [head.spec() for head in heads]
