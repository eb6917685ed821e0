"""The torchrun suite of tests-integration/multi_gpu: all of it on two GPUs, a subset on CPU ranks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parent / "multi_gpu" / "nccl_suite.py"


def _cuda_devices() -> int:
    # Asked in a child process: CUDA initialized in the pytest process would break the ranks that
    # d9d.mesh.testing forks from it later (see test_context_parallel_gpu.py).
    if shutil.which("nvidia-smi") is None:
        return 0
    probe = "import torch; print(torch.cuda.device_count())"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    return int(done.stdout.strip() or 0) if done.returncode == 0 else 0


def _run_suite(out: Path, *extra: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(SUITE), "--out", str(out), *extra,
    ]  # fmt: skip
    env = {
        **os.environ,
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False, env=env)


def _case_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.startswith("CASE ")]


@pytest.mark.multi_gpu
@pytest.mark.skipif(_cuda_devices() < 2, reason="needs 2 CUDA devices")
def test_nccl_suite_on_two_gpus(tmp_path: Path) -> None:
    # One rank per GPU over NCCL; every case against one process (see nccl_suite.py).
    out = Path(os.environ.get("D9D_MULTI_GPU_OUT", tmp_path))
    # Under the repository's 300 s pytest timeout; the whole suite takes a few minutes on 2 H200s.
    result = _run_suite(out, "--device", "cuda", "--case-timeout", "120", timeout_s=285)
    lines = _case_lines(result)
    assert result.returncode == 0, "\n".join(lines) + "\n" + result.stderr[-4000:]
    assert lines and all(": PASS (" in line for line in lines)


def test_suite_subset_on_two_cpu_ranks(tmp_path: Path) -> None:
    # Keeps the suite from rotting where no GPU is: FSDP, TP with sequence parallelism, one
    # pipeline schedule and distributed clipping on 2 gloo ranks.
    cases = ["fsdp", "tp_sequence_parallel", "pp_1f1b", "distributed_clipping"]
    result = _run_suite(tmp_path, "--device", "cpu", "--only", ",".join(cases), timeout_s=120)
    lines = _case_lines(result)
    assert result.returncode == 0, "\n".join(lines) + "\n" + result.stderr[-4000:]
    assert sorted(line.split(":")[0] for line in lines) == sorted(f"CASE {c}" for c in cases)
    assert (tmp_path / "summary.json").is_file() and (tmp_path / "summary.md").is_file()
