"""One rank of the quickstart job under ``torchrun`` (the two-node test of test_multi_node.py).

Usage: ``python multi_node_job.py CONFIG.json OUT_DIR [PAUSE_AFTER_CHECKPOINT]``

Trains the quickstart model from a JSON project config. Each rank appends its losses to
``OUT_DIR/losses-rank<R>.jsonl`` as they come, and at the end writes ``OUT_DIR/rank<R>.pt`` (its
losses, the step it started from, and the full parameters). With ``PAUSE_AFTER_CHECKPOINT=K`` and
``D9D_TEST_PAUSE_THIS_NODE=1`` in the agent's environment, this node's ranks stop once the
checkpoint of step K is saved: each writes ``OUT_DIR/paused-rank<R>.json`` and sleeps, so that
the test can kill the node at a known point; the other node's ranks go on into the next step and
wait there on this one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from quickstart_job import build_trainer, full_parameters

from d9d.loop import CheckpointSaved, EventBus, ForwardBackwardFinished, ProjectConfig


def main() -> None:
    raw: dict[str, Any] = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    pause_after = int(sys.argv[3]) if len(sys.argv) > 3 else None
    rank = int(os.environ["RANK"])
    node = int(os.environ["GROUP_RANK"])
    losses_file = out / f"losses-rank{rank}.jsonl"

    config = ProjectConfig.model_validate(raw)
    events = EventBus()
    losses: list[float] = []

    def record(event: ForwardBackwardFinished) -> None:
        losses.append(event.loss)
        with losses_file.open("a") as f:
            f.write(json.dumps(event.loss) + "\n")

    events.subscribe(ForwardBackwardFinished, record)
    if pause_after is not None and os.environ.get("D9D_TEST_PAUSE_THIS_NODE") == "1":

        def pause(event: CheckpointSaved) -> None:
            if event.step == pause_after:
                marker = {"pid": os.getpid(), "agent_pid": os.getppid(), "node": node}
                (out / f"paused-rank{rank}.json").write_text(json.dumps(marker))
                while True:  # until the test kills this node
                    time.sleep(1)

        events.subscribe(CheckpointSaved, pause)
    trainer = build_trainer(config, events)
    with trainer:
        trainer.train()
        params = full_parameters(trainer.model_stages[0])
        start_step = trainer.total_steps - len(losses)
    torch.save({"losses": losses, "params": params, "start_step": start_step}, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
