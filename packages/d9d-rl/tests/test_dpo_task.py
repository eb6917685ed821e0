"""DPO as a d9d job: reference scores from the initial weights, a tiny model that learns, FSDP = one process.

The data goes the whole way: a JSONL of preference rows, read with a word-level tokenizer by
d9d-hf's reader, scored by the reference (the checkpoint the policy starts from), batched by
``DPODataProvider`` and trained with ``DPOTask``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from rl_tiny_model import VOCAB, tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from torch.distributed.tensor import DTensor

from d9d.hf import HFModelProvider, PretrainedModelConfig, load_pretrained, save_pretrained
from d9d.hf.data import PreferenceDataConfig, PreferencePair, load_preference_pairs
from d9d.loop import (
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    BuildForwardInputsContext,
    DataConfig,
    ForwardBackwardFinished,
    ProjectConfig,
    StepFinished,
    TrainingConfigurator,
)
from d9d.loop.data import TokenRow
from d9d.mesh import DistributedContext
from d9d.mesh.testing import run_distributed
from d9d.rl import (
    DPO_METRIC_NAMES,
    DPODataProvider,
    DPOLossConfig,
    DPOTask,
    ReferenceModel,
    collate_pairs,
    score_pairs,
)

STEPS = 3
WORDS = ["red", "green", "blue", "cat", "dog", "fish", "one", "two", "three", "yes", "no"]
PAIRS = 8  # rows of the JSONL; a global batch of 4 pairs


def _pair(prompt: list[int], chosen: list[int], rejected: list[int], index: int) -> PreferencePair:
    def row(answer: list[int]) -> TokenRow:
        return TokenRow(
            input_ids=prompt + answer, labels=[-100] * len(prompt) + answer, where=f"pair {index}"
        )

    return PreferencePair(chosen=row(chosen), rejected=row(rejected), index=index)


def test_reference_scores_are_the_summed_log_softmax_of_each_answers_tokens() -> None:
    model = tiny_model(seed=2)
    pairs = [_pair([3, 4, 5], [6, 7], [8], 0), _pair([9], [10, 11, 12, 13], [14, 15], 1)]
    scores = score_pairs(model, pairs, pad_id=0)  # one padded forward for all four rows
    with torch.no_grad():
        for pair, score in zip(pairs, scores, strict=True):
            for row, value in ((pair.chosen, score.chosen), (pair.rejected, score.rejected)):
                log_p = torch.log_softmax(model.logits(torch.tensor([row.input_ids]))[0].double(), dim=-1)
                answer = [t for t, label in enumerate(row.labels) if label != -100]
                expected = sum(float(log_p[t - 1, row.input_ids[t]]) for t in answer)
                assert value == pytest.approx(expected, abs=1e-5)


def _tokenizer_directory(root: Path) -> Path:
    directory = root / "tokenizer"
    directory.mkdir()
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["<pad>", "<unk>", "<eos>"]
    tokenizer.train_from_iterator(WORDS, trainers.WordLevelTrainer(special_tokens=special))
    assert tokenizer.get_vocab_size() <= VOCAB
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "pad_token": "<pad>"}))
    return directory


def _data(root: Path) -> Path:
    """Prompts of one to three words; the chosen answer repeats the prompt's last word."""
    rows = []
    for i in range(PAIRS):
        prompt = " ".join(WORDS[(i + k) % 9] for k in range(1 + i % 3))
        last = prompt.split()[-1]
        rows.append({"prompt": prompt, "chosen": f"{last} yes", "rejected": "no " * (1 + i % 2)})
    path = root / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _train(root: str, mesh: dict[str, int], *, colocated: bool = False) -> dict[str, Any]:
    """A short run; the reference scores come from the pass before training, or ``colocated``
    from a ``ReferenceModel`` laid out like the policy."""
    base = Path(root)
    dp = mesh.get("data_parallel_shard", 1)
    config = ProjectConfig.model_validate(
        {
            "mesh": mesh,
            "trainer": {
                "max_steps": STEPS,
                "global_batch_size": 4,
                "microbatch_size": 4 // (2 * dp),
                "seed": 3,
                "device": "cpu",
                "logging": {"progress_bar": False},
            },
            "optimizer": {"name": "adamw", "lr": 0.02, "weight_decay": 0.0},
        }
    )
    dataset = PreferenceDataConfig.model_validate(
        {"source": str(base / "pairs.jsonl"), "format": "text", "sequence_length": 16}
    )
    checkpoint = base / "checkpoint"

    def reference(dist_context: DistributedContext) -> torch.nn.Module:
        return load_pretrained(checkpoint, device=dist_context.device)

    data = DPODataProvider(
        pairs=lambda _: load_preference_pairs(dataset, tokenizer_directory=base / "tokenizer"),
        reference=None if colocated else reference,
        order=DataConfig(shuffle=False),
        pairs_per_forward=3,
    )
    provider = HFModelProvider(PretrainedModelConfig(source=str(checkpoint), attention_backend="eager"))
    colocated_reference = ReferenceModel(provider) if colocated else None
    task = DPOTask(DPOLossConfig(loss="sigmoid", beta=0.5), reference=colocated_reference)
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=provider,
        task_provider=lambda _: task,
        data_provider=data,
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    if colocated_reference is not None:
        colocated_reference.attach(trainer)
    losses: list[float] = []
    metrics: list[dict[str, float]] = []
    with trainer:
        trainer.events.subscribe(ForwardBackwardFinished, lambda e: losses.append(e.loss))
        trainer.events.subscribe(
            StepFinished, lambda e: metrics.append({k: e.metrics[k] for k in DPO_METRIC_NAMES})
        )
        trainer.train()
        weights = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in trainer.model_stages[0].state_dict().items()
        }
    return {"losses": losses, "metrics": metrics, "weights": weights}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dpo")
    _tokenizer_directory(root)
    _data(root)
    save_pretrained(tiny_model(seed=1, sliding_window=False), root / "checkpoint")
    return root


@pytest.fixture(scope="module")
def one_process(job: Path) -> dict[str, Any]:
    return _train(str(job), {})


def test_a_tiny_model_learns_to_prefer_the_chosen_answers(one_process: dict[str, Any]) -> None:
    losses, metrics = one_process["losses"], one_process["metrics"]
    # step 0: the policy is the reference, so every margin is 0 and the loss log 2
    assert losses[0] == pytest.approx(0.6931472, abs=1e-5)
    assert metrics[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    assert losses[-1] < losses[0]
    assert metrics[-1]["rewards/margins"] > 0.0
    assert metrics[-1]["rewards/accuracies"] > 0.5


def _layouts(root: str) -> list[dict[str, Any]]:
    """Every layout on these two ranks: FSDP with either reference, then TP and PP."""
    fsdp = {"data_parallel_shard": 2}
    return [
        _train(root, fsdp),
        _train(root, fsdp, colocated=True),
        _train(root, {"tensor_parallel": 2}),
        _train(root, {"pipeline_parallel": 2}),
    ]


def test_fsdp_tp_and_pp_on_two_ranks_equal_one_process(job: Path, one_process: dict[str, Any]) -> None:
    runs = [run for rank in run_distributed(_layouts, str(job), world_size=2, timeout_s=600) for run in rank]
    one = one_process
    for run in runs:
        assert run["losses"] == pytest.approx(one["losses"], abs=1e-5)
        for step, (got, want) in enumerate(zip(run["metrics"], one["metrics"], strict=True)):
            # step 0: the policy is the reference, every margin is 0 up to rounding (about 1e-7 here),
            # and which side of 0 a rounding falls on decides "chosen > rejected"; compare the rest
            skipped = {"rewards/accuracies"} if step == 0 else set[str]()
            compared = {k: v for k, v in got.items() if k not in skipped}
            assert compared == pytest.approx({k: v for k, v in want.items() if k not in skipped}, abs=1e-5)
        assert run["weights"] and run["weights"].keys() <= one["weights"].keys()  # PP: this rank's stage
        for name, value in run["weights"].items():
            torch.testing.assert_close(value, one["weights"][name], rtol=1e-4, atol=1e-5)


def test_a_batch_without_scores_needs_a_colocated_reference() -> None:
    pairs = [_pair([3, 4], [5], [6], 0)]
    batch = collate_pairs(pairs, None, pad_id=0)
    with pytest.raises(ValueError, match="no ref_log_probs and DPOTask has no reference"):
        DPOTask().build_forward_inputs(BuildForwardInputsContext(batch=batch, step=0))
