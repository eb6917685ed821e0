"""``d9d estimate``: the table, the exit status, and the refusal that names the amount over."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from d9d._loop_command import main

PROVIDER = """
from d9d.loop import ModelProvider
from d9d.loop.estimate import DescribeMemoryResult, LinearShape, ModelMemoryShape

LINEARS = tuple(
    LinearShape(name=f"model.layers.{{layer}}.{n}", in_features=i, out_features=o)
    for n, i, o in (
        ("attn.q", 64, 64),
        ("attn.kv", 64, 64),
        ("attn.o", 64, 64),
        ("mlp.up", 64, 256),
        ("mlp.down", 256, 64),
    )
)


class Shaped(ModelProvider):
    def initialize_model_stage(self, context):
        raise AssertionError("estimate builds nothing")

    def parallelize_model_stage(self, context):
        raise AssertionError("estimate builds nothing")

    def describe_memory(self, context):
        return DescribeMemoryResult(shape=ModelMemoryShape(
            num_layers=4, hidden_size=64, vocab_size=1000, num_heads=4, num_kv_heads=4, head_dim=16,
            ffn_width=256, layer_linears=LINEARS, head=None, storage_bytes=4, compute_bytes=4,
            activation_checkpointing=False,
        ))


class Silent(Shaped):
    def describe_memory(self, context):
        return super(Shaped, self).describe_memory(context)


def shaped(config):
    return Shaped()


def silent(config):
    return Silent()
"""


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "estimate_providers.py").write_text(PROVIDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "job.yaml"
    path.write_text(
        textwrap.dedent("""
        mesh: {pipeline_parallel: 2}
        dataset: {sequence_length: 128}
        trainer: {max_steps: 1, global_batch_size: 4, microbatch_size: 1, device: cpu}
        optimizer: {name: adamw}
        """)
    )
    return path


def test_prints_a_table_per_rank_and_fits(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", str(config), "--device-memory", "1", "--provider", "estimate_providers:shaped"])
    out = capsys.readouterr().out
    assert code == 0
    assert "rank 0" in out and "rank 1" in out and "optimizer state" in out
    assert "device: 1.00 GiB: fits" in out


def test_a_job_over_the_device_exits_2_saying_by_how_much(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["estimate", str(config), "--device-memory", "0.0001", "--provider", "estimate_providers:shaped"]
    )
    captured = capsys.readouterr()
    assert code == 2
    assert "with allocator slack" in captured.out  # the table still comes first
    assert "d9d estimate: the job needs" in captured.err and "on pipeline rank" in captured.err
    assert "over the device's 0.00 GiB by" in captured.err


def test_missing_sequence_length_and_silent_provider_are_named(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate", str(config), "--provider", "estimate_providers:silent"]) == 2
    assert "Silent (estimate_providers:silent) states no model shape" in capsys.readouterr().err
    config.write_text(config.read_text().replace("dataset: {sequence_length: 128}", ""))
    assert main(["estimate", str(config), "--provider", "estimate_providers:shaped"]) == 2
    assert "no dataset.sequence_length" in capsys.readouterr().err
    assert main(["estimate", str(config), "--seq-len", "64", "--provider", "estimate_providers:shaped"]) == 0
