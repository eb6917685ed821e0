"""Auxiliary-loss-free balancing turned on after construction, counting training tokens only."""

import torch

from d9d.kernels.layers import MoELayer


def test_enabled_bias_counts_training_tokens_and_moves_towards_the_mean() -> None:
    torch.manual_seed(0)
    with torch.device("meta"):
        layer = MoELayer(8, 4, 2, 16)
        layer.router.enable_expert_bias()
    assert layer.router.expert_bias is not None and layer.router.expert_bias.device.type == "meta"
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    assert "router.expert_bias" in layer.state_dict()  # persistent: checkpointed with the model
    tokens = torch.randn(5, 8)
    layer.eval()
    layer(tokens)
    assert layer.tokens_per_expert.sum() == 0  # evaluation forwards leave the balance alone
    layer.train()
    layer(tokens)
    counts = layer.tokens_per_expert.clone()
    assert counts.sum() == 5 * 2
    layer.update_expert_bias(0.1)
    expected = 0.1 * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(layer.router.expert_bias, expected)
    assert layer.tokens_per_expert.sum() == 0
