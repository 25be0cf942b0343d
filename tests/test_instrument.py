"""helpers.instrument: what the counter and the activation recorder see, against formulas, and
that torch.distributed is left as it was."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers import WorkerError, run
from helpers.instrument import CommCounter, saved_activations, saved_bytes


def counted_worker(rank, world_size):
    with CommCounter() as counter:
        dist.all_reduce(torch.ones(1000))  # 4,000 bytes
        dist.all_gather_single(torch.empty(world_size * 10), torch.ones(10))
    return counter.calls, counter.sent, counter.seconds, dist.all_reduce.__name__


def test_the_counter_counts_calls_and_ring_bytes_and_times_them():
    for calls, sent, seconds, name in run(counted_worker, 4, show_output=False):
        assert calls == {"all_reduce": 1, "all_gather_single": 1, "reduce_scatter_single": 0}
        assert sent["all_reduce"] == pytest.approx(2 * 3 / 4 * 4000)
        assert sent["all_gather_single"] == pytest.approx(3 / 4 * 4 * 40)
        assert seconds["all_reduce"] > 0 and seconds["reduce_scatter_single"] == 0
        assert name == "all_reduce"  # torch.distributed's own function again


def raising_worker(rank, world_size):
    original = dist.all_reduce
    try:
        with CommCounter():
            raise RuntimeError("inside")
    except RuntimeError:
        pass
    assert dist.all_reduce is original, "CommCounter left torch.distributed patched"
    raise ValueError("the patch was restored")


def test_the_counter_restores_torch_distributed_when_the_block_raises():
    with pytest.raises(WorkerError, match="the patch was restored"):
        run(raising_worker, 1, show_output=False)


def test_saved_activations_counts_what_autograd_keeps_and_not_the_weights():
    layer = nn.Linear(8, 8)
    inputs = torch.randn(4, 8, requires_grad=True)
    with saved_activations(layer) as saved:
        layer(inputs).relu().sum().backward()
    # Linear keeps its input (4 x 8 floats); relu keeps its output (4 x 8 floats)
    assert saved_bytes(saved) == 2 * 4 * 8 * 4
    assert saved_bytes(saved + saved) == saved_bytes(saved)  # each storage once
