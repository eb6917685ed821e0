"""Every family against transformers and against itself on every mesh, from one list (``FAMILIES``).

Per family, from a tiny random transformers checkpoint (no download): the same logits, loss and
gradients as transformers (the padding row's gradient zero, as with its ``padding_idx``); a round
trip that transformers loads with the same logits; LoRA whose merged export transformers loads;
and each parallelism (FSDP, TP, PP, CP; EP for experts) training to the single-process losses
and gradient norms. A new family joins by adding a ``FamilyCase`` to ``FAMILIES``.
"""

from __future__ import annotations

import json
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import d9d.hf
from d9d.hf import (
    DecoderModel,
    HFModelProvider,
    PretrainedModelConfig,
    TokenBatch,
    TokenSample,
    causal_lm_targets,
    causal_lm_task,
)
from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    ForwardBackwardFinished,
    OptimizerStepFinished,
    ProjectConfig,
    TrainingConfigurator,
)
from d9d.mesh.testing import run_distributed

TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "pad_token_id": 0,  # transformers' embedding then has padding_idx=0: that row gets no gradient
}

LAYOUTS: dict[str, dict[str, int]] = {
    "fsdp": {"data_parallel_shard": 2},
    "tp": {"tensor_parallel": 2},  # with sequence parallelism
    "pp": {"pipeline_parallel": 2},
    "cp": {"context_parallel_shard": 2},  # packed rows, load-balanced halves
    "ep": {"expert_parallel": 2, "data_parallel_shard": 2},
}
"""Two-rank meshes, each checked against one process."""


@dataclass(frozen=True)
class FamilyCase:
    """One family (or variant) under test.

    Attributes:
        name: The test id.
        build: A random transformers ``*ForCausalLM`` from a tiny config (no download).
        layouts: The ``LAYOUTS`` it trains on (tensor parallelism refuses MoE layers and tied
            embeddings: those take expert parallelism or none).
    """

    name: str
    build: Callable[[], nn.Module]
    layouts: tuple[str, ...] = field(default=("fsdp", "tp", "pp", "cp"))


def _qwen3() -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **TINY,
        head_dim=16,
        attention_bias=True,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,  # layer 1 slides
    )
    return Qwen3ForCausalLM(config)


def _qwen3_moe() -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **TINY,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        router_aux_loss_coef=0.0,  # test_equivalence checks the load-balancing loss itself
    )
    return Qwen3MoeForCausalLM(config)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
        "rope_theta": 500000.0,
    }
    return LlamaForCausalLM(LlamaConfig(**TINY, rope_parameters=rope, max_position_embeddings=64))


def _llama_tied() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True, head_dim=16))


def _qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    return Qwen2ForCausalLM(config)


def _mistral() -> nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**TINY, head_dim=16, sliding_window=4))


def _olmo2() -> nn.Module:
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return Olmo2ForCausalLM(Olmo2Config(**TINY, attention_bias=True))


def _granite() -> nn.Module:
    from transformers import GraniteConfig, GraniteForCausalLM

    multipliers = {
        "embedding_multiplier": 12.0,
        "attention_multiplier": 0.3,
        "residual_multiplier": 0.22,
        "logits_scaling": 4.0,
    }
    return GraniteForCausalLM(GraniteConfig(**TINY, **multipliers, attention_bias=True))


def _phi3() -> nn.Module:
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(Phi3Config(**TINY, sliding_window=4))


def _phi3_longrope() -> nn.Module:
    """Phi-3-mini-128k's LongRoPE at a tiny scale: the tests' 12- and 16-token rows run past the
    original context (8), so the long factors rotate them (and the extension factor, 4, sets the
    attention factor)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    planes = TINY["hidden_size"] // TINY["num_attention_heads"] // 2
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(planes)],
        "long_factor": [1.0 + 2.5 * i for i in range(planes)],
    }
    config = Phi3Config(
        **TINY, max_position_embeddings=32, original_max_position_embeddings=8, rope_parameters=rope
    )
    return Phi3ForCausalLM(config)


def _phi4_mini() -> nn.Module:
    """Phi-4-mini's shape of Phi-3: LongRoPE over the leading three quarters of each head, the
    rest passed through, a tied head."""
    from transformers import Phi3Config, Phi3ForCausalLM

    planes = TINY["hidden_size"] // TINY["num_attention_heads"] * 3 // 4 // 2
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.2 * i for i in range(planes)],
        "long_factor": [1.0 + 3.0 * i for i in range(planes)],
    }
    config = Phi3Config(
        **TINY,
        max_position_embeddings=64,
        original_max_position_embeddings=8,
        rope_parameters=rope,
        tie_word_embeddings=True,
    )
    return Phi3ForCausalLM(config)


def _gemma3(*, tied: bool = True) -> nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    rope = {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
    }
    config = Gemma3TextConfig(
        **TINY,
        head_dim=16,
        query_pre_attn_scalar=8,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=rope,
        tie_word_embeddings=tied,
    )
    return Gemma3ForCausalLM(config)


def _deepseek_v3() -> nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        **{**TINY, "num_key_value_heads": TINY["num_attention_heads"]},  # MLA: keys and values per head
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,  # group-limited: one group of two experts kept per token
        topk_group=1,
        n_shared_experts=2,
        first_k_dense_replace=1,  # layer 0 dense, layer 1 sparse
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,  # narrower than q/k (24): zero-padded in d9d
    )
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():  # a selection bias that changes which experts win (a buffer: set here)
        model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    return model


def _gpt_oss() -> nn.Module:
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        **TINY,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,  # layer 0 slides, layer 1 attends fully (transformers' default layer_types)
        swiglu_limit=1.0,  # low, so the clamps bite on these random weights
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return GptOssForCausalLM(config)


FAMILIES = [
    FamilyCase("qwen3", _qwen3),  # q/k norms, q/k/v/o biases, a sliding layer
    FamilyCase("qwen3_moe", _qwen3_moe, layouts=("fsdp", "ep", "pp", "cp")),  # stacked experts
    FamilyCase("llama", _llama),  # llama3 rope scaling (Llama 3.1), untied head
    FamilyCase("llama_tied", _llama_tied, layouts=("fsdp", "pp", "cp")),  # Llama 3.2: tied head
    FamilyCase("qwen2", _qwen2),  # q/k/v biases without an o bias, a sliding layer
    FamilyCase("mistral", _mistral),  # a sliding window on every layer
    FamilyCase("granite", _granite),  # embedding, score, residual and logits multipliers
    # post-norms, q/k norms over all heads (which tensor parallelism cannot split: refused)
    FamilyCase("olmo2", _olmo2, layouts=("fsdp", "pp", "cp")),
    FamilyCase("phi3", _phi3),  # fused qkv_proj and gate_up_proj in the checkpoint, a sliding window
    # LongRoPE (the 128k files), past its original context; context parallelism refused
    FamilyCase("phi3_longrope", _phi3_longrope, layouts=("pp",)),
    FamilyCase("phi4_mini", _phi4_mini, layouts=("fsdp",)),  # partial rotary, LongRoPE, tied head
    # local (sliding, own rope base) and global (linear-scaled rope) layers, four 1+w norms, GeGLU, tied head
    FamilyCase("gemma3", _gemma3, layouts=("fsdp", "pp", "cp")),
    FamilyCase("gemma3_untied", lambda: _gemma3(tied=False), layouts=("tp",)),  # Gemma 3's TP plan
    # attention sinks (no context-parallel backend has them), q/k/v/o biases, sliding then full
    # attention, biased router and experts (interleaved gate_up_proj), clamped SwiGLU; TP refused
    FamilyCase("gpt_oss", _gpt_oss, layouts=("fsdp", "ep", "pp")),
    # MLA (q/kv low rank, interleaved rope), a dense layer then sigmoid group-limited routing with
    # the checkpoint's selection bias and shared experts; TP refused (experts take EP)
    FamilyCase("deepseek_v3", _deepseek_v3, layouts=("fsdp", "ep", "pp", "cp")),
]


def save_checkpoint(case: FamilyCase, directory: Path) -> Path:
    """Writes ``case``'s random model (norms and biases away from their init) with transformers."""
    torch.manual_seed(0)
    model: Any = case.build()
    with torch.no_grad():  # non-trivial norms and biases, so a swapped tensor shows
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.copy_(1.0 + 0.1 * torch.randn_like(parameter))
    model.save_pretrained(directory)
    return directory


SEQ = 16
STEPS = 2
PROBE = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(7))


class _Tokens:
    """8 rows of 16 tokens with pad tokens (id 0) among them; odd rows pack two documents."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 16, (8, SEQ), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> TokenSample:
        ids = self.ids[index]
        documents = (
            torch.tensor([0] * 6 + [1] * (SEQ - 6)) if index % 2 else torch.zeros(SEQ, dtype=torch.int64)
        )
        return TokenSample(input_ids=ids, labels=ids.clone(), document_ids=documents)


def _train(
    directory: Path, mesh: dict[str, int], export: Path | None = None, peft: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Trains ``STEPS`` steps (fp32, eager attention); losses, gradient norms, one process's logits."""
    config = ProjectConfig.model_validate(
        {
            "mesh": mesh,
            "trainer": {
                "max_steps": STEPS,
                "global_batch_size": 4,
                "microbatch_size": 2,
                "logging": {"progress_bar": False},
                "device": "cpu",
                **({} if peft is None else {"peft": peft}),
            },
            "data": {"shuffle": False},
            "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.0},
        }
    )
    losses: list[float] = []
    grad_norms: list[float] = []
    model_config = PretrainedModelConfig(source=str(directory), attention_backend="eager")
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=HFModelProvider(model_config),
        task_provider=causal_lm_task,
        data_provider=AutoDataProvider(
            dataset_factory=lambda _: _Tokens(), collator=TokenBatch.collate, config=config.data
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    result: dict[str, Any] = {"losses": losses, "grad_norms": grad_norms}
    with trainer:
        trainer.events.subscribe(ForwardBackwardFinished, lambda event: losses.append(event.loss))
        trainer.events.subscribe(OptimizerStepFinished, lambda event: grad_norms.append(event.grad_norm))
        trainer.train()
        if export is not None:
            trainer.export(export)
        if mesh == {}:
            model = trainer.model_stages[0]
            assert isinstance(model, DecoderModel) and model.export_head == "causal_lm"
            with torch.no_grad():
                result["logits"] = model.eval().logits(PROBE)
    return result


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> directory of the family's tiny checkpoint."""
    root = tmp_path_factory.mktemp("families")
    return {case.name: save_checkpoint(case, root / case.name) for case in FAMILIES}


LORA = {"kind": "lora", "target": r"q_proj|v_proj|o_proj", "r": 4, "alpha": 8.0}


def _train_single(directory: Path, export: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """One process: the full-weight reference run, then the LoRA run that exports to ``export``."""
    return _train(directory, {}), _train(directory, {}, export, LORA)


def _train_layouts(directory: Path, layouts: tuple[str, ...]) -> dict[str, dict[str, Any] | str]:
    """Each of ``layouts`` trained in turn in this world; a layout that raised gives its traceback."""
    results: dict[str, dict[str, Any] | str] = {}
    for layout in layouts:
        try:
            results[layout] = _train(directory, LAYOUTS[layout])
        except Exception:
            results[layout] = traceback.format_exc()
    return results


def _world_size(mesh: dict[str, int]) -> int:
    # expert parallelism splits the data-parallel ranks: it adds none
    return math.prod(size for dim, size in mesh.items() if dim != "expert_parallel")


@dataclass(frozen=True)
class SingleProcessRuns:
    """A family's one-process runs.

    Attributes:
        reference: ``_train``'s result without a mesh (losses, gradient norms, logits).
        lora: The LoRA run's result and the directory of its merged export.
    """

    reference: dict[str, Any]
    lora: tuple[dict[str, Any], Path]


class FamilyRuns:
    """Each family's training runs, made on first use and kept for the module.

    A family's one-process runs share one process, and all its layouts (two ranks each) share one
    two-rank world: each run still builds its own trainer and model from the checkpoint.
    """

    def __init__(self, checkpoints: dict[str, Path], root: Path) -> None:
        self._checkpoints = checkpoints
        self._root = root
        self._single: dict[str, SingleProcessRuns] = {}
        self._layouts: dict[str, list[dict[str, dict[str, Any] | str]]] = {}

    def single(self, case: FamilyCase) -> SingleProcessRuns:
        """The family's reference and LoRA runs."""
        if case.name not in self._single:
            export = self._root / case.name / "lora-export"
            directory = self._checkpoints[case.name]
            runs = run_distributed(_train_single, directory, export, world_size=1, timeout_s=360)
            reference, lora = runs[0]
            self._single[case.name] = SingleProcessRuns(reference=reference, lora=(lora, export))
        return self._single[case.name]

    def layout(self, case: FamilyCase, layout: str) -> list[dict[str, Any]]:
        """Every rank's ``_train`` result on ``layout``; fails naming a rank's traceback there."""
        if case.name not in self._layouts:
            (world_size,) = {_world_size(LAYOUTS[name]) for name in case.layouts}
            self._layouts[case.name] = run_distributed(
                _train_layouts,
                self._checkpoints[case.name],
                case.layouts,
                world_size=world_size,
                timeout_s=180 * len(case.layouts),
            )
        results: list[dict[str, Any]] = []
        for rank, outcome in enumerate(self._layouts[case.name]):
            result = outcome[layout]
            if isinstance(result, str):
                pytest.fail(f"{case.name} on {layout}, rank {rank}:\n{result}")
            results.append(result)
        return results


@pytest.fixture(scope="module")
def family_runs(family_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> FamilyRuns:
    """The families' training runs, shared by the LoRA and parallelism tests."""
    return FamilyRuns(family_checkpoints, tmp_path_factory.mktemp("family-runs"))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(7))
    ids[:, :3] = 0  # left padding: the pad id's embedding row gets no gradient in transformers
    labels = ids.clone()
    labels[:, :3] = -100
    return ids, labels


@pytest.mark.parametrize("case", FAMILIES, ids=lambda case: case.name)
def test_logits_loss_and_gradients_match_transformers(
    family_checkpoints: dict[str, Path], helpers: Any, case: FamilyCase
) -> None:
    directory = family_checkpoints[case.name]
    hf = helpers.hf_model(directory).train()
    model = d9d.hf.load_pretrained(directory).train()
    assert isinstance(model, DecoderModel) and model.export_head == "causal_lm"
    ids, labels = _batch()

    logits = hf(input_ids=ids).logits
    hf_loss = F.cross_entropy(logits[:, :-1].reshape(-1, 128), labels[:, 1:].reshape(-1), ignore_index=-100)
    hf_loss.backward()
    loss = model.loss(ids, causal_lm_targets(labels))
    loss.backward()

    torch.testing.assert_close(loss, hf_loss, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids), logits, atol=1e-5, rtol=1e-5)
    helpers.assert_same_gradients(helpers.d9d_gradients(model), helpers.hf_gradients(hf))
    embedding = model.model.embed_tokens
    assert embedding is not None and embedding.weight.grad is not None
    if not model.spec.tie_word_embeddings:  # (a tied row also gets the LM head's gradient)
        assert embedding.weight.grad[0].abs().max() == 0  # the pad row, though the batch holds pads


@pytest.mark.parametrize("case", FAMILIES, ids=lambda case: case.name)
def test_round_trip_loads_in_transformers_with_the_same_logits(
    family_checkpoints: dict[str, Path], helpers: Any, tmp_path: Path, case: FamilyCase
) -> None:
    directory = family_checkpoints[case.name]
    d9d.hf.save_pretrained(d9d.hf.load_pretrained(directory), tmp_path / "out")
    source, exported = helpers.hf_model(directory).eval(), helpers.hf_model(tmp_path / "out").eval()
    assert set(exported.state_dict()) == set(source.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(exported(PROBE).logits, source(PROBE).logits, atol=0, rtol=0)


@pytest.mark.parametrize("case", FAMILIES, ids=lambda case: case.name)
def test_lora_trains_and_its_merged_export_loads_in_transformers(
    family_runs: FamilyRuns, helpers: Any, case: FamilyCase
) -> None:
    result, export = family_runs.single(case).lora
    hf = helpers.hf_model(export).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(PROBE).logits, result["logits"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", FAMILIES, ids=lambda case: case.name)
def test_config_json_selects_the_family_from_source_and_from_scratch(
    family_checkpoints: dict[str, Path], case: FamilyCase
) -> None:
    directory = family_checkpoints[case.name]
    family = d9d.hf.read_decoder_config(directory)
    raw = json.loads((directory / "config.json").read_text())
    scratch = d9d.hf.ScratchModelConfig.model_validate({"config": raw})
    assert type(scratch.config) is type(family)
    assert scratch.config.decoder_spec() == family.decoder_spec()


@pytest.mark.parametrize(
    ("case", "layout"),
    [pytest.param(case, layout, id=f"{case.name}-{layout}") for case in FAMILIES for layout in case.layouts],
)
def test_parallelism_trains_to_the_single_process_losses(
    family_runs: FamilyRuns, case: FamilyCase, layout: str
) -> None:
    expected = family_runs.single(case).reference
    results = family_runs.layout(case, layout)
    assert len(expected["losses"]) == STEPS
    for result in results:
        torch.testing.assert_close(result["losses"], expected["losses"], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(result["grad_norms"], expected["grad_norms"], atol=1e-4, rtol=1e-4)


def test_every_family_case_names_known_layouts() -> None:
    assert all(set(case.layouts) <= LAYOUTS.keys() for case in FAMILIES)


def test_context_parallelism_refuses_longrope_on_every_rank(family_checkpoints: dict[str, Path]) -> None:
    """A cp rank would pick LongRoPE's factors from its own shard of the positions."""
    outcomes = run_distributed(
        _train_layouts, family_checkpoints["phi3_longrope"], ("cp",), world_size=2, timeout_s=180
    )
    for outcome in outcomes:
        assert "context_parallel > 1 with LongRopeScaling (Phi3Config's rope block)" in outcome["cp"]
