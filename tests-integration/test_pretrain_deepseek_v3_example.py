"""The DeepSeek-V3 pre-training example's config: it builds the family it promises, on its mesh.

The training run itself is the Qwen3-MoE example's script on 4 ranks
(``test_pretrain_moe_example.py`` runs that script); here only what this config adds is checked,
in-process and without training.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from d9d.hf import DecoderCausalLM, HFModelProvider, ScratchModelConfig
from d9d.kernels.layers import GroupLimitedSelection, MoELayer, MultiHeadLatentAttention
from d9d.mesh import DistributedContext, MeshParameters

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pretrain-deepseek-v3"


def test_the_config_builds_a_deepseek_v3_with_the_readme_layers_and_balancing() -> None:
    raw = yaml.safe_load((EXAMPLE / "config.yaml").read_text())
    assert raw["mesh"] == {"pipeline_parallel": 2, "data_parallel_shard": 2, "expert_parallel": 2}
    model_config = ScratchModelConfig.model_validate(raw["model"])
    assert model_config.expert_bias_update_rate is not None  # the README's auxiliary-loss-free balancing
    context = DistributedContext(MeshParameters(), device_type="cpu")
    try:
        family = HFModelProvider(model_config).model_config(context)
    finally:
        context.close()
    spec = family.decoder_spec()
    assert (
        spec.checkpoint_expert_bias and spec.load_balancing_coefficient == 0.0
    )  # as transformers: no aux loss
    layers = DecoderCausalLM(family, attention_backend="eager").model.decoder_layers()
    assert all(isinstance(layer.self_attn, MultiHeadLatentAttention) for layer in layers)
    sparse = [layer.mlp for layer in layers if isinstance(layer.mlp, MoELayer)]
    assert len(sparse) == 3 and all(moe.shared_expert is not None for moe in sparse)  # one dense layer first
    assert sparse[0].router.selection == GroupLimitedSelection(num_groups=4, top_groups=2)
    assert "loss: first" in (EXAMPLE / "README.md").read_text()
