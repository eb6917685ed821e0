"""Every metric against scikit-learn / torchmetrics, on 1 and 4 ranks with uneven shards and batches."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torchmetrics.functional as tmf
from sklearn.metrics import fbeta_score, precision_recall_fscore_support, roc_auc_score

from d9d.loop.metrics import (
    Accuracy,
    BinaryAUROC,
    BinaryScores,
    Metric,
    MetricInputError,
    MetricSet,
    MulticlassScores,
    MultilabelScores,
    Perplexity,
    SumMetric,
    WeightedMean,
)
from d9d.mesh.testing import run_distributed

N, C, L, V = 103, 5, 4, 11  # samples, classes, labels, vocabulary
SHARDS = [40, 30, 20, 13]  # uneven shards over 4 ranks; batches of 7 leave a short last one


def _data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 2, (N,), generator=g)
    return {
        "value": torch.randn(N, generator=g),
        "weight": torch.rand(N, generator=g),
        # rounded scores: ties inside and across ranks
        "score": (torch.rand(N, generator=g) * 0.5 + y * 0.3).round(decimals=2),
        "y": y,
        "logits": torch.randn(N, C, generator=g),
        "cls": torch.arange(N) % C,
        "ml_prob": torch.rand(N, L, generator=g),
        "ml_y": torch.randint(0, 2, (N, L), generator=g),
        "lm_logits": torch.randn(N, 3, V, generator=g),
        "lm_y": torch.where(
            torch.rand(N, 3, generator=g) < 0.2, -100, torch.randint(0, V, (N, 3), generator=g)
        ),
    }


def _metrics() -> dict[str, Metric]:
    metrics: dict[str, Metric] = {
        "sum": SumMetric(),
        "mean": WeightedMean(),
        "ppl": Perplexity(),
        "acc": Accuracy(),
        "acc_top2": Accuracy(top_k=2),
        "bin_acc": Accuracy(threshold=0.4),
        "auroc": BinaryAUROC(),
        "auroc_binned": BinaryAUROC(bins=1000),
        "binary": BinaryScores(threshold=0.4),
        "binary_f2": BinaryScores(threshold=0.4, beta=2.0),
        "mc_top2": MulticlassScores(num_classes=C, top_k=2, average="macro"),
    }
    for average in ("micro", "macro", "weighted", "none"):
        metrics[f"mc_{average}"] = MulticlassScores(num_classes=C, average=average)
        metrics[f"ml_{average}"] = MultilabelScores(num_labels=L, average=average)
    return metrics


def _update(metrics: dict[str, Any], d: dict[str, torch.Tensor]) -> None:
    metrics["sum"].update(d["value"])
    metrics["mean"].update(d["value"], d["weight"])
    metrics["ppl"].update(d["lm_logits"], d["lm_y"])
    for name in ("acc", "acc_top2"):
        metrics[name].update(d["logits"], d["cls"])
    metrics["bin_acc"].update(d["score"], d["y"])
    for name in ("auroc", "auroc_binned", "binary", "binary_f2"):
        metrics[name].update(d["score"], d["y"])
    for name, metric in metrics.items():
        if name.startswith("mc_"):
            metric.update(d["logits"], d["cls"])
        if name.startswith("ml_"):
            metric.update(d["ml_prob"], d["ml_y"])


def _compute(world: int) -> dict[str, float]:
    rank = dist.get_rank()
    data = _data()
    bounds = [0, *np.cumsum(SHARDS).tolist()] if world == 4 else [0, N]
    lo, hi = bounds[rank], bounds[rank + 1]
    metrics = _metrics()
    for start in range(lo, hi, 7):
        _update(metrics, {k: v[start : min(start + 7, hi)] for k, v in data.items()})
    return MetricSet(metrics, contributes=True).compute(dist.group.WORLD)


def _reference() -> dict[str, float]:
    d = _data()
    ref: dict[str, float] = {
        "sum": float(d["value"].double().sum()),
        "mean": float((d["value"].double() * d["weight"]).sum() / d["weight"].double().sum()),
        "ppl": float(tmf.text.perplexity(d["lm_logits"], d["lm_y"], ignore_index=-100)),
        "acc": float(tmf.accuracy(d["logits"], d["cls"], task="multiclass", num_classes=C, average="micro")),
        "acc_top2": float(
            tmf.accuracy(d["logits"], d["cls"], task="multiclass", num_classes=C, top_k=2, average="micro")
        ),
        "bin_acc": float(((d["score"] >= 0.4).long() == d["y"]).double().mean()),
        "auroc": float(roc_auc_score(d["y"].numpy(), d["score"].numpy())),
    }
    p, r, f, _ = precision_recall_fscore_support(d["y"], d["score"] >= 0.4, average="binary", zero_division=0)
    ref |= {"binary/precision": p, "binary/recall": r, "binary/f1": f}
    ref["binary_f2/fbeta"] = float(fbeta_score(d["y"], d["score"] >= 0.4, beta=2.0))
    predicted = d["logits"].argmax(1)
    for average in ("micro", "macro", "weighted", None):
        key = average or "none"
        for name, truth, pred in (("mc", d["cls"], predicted), ("ml", d["ml_y"], d["ml_prob"] >= 0.5)):
            p, r, f, _ = precision_recall_fscore_support(truth, pred, average=average, zero_division=0)
            for metric, value in (("precision", p), ("recall", r), ("f1", f)):
                if average is None:
                    ref |= {f"{name}_{key}/{metric}/{i}": float(v) for i, v in enumerate(value)}
                else:
                    ref[f"{name}_{key}/{metric}"] = float(value)
    ref["mc_top2/f1"] = float(
        tmf.f1_score(d["logits"], d["cls"], task="multiclass", num_classes=C, top_k=2, average="macro")
    )
    return ref


@pytest.mark.parametrize("world", [1, 4])  # one process; 4 ranks with uneven shards
def test_metrics_match_sklearn_and_torchmetrics(world: int) -> None:
    results = run_distributed(_compute, world, world_size=world)
    reference = _reference()
    for result in results:
        assert result == results[0]  # every rank sees the synchronized values
        for name, expected in reference.items():
            assert result[name] == pytest.approx(expected, rel=1e-6, abs=1e-9), name
        # binned: ties within a bin of width 1/1000; the scores are rounded to 0.01, so exact here
        assert result["auroc_binned"] == pytest.approx(reference["auroc"], abs=1e-9)


def test_metric_state_survives_a_checkpoint_round_trip() -> None:
    d = _data()
    first, second = _metrics(), _metrics()
    _update(first, {k: v[:50] for k, v in d.items()})
    for name, metric in second.items():
        metric.load_state_dict(first[name].state_dict())
    _update(second, {k: v[50:] for k, v in d.items()})
    whole = _metrics()
    _update(whole, d)
    assert MetricSet(second, contributes=True).compute(None) == MetricSet(whole, contributes=True).compute(
        None
    )


@pytest.mark.parametrize(
    ("metric", "preds", "target", "message"),
    [
        # a class index past num_classes
        (MulticlassScores(num_classes=3), torch.randn(2, 3), torch.tensor([0, 3]), r"\[3\] outside \[0, 3\)"),
        # a negative class index
        (Accuracy(), torch.randn(2, 3), torch.tensor([-1, 0]), r"\[-1\] outside \[0, 3\)"),
        # a binary target of 2
        (BinaryAUROC(), torch.rand(2), torch.tensor([0, 2]), r"BinaryAUROC got labels \[2\]"),
        # a multilabel target of 2
        (MultilabelScores(num_labels=2), torch.rand(1, 2), torch.tensor([[0, 2]]), "MultilabelScores"),
    ],
)
def test_labels_out_of_range_are_named(
    metric: Any, preds: torch.Tensor, target: torch.Tensor, message: str
) -> None:
    with pytest.raises(MetricInputError, match=message):
        metric.update(preds, target)


def test_metric_set_names_the_metric_and_skips_non_contributing_ranks() -> None:
    metric = SumMetric()
    metric.update(torch.tensor([1.0, 2.0]))
    assert MetricSet({"s": metric}, contributes=False).compute(None) == {"s": 0.0}
