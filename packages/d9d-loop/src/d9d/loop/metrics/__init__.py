"""Metrics that accumulate on the device, synchronize over ranks and live in checkpoints."""

from d9d.loop.metrics._aggregation import Accuracy, Perplexity, SumMetric, WeightedMean
from d9d.loop.metrics._auroc import BinaryAUROC, exact_auroc
from d9d.loop.metrics._metric import Metric, MetricInputError, MetricValue, SummedStateMetric
from d9d.loop.metrics._metric_set import MetricSet
from d9d.loop.metrics._stat_scores import Average, BinaryScores, MulticlassScores, MultilabelScores

__all__ = [
    "Accuracy",
    "Average",
    "BinaryAUROC",
    "BinaryScores",
    "Metric",
    "MetricInputError",
    "MetricSet",
    "MetricValue",
    "MultilabelScores",
    "MulticlassScores",
    "Perplexity",
    "SumMetric",
    "SummedStateMetric",
    "WeightedMean",
    "exact_auroc",
]
