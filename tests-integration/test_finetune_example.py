"""The fine-tuning example: a job from config alone, on the toy set and on a user's chat JSONL file."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from script_in_process import run_script_in_process
from script_runner import run_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "finetune-qwen3" / "train.py"
CAPITALS = {"france": "paris", "italy": "rome", "spain": "madrid", "peru": "lima", "kenya": "nairobi"}


# What train.py and its toy_setup import at their top: imported once in the session's script runner
# (conftest.py's torch_runner), before it forks each run (see script_runner), instead of once per run.
SCRIPT_IMPORTS = (
    "pydantic",
    "tokenizers",
    "d9d.hf",
    "d9d.hf.qwen3",
    "d9d.hf.data",
    "d9d.loop",
    "d9d.loop.data",
    "d9d.mesh",
)


def _run(
    config: str, tmp_path: Path, torch_runner: subprocess.Popen[str]
) -> subprocess.CompletedProcess[str]:
    """``python train.py CONFIG`` in a process of its own (forked by the session's script runner)."""
    path = tmp_path / "config.yaml"
    path.write_text(config)
    return run_script(torch_runner, SCRIPT, str(path), cwd=tmp_path, timeout_s=300, preload=SCRIPT_IMPORTS)


def _shipped_config(tmp_path: Path, *, steps: int = 30) -> str:
    config = (REPO / "examples" / "finetune-qwen3" / "config.yaml").read_text()
    config = config.replace("runs/finetune-qwen3", str(tmp_path / "runs"))
    return config.replace("max_steps: 150", f"max_steps: {steps}").replace(
        "warmup: {steps: 10}", "warmup: {steps: 3}"
    )


def _losses(stdout: str) -> tuple[float, float]:
    match = re.search(r"held-out loss before: ([\d.]+)\s+after: ([\d.]+)", stdout)
    assert match is not None, stdout
    return float(match.group(1)), float(match.group(2))


def test_script_without_arguments_prints_usage(capsys: pytest.CaptureFixture[str]) -> None:
    # Ends before any work: run in this process (see script_in_process), not a fresh interpreter.
    code, stderr = run_script_in_process(SCRIPT, capsys=capsys)
    assert code == 2
    assert "usage: train.py CONFIG.yaml" in stderr


@pytest.fixture(scope="module")
def shipped_run(
    tmp_path_factory: pytest.TempPathFactory, torch_runner: subprocess.Popen[str]
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The shipped config, 30 steps, once per module: its directory (toy set, tiny checkpoint, export)."""
    directory = tmp_path_factory.mktemp("shipped")
    return directory, _run(_shipped_config(directory), directory, torch_runner)


def test_a_short_run_lowers_the_held_out_loss_and_exports_for_transformers(
    shipped_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    tmp_path, result = shipped_run
    assert result.returncode == 0, result.stderr[-3000:]
    before, after = _losses(result.stdout)
    assert after < 0.5 * before

    from transformers import AutoModelForCausalLM

    export = tmp_path / "runs" / "export"
    assert (export / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([[3, 4, 5]])).logits
    assert logits.shape[:2] == (1, 3) and torch.isfinite(logits).all()

    # AutoTokenizer reads the export as the job's tokenizer.json, not as Qwen2's BPE of its words
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    trained = Tokenizer.from_file(str(tmp_path / "runs" / "tiny-qwen3" / "tokenizer.json"))
    loaded = AutoTokenizer.from_pretrained(export)
    prompt = "what is the capital of france ?"
    assert loaded(prompt)["input_ids"] == trained.encode(prompt).ids
    assert len(trained.encode(prompt).ids) == 7


def test_a_users_chat_jsonl_file_trains_from_config_alone(
    tmp_path: Path, torch_runner: subprocess.Popen[str]
) -> None:
    chats = tmp_path / "chats.jsonl"
    lines = [
        {
            "messages": [
                {"role": "system", "content": "answer with one word"},
                {"role": "user", "content": f"{phrase.format(country)}"},
                {"role": "assistant", "content": capital},
            ]
        }
        for country, capital in CAPITALS.items()
        for phrase in ("what is the capital of {} ?", "name the capital of {} .", "{} has which capital ?")
    ]
    chats.write_text("".join(json.dumps(line) + "\n" for line in lines * 4))
    config = _shipped_config(tmp_path, steps=30)
    config = config.replace(f"source: {tmp_path}/runs/toy_pairs.jsonl", f"source: {chats}")
    config = config.replace("format: prompt_completion", "format: chat").replace(
        "toy_data: true", "toy_data: false"
    )
    result = _run(config, tmp_path, torch_runner)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "60 samples used, 0 truncated, 0 dropped as too long, 0 skipped" in result.stdout
    before, after = _losses(result.stdout)
    assert after < 0.5 * before


def test_streaming_trains_from_the_file_as_it_goes(
    tmp_path: Path, torch_runner: subprocess.Popen[str]
) -> None:
    config = _shipped_config(tmp_path, steps=12).replace("eval_fraction: 0.2", "eval_fraction: 0.0")
    config = config.replace("packing: true ", "streaming: true\n  packing: true ")
    assert "streaming: true" in config
    result = _run(config, tmp_path, torch_runner)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "held-out loss before: n/a (no held-out split" in result.stdout
    assert (tmp_path / "runs" / "export" / "config.json").is_file()
    # the samples read so far are counted, as for data read into memory (it printed nothing)
    counts = re.search(
        r"so far \(streaming, the samples read up to step 12 by this process\): .*: (\d+) "
        r"samples used, 0 truncated, 0 dropped as too long, 0 skipped",
        result.stdout,
    )
    assert counts is not None and int(counts.group(1)) > 0, result.stdout


def test_a_bad_line_stops_the_run_naming_file_and_line(
    tmp_path: Path, torch_runner: subprocess.Popen[str]
) -> None:
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{oops\n'
    )
    config = _shipped_config(tmp_path).replace(f"source: {tmp_path}/runs/toy_pairs.jsonl", f"source: {chats}")
    config = config.replace("format: prompt_completion", "format: chat").replace(
        "toy_data: true", "toy_data: false"
    )
    result = _run(config, tmp_path, torch_runner)
    assert result.returncode == 2
    assert f"{chats}:2: not valid JSON" in result.stderr
    assert not (tmp_path / "runs" / "export").exists()


def test_an_export_dir_holding_other_files_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    export = tmp_path / "runs" / "export"
    export.mkdir(parents=True)
    (export / "notes.txt").write_text("mine")
    path = tmp_path / "config.yaml"
    path.write_text(_shipped_config(tmp_path))
    # Refused before any work (no process group either): in this process, see script_in_process.
    code, stderr = run_script_in_process(SCRIPT, str(path), capsys=capsys)
    assert code == 2
    assert "not a d9d export" in stderr and "replace_export_dir" in stderr
    assert (export / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "runs" / "tiny-qwen3").exists()  # refused before any work


def test_toy_data_is_written_only_inside_the_work_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a typo in dataset.source with toy_data: true silently wrote a toy file there and trained on it
    typo = tmp_path / "data" / "my_pairs.jsonl"
    path = tmp_path / "config.yaml"
    path.write_text(
        _shipped_config(tmp_path).replace(f"source: {tmp_path}/runs/toy_pairs.jsonl", f"source: {typo}")
    )
    # Refused before any work: in this process, see script_in_process.
    code, stderr = run_script_in_process(SCRIPT, str(path), capsys=capsys)
    assert code == 2
    assert (
        f"finetune.toy_data: dataset.source {typo} does not exist and is outside finetune.work_dir "
        f"{tmp_path / 'runs'}" in stderr
    )
    assert not (tmp_path / "data").exists() and not (tmp_path / "runs").exists()


def test_rerunning_a_finished_config_says_so_without_a_before_loss(
    tmp_path: Path, torch_runner: subprocess.Popen[str]
) -> None:
    # the second run resumed at its last step, trained nothing and printed the trained model's
    # loss as the untrained "before"
    config = _shipped_config(tmp_path, steps=3)
    checkpoints = tmp_path / "runs" / "checkpoints"
    config = config.replace("trainer:\n", f"trainer:\n  checkpoint: {{directory: {checkpoints}}}\n", 1)
    first = _run(config, tmp_path, torch_runner)
    assert first.returncode == 0, first.stderr[-3000:]
    _losses(first.stdout)
    again = _run(config, tmp_path, torch_runner)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already finished at step 3: nothing trained; held-out loss: " in again.stdout
    assert "held-out loss before" not in again.stdout
    assert f"exported the finished model again to {tmp_path / 'runs' / 'export'}" in again.stdout
    assert (tmp_path / "runs" / "export" / "config.json").is_file()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_llama_or_qwen2_source_trains_by_config_alone(
    tmp_path: Path,
    family: str,
    shipped_run: tuple[Path, subprocess.CompletedProcess[str]],
    torch_runner: subprocess.Popen[str],
) -> None:
    # The same script and config with model.source at another family's checkpoint: config.json's
    # model_type picks the family; nothing else changes. The toy set and its tokenizer come from
    # the shipped run (toy_data: true wrote them there).
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    shipped, toy = shipped_run
    assert toy.returncode == 0, toy.stderr[-3000:]  # the toy set and a tokenizer for it
    tiny = shipped / "runs" / "tiny-qwen3"
    shape: dict[str, Any] = json.loads((tiny / "config.json").read_text())
    fields: dict[str, Any] = {
        key: shape[key] for key in ("vocab_size", "max_position_embeddings", "pad_token_id", "eos_token_id")
    }
    fields.update(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = (
        LlamaForCausalLM(LlamaConfig(**fields, head_dim=16))
        if family == "llama"
        else Qwen2ForCausalLM(Qwen2Config(**fields))
    )
    source = tmp_path / f"tiny-{family}"
    model.save_pretrained(source)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (source / name).write_bytes((tiny / name).read_bytes())
    config = _shipped_config(tmp_path, steps=20).replace("toy_data: true", "toy_data: false")
    toy_pairs = f"source: {shipped}/runs/toy_pairs.jsonl"
    config = config.replace(f"source: {tmp_path}/runs/toy_pairs.jsonl", toy_pairs)
    assert toy_pairs in config
    config = config.replace("replace_export_dir: false", "replace_export_dir: true")
    result = _run(f"model: {{source: {source}}}\n{config}", tmp_path, torch_runner)
    assert result.returncode == 0, result.stderr[-3000:]
    before, after = _losses(result.stdout)
    assert after < before
    export = AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "export", attn_implementation="eager")
    assert type(export).__name__ == ("LlamaForCausalLM" if family == "llama" else "Qwen2ForCausalLM")


def test_the_readmes_plot_and_export_recipes_work_on_the_shipped_config(
    tmp_path: Path,
    shipped_run: tuple[Path, subprocess.CompletedProcess[str]],
    torch_runner: subprocess.Popen[str],
) -> None:
    # README: the shipped config's jsonl tracker feeds `d9d plot`; naming the generated model and
    # adding a checkpoint directory is all `d9d export CONFIG CHECKPOINTS OUT` needs.
    from transformers import AutoModelForCausalLM

    from d9d._loop_command import main

    shipped, toy = shipped_run
    assert toy.returncode == 0, toy.stderr[-3000:]
    metrics = shipped / "runs" / "metrics.jsonl"
    assert metrics.is_file()
    assert main(["plot", str(metrics), "-o", str(tmp_path / "metrics.png")]) == 0

    config = _shipped_config(tmp_path, steps=4).replace("toy_data: true", "toy_data: false")
    config = config.replace(
        f"source: {tmp_path}/runs/toy_pairs.jsonl", f"source: {shipped}/runs/toy_pairs.jsonl"
    )
    checkpoints = tmp_path / "runs" / "checkpoints"
    config = config.replace("trainer:\n", f"trainer:\n  checkpoint: {{directory: {checkpoints}}}\n", 1)
    config = f"model: {{source: {shipped / 'runs' / 'tiny-qwen3'}}}\n{config}"
    result = _run(config, tmp_path, torch_runner)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "config.yaml"), str(checkpoints), str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    assert type(model).__name__ == "Qwen3ForCausalLM"


def _shipped_yaml(monkeypatch: pytest.MonkeyPatch, name: str) -> Any:
    """The example's config file ``name`` validated by the script's own ``FinetuneConfig``."""
    import importlib.util
    import sys

    import yaml

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("finetune_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "finetune_train", module)  # pydantic resolves annotations there
    spec.loader.exec_module(module)
    return module.FinetuneConfig.model_validate(yaml.safe_load((SCRIPT.parent / name).read_text()))


def test_the_one_gpu_lora_config_validates(monkeypatch: pytest.MonkeyPatch) -> None:
    # docs/one-gpu.md points at it: it must stay a valid config of this script.
    config = _shipped_yaml(monkeypatch, "qwen3-8b-lora-24gib.yaml")
    assert config.model.master_dtype == "bfloat16" and config.model.activation_checkpointing
    assert config.trainer.peft.kind == "lora" and config.trainer.peft.r == 16


def test_the_one_gpu_14b_4bit_lora_config_validates(monkeypatch: pytest.MonkeyPatch) -> None:
    # docs/one-gpu.md points at it: a valid config of this script, with the 4-bit base on
    from d9d.loop.peft import LoRAConfig, NF4BaseConfig

    config = _shipped_yaml(monkeypatch, "qwen3-14b-qlora-24gib.yaml")
    assert config.model.source == "Qwen/Qwen3-14B" and config.model.master_dtype == "bfloat16"
    peft = config.trainer.peft
    assert isinstance(peft, LoRAConfig) and peft.export == "merged"
    assert peft.base == NF4BaseConfig(block_size=64, double_quant=True)


def test_a_missing_template_file_stops_the_run_in_one_line_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _shipped_config(tmp_path).replace(
        "format: prompt_completion", f"format: {{kind: chat, template: {tmp_path / 'missing.jinja'}}}"
    )
    path = tmp_path / "config.yaml"
    path.write_text(config)
    code, stderr = run_script_in_process(SCRIPT, str(path), capsys=capsys)
    assert code == 2
    assert "missing.jinja does not exist" in stderr and "Traceback" not in stderr
    assert not (tmp_path / "runs" / "tiny-qwen3").exists()  # refused before any work


def test_chat_data_on_a_tokenizer_without_a_chat_template_stops_in_one_line(
    tmp_path: Path,
    shipped_run: tuple[Path, subprocess.CompletedProcess[str]],
    torch_runner: subprocess.Popen[str],
) -> None:
    shipped, toy = shipped_run
    assert toy.returncode == 0, toy.stderr[-3000:]
    source = tmp_path / "no-template"
    source.mkdir()
    for file in (shipped / "runs" / "tiny-qwen3").iterdir():
        (source / file.name).write_bytes(file.read_bytes())
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (source / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (source / "chat_template.jinja").unlink(missing_ok=True)
    chats = tmp_path / "chats.jsonl"
    line = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    chats.write_text(json.dumps(line) + "\n")
    config = _shipped_config(tmp_path).replace(f"source: {tmp_path}/runs/toy_pairs.jsonl", f"source: {chats}")
    config = config.replace("format: prompt_completion", "format: chat").replace(
        "toy_data: true", "toy_data: false"
    )
    result = _run(f"model: {{source: {source}}}\n{config}", tmp_path, torch_runner)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "has no chat template" in result.stderr and "dataset.format.template" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
