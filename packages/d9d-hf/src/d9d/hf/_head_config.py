"""The ``heads:`` list of the ``model:`` section: several heads on one backbone, each with its
loss weight and metrics. Each entry knows its core head (``spec``) and its task side: its loss,
its metrics and what it needs of a batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from d9d.hf._causal_lm_task import IGNORE_INDEX
from d9d.hf._decoder import ClassificationHeadSpec, DecoderHead, LanguageModelHeadSpec
from d9d.loop.metrics import Accuracy, BinaryAUROC, Metric, MulticlassScores, WeightedMean

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

    @property
    def needs_token_targets(self) -> bool:
        """True: the batch's next-token targets."""
        return True

    def spec(self) -> LanguageModelHeadSpec:
        """The core's head object."""
        return LanguageModelHeadSpec(name=self.name)

    def check_labels(self, class_labels: Mapping[str, torch.Tensor]) -> None:
        """Nothing: its labels are the tokens."""
        del class_labels

    def loss(
        self, output: torch.Tensor, targets: torch.Tensor | None, class_labels: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """The mean per-token loss over the microbatch's target tokens."""
        del class_labels
        return _token_mean(output, targets)[0]

    def create_metrics(self) -> dict[str, Metric]:
        """``<name>/loss``."""
        return {f"{self.name}/loss": WeightedMean()}

    def update_metrics(
        self,
        metrics: Mapping[str, Metric],
        output: torch.Tensor,
        targets: torch.Tensor | None,
        class_labels: Mapping[str, torch.Tensor],
    ) -> None:
        """Adds the microbatch's mean loss, weighted by its target tokens."""
        del class_labels
        mean, count = _token_mean(output, targets)
        metrics[f"{self.name}/loss"].update(mean.detach(), count)


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

    @property
    def needs_token_targets(self) -> bool:
        """False: one class per row."""
        return False

    def spec(self) -> ClassificationHeadSpec:
        """The core's head object."""
        return ClassificationHeadSpec(name=self.name, num_labels=self.num_labels)

    def check_labels(self, class_labels: Mapping[str, torch.Tensor]) -> None:
        """Raises ``ValueError`` unless the batch has this head's class labels."""
        if self.name not in class_labels:
            raise ValueError(f"the batch has no class_labels for head {self.name!r}")

    def loss(
        self, output: torch.Tensor, targets: torch.Tensor | None, class_labels: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """The cross-entropy mean over the microbatch's rows."""
        del targets
        return F.cross_entropy(output.float(), class_labels[self.name])

    def create_metrics(self) -> dict[str, Metric]:
        """``<name>/loss`` and ``<name>/<metric>`` for each configured metric."""
        metrics: dict[str, Metric] = {f"{self.name}/loss": WeightedMean()}
        for metric in self.metrics:
            metrics[f"{self.name}/{metric}"] = _classification_metric(metric, self.num_labels)
        return metrics

    def update_metrics(
        self,
        metrics: Mapping[str, Metric],
        output: torch.Tensor,
        targets: torch.Tensor | None,
        class_labels: Mapping[str, torch.Tensor],
    ) -> None:
        """Adds the microbatch's loss (weighted by rows) and its classes to the metrics."""
        del targets
        labels = class_labels[self.name]
        logits = output.detach().float()
        metrics[f"{self.name}/loss"].update(F.cross_entropy(logits, labels), float(labels.numel()))
        for metric in self.metrics:
            match metric:
                case "accuracy" | "f1":
                    metrics[f"{self.name}/{metric}"].update(logits, labels)
                case "auroc":
                    metrics[f"{self.name}/auroc"].update(logits.softmax(-1)[:, 1], labels)


HeadConfig = Annotated[CausalLMHeadConfig | ClassificationHeadConfig, Field(discriminator="kind")]
"""One entry of ``model.heads`` (``kind`` picks the head)."""


def head_specs(heads: tuple[HeadConfig, ...]) -> list[DecoderHead]:
    """The core's head objects of the configured heads, in order."""
    return [head.spec() for head in heads]


def _token_mean(losses: torch.Tensor, targets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean per-token loss over the target tokens, and their count."""
    if targets is None:
        raise ValueError("a causal_lm head needs the batch's targets")
    count = (targets != IGNORE_INDEX).sum()
    return losses.sum() / count.clamp(min=1), count


def _classification_metric(name: ClassificationMetric, num_labels: int) -> Metric:
    match name:
        case "accuracy":
            return Accuracy()
        case "f1":
            return MulticlassScores(num_classes=num_labels)
        case "auroc":
            return BinaryAUROC()
