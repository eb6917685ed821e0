"""Warms up meta-device ops in the parent process.

The executors find stage output shapes with a forward on the meta device; torch imports its meta
kernels (hundreds of modules, seconds) on the first such op. Doing it once here means every rank
forked by ``run_distributed`` starts with them loaded.
"""

import torch

torch.nn.functional.linear(torch.empty(2, 3, device="meta"), torch.empty(4, 3, device="meta")).tanh().mean()
