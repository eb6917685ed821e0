"""The Qwen3-MoE pre-training example: PP x EP x FSDP on 4 CPU ranks trains and exports.

The script runs unchanged as ``__main__`` on 4 ranks forked from the test zygote, with the process
group torchrun would have started already up (``run_distributed``): a fresh interpreter per rank
would spend most of the run importing torch and d9d. The real launcher runs a script in
test_quickstart.py and test_multi_node*.py.
"""

from __future__ import annotations

import os
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from script_in_process import run_script_in_process

from d9d.mesh.testing import run_distributed

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "pretrain-qwen3-moe" / "train.py"


def _script_on_this_rank(script: str, config: str, out: str) -> int:
    """``python script config`` on this rank, its stdout and stderr in ``out``/rank<N>.{stdout,stderr}."""
    rank = dist.get_rank()
    for fd, stream in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(f"{out}/rank{rank}.{stream}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.argv = [script, config]
    sys.path.insert(0, os.path.dirname(script))  # as for `python SCRIPT`
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def test_a_short_run_on_four_ranks_lowers_the_loss_and_exports(tmp_path: Path) -> None:
    config = (REPO / "examples" / "pretrain-qwen3-moe" / "config.yaml").read_text()
    assert "mesh: {pipeline_parallel: 2, data_parallel_shard: 2, expert_parallel: 2}" in config
    config = config.replace("runs/pretrain-qwen3-moe", str(tmp_path / "runs"))
    config = config.replace("max_steps: 60", "max_steps: 12").replace("every_steps: 20", "every_steps: 10")
    path = tmp_path / "config.yaml"
    path.write_text(config)
    codes = run_distributed(
        _script_on_this_rank, str(SCRIPT), str(path), str(tmp_path), world_size=4, timeout_s=240
    )
    stderr = (tmp_path / "rank0.stderr").read_text()
    stdout = (tmp_path / "rank0.stdout").read_text()
    failed = {
        rank: (tmp_path / f"rank{rank}.stderr").read_text()[-3000:] for rank, c in enumerate(codes) if c
    }
    assert codes == [0, 0, 0, 0], failed
    assert "12/12" in stderr, stderr[-3000:]  # the main rank's progress bar reached the end
    match = re.search(r"loss: first ([\d.]+), last ([\d.]+)", stdout)
    assert match is not None, stdout
    first, last = float(match.group(1)), float(match.group(2))
    assert last < 0.9 * first  # 4.86 -> 3.94 in 12 steps (warm-up 5)
    export = tmp_path / "runs" / "export"
    assert (export / "config.json").is_file()
    assert (export / "model.safetensors.index.json").is_file()
    assert (tmp_path / "runs" / "checkpoints" / "step_000000010").is_dir()


def test_an_export_dir_holding_other_files_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The example exported with overwrite=True unchecked: a user's files in export_dir were
    # deleted, exit status 0, nothing printed.
    config = (REPO / "examples" / "pretrain-qwen3-moe" / "config.yaml").read_text()
    config = config.replace("runs/pretrain-qwen3-moe", str(tmp_path / "runs"))
    export = tmp_path / "runs" / "export"
    export.mkdir(parents=True)
    (export / "notes.txt").write_text("mine")
    path = tmp_path / "config.yaml"
    path.write_text(config)
    # Refused before any work (no process group either): in this process, see script_in_process.
    code, stderr = run_script_in_process(SCRIPT, str(path), capsys=capsys)
    assert code == 2, stderr[-2000:]
    assert f"export target {export} is a non-empty directory that is not a d9d export" in stderr
    assert "notes.txt" in stderr and "pretrain.replace_export_dir: true" in stderr
    assert (export / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "runs" / "checkpoints").exists()  # refused before any work


def test_the_config_trains_with_the_load_balancing_loss_its_readme_promises() -> None:
    # the README says "load-balancing loss on": config.json's output_router_logits must say so
    # (transformers, and d9d by default, add the loss only when it is true)
    import yaml

    from d9d.hf import HFModelProvider, ScratchModelConfig
    from d9d.mesh import DistributedContext, MeshParameters

    assert "load-balancing loss on" in (SCRIPT.parent / "README.md").read_text()
    model = yaml.safe_load((SCRIPT.parent / "config.yaml").read_text())["model"]
    context = DistributedContext(MeshParameters(), device_type="cpu")
    try:
        spec = HFModelProvider(ScratchModelConfig.model_validate(model)).model_config(context).decoder_spec()
    finally:
        context.close()
    assert spec.load_balancing and spec.load_balancing_coefficient == model["config"]["router_aux_loss_coef"]
