"""A model is one backbone plus head objects: no code asks which kind a head is, a single head is
the one-element case, and a head written outside d9d-hf plugs in through ``DecoderHead``."""

from __future__ import annotations

import ast
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import d9d.hf
from d9d.hf import (
    DecoderInputs,
    DecoderModel,
    DecoderSpec,
    LanguageModelHeadSpec,
    ScratchModelConfig,
    SequenceClassificationHeadSpec,
    StageHandoff,
    causal_lm_targets,
    save_pretrained,
)
from d9d.hf._decoder import head_files, load_weights
from d9d.hf._families import as_family
from d9d.state_mappers import SafetensorsCheckpoint

HEAD_KINDS = {
    "LanguageModelHeadSpec",
    "ClassificationHeadSpec",
    "SequenceClassificationHeadSpec",
    "EmbeddingHeadSpec",
    "CausalLMHeadConfig",
    "ClassificationHeadConfig",
    "DecoderCausalLM",
    "DecoderSequenceClassification",
    "DecoderEmbedding",
    "DecoderMultiHead",
}
TINY = {
    "model_type": "qwen3",
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "num_hidden_layers": 2,
    "pad_token_id": 0,
}


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def test_no_code_of_d9d_hf_tests_which_kind_a_head_or_model_is() -> None:
    found: list[str] = []
    root = Path(d9d.hf.__file__).parent
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            kinds: set[str] = set()
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance"
            ):
                kinds = _names(node.args[1]) & HEAD_KINDS
            elif isinstance(node, ast.match_case):
                kinds = _names(node.pattern) & HEAD_KINDS
            if kinds:
                line = node.pattern.lineno if isinstance(node, ast.match_case) else node.lineno
                found.append(f"{path.relative_to(root)}:{line} {sorted(kinds)}")
    assert not found, f"head-kind tests: {found}"


def _family():
    return as_family(ScratchModelConfig.model_validate({"config": TINY}).config)


def test_one_head_is_the_one_element_case_of_several() -> None:
    torch.manual_seed(0)
    one = DecoderModel(_family(), LanguageModelHeadSpec(), attention_backend="eager")
    one.reset_parameters()
    several = DecoderModel(_family(), [LanguageModelHeadSpec()], attention_backend="eager")
    several.load_state_dict(one.state_dict())
    assert one.state_dict().keys() == several.state_dict().keys()
    ids = torch.randint(1, 64, (2, 6))
    inputs = DecoderInputs(input_ids=ids, labels=causal_lm_targets(ids))
    with torch.no_grad():
        out_one, out_several = one(inputs), several(inputs)
    assert isinstance(out_one, torch.Tensor) and isinstance(out_several, dict)
    torch.testing.assert_close(out_several["lm"], out_one)


@dataclass(kw_only=True, frozen=True)
class _MeanScore:
    """A head d9d-hf does not ship: one score per row from mean-pooled hidden states, saved beside
    the export as its own file."""

    name: str = "quality"

    @property
    def module_path(self) -> str:
        return "quality_head"

    @property
    def transformers_head(self) -> None:
        return None

    def build(self, spec: DecoderSpec) -> nn.Module:
        return nn.Linear(spec.hidden_size, 1)

    def hf_tensors(self, prefix: str, spec: DecoderSpec) -> list[tuple[str, str]]:
        return []

    def exported_state(self, spec: DecoderSpec) -> list[str]:
        return ["quality_head.weight", "quality_head.bias"]

    def loads_from(self, names: Collection[str], spec: DecoderSpec) -> bool:
        return False

    def saved_file(
        self, checkpoint: SafetensorsCheckpoint, spec: DecoderSpec
    ) -> SafetensorsCheckpoint | None:
        return None

    def export_files(self, module: nn.Module, spec: DecoderSpec) -> dict[str, bytes]:
        return {"quality.txt": str(len(module.state_dict())).encode()}

    def ties_embedding(self, spec: DecoderSpec) -> bool:
        return False

    def tie(self, module: nn.Module, embedding: nn.Module | None, spec: DecoderSpec) -> None:
        pass

    def reset(self, module: nn.Module) -> None:
        assert isinstance(module, nn.Linear)
        nn.init.zeros_(module.weight)
        nn.init.ones_(module.bias)

    def prepare(self, inputs: DecoderInputs, spec: DecoderSpec) -> DecoderInputs:
        return inputs

    def output(self, module: nn.Module, handoff: StageHandoff) -> torch.Tensor:
        return module(handoff["hidden_states"].mean(dim=1)).squeeze(-1)

    def with_auxiliary(
        self, output: torch.Tensor, auxiliary: torch.Tensor, handoff: StageHandoff
    ) -> torch.Tensor:
        return output + 0 * auxiliary


def test_a_head_written_outside_d9d_hf_loads_fresh_beside_a_checkpoint_and_exports_its_files(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    source = DecoderModel(_family(), SequenceClassificationHeadSpec(num_labels=3), attention_backend="eager")
    source.reset_parameters()
    save_pretrained(source, tmp_path / "source")
    model = DecoderModel(
        _family(), [SequenceClassificationHeadSpec(num_labels=3), _MeanScore()], attention_backend="eager"
    )
    load_weights(model, tmp_path / "source", show_progress=False)
    torch.testing.assert_close(
        model.state_dict()["score.classifier.weight"], source.state_dict()["score.classifier.weight"]
    )
    ids = torch.randint(1, 64, (2, 5))
    with torch.no_grad():
        outputs = model.outputs(ids)
    torch.testing.assert_close(outputs["score"], source.classify(ids))
    torch.testing.assert_close(outputs["quality"], torch.ones(2))  # its fresh rule: weight 0, bias 1
    assert head_files(model) == {"quality.txt": b"2"}
    save_pretrained(model, tmp_path / "export")
    assert (tmp_path / "export" / "quality.txt").read_bytes() == b"2"
    assert not any("quality" in name for name in SafetensorsCheckpoint(tmp_path / "export").specs)
