"""The quantization error of a 4-bit NF4 base: bitsandbytes (what d9d uses) against torchao.

Prints one table: for each library, the relative Frobenius error of the dequantized weights
(``||deq(Q(W)) - W||_F / ||W||_F`` over all projections together) and of the logits of a model
whose seven projections per layer hold the dequantized weights, against the model as loaded.
Both libraries at QLoRA's settings: blocks of 64 weights, double-quantized block scales.

    uv run python packages/d9d-loop/benchmarks/nf4_error.py              # a random Qwen3 (CPU)
    uv run python packages/d9d-loop/benchmarks/nf4_error.py --source DIR # a checkpoint (bf16)

The random model has Qwen3-0.6B's layer widths (hidden 1024, intermediate 3072) and 4 layers,
initialized as transformers does (normal, std 0.02). Needs bitsandbytes, torchao, transformers.
"""

from __future__ import annotations

import argparse
import copy
import re

import torch

PROJECTIONS = re.compile(r"(q|k|v|o|gate|up|down)_proj$")


def _bitsandbytes(weight: torch.Tensor) -> torch.Tensor:
    import bitsandbytes.functional as bnb

    packed, state = bnb.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    return bnb.dequantize_4bit(packed, state)


def _torchao(weight: torch.Tensor) -> torch.Tensor:
    from torchao.quantization import to_nf4

    return to_nf4(weight, 64, 256).get_original_weight()


def _model(source: str | None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if source is not None:
        return AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=4096,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    )
    return Qwen3ForCausalLM(config).to(torch.bfloat16)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=None, help="a transformers checkpoint directory")
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    reference = _model(args.source).eval()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, reference.config.vocab_size, (1, args.tokens), generator=generator)
    logits = reference(ids).logits
    print("| library | weights: relative error | logits: relative error |")
    print("|---|---|---|")
    for name, roundtrip in (("bitsandbytes", _bitsandbytes), ("torchao", _torchao)):
        model = copy.deepcopy(reference)
        error = norm = 0.0
        for module_name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and PROJECTIONS.search(module_name):
                weight = module.weight.data
                dequantized = roundtrip(weight).to(weight.dtype)
                error += float((dequantized.float() - weight.float()).square().sum())
                norm += float(weight.float().square().sum())
                module.weight.data = dequantized
        print(f"| {name} | {(error / norm) ** 0.5:.5f} | {_relative(model(ids).logits, logits):.5f} |")


if __name__ == "__main__":
    main()
