"""Two nodes for real on one machine: two ``torchrun`` agents (CPU, gloo) joined by a c10d rendezvous.

Each agent is one "node" of one rank; the quickstart runs with FSDP sharding its state across the
nodes (``data_parallel_shard: 2``). The test checks that a node killed mid-run ends the other node's
rank instead of hanging it, that the nodes' losses up to then are those of the same job on forked
ranks, and that the checkpoint the two nodes wrote resumes bit-exactly on one node of 2 ranks (the
losses before the kill and after the resume are one process's). Two nodes of 2 ranks with HSDP are
test_multi_node_finetune.py's. docs/multi-node.md shows the same commands.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from multi_node_launch import RUN_TIMEOUT_S, Nodes, kill_node, launcher
from quickstart_job import quickstart_config, run_quickstart

from d9d.mesh.testing import run_distributed

JOB = Path(__file__).resolve().parent / "multi_node_job.py"
SHARDED_ACROSS_NODES = {"data_parallel_shard": 2}
WORLD = 2  # one rank on each of the two nodes
STEPS = 4
PAUSE_AFTER_CHECKPOINT = 2  # node 1 stops once the checkpoint of this step is saved, and is killed
COLLECTIVE_TIMEOUT_S = 60.0  # trainer.timeouts.collective_seconds of the two-node runs

pytestmark = pytest.mark.slow


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Any]:
    """Starts the two nodes of one rank each on a config (see multi_node_launch); ``pause_node``'s
    rank stops once the checkpoint of step ``PAUSE_AFTER_CHECKPOINT`` is saved."""
    with launcher(JOB, tmp_path) as nodes:

        def start(config: dict[str, Any], out: Path, *, pause_node: int | None = None) -> Nodes:
            out.mkdir(parents=True, exist_ok=True)
            config_path = out / "config.json"
            config_path.write_text(json.dumps(config))
            env = {n: {"D9D_TEST_PAUSE_THIS_NODE": "1" if n == pause_node else "0"} for n in range(2)}
            args = [str(config_path), str(out), str(PAUSE_AFTER_CHECKPOINT)]
            return nodes.start(args, out, nproc_per_node=1, node_env=env)

        yield start


def _config(directory: Path | None) -> dict[str, Any]:
    """The two-node job; ``directory=None``: the same job without checkpoints (the reference run,
    whose losses and parameters saving does not change: the resumed runs must equal it)."""
    trainer: dict[str, Any] = {"max_steps": STEPS, "timeouts": {"collective_seconds": COLLECTIVE_TIMEOUT_S}}
    if directory is not None:
        trainer["checkpoint"] = {"directory": str(directory), "every_steps": 1, "keep_last": 3}
    return quickstart_config(mesh=SHARDED_ACROSS_NODES, trainer=trainer)


def _losses(out: Path, rank: int) -> list[float]:
    return [json.loads(line) for line in (out / f"losses-rank{rank}.jsonl").read_text().splitlines()]


def _run(config: dict[str, Any]) -> dict[str, Any]:
    return run_quickstart(config)


def _assert_bit_exact(resumed: dict[str, Any], reference: dict[str, Any]) -> None:
    start = resumed["start_step"]
    assert start == PAUSE_AFTER_CHECKPOINT, "not resumed from the newest complete checkpoint"
    assert resumed["losses"] == reference["losses"][start:]
    for name, value in reference["params"].items():
        assert torch.equal(resumed["params"][name], value), f"{name} differs after resume"


@pytest.mark.timeout(900)
def test_a_killed_node_ends_the_job_and_its_checkpoint_resumes_bit_exactly(
    tmp_path: Path, launch: Any
) -> None:
    # 1. Two nodes train; node 1 dies (agent and worker SIGKILLed) once the checkpoint of step
    #    PAUSE_AFTER_CHECKPOINT is saved, while node 0's rank waits on it in the next step's collectives.
    killed = tmp_path / "killed"
    directory = killed / "ckpt"
    nodes = launch(_config(directory), killed, pause_node=1)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (killed / "paused-rank1.json").exists():
        assert nodes.agents[0].poll() is None, nodes.output(0)[-3000:]
        assert time.monotonic() < deadline, f"node 1 never saved step {PAUSE_AFTER_CHECKPOINT}'s checkpoint"
        time.sleep(0.2)
    kill_node(nodes.agents[1])
    # Node 0's rank ends with an error naming what was lost, not a hang: Nodes.wait fails the test
    # if it still runs after the collective timeout plus a generous margin.
    assert nodes.wait(COLLECTIVE_TIMEOUT_S + RUN_TIMEOUT_S)[0] != 0
    survivor = nodes.output(0)
    # e.g. "step 2 failed on rank 0: RuntimeError: [.../gloo/transport/tcp/pair.cc:545] Read error
    # [127.0.0.1]:61577: Connection reset by peer": the step, the rank, and the lost peer's address
    failed = rf"step {PAUSE_AFTER_CHECKPOINT} failed on rank 0: .*\[127\.0\.0\.1\]:\d+"
    assert re.search(failed, survivor), survivor[-6000:]

    # 2. The two nodes' checkpoint resumes on one node of 2 ranks (forked) from the newest complete
    #    checkpoint: bit for bit the uninterrupted run of the same mesh, whose losses the nodes also
    #    gave before the kill; together those losses are close to one process's.
    reference = run_distributed(_run, _config(None), world_size=WORLD, timeout_s=RUN_TIMEOUT_S)
    resumed = run_distributed(_run, _config(directory), world_size=WORLD, timeout_s=RUN_TIMEOUT_S)
    single_config = quickstart_config(trainer={"max_steps": STEPS})
    single = run_distributed(_run, single_config, world_size=1, timeout_s=RUN_TIMEOUT_S)[0]
    for rank in range(WORLD):
        before_kill = _losses(killed, rank)
        assert before_kill == reference[rank]["losses"][: len(before_kill)]
        assert len(before_kill) >= PAUSE_AFTER_CHECKPOINT
        _assert_bit_exact(resumed[rank], reference[rank])
        one_process = before_kill[:PAUSE_AFTER_CHECKPOINT] + resumed[rank]["losses"]
        expected = torch.tensor(single["losses"])
        torch.testing.assert_close(torch.tensor(one_process), expected, rtol=1e-4, atol=0)
