"""The decode benchmark's CPU smoke run: both sides, one side per call, and the admission wait."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

_SCRIPT = Path(__file__).parents[1] / "benchmarks" / "decode_throughput.py"


@pytest.fixture(scope="module")
def benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("d9d_rl_benchmark_decode_throughput", _SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through it
    spec.loader.exec_module(module)
    return module


def _rows(
    benchmark: ModuleType,
    arguments: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> list[list[str]]:
    """The table rows that ``main`` prints for ``--quick --repeats 1`` (batches 1 and 4)."""
    monkeypatch.setattr(sys, "argv", ["decode_throughput.py", "--quick", "--repeats", "1", *arguments])
    benchmark.main()
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.startswith("tiny ")]
    assert rows, "\n".join(lines)
    return rows


def test_both_sides_print_a_ratio(
    benchmark: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = _rows(benchmark, [], monkeypatch, capsys)
    assert [row[1] for row in rows] == ["1", "4"]
    for row in rows:
        engine, reference, ratio = float(row[3]), float(row[4]), float(row[5])
        assert engine > 0 and reference > 0 and ratio == pytest.approx(engine / reference, abs=0.006)


def test_one_side_per_call_prints_no_ratio(
    benchmark: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for row in _rows(benchmark, ["--sides", "engine", "--admission-wait-steps", "3"], monkeypatch, capsys):
        assert float(row[3]) > 0 and row[4:6] == ["n/a", "n/a"]
    for row in _rows(benchmark, ["--sides", "transformers"], monkeypatch, capsys):
        assert row[3] == "n/a" and float(row[4]) > 0 and row[5] == "n/a"


def test_a_second_engine_needs_both_sides(
    benchmark: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        sys, "argv", ["decode_throughput.py", "--quick", "--sides", "engine", "--decode-ahead", "both"]
    )
    with pytest.raises(SystemExit):
        benchmark.main()
    assert "needs --sides both" in capsys.readouterr().err
