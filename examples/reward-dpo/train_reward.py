"""d9d reward model: a scalar head on a Qwen3 backbone, trained on preference pairs.

Run:        uv run examples/reward-dpo/train_reward.py examples/reward-dpo/reward.yaml
Scale out:  set `mesh: {data_parallel_shard: 2}` and run
            torchrun --nproc-per-node 2 examples/reward-dpo/train_reward.py reward.yaml

Reads prompt/chosen/rejected rows (generated, or your own JSONL), trains the Bradley-Terry loss
of a one-label sequence-classification head, reports the held-out pair accuracy and margin, and
exports a directory transformers loads as Qwen3ForSequenceClassification (num_labels=1).
"""

from __future__ import annotations

from pathlib import Path

from _reward_dpo_common import (
    PairsSection,
    checkpoint_directory,
    eval_reporter,
    pair_files,
    script_main,
    tiny_checkpoint,
    train_and_export,
)
from pydantic import Field
from toy_data import TINY_PAD

from d9d.hf import (
    HFModelConfig,
    HFModelProvider,
    PretrainedModelConfig,
    RewardBatch,
    RewardPairs,
    reward_task,
)
from d9d.hf.data import PreferenceDataConfig, load_preference_pairs
from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    EvaluationData,
    ProjectConfig,
    TrainingConfigurator,
    check_export_target,
)
from d9d.mesh import DistributedContext


class RewardSection(PairsSection):
    """The pairs (see ``PairsSection``), the loss's centering term and where the run writes.

    Attributes:
        center_rewards_coefficient: TRL's centering term (None: off).
        export_dir: The Hugging Face export of the reward model.
    """

    center_rewards_coefficient: float | None = Field(default=None, ge=0.0)
    export_dir: Path = Path("runs/reward-dpo/reward-model")


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
    checkpoint = tiny_checkpoint(config.reward.work_dir, config.trainer.seed)
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


class Pairs:
    """Both splits as ``RewardPairs``, read (and every row checked) once the checkpoint is known."""

    def __init__(self, config: RewardConfig, model: PretrainedModelConfig) -> None:
        self._config = config
        self._model = model
        self._splits: tuple[RewardPairs, RewardPairs] | None = None

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
                    tokenizer_directory=checkpoint_directory(self._model, dist_context),
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
    report = eval_reporter("eval/loss", "eval/accuracy", "eval/margin")
    return train_and_export(trainer, section, overwrite=overwrite, report=report, exported="the reward model")


USAGE = "usage: train_reward.py CONFIG.yaml  (e.g. examples/reward-dpo/reward.yaml)"


def main() -> None:
    script_main(USAGE, RewardConfig.from_yaml, run, section="reward")


if __name__ == "__main__":
    main()
