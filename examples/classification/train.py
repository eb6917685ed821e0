"""d9d classification: a fresh sequence-classification head with LoRA on a Qwen3 backbone.

Run:        uv run examples/classification/train.py examples/classification/config.yaml
Scale out:  set `mesh: {data_parallel_shard: 2}` and run
            torchrun --nproc-per-node 2 examples/classification/train.py config.yaml

Trains on generated texts (label: a positive or a negative word among neutral ones), reports
AUROC and F1 on the held-out split during training, saves an adapters-only checkpoint and a
merged Hugging Face export, then runs inference from the checkpoint and writes one JSONL line per
held-out sample (id, label, score).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer
from toy_data import LabelledText, generate_texts, write_tiny_checkpoint

from d9d.hf import DecoderInputs, HFModelConfig, HFModelProvider, PretrainedModelConfig, resolve_snapshot
from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    BuildForwardInputsContext,
    BuildForwardInputsResult,
    ComputeLossContext,
    ComputeLossResult,
    ConfigFileError,
    CreateMetricsContext,
    CreateMetricsResult,
    EvaluationData,
    ExportTargetError,
    InferenceConfig,
    InferenceConfigurator,
    InferenceFinishedContext,
    InferenceTask,
    ProcessOutputsContext,
    ProjectConfig,
    StepFinished,
    TrainingConfigurator,
    TrainTask,
    UpdateMetricsContext,
    check_export_target,
)
from d9d.loop.metrics import BinaryAUROC, BinaryScores
from d9d.mesh import DistributedContext, gather_object


class ClassificationSection(BaseModel):
    """The data, where the run writes, and the inference pass.

    Attributes:
        work_dir: The generated tiny checkpoint lives here.
        train_samples: Generated training texts.
        eval_samples: Generated held-out texts (evaluated during training, then predicted).
        sequence_length: Tokens per row (texts are right-padded to it, or cut).
        export_dir: The merged Hugging Face export. A previous export there is replaced; any other
            non-empty directory stops the run before training, unless ``replace_export_dir``.
        replace_export_dir: Replace ``export_dir`` even when it holds files d9d did not write.
        predictions: The JSONL file of the inference pass.
        inference_batch_size: Rows per inference forward (all ranks together).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    work_dir: Path = Path("runs/classification")
    train_samples: int = Field(default=2048, ge=1)
    eval_samples: int = Field(default=256, ge=1)
    sequence_length: int = Field(default=16, ge=8)
    export_dir: Path = Path("runs/classification/export")
    replace_export_dir: bool = False
    predictions: Path = Path("runs/classification/predictions.jsonl")
    inference_batch_size: int = Field(default=64, ge=1)


class ClassificationConfig(ProjectConfig):
    """The quickstart's sections plus ``model`` (None: a generated tiny Qwen3) and ``classification``."""

    model: HFModelConfig | None = None
    classification: ClassificationSection = ClassificationSection()


@dataclass(kw_only=True)
class Row:
    """One tokenized sample."""

    id: int
    input_ids: torch.Tensor
    label: int


@dataclass(kw_only=True)
class RowBatch:
    """Rows stacked: ``ids`` and ``labels`` ``(batch,)``, ``input_ids`` ``(batch, seq)``."""

    ids: torch.Tensor
    input_ids: torch.Tensor
    labels: torch.Tensor

    @staticmethod
    def collate(rows: list[Row]) -> RowBatch:
        return RowBatch(
            ids=torch.tensor([r.id for r in rows]),
            input_ids=torch.stack([r.input_ids for r in rows]),
            labels=torch.tensor([r.label for r in rows]),
        )


@dataclass(kw_only=True)
class RowKeys:
    """What inference keeps of each row to write beside its score."""

    ids: torch.Tensor
    labels: torch.Tensor


class Rows:
    """A map-style dataset of tokenized rows."""

    def __init__(self, rows: list[Row]) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> Row:
        return self._rows[index]


def tokenize(texts: list[LabelledText], tokenizer: Tokenizer, *, length: int, pad_id: int) -> Rows:
    """Right-padded (or cut) rows of ``length`` token ids."""
    rows: list[Row] = []
    for text in texts:
        ids = tokenizer.encode(text.text).ids[:length]
        ids = ids + [pad_id] * (length - len(ids))
        rows.append(Row(id=text.id, input_ids=torch.tensor(ids), label=text.label))
    return Rows(rows)


def _probabilities(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().softmax(-1)[:, 1]


class ClassificationTask(TrainTask[RowBatch, DecoderInputs, None, torch.Tensor, torch.Tensor]):
    """Cross-entropy of the two class logits; AUROC and F1 of the positive class's probability."""

    def build_forward_inputs(
        self, ctx: BuildForwardInputsContext[RowBatch]
    ) -> BuildForwardInputsResult[DecoderInputs, None, torch.Tensor]:
        return BuildForwardInputsResult(
            input=DecoderInputs(input_ids=ctx.batch.input_ids), shared=None, state=ctx.batch.labels
        )

    def compute_loss(self, ctx: ComputeLossContext[torch.Tensor, torch.Tensor]) -> ComputeLossResult:
        loss = F.cross_entropy(ctx.pipeline_results.float(), ctx.state)
        return ComputeLossResult(loss=loss, loss_weight=None)

    def create_metrics(self, ctx: CreateMetricsContext) -> CreateMetricsResult:
        return CreateMetricsResult(metrics={"auroc": BinaryAUROC(), "f1": BinaryScores()})

    def update_metrics(self, ctx: UpdateMetricsContext[torch.Tensor, torch.Tensor]) -> None:
        probabilities = _probabilities(ctx.pipeline_results)
        ctx.metrics["auroc"].update(probabilities, ctx.state)
        ctx.metrics["f1"].update(probabilities, ctx.state)


class PredictionWriter(InferenceTask[RowBatch, DecoderInputs, None, torch.Tensor]):
    """Collects ``(id, label, score)`` on the ranks whose outputs count; the main rank writes them."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._records: list[dict[str, Any]] = []

    def build_forward_inputs(
        self, ctx: BuildForwardInputsContext[RowBatch]
    ) -> BuildForwardInputsResult[DecoderInputs, None, RowKeys]:
        batch = ctx.batch
        return BuildForwardInputsResult(
            input=DecoderInputs(input_ids=batch.input_ids),
            shared=None,
            state=RowKeys(ids=batch.ids, labels=batch.labels),
        )

    def process_outputs(self, ctx: ProcessOutputsContext[torch.Tensor]) -> None:
        keys: RowKeys = ctx.state
        scores = _probabilities(ctx.pipeline_results)
        for row in range(scores.shape[0]):
            self._records.append(
                {"id": int(keys.ids[row]), "label": int(keys.labels[row]), "score": float(scores[row])}
            )

    def finish(self, ctx: InferenceFinishedContext) -> None:
        gathered = gather_object(self._records if ctx.writes else [], group=ctx.dist_context.world_group())
        if gathered is None:
            return
        records = sorted((r for part in gathered for r in part), key=lambda r: r["id"])
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._path.write_text("".join(json.dumps(r) + "\n" for r in records))


class Data:
    """Both splits, tokenized once the model (so its tokenizer and pad id) is known."""

    def __init__(self, config: ClassificationConfig, model_config: PretrainedModelConfig) -> None:
        self._config = config
        self._model_config = model_config
        self._splits: tuple[Rows, Rows] | None = None

    def _build(self, dist_context: DistributedContext) -> tuple[Rows, Rows]:
        if self._splits is None:
            source, revision = self._model_config.source, self._model_config.revision
            with dist_context.main_process_first():
                directory = resolve_snapshot(source, revision=revision)
            tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
            pad = json.loads((directory / "config.json").read_text()).get("pad_token_id")
            if pad is None:
                raise ValueError(
                    f"{directory}/config.json names no pad_token_id (the head pools the last real token)"
                )
            section, seed = self._config.classification, self._config.trainer.seed
            length = section.sequence_length
            count = section.train_samples + section.eval_samples
            texts = generate_texts(count, seed=seed, max_words=length)
            train = tokenize(texts[: section.train_samples], tokenizer, length=length, pad_id=pad)
            held_out = tokenize(texts[section.train_samples :], tokenizer, length=length, pad_id=pad)
            self._splits = (train, held_out)
        return self._splits

    def train(self, dist_context: DistributedContext) -> Rows:
        return self._build(dist_context)[0]

    def held_out(self, dist_context: DistributedContext) -> Rows:
        return self._build(dist_context)[1]


def model_section(config: ClassificationConfig) -> PretrainedModelConfig:
    """The ``model`` section, or a generated tiny causal-LM Qwen3 with a fresh 2-class head."""
    if config.model is not None:
        if not isinstance(config.model, PretrainedModelConfig):
            raise ValueError("model: the classifier starts from a checkpoint (set model.source)")
        return config.model
    checkpoint = config.classification.work_dir / "tiny-qwen3"
    if not checkpoint.exists():
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        write_tiny_checkpoint(checkpoint, seed=config.trainer.seed)
    return PretrainedModelConfig(source=str(checkpoint), head="sequence_classification", num_labels=2)


def latest_checkpoint(directory: Path) -> Path:
    """The newest complete ``step_N`` checkpoint under ``directory``."""
    steps = [p for p in directory.glob("step_*") if p.name.removeprefix("step_").isdigit()]
    if not steps:
        raise FileNotFoundError(f"no checkpoint under {directory} (set trainer.checkpoint.directory)")
    return max(steps, key=lambda p: int(p.name.removeprefix("step_")))


def run(config: ClassificationConfig) -> Path:
    """Trains with evaluation, exports, then predicts the held-out split; returns the JSONL path."""
    if config.trainer.checkpoint.directory is None:
        raise ValueError("trainer.checkpoint.directory is needed: inference reads the trained checkpoint")
    # Before any work: an export_dir holding the user's own files is refused, not emptied.
    overwrite = check_export_target(
        config.classification.export_dir, replace_other=config.classification.replace_export_dir
    )
    model_config = model_section(config)
    data = Data(config, model_config)
    held_out = EvaluationData(dataset_factory=data.held_out, collator=RowBatch.collate)
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=HFModelProvider(model_config),
        task_provider=lambda _: ClassificationTask(),
        data_provider=AutoDataProvider(
            dataset_factory=data.train, collator=RowBatch.collate, config=config.data
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
        evaluation_data=held_out,
    ).configure()
    with trainer:
        main = trainer.dist_context.is_main_process
        trainer.events.subscribe(StepFinished, lambda event: _report(event) if main else None)
        trainer.train()
        section = config.classification
        export = trainer.export(
            section.export_dir, overwrite=overwrite, replace_other=section.replace_export_dir
        )
    if main:
        print(f"exported the merged model to {export}")
    section = config.classification
    writer = PredictionWriter(section.predictions)
    inference = InferenceConfigurator(
        mesh=config.mesh,
        parameters=InferenceConfig(
            global_batch_size=section.inference_batch_size,
            microbatch_size=section.inference_batch_size // config.mesh.data_parallel,
            weights=latest_checkpoint(config.trainer.checkpoint.directory),
            weights_format="checkpoint",
            peft=config.trainer.peft,  # the checkpoint holds the adapters and the head
            seed=config.trainer.seed,
            device=config.trainer.device,
        ),
        model_provider=HFModelProvider(model_config),  # the base backbone from its source
        task=writer,
        data=held_out,
    ).configure()
    with inference:
        inference.run()
        if main:
            print(f"wrote predictions to {section.predictions}")
    return section.predictions


def _report(event: StepFinished) -> None:
    metrics = event.metrics
    if "eval/auroc" in metrics:
        print(
            f"eval after {event.step + 1} steps: eval/loss={metrics['eval/loss']:.4f} "
            f"eval/auroc={metrics['eval/auroc']:.4f} eval/f1={metrics['eval/f1/f1']:.4f}",
            flush=True,
        )


USAGE = "usage: train.py CONFIG.yaml  (e.g. examples/classification/config.yaml)"


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    try:
        config = ClassificationConfig.from_yaml(sys.argv[1])
    except ConfigFileError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    try:
        run(config)
    except ExportTargetError as e:
        print(f"{e} (classification.replace_export_dir: true)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
