"""Several heads on one backbone through d9d-loop: trains, tracks each head's metrics, exports.

A tiny Qwen3 from scratch with a language-model head and two classification heads trains 3
steps in one process, under pipeline parallelism (PP=2: the heads on the last stage), FSDP=2
and TP=2; every layout reports the single-process losses and metrics. The export holds a
transformers directory (backbone and LM head: transformers gives the d9d model's logits) and
one safetensors file with a JSON config per classification head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from d9d.hf import (
    ClassificationHeadSpec,
    DecoderCausalLM,
    DecoderInputs,
    DecoderModel,
    HFModelProvider,
    LanguageModelHeadSpec,
    MultiHeadBatch,
    MultiHeadSample,
    PretrainedModelConfig,
    ScratchModelConfig,
    SequenceClassificationHeadSpec,
    causal_lm_targets,
    multi_head_task,
)
from d9d.hf._families import as_family
from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    ForwardBackwardFinished,
    ProjectConfig,
    StepFinished,
    TrainingConfigurator,
)
from d9d.mesh.testing import run_distributed
from d9d.state_mappers import SafetensorsCheckpoint

SEQ = 12
STEPS = 3
TINY: dict[str, Any] = {
    "model_type": "qwen3",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_hidden_layers": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": True,
}
HEADS: list[dict[str, Any]] = [
    {"kind": "causal_lm", "name": "lm", "loss_weight": 1.0},
    {"kind": "classification", "name": "sentiment", "num_labels": 2, "loss_weight": 0.5,
     "metrics": ["accuracy", "f1", "auroc"]},
    {"kind": "classification", "name": "topic", "num_labels": 3, "loss_weight": 0.25},
]  # fmt: skip
PROBE = torch.randint(1, 128, (2, SEQ), generator=torch.Generator().manual_seed(7))


class _Rows:
    """16 right-padded rows; the sentiment label is whether token 5 is even, the topic its value mod 3."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(3)
        self.ids = torch.randint(1, 128, (16, SEQ), generator=generator)
        for row in range(16):
            self.ids[row, SEQ - row % 4 :] = 0  # 0 to 3 padding tokens

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> MultiHeadSample:
        ids = self.ids[index]
        labels = ids.masked_fill(ids == 0, -100)
        key = int(ids[5])
        return MultiHeadSample(
            input_ids=ids,
            labels=labels,
            class_labels={"sentiment": torch.tensor(key % 2), "topic": torch.tensor(key % 3)},
        )


def _model(
    source: Path | None, heads: list[dict[str, Any]], tie: bool
) -> ScratchModelConfig | PretrainedModelConfig:
    if source is None:
        config = {**TINY, "tie_word_embeddings": tie}
        raw = {"config": config, "heads": heads, "attention_backend": "eager"}
        return ScratchModelConfig.model_validate(raw)
    return PretrainedModelConfig.model_validate(
        {"source": str(source), "heads": heads, "attention_backend": "eager"}
    )


def _train(
    mesh: dict[str, int],
    export: Path | None,
    source: Path | None = None,
    heads: list[dict[str, Any]] = HEADS,
    tie: bool = True,
) -> dict[str, Any]:
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
    model = _model(source, heads, tie)
    assert model.heads is not None
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=HFModelProvider(model),
        task_provider=multi_head_task(model.heads),
        data_provider=AutoDataProvider(
            dataset_factory=lambda _: _Rows(), collator=MultiHeadBatch.collate, config=config.data
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
        if source is not None and export is not None:
            trainer.export(export / "initial")
        trainer.train()
        if export is not None:
            trainer.export(export / "trained")
        if mesh == {} and heads is HEADS:
            stage = trainer.model_stages[0]
            assert isinstance(stage, DecoderModel) and stage.lm_head is not None
            with torch.no_grad():
                result["logits"] = stage.lm_head.compute_logits(stage.hidden_states(PROBE))
                result["sentiment"] = stage.heads["sentiment"].state_dict()["classifier.weight"].clone()
    return result


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    export = tmp_path_factory.mktemp("multi_head")
    result = run_distributed(_train, {}, export, world_size=1, timeout_s=120)[0]
    result["export"] = export / "trained"
    return result


def _head_metrics(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.split("/")[0] in {"lm", "sentiment", "topic"}}


def test_one_process_trains_every_head_and_tracks_its_metrics(reference: dict[str, Any]) -> None:
    assert len(reference["losses"]) == STEPS
    last = _head_metrics(reference["metrics"][-1])
    for name in ("lm/loss", "sentiment/loss", "sentiment/accuracy", "sentiment/auroc", "topic/loss"):
        assert name in last, sorted(last)
    assert any(name.startswith("sentiment/f1") for name in last)
    assert 0.0 <= last["sentiment/accuracy"] <= 1.0


@pytest.mark.parametrize(
    "mesh",
    [{"pipeline_parallel": 2}, {"data_parallel_shard": 2}],
    ids=["pp2", "fsdp2"],
)
def test_layout_trains_to_the_single_process_losses_and_metrics(
    reference: dict[str, Any], mesh: dict[str, int], tmp_path: Path
) -> None:
    export = tmp_path / "export"
    results = run_distributed(_train, mesh, export, world_size=2, timeout_s=180)
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], atol=2e-5, rtol=2e-5)
    # the main rank reports the metrics combined across ranks (under PP: the last stage's)
    for ours, expected in zip(results_metrics(results[0]), reference["metrics"], strict=True):
        torch.testing.assert_close(ours, _head_metrics(expected), atol=1e-4, rtol=1e-4)
    theirs = load_file(export / "trained" / "head-sentiment.safetensors")["classifier.weight"]
    torch.testing.assert_close(theirs, reference["sentiment"], atol=1e-4, rtol=1e-4)


def test_tensor_parallel_trains_to_the_single_process_losses_and_metrics() -> None:
    # TP needs untied embeddings (the vocabulary-parallel embedding); every head is replicated.
    expected = run_distributed(_train, {}, None, None, HEADS, False, world_size=1, timeout_s=120)[0]
    mesh = {"tensor_parallel": 2}
    results = run_distributed(_train, mesh, None, None, HEADS, False, world_size=2, timeout_s=180)
    for result in results:
        torch.testing.assert_close(result["losses"], expected["losses"], atol=2e-5, rtol=2e-5)
    for ours, theirs in zip(results_metrics(results[0]), results_metrics(expected), strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def results_metrics(result: dict[str, Any]) -> list[dict[str, float]]:
    return [_head_metrics(metrics) for metrics in result["metrics"]]


def test_export_is_a_transformers_directory_plus_one_file_per_classification_head(
    reference: dict[str, Any], helpers: Any
) -> None:
    export: Path = reference["export"]
    hf = helpers.hf_model(export)
    with torch.no_grad():
        torch.testing.assert_close(hf(PROBE).logits, reference["logits"], atol=1e-4, rtol=1e-4)
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    index = json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any("heads" in name or "score" in name for name in index)
    sentiment = load_file(export / "head-sentiment.safetensors")
    torch.testing.assert_close(sentiment["classifier.weight"], reference["sentiment"])
    topic = json.loads((export / "head-topic.json").read_text())
    assert topic == {
        "bias": False,
        "dtype": "float32",
        "hidden_size": 32,
        "kind": "classification",
        "name": "topic",
        "num_labels": 3,
        "pooling": "last",
    }
    assert load_file(export / "head-topic.safetensors")["classifier.weight"].shape == (3, 32)


@pytest.mark.parametrize("checkpoint", ["tied", "dense", "moe"])
def test_pretrained_backbone_and_lm_head_load_from_the_checkpoint(
    checkpoints: dict[str, Path], checkpoint: str, tmp_path: Path, helpers: Any
) -> None:
    # The export before any step is the checkpoint again: backbone and LM head (tied or not) loaded.
    run_distributed(_train, {}, tmp_path, checkpoints[checkpoint], world_size=1, timeout_s=120)
    ours, theirs = helpers.hf_model(tmp_path / "initial"), helpers.hf_model(checkpoints[checkpoint])
    with torch.no_grad():
        torch.testing.assert_close(ours(PROBE).logits, theirs(PROBE).logits)
    assert (tmp_path / "trained" / "head-sentiment.json").exists()


CLASSIFIERS = HEADS[1:]  # two classification heads, no language-model head


def test_two_classification_heads_train_under_pp_and_export_the_bare_backbone(tmp_path: Path) -> None:
    expected = run_distributed(_train, {}, None, None, CLASSIFIERS, world_size=1, timeout_s=120)[0]
    export = tmp_path / "export"
    pp = run_distributed(
        _train, {"pipeline_parallel": 2}, export, None, CLASSIFIERS, world_size=2, timeout_s=180
    )
    for result in pp:
        torch.testing.assert_close(result["losses"], expected["losses"], atol=2e-5, rtol=2e-5)
    trained = export / "trained"
    assert json.loads((trained / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    index = json.loads((trained / "model.safetensors.index.json").read_text())["weight_map"]
    assert "embed_tokens.weight" in index and "lm_head.weight" not in index
    assert {p.name for p in trained.glob("head-*")} == {
        f"head-{name}.{ext}" for name in ("sentiment", "topic") for ext in ("json", "safetensors")
    }
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(trained, attn_implementation="eager", dtype=torch.float32)
    assert backbone.config.num_hidden_layers == 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"head": "causal_lm"}, "either head"),
        ({"heads": [{"kind": "causal_lm"}, {"kind": "causal_lm", "name": "b"}]}, "at most one"),
        ({"heads": [{"kind": "classification", "name": "a", "num_labels": 2}] * 2}, "unique"),
        (
            {"heads": [{"kind": "classification", "name": "a", "num_labels": 3, "metrics": ["auroc"]}]},
            "auroc",
        ),
        ({"heads": [{"kind": "regression", "name": "a"}]}, "kind"),
        ({"heads": [{"kind": "classification", "name": "a.b", "num_labels": 2}]}, "pattern"),
    ],
)
def test_heads_config_is_checked(options: dict[str, Any], message: str) -> None:
    raw = {"source": "x", "heads": [{"kind": "causal_lm"}], **options}
    with pytest.raises(ValidationError, match=message):
        PretrainedModelConfig.model_validate(raw)


def test_single_head_config_is_unchanged() -> None:
    config = PretrainedModelConfig.model_validate({"source": "x", "head": "sequence_classification"})
    assert config.heads is None and config.head == "sequence_classification"


def test_an_export_read_back_trains_alike_on_every_layout(reference: dict[str, Any], tmp_path: Path) -> None:
    # Every head comes from the export (the classification heads from their files): PP=2 starts
    # from the same values as one process and trains to its losses.
    source: Path = reference["export"]
    one = run_distributed(_train, {}, None, source, world_size=1, timeout_s=120)[0]
    mesh = {"pipeline_parallel": 2}
    for result in run_distributed(_train, mesh, tmp_path, source, world_size=2, timeout_s=180):
        torch.testing.assert_close(result["losses"], one["losses"], atol=2e-5, rtol=2e-5)
    for name in ("sentiment", "topic"):
        file = f"head-{name}.safetensors"
        torch.testing.assert_close(load_file(tmp_path / "initial" / file), load_file(source / file))


def test_a_saved_head_of_another_shape_is_refused(reference: dict[str, Any]) -> None:
    checkpoint = SafetensorsCheckpoint(reference["export"])
    spec = as_family(ScratchModelConfig.model_validate({"config": TINY}).config).decoder_spec()
    assert spec.hidden_size == 32
    assert ClassificationHeadSpec(name="other", num_labels=3).saved_file(checkpoint, spec) is None
    with pytest.raises(ValueError, match="num_labels"):
        ClassificationHeadSpec(name="topic", num_labels=4).saved_file(checkpoint, spec)


def test_each_head_computes_what_its_single_head_model_computes() -> None:
    raw = {"config": {**TINY, "tie_word_embeddings": False}}
    family = as_family(ScratchModelConfig.model_validate(raw).config)
    torch.manual_seed(0)
    heads = [LanguageModelHeadSpec(name="lm"), ClassificationHeadSpec(name="topic", num_labels=3)]
    multi = DecoderModel(family, heads, attention_backend="eager")
    multi.reset_parameters()
    state = multi.state_dict()
    backbone = {name: t for name, t in state.items() if name.startswith("model.")}
    causal = DecoderCausalLM(family, attention_backend="eager")
    causal.load_state_dict({**backbone, "lm_head.weight": state["lm_head.weight"]})
    classifier = DecoderModel(
        family.with_num_labels(3), SequenceClassificationHeadSpec(), attention_backend="eager"
    )
    classifier.load_state_dict(
        {**backbone, "score.classifier.weight": state["heads.topic.classifier.weight"]}
    )
    ids = _Rows().ids[:4]
    targets = causal_lm_targets(ids.masked_fill(ids == 0, -100))
    with torch.no_grad():
        outputs = multi.outputs(ids, labels=targets)
        torch.testing.assert_close(outputs["lm"], causal(DecoderInputs(input_ids=ids, labels=targets)))
        torch.testing.assert_close(outputs["topic"], classifier.classify(ids))
