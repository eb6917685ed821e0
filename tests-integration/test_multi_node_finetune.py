"""The Qwen3 fine-tune on two nodes for real on one machine (two ``torchrun`` agents, CPU, gloo).

The finetune-qwen3 example's own ``run()`` (tiny generated Qwen3, toy prompt/completion set, the
shipped config.yaml with fewer steps) runs under finetune_job.py, which only records what every
rank saw. Two nodes of 2 ranks with HSDP, replicating across the nodes and sharding within each,
give the single-process losses; the checkpoint those 4 ranks wrote then resumes on another layout,
2 forked ranks (world 2, ``data_parallel_replicate: 2``): the state it loads is the saved one bit for
bit, it goes on from the saved step, and its losses and final parameters are one process's (close:
another world size sums in another order). docs/multi-node.md shows the same commands.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from finetune_job import run_job
from multi_node_launch import RUN_TIMEOUT_S, Launcher, launcher

from d9d.mesh.testing import run_distributed

REPO = Path(__file__).resolve().parents[1]
JOB = Path(__file__).resolve().parent / "finetune_job.py"
STEPS = 4
SAVED = 2  # the checkpoint of this step (written by the 4 ranks) is resumed on 2 ranks

pytestmark = pytest.mark.slow


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Launcher]:
    with launcher(JOB, tmp_path) as started:
        yield started


def _config(tmp_path: Path, name: str, *, mesh: str, checkpoint: str = "") -> Path:
    """The shipped config.yaml, 4 steps, one toy set and tiny model for every run, outputs in ``name``."""
    text = (REPO / "examples" / "finetune-qwen3" / "config.yaml").read_text()
    out = tmp_path / name
    text = text.replace("runs/finetune-qwen3/export", str(out / "export"))
    text = text.replace("runs/finetune-qwen3/metrics.jsonl", str(out / "metrics.jsonl"))
    text = text.replace("runs/finetune-qwen3", str(tmp_path / "runs"))
    replacements = {
        "mesh: {}": f"mesh: {mesh}",
        "max_steps: 150": f"max_steps: {STEPS}",
        "microbatch_size: 4": "microbatch_size: 2",  # 8 rows a step: 2 on each of 4 ranks
        "warmup: {steps: 10}": "warmup: {steps: 1}",
        "trainer:\n": f"trainer:\n  timeouts: {{collective_seconds: 60}}\n{checkpoint}",
    }
    for old, new in replacements.items():
        assert old in text, old
        text = text.replace(old, new, 1)
    out.mkdir(parents=True)
    path = out / "config.yaml"
    path.write_text(text)
    return path


def _ranks(out: Path, world: int) -> list[dict[str, Any]]:
    return [torch.load(out / f"rank{rank}.pt") for rank in range(world)]


def _assert_same_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for rank, seen in enumerate(ranks):
        assert seen["losses"] == ranks[0]["losses"], f"rank {rank}'s losses differ from rank 0's"
        for name, value in ranks[0]["params"].items():
            assert torch.equal(seen["params"][name], value), f"rank {rank}'s {name} differs from rank 0's"


def _assert_close_to(seen: dict[str, Any], single: dict[str, Any], start: int) -> None:
    torch.testing.assert_close(
        torch.tensor(seen["losses"]), torch.tensor(single["losses"][start:]), rtol=1e-4, atol=0
    )
    for name, value in single["params"].items():
        torch.testing.assert_close(seen["params"][name], value, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.timeout(900)
def test_two_nodes_fine_tune_as_one_process_and_resume_on_two_ranks(tmp_path: Path, nodes: Launcher) -> None:
    # 2 nodes x 2 ranks, HSDP: replicated across the nodes, sharded within each. The work_dir is
    # fresh: the ranks that find no toy set or tiny model there write them (see toy_setup.py).
    directory = tmp_path / "checkpoints"
    saving = f"  checkpoint: {{directory: {directory}, every_steps: {SAVED}, keep_last: 3}}\n"
    hsdp = _config(
        tmp_path, "hsdp", mesh="{data_parallel_replicate: 2, data_parallel_shard: 2}", checkpoint=saving
    )
    run = nodes.start([str(hsdp), str(tmp_path / "hsdp")], tmp_path / "hsdp", nproc_per_node=2)
    assert run.wait() == [0, 0], run.outputs()
    # One process, on the toy set and the tiny Qwen3 the nodes wrote.
    single_config = _config(tmp_path, "single", mesh="{}")
    single = run_distributed(
        run_job, single_config, tmp_path / "single", world_size=1, timeout_s=RUN_TIMEOUT_S
    )[0]
    assert len(single["losses"]) == STEPS
    four = _ranks(tmp_path / "hsdp", 4)
    _assert_same_on_every_rank(four)
    _assert_close_to(four[0], single, start=0)

    # 2 ranks (world 2, forked: test_multi_node.py covers a kill and resume across torchrun nodes)
    # resume the 4 ranks' checkpoint of step SAVED.
    resume = (
        f"  checkpoint: {{directory: {directory}, every_steps: {SAVED}, keep_last: 3, "
        f"resume: {{from_step: {SAVED}}}}}\n"
    )
    replicas = _config(tmp_path, "replicas", mesh="{data_parallel_replicate: 2}", checkpoint=resume)
    two = run_distributed(run_job, replicas, tmp_path / "replicas", world_size=2, timeout_s=RUN_TIMEOUT_S)
    _assert_same_on_every_rank(two)
    for rank, seen in enumerate(two):
        assert seen["first_step"] == SAVED, f"rank {rank} started at step {seen['first_step']}"
        for name, value in four[0]["saved"][SAVED].items():
            assert torch.equal(seen["resumed"][name], value), f"rank {rank}: {name} not the saved one"
    _assert_close_to(two[0], single, start=SAVED)
