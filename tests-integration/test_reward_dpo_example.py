"""The DPO half of examples/reward-dpo: its config validates and its pieces build, without training.

The example's run (a reward model, then DPO) is measured in its README; this file checks, in a
few seconds, what a change could silently break: the shipped config, the early refusals, and the
held-out pairs scored by the reference and batched for ``DPOTask``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from script_in_process import run_script_in_process
from transformers import AutoModelForCausalLM

from d9d.loop import StepFinished
from d9d.mesh import DistributedContext, MeshParameters
from d9d.rl import DPOBatch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "reward-dpo"
SCRIPT = EXAMPLE / "train_dpo.py"
SHIPPED = (EXAMPLE / "dpo.yaml").read_text()


# Module names the example's scripts import from their own folder; other examples have files of
# the same names (examples/classification/toy_data.py), which an earlier test may have imported.
EXAMPLE_MODULES = ("toy_data", "train_reward", "train_dpo", "completions", "_reward_dpo_common")


@pytest.fixture(scope="module", autouse=True)
def _example_modules_of_this_folder() -> Iterator[None]:
    """While this file runs, ``toy_data`` and its siblings are imported from this example's folder."""
    saved = {name: sys.modules.pop(name) for name in EXAMPLE_MODULES if name in sys.modules}
    try:
        yield
    finally:
        for name in EXAMPLE_MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


@pytest.fixture(scope="module")
def train_dpo() -> Iterator[ModuleType]:
    """The script as a module (its directory first on ``sys.path``, as ``python train_dpo.py`` has it)."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        yield importlib.import_module("train_dpo")
    finally:
        sys.path.remove(str(EXAMPLE))


def test_the_shipped_config_validates_with_each_loss(train_dpo: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "dpo.yaml"
    path.write_text(SHIPPED)
    config = train_dpo.DPOConfig.from_yaml(path)
    assert (config.dpo.loss.loss, config.dpo.loss.beta, config.dpo.reference) == ("sigmoid", 0.1, "scored")
    assert config.trainer.max_steps == 20 and config.model is None
    # the commented switches: IPO and the colocated reference
    ipo = SHIPPED.replace("  loss: {loss: sigmoid, beta: 0.1}\n  # loss:", "  loss:")
    ipo = ipo.replace("reference: scored", "reference: colocated")
    path.write_text(ipo)
    config = train_dpo.DPOConfig.from_yaml(path)
    assert (config.dpo.loss.loss, config.dpo.reference) == ("ipo", "colocated")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (("  sequence_length: 16", "  sequence_length: 16\n  betta: 0.2"), "betta"),
        (("{loss: sigmoid, beta: 0.1}", "{loss: ipo, beta: 0.1, label_smoothing: 0.1}"), "label_smoothing"),
        (("reference: scored", "reference: shared"), "dpo.reference"),
    ],
)
def test_a_bad_config_stops_the_script_naming_the_key(
    change: tuple[str, str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "dpo.yaml"
    path.write_text(SHIPPED.replace(*change))
    code, stderr = run_script_in_process(SCRIPT, str(path), capsys=capsys)
    assert code == 2
    assert named in stderr


def test_an_export_dir_of_other_files_stops_the_script_naming_the_switch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    export = tmp_path / "mine"
    export.mkdir()
    (export / "notes.txt").write_text("not d9d's")
    path = tmp_path / "dpo.yaml"
    shipped = SHIPPED.replace("runs/reward-dpo/dpo-policy", str(export))
    path.write_text(shipped.replace("runs/reward-dpo", str(tmp_path / "runs")))
    code, stderr = run_script_in_process(SCRIPT, str(path), capsys=capsys)
    assert code == 2
    assert "(dpo.replace_export_dir: true)" in stderr
    assert (export / "notes.txt").read_text() == "not d9d's"
    assert not (tmp_path / "runs").exists()  # refused before any work


def test_the_eval_report_prints_evaluation_steps_only(
    train_dpo: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    report = train_dpo.eval_reporter("eval/loss", "eval/rewards/margins")
    capsys.readouterr()
    report(StepFinished(step=3, metrics={"loss": 0.7}))
    report(StepFinished(step=4, metrics={"eval/loss": 0.69314, "eval/rewards/margins": 0.125}))
    assert capsys.readouterr().out == "eval after 5 steps: eval/loss=0.6931 eval/rewards/margins=0.1250\n"


def test_the_held_out_pairs_carry_the_reference_scores_in_dpo_batches(
    train_dpo: ModuleType, tmp_path: Path
) -> None:
    path = tmp_path / "dpo.yaml"
    path.write_text(
        SHIPPED.replace("runs/reward-dpo", str(tmp_path / "runs")).replace(
            "generated_pairs: 1024", "generated_pairs: 16"
        )
    )
    config = train_dpo.DPOConfig.from_yaml(path)
    model = train_dpo.model_section(config)
    assert model.head == "causal_lm" and model.pad_token_id == 0
    pairs = train_dpo.Pairs(config, model)
    context = DistributedContext(MeshParameters(), device_type="cpu")
    try:
        assert len(pairs.train(context).pairs) == 16
        held_out = train_dpo.held_out_data(pairs, scored=True)
        dataset = held_out.dataset_factory(context)
        assert len(dataset) == 8
        batch: DPOBatch = held_out.collator([dataset[i] for i in range(4)])
        assert batch.input_ids.shape[0] == 8 and batch.ref_log_probs is not None
        # the reference's scores: transformers' log-softmax of the initial weights' logits, summed
        # over each row's answer targets (chosen/rejected rows interleaved)
        reference = AutoModelForCausalLM.from_pretrained(model.source).eval()
        with torch.no_grad():
            log_probs = reference(batch.input_ids).logits.double().log_softmax(dim=-1)
        answer = batch.targets != -100
        picked = log_probs.gather(-1, batch.targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        want = (picked * answer).sum(dim=-1)
        torch.testing.assert_close(batch.ref_log_probs.double(), want, rtol=1e-5, atol=1e-4)
        unscored = train_dpo.held_out_data(pairs, scored=False)
        unscored_data = unscored.dataset_factory(context)
        assert unscored.collator([unscored_data[i] for i in range(4)]).ref_log_probs is None
    finally:
        context.close()  # no process group left behind for the tests after this one
