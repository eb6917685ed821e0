"""A family declares its tensor-parallel plan; without one it is refused under tp before a layer is built.

Before, the core applied Qwen3/Llama's layer plan to every family: a family whose layer has other
modules kept them unsplit and failed at step 0 with a shape error.
"""

from __future__ import annotations

import pytest

from d9d.hf import (
    DecoderLayer,
    DecoderTensorParallelPlan,
    HFModelProvider,
    LlamaConfig,
    MegatronDecoderPlan,
    Olmo2Config,
    Qwen2Config,
    Qwen3DenseConfig,
    ScratchModelConfig,
    build_decoder,
)
from d9d.hf._decoder import parallelize_decoder_tensor_parallel, tensor_parallel_plan_of
from d9d.kernels.layers import AttentionBackend, AttentionBackendName
from d9d.loop import InitializeModelStageContext
from d9d.mesh import DENSE_DOMAIN, DistributedContext, MeshParameters
from d9d.mesh.testing import run_distributed
from d9d.pipeline import PipelineStageInfo

_TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


class _LlamaWithoutPlan(LlamaConfig):
    """A family that declares no tensor-parallel plan (Llama's layers, its plan withheld)."""

    def tensor_parallel_plan(self) -> DecoderTensorParallelPlan | None:
        return None


class _LlamaWithoutPlanNeverBuilt(_LlamaWithoutPlan):
    """As above; building a layer fails the test: the refusal must come first."""

    def build_decoder_layer(
        self, index: int, *, attention_backend: AttentionBackend | AttentionBackendName | None
    ) -> DecoderLayer:
        raise AssertionError(f"layer {index} was built before the refusal")


@pytest.mark.parametrize(
    "family",
    [
        Qwen3DenseConfig(model_type="qwen3", head_dim=8, **_TINY),  # q/k norms ride along
        LlamaConfig(model_type="llama", **_TINY),
        Qwen2Config(model_type="qwen2", **_TINY),
    ],
)
def test_the_shipped_families_declare_megatrons_plan(
    family: LlamaConfig | Qwen2Config | Qwen3DenseConfig,
) -> None:
    assert isinstance(family.tensor_parallel_plan(), MegatronDecoderPlan)
    assert tensor_parallel_plan_of(family, tensor_parallel=2) is not None


@pytest.mark.parametrize(
    ("tensor_parallel", "refused"),
    [
        (1, False),  # nothing to split: a family without a plan trains as before
        (2, True),  # refused, naming the family
        (4, True),
    ],
)
def test_a_family_without_a_plan_is_refused_only_under_tensor_parallelism(
    tensor_parallel: int, refused: bool
) -> None:
    family = _LlamaWithoutPlan(model_type="llama", **_TINY)
    if not refused:
        assert tensor_parallel_plan_of(family, tensor_parallel=tensor_parallel) is None
        return
    with pytest.raises(
        ValueError, match=rf"model_type llama has no tensor-parallel plan.*tensor_parallel={tensor_parallel}"
    ):
        tensor_parallel_plan_of(family, tensor_parallel=tensor_parallel)


def _provider_refusal() -> str:
    context = DistributedContext(MeshParameters(tensor_parallel=2), device_type="cpu")
    provider = HFModelProvider(
        ScratchModelConfig(config=_LlamaWithoutPlanNeverBuilt(model_type="llama", **_TINY))
    )
    try:
        provider.initialize_model_stage(
            InitializeModelStageContext(
                dist_context=context, stage=PipelineStageInfo(current_stage=0, num_stages=1)
            )
        )
    except ValueError as e:
        return str(e)
    finally:
        context.close()
    return "not refused"


def test_the_provider_refuses_it_under_tensor_parallel_2_before_building_a_layer() -> None:
    for message in run_distributed(_provider_refusal, world_size=2):
        assert "model_type llama has no tensor-parallel plan" in message, message
        assert "mesh.tensor_parallel=2" in message


def _recipe_refusal() -> str:
    # the recipe refuses too (a user calling parallelize_decoder on a model built by hand)
    context = DistributedContext(MeshParameters(tensor_parallel=2), device_type="cpu")
    model = build_decoder(_LlamaWithoutPlan(model_type="llama", **_TINY), "causal_lm")
    try:
        parallelize_decoder_tensor_parallel(model, mesh=context.mesh_for(DENSE_DOMAIN)["tp"])
    except ValueError as e:
        return str(e)
    finally:
        context.close()
    return "not refused"


def test_the_recipe_refuses_a_model_of_such_a_family() -> None:
    for message in run_distributed(_recipe_refusal, world_size=2):
        assert "model_type llama has no tensor-parallel plan" in message, message


def _olmo2_provider_refusal() -> str:
    context = DistributedContext(MeshParameters(tensor_parallel=2), device_type="cpu")
    provider = HFModelProvider(ScratchModelConfig(config=Olmo2Config(model_type="olmo2", **_TINY)))
    try:
        provider.initialize_model_stage(
            InitializeModelStageContext(
                dist_context=context, stage=PipelineStageInfo(current_stage=0, num_stages=1)
            )
        )
    except ValueError as e:
        return str(e)
    finally:
        context.close()
    return "not refused"


def test_olmo2_refuses_tensor_parallelism_at_load_naming_the_family_and_the_reason() -> None:
    # its q/k norms span all heads: a rank's column slice of q_proj would be normalized alone
    family = Olmo2Config(model_type="olmo2", **_TINY)
    assert tensor_parallel_plan_of(family, tensor_parallel=1) is None  # trains as before without tp
    for message in run_distributed(_olmo2_provider_refusal, world_size=2):
        assert message.startswith("model_type olmo2 does not support mesh.tensor_parallel=2: "), message
        assert "q/k norms span all heads" in message


def test_megatrons_plan_refuses_a_layer_whose_qk_norms_span_all_heads() -> None:
    # OLMo 2's layer under a plan that would split its heads: refused, not silently wrong
    layer = Olmo2Config(model_type="olmo2", **_TINY).build_decoder_layer(0, attention_backend="eager")
    with pytest.raises(ValueError, match="q/k norms span all heads"):
        MegatronDecoderPlan().layer_styles(layer)
