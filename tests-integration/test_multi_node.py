"""Two nodes for real on one machine: two ``torchrun`` agents (CPU, gloo) joined by a c10d rendezvous.

Each agent is one "node" of 2 ranks; the quickstart runs with HSDP replicating across the nodes and
sharding within each (``data_parallel_replicate: 2, data_parallel_shard: 2``). The tests check that
the two nodes give the single-process losses, that a node killed mid-run ends the other node's
ranks instead of hanging them, and that the checkpoint the 4 ranks wrote resumes bit-exactly, on
the two nodes again and on one node of 4 ranks. docs/multi-node.md shows the same commands.
"""

from __future__ import annotations

import json
import re
import shutil
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
HSDP_ACROSS_NODES = {"data_parallel_replicate": 2, "data_parallel_shard": 2}
STEPS = 12
PAUSE_AFTER_CHECKPOINT = 5  # node 1 stops once the checkpoint of this step is saved, and is killed
COLLECTIVE_TIMEOUT_S = 60.0  # trainer.timeouts.collective_seconds of the two-node runs

pytestmark = pytest.mark.slow


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Any]:
    """Starts the two nodes of 2 ranks each on a config (see multi_node_launch); ``pause_node``'s
    ranks stop once the checkpoint of step ``PAUSE_AFTER_CHECKPOINT`` is saved."""
    with launcher(JOB, tmp_path) as nodes:

        def start(config: dict[str, Any], out: Path, *, pause_node: int | None = None) -> Nodes:
            out.mkdir(parents=True, exist_ok=True)
            config_path = out / "config.json"
            config_path.write_text(json.dumps(config))
            env = {n: {"D9D_TEST_PAUSE_THIS_NODE": "1" if n == pause_node else "0"} for n in range(2)}
            return nodes.start([str(config_path), str(out), str(PAUSE_AFTER_CHECKPOINT)], out, node_env=env)

        yield start


def _config(directory: Path | None) -> dict[str, Any]:
    """The two-node job; ``directory=None``: the same job without checkpoints (the reference run,
    whose losses and parameters saving does not change: the resumed runs must equal it)."""
    trainer: dict[str, Any] = {"max_steps": STEPS, "timeouts": {"collective_seconds": COLLECTIVE_TIMEOUT_S}}
    if directory is not None:
        trainer["checkpoint"] = {"directory": str(directory), "every_steps": 1, "keep_last": 3}
    return quickstart_config(mesh=HSDP_ACROSS_NODES, trainer=trainer)


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
    # 1. Two nodes train; node 1 dies (agent and workers SIGKILLed) once the checkpoint of step 5
    #    is saved, while node 0's ranks wait on it in step 6's collectives.
    killed = tmp_path / "killed"
    directory = killed / "ckpt"
    nodes = launch(_config(directory), killed, pause_node=1)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    paused = [killed / "paused-rank2.json", killed / "paused-rank3.json"]
    while not all(p.exists() for p in paused):
        assert nodes.agents[0].poll() is None, nodes.output(0)[-3000:]
        assert time.monotonic() < deadline, "node 1 never reached the checkpoint of step 5"
        time.sleep(0.2)
    kill_node(nodes.agents[1])
    # Node 0's ranks end with an error naming what was lost, not a hang: Nodes.wait fails the test
    # if they still run after the collective timeout plus a generous margin.
    assert nodes.wait(COLLECTIVE_TIMEOUT_S + RUN_TIMEOUT_S)[0] != 0
    survivor = nodes.output(0)
    # e.g. "step 5 failed on rank 1: RuntimeError: [.../gloo/transport/tcp/pair.cc:545] Read error
    # [127.0.0.1]:61577: Connection reset by peer": the step, the rank, and the lost peer's address
    assert re.search(r"step 5 failed on rank [01]: .*\[127\.0\.0\.1\]:\d+", survivor), survivor[-6000:]
    one_node = tmp_path / "one-node"
    shutil.copytree(directory, one_node)  # before the rerun below goes on in `directory`

    # 2. A rerun on the two nodes resumes from the newest complete checkpoint (step 5).
    rerun = tmp_path / "rerun"
    nodes = launch(_config(directory), rerun)
    assert nodes.wait() == [0, 0], nodes.output(0)[-3000:] + nodes.output(1)[-3000:]

    # The uninterrupted run (4 forked ranks, the same mesh): the two nodes' losses before the
    # kill and after the resume are its losses, bit for bit, and close to one process's.
    reference = run_distributed(_run, _config(None), world_size=4, timeout_s=RUN_TIMEOUT_S)
    single = run_distributed(_run, quickstart_config(), world_size=1, timeout_s=RUN_TIMEOUT_S)[0]
    for rank in range(4):
        before_kill = _losses(killed, rank)
        assert before_kill == reference[rank]["losses"][: len(before_kill)]
        assert len(before_kill) >= PAUSE_AFTER_CHECKPOINT
        resumed = torch.load(rerun / f"rank{rank}.pt")
        _assert_bit_exact(resumed, reference[rank])
        two_nodes = before_kill[:PAUSE_AFTER_CHECKPOINT] + resumed["losses"]
        torch.testing.assert_close(torch.tensor(two_nodes), torch.tensor(single["losses"]), rtol=1e-4, atol=0)

    # 3. The same checkpoint (written by 2 nodes x 2 ranks) resumes on one node of 4 ranks.
    resumed_one_node = run_distributed(_run, _config(one_node), world_size=4, timeout_s=RUN_TIMEOUT_S)
    for rank in range(4):
        _assert_bit_exact(resumed_one_node[rank], reference[rank])
