"""Triton kernels wrapped as ``torch.library`` custom ops with autograd.

The ``*_op.py`` modules register the custom ops and import nothing from Triton at import time; the
``*_kernels.py`` modules hold the ``@triton.jit`` kernels and are imported only when a kernel runs.
"""
