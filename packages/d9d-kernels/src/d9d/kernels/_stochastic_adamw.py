"""AdamW for bf16 parameters with stochastic rounding."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any, cast, overload

import torch
from torch.distributed.tensor import DTensor

from d9d.kernels._backend import KernelBackend
from d9d.kernels._host_state import HostStateOffload, HostStateStreamer, StreamedOperands
from d9d.kernels._stochastic_rounding import adamw_step_stochastic_multi_, draw_seeds


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _advance_steps(steps: list[torch.Tensor]) -> list[int]:
    """Adds one to every step counter and returns the new counts, in a few ops for all of them.

    A per-parameter ``+= 1`` and ``.item()`` cost two dispatches each: for the 504 adapters of an
    8B LoRA that was about 20 ms of host time per step with the device idle.
    """
    if not steps:
        return []
    torch._foreach_add_(steps, 1.0)  # pyright: ignore[reportPrivateUsage]
    counts = cast(list[float], torch.stack(steps).tolist())
    return [int(n) for n in counts]


def _host_zeros_like(param: torch.Tensor, dtype: torch.dtype | None, *, pin: bool) -> torch.Tensor:
    """Zeros shaped like ``param``'s local shard in host memory; a DTensor of the same layout for one."""
    local = _local(param)
    host = torch.zeros(local.shape, dtype=dtype or param.dtype, device="cpu", pin_memory=pin)
    if isinstance(param, DTensor):
        return DTensor.from_local(
            host,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return host


class StochasticAdamW(torch.optim.Optimizer):
    """AdamW whose update of bf16 parameters (and bf16 moments) uses stochastic rounding.

    Training directly in bf16 loses every update smaller than half a bf16 step when rounding to
    nearest; stochastic rounding keeps them in expectation, which lets bf16 parameters train without
    an fp32 master copy. On CUDA one fused kernel updates every parameter of a group that shares
    a step count and dtypes (``adamw_step_stochastic_multi_``).

    State per parameter: ``step`` (a CPU fp32 scalar tensor), ``exp_avg`` and ``exp_avg_sq`` (shaped
    like the parameter, of ``state_dtype`` or the parameter's dtype). DTensor parameters are updated
    through their local shards.

    With ``offload``, the moments of every parameter are allocated at construction in host memory
    (pinned when the parameters are on CUDA; those of the first parameters up to
    ``offload.resident_bytes`` stay on the device) and each step streams them through the device in
    chunks: copied in, stepped by the same fused kernel, copied back, with the copies of
    neighbouring chunks overlapping the step of the current one. The device then holds the
    parameters, the gradients and two chunks of moments instead of all moments. The result is the
    on-device step's, bit for bit, except for a parameter larger than a chunk, which is stepped in
    slices: its rounding noise is then drawn per slice (the same distribution, other bits).
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        state_dtype: torch.dtype | None = None,
        backend: KernelBackend = KernelBackend.AUTO,
        offload: HostStateOffload | None = None,
    ) -> None:
        """Creates the optimizer.

        Args:
            params: Parameters or parameter groups.
            lr: Learning rate.
            betas: Decays of the first and second moments.
            eps: Added to the bias-corrected root of the second moment.
            weight_decay: Decoupled weight decay.
            state_dtype: Dtype of the moments (bf16 or fp32); the parameter's dtype when None.
            backend: Which implementation of the step runs.
            offload: Keep the moments in host memory and stream them through the device each step;
                on the device when None.

        Raises:
            ValueError: A hyperparameter is out of range, or the offloaded moments need more host
                memory than is available (checked before any is allocated).
        """
        if lr < 0.0:
            raise ValueError(f"StochasticAdamW: lr={lr} must be >= 0")
        if state_dtype not in (None, torch.bfloat16, torch.float32):
            raise ValueError(f"StochasticAdamW: state_dtype={state_dtype} is not bf16, fp32 or None")
        defaults: dict[str, Any] = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self._state_dtype = state_dtype
        self._backend = backend
        self._gradient_scale: torch.Tensor | None = None
        self._streamer: HostStateStreamer | None = None
        self._resident: set[int] = set()  # ids of the parameters whose offloaded moments stay on the device
        if offload is not None:
            self._streamer = self._offload_state(offload)

    def _offload_state(self, offload: HostStateOffload) -> HostStateStreamer:
        """Allocates the moments: the first ``resident_bytes`` on the device, the rest on the host.

        The host part is checked against the host's free memory before any of it is allocated.
        """
        params: list[torch.Tensor] = list(chain.from_iterable(g["params"] for g in self.param_groups))
        devices = {_local(p).device for p in params}
        if len(devices) != 1:
            raise ValueError(
                f"StochasticAdamW(offload=...): parameters on several devices {sorted(map(str, devices))}"
            )
        device = devices.pop()
        sizes = [2 * _local(p).numel() * (self._state_dtype or p.dtype).itemsize for p in params]
        resident, kept = [False] * len(params), 0
        for index, size in enumerate(sizes):
            if kept + size <= offload.resident_bytes:
                resident[index], kept = True, kept + size
        offload.check_fits(sum(sizes) - kept, what="StochasticAdamW")
        for param, on_device in zip(params, resident, strict=True):
            moments = [
                torch.zeros_like(param, dtype=self._state_dtype or param.dtype)
                if on_device
                else _host_zeros_like(param, self._state_dtype, pin=device.type == "cuda")
                for _ in range(2)
            ]
            if on_device:
                self._resident.add(id(param))
            self.state[param] = {"step": torch.tensor(0.0), "exp_avg": moments[0], "exp_avg_sq": moments[1]}
        return HostStateStreamer(device=device, chunk_bytes=offload.chunk_bytes)

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Performs one optimization step over every parameter that has a gradient."""
        loss: float | None = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step(self._gradient_scale)
        return loss

    def step_with_gradient_scale(self, scale: torch.Tensor) -> None:
        """One step as if every gradient were first multiplied by ``scale``; gradients stay as they are.

        The factor (e.g. a gradient-clipping coefficient, a one-element tensor on the parameters'
        device, never read on the host) is applied inside the kernel that reads the gradients, which
        saves a whole pass over them. Runs through ``step()``, so step hooks and an LR scheduler's
        step tracking see it as a step.
        """
        self._gradient_scale = scale
        try:
            self.step()
        finally:
            self._gradient_scale = None

    def _step(self, scale: torch.Tensor | None) -> None:
        for group in self.param_groups:
            stepped = [param for param in group["params"] if param.grad is not None]
            for param in stepped:
                state = self.state[param]
                if not state:
                    dtype = self._state_dtype or param.dtype
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, dtype=dtype)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=dtype)
            # One launch per (step, device, dtypes): parameters that missed steps lag behind.
            buckets: dict[tuple[Any, ...], list[tuple[torch.Tensor, ...]]] = defaultdict(list)
            resident: dict[tuple[Any, ...], list[bool]] = defaultdict(list)
            for param, step in zip(
                stepped, _advance_steps([self.state[p]["step"] for p in stepped]), strict=True
            ):
                state = self.state[param]
                operands = tuple(
                    _local(t) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])
                )
                key = (step, operands[0].device, *(t.dtype for t in operands))
                buckets[key].append(operands)
                resident[key].append(id(param) in self._resident)
            for key, members in buckets.items():
                self._step_bucket(group, key, members, resident[key], scale)

    def _step_bucket(
        self,
        group: dict[str, Any],
        key: tuple[Any, ...],
        members: list[tuple[torch.Tensor, ...]],
        resident: list[bool],
        scale: torch.Tensor | None,
    ) -> None:
        """One fused launch over a bucket, or one per chunk when the moments are on the host."""
        beta1, beta2 = group["betas"]
        grad_scale = None if scale is None else scale.to(key[1])

        def run(
            params: list[torch.Tensor],
            grads: list[torch.Tensor],
            exp_avgs: list[torch.Tensor],
            exp_avg_sqs: list[torch.Tensor],
            seeds: list[int],
        ) -> None:
            adamw_step_stochastic_multi_(
                params, grads, exp_avgs, exp_avg_sqs, lr=group["lr"], beta1=beta1, beta2=beta2,
                eps=group["eps"], weight_decay=group["weight_decay"], step=key[0], seeds=seeds,
                grad_scale=grad_scale, backend=self._backend,
            )  # fmt: skip

        seeds = draw_seeds(len(members))
        if self._streamer is None:
            params, grads, exp_avgs, exp_avg_sqs = (list(column) for column in zip(*members, strict=True))
            run(params, grads, exp_avgs, exp_avg_sqs, seeds)
            return
        # The resident moments step first, while the first streamed chunk is being copied in.
        on_device = [member for member, kept in zip(members, resident, strict=True) if kept]
        if on_device:
            params, grads, exp_avgs, exp_avg_sqs = (list(column) for column in zip(*on_device, strict=True))
            run(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                [s for s, kept in zip(seeds, resident, strict=True) if kept],
            )
        self._streamer.step(
            [
                StreamedOperands(param=p, grad=g, exp_avg=m, exp_avg_sq=v, seed=seed)
                for (p, g, m, v), seed, kept in zip(members, seeds, resident, strict=True)
                if not kept
            ],
            run,
        )

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state; offloaded moments are read once their last copies have landed."""
        if self._streamer is not None:
            self._streamer.wait()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state saved by ``state_dict``; offloaded moments are copied into their host buffers.

        torch's loader would move every moment to its parameter's device (all of them at once, the
        memory offloading saves); with ``offload`` the groups load through it and the moments are
        copied here instead. A parameter the saved state does not hold starts afresh.
        """
        if self._streamer is None:
            super().load_state_dict(state_dict)
            return
        self._streamer.wait()
        held = dict(self.state)
        super().load_state_dict({**state_dict, "state": {}})
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        saved_state: dict[Any, dict[str, Any]] = state_dict["state"]
        for saved_id, param in zip(saved_ids, params, strict=True):
            state = held[param]
            saved = saved_state.get(saved_id)
            for name in ("exp_avg", "exp_avg_sq"):
                if saved is None:
                    _local(state[name]).zero_()
                elif saved[name] is not state[name]:
                    _local(state[name]).copy_(_local(saved[name]))
            state["step"] = torch.tensor(0.0 if saved is None else float(saved["step"]))
            self.state[param] = state
