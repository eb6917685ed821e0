"""Step figures and metric states reach the device without a blocking host-to-device copy.

A copy from pageable host memory waits for every kernel queued on the stream, so one mid-step
would hold the host until the backward ran. On CUDA, sync debug mode checks that none happens;
on the CPU, meta tensors stand in for an accelerator's (reading one raises) to check that
device values are never read and land where they should.
"""

import pytest
import torch

from d9d.loop.metrics import Accuracy, WeightedMean
from d9d.loop.step._device_scalars import device_scalar
from d9d.loop.step._gradient_manager import all_reduce_sum_on_device
from d9d.loop.step._runner import MicrobatchTotals

META = torch.device("meta")


@pytest.mark.parametrize(
    "value",
    [
        3,  # a Python int
        2.5,  # a Python float
        torch.tensor(2.5),  # a CPU tensor, read on the host
        torch.tensor([7], dtype=torch.int64),  # one element of another dtype
    ],
)
def test_device_scalar_values(value: torch.Tensor | float) -> None:
    result = device_scalar(value, device=torch.device("cpu"), dtype=torch.float64)
    assert result.shape == () and result.dtype == torch.float64
    assert float(result) == float(value)


def test_device_scalar_keeps_accelerator_tensors_unread() -> None:
    on_device = torch.empty((1,), dtype=torch.float32, device=META)
    assert device_scalar(on_device, device=META, dtype=torch.float64).device == META
    assert device_scalar(4.0, device=META, dtype=torch.float32).device == META


def test_step_sums_and_weighted_loss_stay_on_the_device() -> None:
    totals = MicrobatchTotals()
    totals.add(torch.empty((), device=META), 3.0)  # a Python weight
    totals.add(torch.empty((), device=META), torch.empty((), device=META))
    loss = totals.weighted_loss(META)
    assert isinstance(loss, torch.Tensor) and loss.device == META
    sums = all_reduce_sum_on_device([loss, totals.weight, float(totals.microbatches), 12.0], None, META)
    assert sums.device == META and sums.shape == (4,)


def test_metric_states_follow_the_values_device() -> None:
    mean = WeightedMean()
    mean.update(torch.tensor([1.0, 3.0]), 2.0)
    mean.update(torch.tensor([5.0]), torch.tensor([4.0]))
    assert float(mean.compute()) == pytest.approx((2 * 4 + 4 * 5) / 8)
    on_device = WeightedMean()
    on_device.update(torch.empty((3,), device=META), 2.0)  # the scalar states become meta fills
    accuracy = Accuracy()
    accuracy.update(torch.tensor([0.9, 0.2, 0.7]), torch.tensor([1, 0, 0]))
    assert float(accuracy.compute()) == pytest.approx(2 / 3)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
def test_no_stream_synchronization_on_cuda() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    loss = torch.ones((), device=device)
    mean, accuracy = WeightedMean(), Accuracy()  # CPU states, moved to the device by the update
    # Inputs made before the check: a tensor built from a Python list is a blocking copy itself.
    preds, target = torch.tensor([0.9, 0.1], device=device), torch.tensor([1, 0], device=device)
    torch.cuda.set_sync_debug_mode("error")  # a blocking copy or read raises
    try:
        totals = MicrobatchTotals()
        totals.add(loss, 2.0)
        sums = all_reduce_sum_on_device([totals.weighted_loss(device), totals.weight, 1.0], None, device)
        mean.update(loss, 2.0)
        accuracy.update(preds, target)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert sums.tolist() == [2.0, 2.0, 1.0]
