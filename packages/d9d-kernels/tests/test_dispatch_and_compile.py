"""Backend dispatch, import without Triton, and tracing of the custom ops by torch.compile."""

import subprocess
import sys

import pytest
import torch

from d9d.kernels import KernelBackend, apply_rope, linear_cross_entropy, rms_norm, swiglu

from ._compare import DEVICES


def test_import_loads_no_triton_and_cpu_runs_reference() -> None:
    # The kernel modules (the only ones importing triton) load at the first Triton call.
    code = (
        "import sys, torch, d9d.kernels as k\n"
        "y = k.rms_norm(torch.ones(2, 4), torch.ones(4))\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "print(round(float(y.sum()), 3))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "8.0"


def test_forcing_triton_on_cpu_without_interpreter_names_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="swiglu: backend=triton needs CUDA tensors"):
        swiglu(torch.ones(3), torch.ones(3), backend=KernelBackend.TRITON)


def test_auto_runs_reference_on_cpu() -> None:
    # AUTO on CPU tensors is the reference, which also differentiates cos / sin
    x, angles = torch.randn(1, 3, 2, 4), torch.randn(1, 3, 4, requires_grad=True)
    out = apply_rope(x, angles.cos(), angles.sin())
    out.sum().backward()
    assert angles.grad is not None


@pytest.mark.parametrize("device", DEVICES)
def test_custom_ops_trace_in_one_graph(device: str) -> None:
    # aot_eager traces through the fake implementations and the registered autograd with no C++
    # compiler; fullgraph=True fails on any graph break around the ops.
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, device=device, requires_grad=True)
    w = torch.randn(16, device=device, requires_grad=True)
    head = torch.randn(50, 16, device=device, requires_grad=True)
    labels = torch.randint(0, 50, (15,), device=device)
    triton = KernelBackend.TRITON

    def model(x: torch.Tensor, w: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, w, backend=triton)
        h = swiglu(h, h * 2, backend=triton).reshape(15, 16)
        return linear_cross_entropy(h, head, labels, backend=triton)

    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    eager_loss = model(x, w, head)
    eager_grads = torch.autograd.grad(eager_loss, (x, w, head))
    compiled_loss = compiled(x, w, head)
    compiled_grads = torch.autograd.grad(compiled_loss, (x, w, head))
    torch.testing.assert_close(compiled_loss, eager_loss)
    for got, expected in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, expected)


def test_auto_under_compile_leaves_fusible_ops_to_inductor(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without tensor arguments AUTO reduces to "is Triton there": the rule under test is the
    # compile switch alone, which must send fusible ops (norms, SwiGLU, RoPE) to the reference.
    from d9d.kernels._backend import triton_installed, use_triton

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert use_triton(KernelBackend.AUTO, "rms_norm", fusible=True) is False
    assert use_triton(KernelBackend.AUTO, "grouped_mm") is True
    assert use_triton(KernelBackend.TRITON, "rms_norm", fusible=True) is True
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert use_triton(KernelBackend.AUTO, "rms_norm", fusible=True) is triton_installed()
