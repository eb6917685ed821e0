"""A reward model: one score per row (transformers' ``*ForSequenceClassification``, ``num_labels=1``),
trained with the Bradley-Terry pairwise loss on preference pairs.

The loss and the metrics equal a hand computation (synced over two ranks of uneven pair
counts: those of all pairs); the gradients of a tiny Llama and Qwen3 equal
plain PyTorch's loss on transformers' scores of the raw rows (an end token that is also the
padding token included); a job trains from a causal-LM checkpoint without a padding id (set by
``model.pad_token_id``), exports a directory transformers loads as ``Qwen3ForSequenceClassification``
with the d9d model's scores, and FSDP over two ranks trains to the single-process losses and
metrics. Bad pairs and a model that is no reward model are refused before training.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import d9d.hf
from d9d.hf import (
    DecoderInputs,
    DecoderModel,
    HFModelProvider,
    PretrainedModelConfig,
    RewardBatch,
    RewardPairs,
    RewardTask,
    check_reward_model,
    reward_task,
)
from d9d.hf._decoder import DecoderSpec
from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    ComputeLossContext,
    CreateMetricsContext,
    ForwardBackwardFinished,
    ProjectConfig,
    StepFinished,
    TrainingConfigurator,
    UpdateMetricsContext,
)
from d9d.mesh.testing import run_distributed

PAD = 0
TINY: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_hidden_layers": 2,
}
STEPS = 3


def _records(count: int, seed: int) -> list[dict[str, list[int]]]:
    """Pairs of 3 to 9 tokens; every third chosen side ends with the end token that is also padding."""
    generator = torch.Generator().manual_seed(seed)
    records: list[dict[str, list[int]]] = []
    for index in range(count):
        sides = {}
        for side in ("chosen", "rejected"):
            length = int(torch.randint(3, 10, (1,), generator=generator))
            sides[side] = torch.randint(1, 128, (length,), generator=generator).tolist()
        if index % 3 == 0:
            sides["chosen"].append(PAD)
        records.append(sides)
    return records


def _pairs(records: list[dict[str, list[int]]]) -> RewardPairs:
    return RewardPairs.from_records(records, list, pad_token_id=PAD)


def _scores(chosen: list[float], rejected: list[float]) -> torch.Tensor:
    return torch.tensor([v for pair in zip(chosen, rejected, strict=True) for v in pair]).unsqueeze(1)


@pytest.mark.parametrize("center", [None, 0.01])
def test_loss_and_metrics_equal_a_hand_computation(center: float | None) -> None:
    chosen, rejected = [2.0, 0.5, -1.0, 0.0], [1.0, 1.5, -1.0, -3.0]
    task = RewardTask(center_rewards_coefficient=center)
    result = task.compute_loss(
        ComputeLossContext(pipeline_results=_scores(chosen, rejected), state=None, microbatch_index=0, step=0)
    )
    # -log(sigmoid(d)) = log(1 + exp(-d)) for the margins d = 1, -1, 0, 3
    expected = sum(math.log1p(math.exp(-d)) for d in (1.0, -1.0, 0.0, 3.0)) / 4
    if center is not None:
        expected += center * (3.0**2 + 2.0**2 + (-2.0) ** 2 + (-3.0) ** 2) / 4
    assert result.loss.item() == pytest.approx(expected, rel=1e-6)
    assert result.loss_weight == 4.0
    metrics = task.create_metrics(CreateMetricsContext(purpose="train")).metrics
    for half in (slice(0, 2), slice(2, 4)):  # two microbatches: the metrics sum over both
        scores = _scores(chosen[half], rejected[half])
        task.update_metrics(
            UpdateMetricsContext(pipeline_results=scores, state=None, metrics=metrics, purpose="train")
        )
    assert metrics["accuracy"].compute().item() == pytest.approx(2 / 4)  # a tie is not a win
    assert metrics["margin"].compute().item() == pytest.approx(3 / 4)
    assert metrics["chosen_reward"].compute().item() == pytest.approx(1.5 / 4)
    assert metrics["rejected_reward"].compute().item() == pytest.approx(-1.5 / 4)


RANK_PAIRS = [([1.0], [0.0]), ([1.0, 0.0, -1.0], [2.0, 0.0, -2.0])]  # rank 0: 1 of 1 won, rank 1: 1 of 3


def _synced_metrics() -> dict[str, float]:
    import torch.distributed as dist

    chosen, rejected = RANK_PAIRS[dist.get_rank()]
    task = RewardTask()
    metrics = task.create_metrics(CreateMetricsContext(purpose="train")).metrics
    scores = _scores(chosen, rejected)
    task.update_metrics(
        UpdateMetricsContext(pipeline_results=scores, state=None, metrics=metrics, purpose="train")
    )
    values: dict[str, float] = {}
    for name, metric in metrics.items():
        metric.sync(None)  # what d9d-loop does over the loss-reduction group
        value = metric.compute()
        assert isinstance(value, torch.Tensor)
        values[name] = value.item()
    return values


def test_metrics_over_ranks_of_uneven_pair_counts_are_those_of_all_pairs() -> None:
    for values in run_distributed(_synced_metrics, world_size=2, timeout_s=60):
        assert values["accuracy"] == pytest.approx(2 / 4)  # not the mean of 1/1 and 1/3
        assert values["margin"] == pytest.approx((1.0 - 1.0 + 0.0 + 1.0) / 4)
        assert values["chosen_reward"] == pytest.approx(1.0 / 4)


def _hf_reward_model(family: str) -> Any:
    from transformers import (
        LlamaConfig,
        LlamaForSequenceClassification,
        Qwen3Config,
        Qwen3ForSequenceClassification,
    )

    torch.manual_seed(0)
    if family == "llama":
        return LlamaForSequenceClassification(LlamaConfig(**TINY, num_labels=1, pad_token_id=PAD))
    return Qwen3ForSequenceClassification(Qwen3Config(**TINY, num_labels=1, pad_token_id=PAD))


def _raw_batch(records: list[dict[str, list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows as given (trailing pad-id tokens kept), interleaved and right-padded."""
    rows = [record[side] for record in records for side in ("chosen", "rejected")]
    length = max(map(len, rows))
    ids = torch.full((len(rows), length), PAD)
    mask = torch.zeros_like(ids)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = torch.tensor(row)
        mask[index, : len(row)] = 1
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gradients_equal_plain_pytorch_on_transformers_scores(
    family: str, tmp_path: Path, helpers: Any
) -> None:
    hf = _hf_reward_model(family)
    hf.save_pretrained(tmp_path)
    hf = helpers.hf_model(tmp_path, "sequence_classification").train()
    model = d9d.hf.load_pretrained(tmp_path, head="sequence_classification").train()
    assert isinstance(model, DecoderModel)
    records = _records(6, seed=1)
    ids, mask = _raw_batch(records)
    scores = hf(input_ids=ids, attention_mask=mask).logits
    chosen, rejected = scores[0::2, 0], scores[1::2, 0]
    (-F.logsigmoid(chosen - rejected).mean() + 0.01 * ((chosen + rejected) ** 2).mean()).backward()

    batch = RewardBatch.collator(PAD)(list(_pairs(records)))
    ours = model(DecoderInputs(input_ids=batch.input_ids, attention_mask=batch.attention_mask))
    assert isinstance(ours, torch.Tensor)
    torch.testing.assert_close(ours, scores, atol=1e-5, rtol=1e-5)
    task = RewardTask(center_rewards_coefficient=0.01)
    task.compute_loss(
        ComputeLossContext(pipeline_results=ours, state=None, microbatch_index=0, step=0)
    ).loss.backward()
    helpers.assert_same_gradients(helpers.d9d_gradients(model), helpers.hf_gradients(hf))


def _causal_checkpoint(directory: Path) -> Path:
    """A tiny causal-LM Qwen3 whose config.json names no padding token."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**TINY, tie_word_embeddings=True)
    config.pad_token_id = None
    Qwen3ForCausalLM(config).save_pretrained(directory)
    assert json.loads((directory / "config.json").read_text()).get("pad_token_id") is None
    return directory


PROBE = _records(4, seed=9)


def _train(mesh: dict[str, int], source: Path, export: Path | None) -> dict[str, Any]:
    config = ProjectConfig.model_validate(
        {
            "mesh": mesh,
            "trainer": {
                "max_steps": STEPS,
                "global_batch_size": 8,
                "microbatch_size": 2,
                "logging": {"progress_bar": False},
                "device": "cpu",
            },
            "data": {"shuffle": False},
            "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.0},
        }
    )
    model = PretrainedModelConfig(
        source=str(source),
        head="sequence_classification",
        num_labels=1,
        pad_token_id=PAD,
        attention_backend="eager",
    )
    provider = HFModelProvider(model)
    pairs = _pairs(_records(24, seed=0))
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=provider,
        task_provider=reward_task(provider, pad_token_id=PAD, center_rewards_coefficient=0.01),
        data_provider=AutoDataProvider(
            dataset_factory=lambda _: pairs, collator=RewardBatch.collator(PAD), config=config.data
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    losses: list[float] = []
    metrics: list[dict[str, float]] = []
    result: dict[str, Any] = {"losses": losses, "metrics": metrics}
    with trainer:
        trainer.events.subscribe(ForwardBackwardFinished, lambda event: losses.append(event.loss))
        trainer.events.subscribe(StepFinished, lambda event: metrics.append(dict(event.metrics)))
        trainer.train()
        if export is not None:
            trainer.export(export)
        if mesh == {}:
            stage = trainer.model_stages[0]
            batch = RewardBatch.collator(PAD)(list(_pairs(PROBE)))
            with torch.no_grad():
                inputs = DecoderInputs(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
                result["scores"] = stage(inputs, None)
    return result


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("reward")
    source = _causal_checkpoint(root / "causal")
    result = run_distributed(_train, {}, source, root / "export", world_size=1, timeout_s=120)[0]
    return {**result, "source": source, "export": root / "export"}


def _reward_metrics(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k in {"loss", "accuracy", "margin", "chosen_reward"}}


def test_export_loads_as_transformers_sequence_classification_with_the_same_scores(
    reference: dict[str, Any], helpers: Any
) -> None:
    assert len(reference["losses"]) == STEPS
    assert 0.0 <= reference["metrics"][-1]["accuracy"] <= 1.0
    export: Path = reference["export"]
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForSequenceClassification"]
    assert config["pad_token_id"] == PAD
    hf = helpers.hf_model(export, "sequence_classification").eval()
    assert hf.config.num_labels == 1
    ids, mask = _raw_batch(PROBE)  # trailing pad-id tokens kept: transformers skips them itself
    with torch.no_grad():
        scores = hf(input_ids=ids, attention_mask=mask).logits
    assert scores.shape == (2 * len(PROBE), 1)
    torch.testing.assert_close(scores, reference["scores"], atol=1e-5, rtol=1e-5)


def test_fsdp_over_two_ranks_trains_to_the_single_process_losses_and_metrics(
    reference: dict[str, Any],
) -> None:
    results = run_distributed(
        _train, {"data_parallel_shard": 2}, reference["source"], None, world_size=2, timeout_s=180
    )
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], atol=2e-5, rtol=2e-5)
    # the main rank reports the metrics summed over both ranks' pairs
    for ours, expected in zip(results[0]["metrics"], reference["metrics"], strict=True):
        torch.testing.assert_close(_reward_metrics(ours), _reward_metrics(expected), atol=1e-4, rtol=1e-4)


def test_a_pair_without_a_side_is_refused_naming_the_row() -> None:
    records: list[dict[str, Any]] = [{"chosen": [5, 6], "rejected": [7]}] * 2
    with pytest.raises(ValueError, match="preference row 2 has no 'rejected'"):
        RewardPairs.from_records([*records, {"chosen": [5]}], list, pad_token_id=PAD)
    with pytest.raises(ValueError, match="preference row 1 has no 'chosen'"):
        RewardPairs.from_records([records[0], {"chosen": "", "rejected": "b"}], list, pad_token_id=PAD)
    with pytest.raises(ValueError, match="preference row 1: its 'chosen' side has no token other than pad"):
        RewardPairs.from_records(
            [records[0], {"chosen": [PAD, PAD], "rejected": [3]}], list, pad_token_id=PAD
        )


def _spec(num_labels: int, pad_token_id: int | None) -> DecoderSpec:
    raw = {"model_type": "qwen3", **TINY, "num_labels": num_labels, "pad_token_id": pad_token_id}
    return d9d.hf.Qwen3DenseConfig.model_validate(raw).decoder_spec()


@pytest.mark.parametrize(
    ("head", "num_labels", "pad", "message"),
    [
        ("causal_lm", 1, PAD, "needs model.head: sequence_classification"),
        ("sequence_classification", 2, PAD, "set model.num_labels: 1"),
        ("sequence_classification", 1, None, "set model.pad_token_id"),
        ("sequence_classification", 1, 3, "pad_token_id is 3, the pairs are padded with 0"),
    ],
)
def test_a_model_that_is_no_reward_model_is_refused(
    head: Any, num_labels: int, pad: int | None, message: str
) -> None:
    check_reward_model("sequence_classification", _spec(1, PAD), pad_token_id=PAD)
    with pytest.raises(ValueError, match=message):
        check_reward_model(head, _spec(num_labels, pad), pad_token_id=PAD)
