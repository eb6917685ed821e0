"""d9d Hugging Face interop: Qwen3 models from config.json and safetensors checkpoints, and back."""

from d9d.hf._head import HeadName
from d9d.hf._hub import SNAPSHOT_PATTERNS, resolve_snapshot
from d9d.hf._pretrained import load_pretrained, save_pretrained
from d9d.hf._tied_embeddings import broadcast_tied_weight, sum_tied_gradients

__all__ = [
    "SNAPSHOT_PATTERNS",
    "HeadName",
    "broadcast_tied_weight",
    "load_pretrained",
    "resolve_snapshot",
    "save_pretrained",
    "sum_tied_gradients",
]
