"""Runs the Triton kernels in Triton's CPU interpreter where no CUDA device is present.

Triton reads TRITON_INTERPRET when a kernel is decorated; d9d.kernels imports its kernel modules only
at the first Triton call, so setting the variable here (before any test runs) is early enough.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
