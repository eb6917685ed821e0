"""d9d DPO (or IPO): a causal-LM Qwen3 trained on the reward model's preference pairs.

Run:        uv run examples/reward-dpo/train_dpo.py examples/reward-dpo/dpo.yaml
Scale out:  set `mesh: {data_parallel_shard: 2}` and run
            torchrun --nproc-per-node 2 examples/reward-dpo/train_dpo.py dpo.yaml

Reads the same prompt/chosen/rejected rows as train_reward.py, scores every pair with the frozen
reference (the policy's initial weights) before training, or runs that reference beside the
policy (``dpo.reference: colocated``), trains ``DPOTask``, reports the held-out implicit-reward
accuracy and margin, and exports the policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from _reward_dpo_common import (
    PairsSection,
    checkpoint_directory,
    eval_reporter,
    pair_files,
    script_main,
    tiny_checkpoint,
    train_and_export,
)
from toy_data import TINY_PAD

from d9d.hf import HFModelProvider, PretrainedModelConfig, load_pretrained
from d9d.hf.data import PreferenceData, PreferenceDataConfig, PreferencePair, load_preference_pairs
from d9d.loop import (
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    EvaluationData,
    ProjectConfig,
    TrainingConfigurator,
    check_export_target,
)
from d9d.mesh import DistributedContext
from d9d.rl import (
    DPOBatch,
    DPODataProvider,
    DPOLossConfig,
    DPOTask,
    ReferenceModel,
    ReferenceScore,
    collate_pairs,
    score_pairs,
)


class DPOSection(PairsSection):
    """The pairs (see ``PairsSection``; train_reward.py's), the loss, where the reference comes from.

    Attributes:
        loss: DPO's sigmoid loss or IPO, and beta.
        reference: ``scored``: every pair is scored by the initial weights before training (no
            second model while training); ``colocated``: the reference runs beside the policy.
        export_dir: The Hugging Face export of the policy.
    """

    loss: DPOLossConfig = DPOLossConfig()
    reference: Literal["scored", "colocated"] = "scored"
    export_dir: Path = Path("runs/reward-dpo/dpo-policy")


class DPOConfig(ProjectConfig):
    """The quickstart's sections plus ``model`` (None: the generated tiny Qwen3) and ``dpo``."""

    model: PretrainedModelConfig | None = None
    dpo: DPOSection = DPOSection()


def model_section(config: DPOConfig) -> PretrainedModelConfig:
    """The ``model`` section, or train_reward.py's generated tiny Qwen3 with its causal-LM head."""
    if config.model is not None:
        if config.model.head != "causal_lm":
            raise ValueError(f"model.head: DPO trains a causal LM, got {config.model.head!r}")
        return config.model
    checkpoint = tiny_checkpoint(config.dpo.work_dir, config.trainer.seed)
    return PretrainedModelConfig(source=str(checkpoint), pad_token_id=TINY_PAD)


class Pairs:
    """Both splits, read (and every row checked) once; the held-out ones scored when needed."""

    def __init__(self, config: DPOConfig, model: PretrainedModelConfig) -> None:
        self._config = config
        self._model = model
        self._splits: tuple[PreferenceData, PreferenceData] | None = None

    def _build(self, dist_context: DistributedContext) -> tuple[PreferenceData, PreferenceData]:
        if self._splits is None:
            section = self._config.dpo
            with dist_context.main_process_first():
                files = pair_files(section, self._config.trainer.seed)  # the reward model's pairs
            dataset = {"format": "text", "sequence_length": section.sequence_length}
            train, held_out = (
                load_preference_pairs(
                    PreferenceDataConfig.model_validate({"source": str(file), **dataset}),
                    tokenizer_directory=checkpoint_directory(self._model, dist_context),
                    pad_id=self._model.pad_token_id,
                )
                for file in files
            )
            self._splits = (train, held_out)
        return self._splits

    def train(self, dist_context: DistributedContext) -> PreferenceData:
        return self._build(dist_context)[0]

    def held_out(self, dist_context: DistributedContext) -> PreferenceData:
        return self._build(dist_context)[1]

    def reference(self, dist_context: DistributedContext) -> torch.nn.Module:
        """The frozen reference: the policy's initial weights, whole, on this rank's device."""
        return load_pretrained(checkpoint_directory(self._model, dist_context), device=dist_context.device)


Scored = tuple[PreferencePair, ReferenceScore | None]


class ScoredPairs:
    """Pairs with their reference scores (None: a colocated reference scores them) as a dataset."""

    def __init__(self, items: list[Scored]) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> Scored:
        return self._items[index]


def held_out_data(pairs: Pairs, *, scored: bool) -> EvaluationData[Scored, DPOBatch]:
    """The held-out pairs, with the reference's scores (``scored``) or none (colocated)."""
    pad = {"pad": 0}

    def dataset(dist_context: DistributedContext) -> ScoredPairs:
        data = pairs.held_out(dist_context)
        pad["pad"] = data.pad_id
        if not scored:
            return ScoredPairs([(pair, None) for pair in data.pairs])
        reference = pairs.reference(dist_context).eval()
        scores = score_pairs(reference, data.pairs, pad_id=data.pad_id, device=dist_context.device)
        return ScoredPairs(list(zip(data.pairs, scores, strict=True)))

    def collate(items: list[Scored]) -> DPOBatch:
        found = [score for _, score in items if score is not None]
        return collate_pairs([pair for pair, _ in items], found if scored else None, pad_id=pad["pad"])

    return EvaluationData(dataset_factory=dataset, collator=collate)


def run(config: DPOConfig) -> Path:
    """Trains DPO with evaluation, then exports the policy; returns the export directory."""
    section = config.dpo
    # Before any work: an export_dir holding the user's own files is refused, not emptied.
    overwrite = check_export_target(section.export_dir, replace_other=section.replace_export_dir)
    model = model_section(config)
    pairs = Pairs(config, model)
    provider = HFModelProvider(model)
    reference: ReferenceModel | None
    match section.reference:
        case "scored":
            reference = None
        case "colocated":
            reference = ReferenceModel(provider)
    data = DPODataProvider(
        pairs=pairs.train,
        reference=pairs.reference if reference is None else None,
        order=config.data,
        pairs_per_forward=64,
    )
    task = DPOTask(section.loss, reference=reference)
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=provider,
        task_provider=lambda _: task,
        data_provider=data,
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
        evaluation_data=held_out_data(pairs, scored=reference is None),
    ).configure()
    if reference is not None:
        reference.attach(trainer)
    report = eval_reporter("eval/loss", "eval/rewards/accuracies", "eval/rewards/margins")
    return train_and_export(trainer, section, overwrite=overwrite, report=report, exported="the DPO policy")


USAGE = "usage: train_dpo.py CONFIG.yaml  (e.g. examples/reward-dpo/dpo.yaml)"


def main() -> None:
    script_main(USAGE, DPOConfig.from_yaml, run, section="dpo")


if __name__ == "__main__":
    main()
