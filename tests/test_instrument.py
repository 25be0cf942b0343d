"""helpers.instrument: what the observer and the activation recorder see, against formulas, and
that torch.distributed is left as it was."""

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import all_reduce as imported_all_reduce

from helpers import WorkerError, run
from helpers.instrument import Observer, saved_activations, saved_bytes, saved_bytes_by_kind


def observed_worker(rank, world_size):
    with Observer() as observed:
        with observed.span("forward"):
            dist.all_reduce(torch.ones(1000))  # 4,000 bytes
        with observed.span("backward"):
            dist.all_gather_single(torch.empty(world_size * 10), torch.ones(10))
            dist.all_to_all_single(torch.empty(world_size * 3, 2), torch.ones(world_size * 3, 2))
    return {"calls": observed.calls(), "sent": observed.sent(), "seconds": observed.seconds(),
            "forward calls": observed.calls("forward"),
            "spans": [span.label for span in observed.spans],
            "received": [record.received for record in observed.records],
            "name": dist.all_reduce.__name__}


def test_the_observer_counts_calls_and_ring_bytes_by_span_and_times_them():
    for got in run(observed_worker, 4, show_output=False):
        assert got["calls"] == {"all_reduce": 1, "all_gather_single": 1, "all_to_all_single": 1}
        assert got["forward calls"] == {"all_reduce": 1}
        assert got["spans"] == ["forward", "backward"]
        assert got["sent"]["all_reduce"] == pytest.approx(2 * 3 / 4 * 4000)
        assert got["sent"]["all_gather_single"] == pytest.approx(3 / 4 * 4 * 40)
        # all-to-all: 4 pieces of 3 rows x 2 floats; the rank's own piece stays
        assert got["sent"]["all_to_all_single"] == 3 * 3 * 2 * 4
        assert got["received"][2] == 3 * 3 * 2 * 4
        assert got["seconds"]["all_reduce"] > 0
        assert got["name"] == "all_reduce"  # torch.distributed's own function again


def point_to_point_worker(rank, world_size):
    with Observer(point_to_point_worker) as observed:
        if rank == 0:
            dist.send(torch.ones(5), dst=1)
            work = imported_all_reduce(torch.ones(8), async_op=True)  # through this module
            time.sleep(0.01)
        else:
            dist.recv(torch.empty(5), src=0)
            work = imported_all_reduce(torch.ones(8), async_op=True)
        work.wait()
        time.sleep(0.01)  # the Work's future calls back on another thread
    return [(record.name, record.detail, record.sent, record.received, record.completed is not None)
            for record in observed.records]


def test_point_to_point_bytes_peers_async_completion_and_the_callers_own_references():
    first, second = run(point_to_point_worker, 2, show_output=False)
    ring = 2 * 1 / 2 * 8 * 4
    assert first == [("send", 1, 20, 0, True), ("all_reduce", None, ring, ring, True)]
    assert second == [("recv", 0, 0, 20, True), ("all_reduce", None, ring, ring, True)]


def futureless_worker(rank, world_size):
    """gloo's reduce-scatter returns a Work without a future, which copies its result into the
    output at every wait(): its completion is still seen, and the observer's own wait never
    overwrites what the caller did with the output after its wait."""
    received = torch.empty(2**18)
    with Observer() as observed:
        work = dist.reduce_scatter_single(received, torch.ones(world_size * 2**18),
                                          op=dist.ReduceOp.AVG, async_op=True)
        work.wait()  # returns after the observer's own wait, which noted the end
        completed = observed.records[0].completed
        received += 10  # the caller's use of its result
        time.sleep(0.05)
    return observed.records[0].launched, completed, received.unique().tolist()


def test_the_completion_of_an_async_collective_without_a_future_is_recorded():
    for launched, completed, values in run(futureless_worker, 2, show_output=False):
        assert completed is not None and completed > launched
        assert values == [11.0]


def raising_worker(rank, world_size):
    original = dist.all_reduce
    try:
        with Observer(raising_worker):
            raise RuntimeError("inside")
    except RuntimeError:
        pass
    assert dist.all_reduce is original, "the Observer left torch.distributed patched"
    assert imported_all_reduce is original, "the Observer left this module's reference patched"
    raise ValueError("the patch was restored")


def nested_observers_worker(rank, world_size):
    with Observer() as outer, Observer() as inner:
        dist.all_gather_into_tensor(torch.empty(world_size * 10), torch.ones(10))  # by position
    return [observed.sent() for observed in (outer, inner)]


def test_an_observer_inside_another_sees_what_the_outer_one_sees():
    for outer, inner in run(nested_observers_worker, 2, show_output=False):
        assert outer == inner == {"all_gather_into_tensor": pytest.approx(1 / 2 * 2 * 40)}


def test_the_observer_restores_torch_distributed_when_the_block_raises():
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


def test_saved_activations_sorts_what_is_kept_by_the_kind_classify_names():
    layer = nn.Linear(8, 8)
    inputs = torch.randn(4, 8, requires_grad=True)
    ids = torch.tensor([1, 2, 3, 0])

    def kind(tensor):  # the float tensors by their number of dimensions; the integer ones left out
        return None if not tensor.is_floating_point() else f"{tensor.dim()}-D"

    with saved_activations(layer, classify=kind) as saved:
        # Linear keeps its input (4 x 8); relu its output (4 x 8); indexing its indices (int64)
        # and nothing else; a sum of a 1-D slice keeps nothing
        layer(inputs).relu()[ids].sum().backward()
    assert saved_bytes_by_kind(saved) == {"2-D": 2 * 4 * 8 * 4}
    with saved_activations(layer) as everything:
        layer(inputs).relu()[ids].sum().backward()
    assert saved_bytes(everything) == 2 * 4 * 8 * 4 + 4 * 8  # the int64 indices too
