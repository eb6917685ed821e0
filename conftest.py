"""Repository-wide pytest setup.

Where no CUDA device is present, Triton kernels run in Triton's CPU interpreter. Triton reads
``TRITON_INTERPRET`` when a function is decorated, so it must be set before any test module
imports Triton (some packages' tests import libraries that import it); d9d-kernels' own
conftest does the same for its tests run alone.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
