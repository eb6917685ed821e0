"""d9d kernels: fused Triton ops with PyTorch fallbacks, and layers built on them."""

__all__: list[str] = []
