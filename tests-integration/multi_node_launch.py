"""Starting "nodes" on one machine: one ``torchrun`` agent each, joined by a c10d rendezvous.

Shared by the two-node tests (test_multi_node.py, test_multi_node_finetune.py). docs/multi-node.md
shows the same launcher command with real host names.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

RUN_TIMEOUT_S = 240.0  # a 4-rank job on a busy 2-core machine takes about a minute


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (torchrun starts each worker in a session of its own, so a
    process-group kill of the agent does not reach them)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_node(agent: subprocess.Popen[bytes]) -> None:
    """SIGKILL an agent and its workers at once, as a node that loses power."""
    workers = _children(agent.pid)
    for target in [agent.pid, *workers]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(os.getpgid(target), signal.SIGKILL)
    agent.wait()


@dataclass
class Nodes:
    agents: list[subprocess.Popen[bytes]]
    logs: list[Path]

    def wait(self, timeout_s: float = RUN_TIMEOUT_S) -> list[int]:
        deadline = time.monotonic() + timeout_s
        codes: list[int] = []
        for agent, log in zip(self.agents, self.logs, strict=True):
            try:
                codes.append(agent.wait(timeout=max(deadline - time.monotonic(), 1.0)))
            except subprocess.TimeoutExpired:
                pytest.fail(f"node still running after {timeout_s} s:\n{log.read_text()[-3000:]}")
        return codes

    def output(self, node: int) -> str:
        return self.logs[node].read_text()

    def outputs(self) -> str:
        """The tail of every node's log, for a failure message."""
        return "\n".join(f"--- node {n}:\n{self.output(n)[-3000:]}" for n in range(len(self.logs)))


def torchrun(nnodes: int, nproc_per_node: int, port: int, rdzv_id: str, node_rank: int) -> list[str]:
    """The launcher command of one node (docs/multi-node.md shows it with real host names)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        str(nproc_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"localhost:{port}",
        "--rdzv-id",
        rdzv_id,
        "--max-restarts",
        "0",
    ]


def _wait_listening(port: int, agent: subprocess.Popen[bytes], log: Path) -> None:
    """Until the first agent hosts the rendezvous store on ``port`` (so that it, node 0, is the
    store's host, as on a cluster where the endpoint names node 0)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        with socket.socket() as s:
            if s.connect_ex(("localhost", port)) == 0:
                return
        assert agent.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "the first agent never opened the rendezvous port"
        time.sleep(0.2)


@dataclass
class Launcher:
    """Starts nodes (node 0 first: it hosts the rendezvous store) and, at ``close``, kills every
    agent still alive and the workers of ``job`` whose command line names ``marker``."""

    job: Path
    marker: Path
    started: list[subprocess.Popen[bytes]] = field(default_factory=list[subprocess.Popen[bytes]])

    def start(
        self,
        args: Sequence[str],
        out: Path,
        *,
        nnodes: int = 2,
        nproc_per_node: int = 2,
        node_env: Mapping[int, Mapping[str, str]] | None = None,
    ) -> Nodes:
        """``torchrun ... JOB ARGS`` on ``nnodes`` nodes, each logging to ``out/node<N>.log``."""
        out.mkdir(parents=True, exist_ok=True)
        port, rdzv_id = free_port(), f"d9d-{uuid.uuid4().hex[:8]}"
        agents: list[subprocess.Popen[bytes]] = []
        logs: list[Path] = []
        for node in range(nnodes):
            log = out / f"node{node}.log"
            env = dict(os.environ, **(node_env or {}).get(node, {}))
            with log.open("wb") as sink:
                agent = subprocess.Popen(
                    [*torchrun(nnodes, nproc_per_node, port, rdzv_id, node), str(self.job), *args],
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,  # one process group per node
                    cwd=out,
                )
            self.started.append(agent)
            agents.append(agent)
            logs.append(log)
            if node == 0:
                _wait_listening(port, agent, log)
        return Nodes(agents, logs)

    def close(self) -> None:
        for agent in self.started:
            if agent.poll() is None:
                kill_node(agent)
        self._kill_orphans()

    def _kill_orphans(self) -> None:
        """Workers whose agent was killed keep running in their own session: end this test's."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if str(self.job) in cmdline and str(self.marker) in cmdline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(entry.name), signal.SIGKILL)


@contextlib.contextmanager
def launcher(job: Path, marker: Path) -> Generator[Launcher]:
    """A ``Launcher`` for ``job`` whose leftovers are killed on exit (use in a fixture)."""
    nodes = Launcher(job, marker)
    try:
        yield nodes
    finally:
        nodes.close()
