"""d9d reward model: a scalar head on a Qwen3 backbone, trained on preference pairs.

Run:        uv run examples/reward-dpo/train_reward.py examples/reward-dpo/reward.yaml
Scale out:  set `mesh: {data_parallel_shard: 2}` and run
            torchrun --nproc-per-node 2 examples/reward-dpo/train_reward.py reward.yaml

Reads prompt/chosen/rejected rows (generated, or your own JSONL), trains the Bradley-Terry loss
of a one-label sequence-classification head, reports the held-out pair accuracy and margin, and
exports a directory transformers loads as Qwen3ForSequenceClassification (num_labels=1).
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from toy_data import TINY_PAD, write_pairs, write_tiny_checkpoint

from d9d.hf import (
    HFModelConfig,
    HFModelProvider,
    PretrainedModelConfig,
    RewardBatch,
    RewardPairs,
    resolve_snapshot,
    reward_task,
)
from d9d.hf.data import PreferenceDataConfig, load_preference_pairs
from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    ConfigFileError,
    EvaluationData,
    ExportTargetError,
    ProjectConfig,
    StepFinished,
    TrainingConfigurator,
    check_export_target,
)
from d9d.mesh import DistributedContext


class RewardSection(BaseModel):
    """The data, the loss's centering term and where the run writes.

    Attributes:
        work_dir: The generated tiny checkpoint and pairs live here.
        train: Training pairs: a JSONL of ``{prompt, chosen, rejected}`` (None: generated).
        held_out: Held-out pairs, evaluated during training (None: generated).
        generated_pairs: Pairs generated for training (and an eighth of that for held-out).
        sequence_length: Tokens of the longest prompt + answer kept.
        center_rewards_coefficient: TRL's centering term (None: off).
        export_dir: The Hugging Face export. A previous export there is replaced; any other
            non-empty directory stops the run before training, unless ``replace_export_dir``.
        replace_export_dir: Replace ``export_dir`` even when it holds files d9d did not write.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    work_dir: Path = Path("runs/reward-dpo")
    train: Path | None = None
    held_out: Path | None = None
    generated_pairs: int = Field(default=1024, ge=8)
    sequence_length: int = Field(default=16, ge=4)
    center_rewards_coefficient: float | None = Field(default=None, ge=0.0)
    export_dir: Path = Path("runs/reward-dpo/reward-model")
    replace_export_dir: bool = False


class RewardConfig(ProjectConfig):
    """The quickstart's sections plus ``model`` (None: a generated tiny Qwen3) and ``reward``."""

    model: HFModelConfig | None = None
    reward: RewardSection = RewardSection()


def model_section(config: RewardConfig) -> PretrainedModelConfig:
    """The ``model`` section, or a generated tiny causal-LM Qwen3 with a fresh one-label head."""
    if config.model is not None:
        if not isinstance(config.model, PretrainedModelConfig):
            raise ValueError("model: the reward model starts from a checkpoint (set model.source)")
        return config.model
    checkpoint = config.reward.work_dir / "tiny-qwen3"
    if not checkpoint.exists():
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        write_tiny_checkpoint(checkpoint, seed=config.trainer.seed)
    return PretrainedModelConfig(
        source=str(checkpoint), head="sequence_classification", num_labels=1, pad_token_id=TINY_PAD
    )


def pad_token_id(model: PretrainedModelConfig) -> int:
    """``model.pad_token_id``: the pairs are padded with it and the export's config.json names it."""
    if model.pad_token_id is None:
        raise ValueError(
            "model.pad_token_id is needed: the reward is read at each row's last token that is not "
            "padding (Qwen3's <|endoftext|> is 151643)"
        )
    return model.pad_token_id


def pair_files(section: RewardSection, seed: int) -> tuple[Path, Path]:
    """The training and held-out JSONL files (generated under ``work_dir`` when not given)."""
    train = section.train or section.work_dir / "pairs-train.jsonl"
    held_out = section.held_out or section.work_dir / "pairs-held-out.jsonl"
    if section.train is None and not train.exists():
        write_pairs(train, section.generated_pairs, seed=seed)
    if section.held_out is None and not held_out.exists():
        write_pairs(held_out, max(8, section.generated_pairs // 8), seed=seed + 1)
    return train, held_out


class Pairs:
    """Both splits as ``RewardPairs``, read (and every row checked) once the checkpoint is known."""

    def __init__(self, config: RewardConfig, model: PretrainedModelConfig) -> None:
        self._config = config
        self._model = model
        self._splits: tuple[RewardPairs, RewardPairs] | None = None

    def _directory(self, dist_context: DistributedContext) -> Path:
        with dist_context.main_process_first():
            return resolve_snapshot(self._model.source, revision=self._model.revision)

    def _build(self, dist_context: DistributedContext) -> tuple[RewardPairs, RewardPairs]:
        if self._splits is None:
            section, pad = self._config.reward, pad_token_id(self._model)
            with dist_context.main_process_first():
                files = pair_files(section, self._config.trainer.seed)
            splits = [
                load_preference_pairs(
                    PreferenceDataConfig.model_validate(
                        {"source": str(file), "format": "text", "sequence_length": section.sequence_length}
                    ),
                    tokenizer_directory=self._directory(dist_context),
                    pad_id=pad,
                )
                for file in files
            ]
            train, held_out = (RewardPairs(split.pairs, pad_token_id=pad) for split in splits)
            self._splits = (train, held_out)
        return self._splits

    def train(self, dist_context: DistributedContext) -> RewardPairs:
        return self._build(dist_context)[0]

    def held_out(self, dist_context: DistributedContext) -> RewardPairs:
        return self._build(dist_context)[1]


def run(config: RewardConfig) -> Path:
    """Trains with evaluation, then exports; returns the export directory."""
    section = config.reward
    # Before any work: an export_dir holding the user's own files is refused, not emptied.
    overwrite = check_export_target(section.export_dir, replace_other=section.replace_export_dir)
    model = model_section(config)
    pairs = Pairs(config, model)
    provider = HFModelProvider(model)
    pad = pad_token_id(model)
    collate = RewardBatch.collator(pad)
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=provider,
        task_provider=reward_task(
            provider, pad_token_id=pad, center_rewards_coefficient=section.center_rewards_coefficient
        ),
        data_provider=AutoDataProvider(dataset_factory=pairs.train, collator=collate, config=config.data),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
        evaluation_data=EvaluationData(dataset_factory=pairs.held_out, collator=collate),
    ).configure()
    with trainer:
        main = trainer.dist_context.is_main_process
        trainer.events.subscribe(StepFinished, lambda event: _report(event) if main else None)
        trainer.train()
        replace = section.replace_export_dir
        export = trainer.export(section.export_dir, overwrite=overwrite, replace_other=replace)
    if main:
        print(f"exported the reward model to {export}")
    return export


def _report(event: StepFinished) -> None:
    metrics = event.metrics
    if "eval/accuracy" in metrics:
        print(
            f"eval after {event.step + 1} steps: eval/loss={metrics['eval/loss']:.4f} "
            f"eval/accuracy={metrics['eval/accuracy']:.4f} eval/margin={metrics['eval/margin']:.4f}",
            flush=True,
        )


USAGE = "usage: train_reward.py CONFIG.yaml  (e.g. examples/reward-dpo/reward.yaml)"


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    try:
        config = RewardConfig.from_yaml(sys.argv[1])
    except ConfigFileError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    try:
        run(config)
    except ExportTargetError as e:
        print(f"{e} (reward.replace_export_dir: true)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
