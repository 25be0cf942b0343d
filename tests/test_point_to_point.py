"""Lesson 02 (helpers.point_to_point): workers and exercises, each against values computed here
without communication."""

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
import torch.distributed as dist
from checker import expect_rejection

from helpers import WorkerError, WorkerTimeout, run
from helpers.point_to_point import workers as p2p


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_chain_doubles_along_the_ranks(world_size):
    first_values = [1.0, -2.0, 0.5]
    out = run(p2p.chain_worker, world_size, args=(first_values,), show_output=False)
    start = torch.tensor(first_values)
    torch.testing.assert_close(out[0]["holds"], start)
    assert out[0]["received"] is None
    for rank in range(1, world_size):
        torch.testing.assert_close(out[rank]["received"], start * 2 ** (rank - 1))
        torch.testing.assert_close(out[rank]["holds"], start * 2**rank)


def test_receive_buffer_of_the_right_size_gets_the_data():
    out = run(p2p.receive_into_worker, 2, args=(4, 4, torch.float32), show_output=False)
    torch.testing.assert_close(out[1], torch.ones(4))


def test_too_large_receive_buffer_is_filled_silently():
    out = run(p2p.receive_into_worker, 2, args=(4, 8, torch.float32), show_output=False)
    torch.testing.assert_close(out[1], torch.tensor([1.0] * 4 + [0.0] * 4))


def test_too_small_receive_buffer_kills_the_receiver():
    with pytest.raises(WorkerError) as caught:
        run(p2p.receive_into_worker, 2, args=(4, 2, torch.float32), show_output=False)
    assert caught.value.rank == 1
    assert str(caught.value).startswith("rank 1 died from signal SIGABRT")
    assert "Received data size doesn't match expected size" in caught.value.traceback


@pytest.mark.parametrize("mode, labels", [
    ("compute alone", [["compute"], ["compute"]]),
    ("blocking", [["send", "compute"], ["recv", "compute"]]),
    ("overlapped", [["isend", "compute", "wait"], ["irecv", "compute", "wait"]]),
])
def test_overlap_timelines_record_each_step_in_order(mode, labels):
    out = run(p2p.overlap_worker, 2, args=(2**16, 2, mode), show_output=False)
    for rank, events in enumerate(out):
        assert [label for label, _, _ in events] == labels[rank]
        times = [t for _, start, end in events for t in (start, end)]
        assert times == sorted(times) and times[0] >= 0


def test_collectives_in_crossed_group_order_deadlock():
    with pytest.raises(WorkerTimeout) as caught:
        run(p2p.crossed_groups_worker, 2, timeout=2, show_output=False)
    for rank in range(2):
        assert caught.value.where[rank].startswith(
            "blocked in torch.distributed.all_reduce(), called from crossed_groups_worker")


def test_both_ranks_sending_first_deadlocks_in_send():
    with pytest.raises(WorkerTimeout) as caught:
        run(p2p.send_first_worker, 2, timeout=2, show_output=False)
    for rank in range(2):
        assert caught.value.where[rank].startswith(
            "blocked in torch.distributed.send(), called from send_first_worker at "
            '"helpers/point_to_point/workers.py"'
        )


def test_ordered_exchange_swaps_the_tensors():
    out = run(p2p.ordered_exchange_worker, 2, show_output=False)
    torch.testing.assert_close(out[0], torch.full((4,), 1.0))
    torch.testing.assert_close(out[1], torch.full((4,), 0.0))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_receives_from_the_left_neighbour(world_size):
    out = run(p2p.ring_worker, world_size, show_output=False)
    for rank in range(world_size):
        torch.testing.assert_close(out[rank], torch.full((2,), float((rank - 1) % world_size)))


def test_mismatched_collectives_hang_without_debug_and_fail_fast_with_detail():
    with pytest.raises(WorkerTimeout):
        run(p2p.mismatched_collectives_worker, 2, timeout=2, show_output=False)
    with pytest.raises(WorkerError, match="Detected mismatch between collectives"):
        run(p2p.mismatched_collectives_worker, 2, timeout=30, show_output=False,
            env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})


def test_monitored_barrier_names_the_late_rank():
    with pytest.raises(WorkerError) as caught:
        run(p2p.late_rank_worker, 3, args=(2, 1), timeout=30, show_output=False)
    assert caught.value.rank == 0
    assert "Rank 2 failed to pass monitoredBarrier in 1000 ms" in caught.value.message


# Typical wrong answers to the exercises, and what the checker says.


def broadcast_to_rank_one_only(rank, world_size, tensor):
    if rank == 0:
        dist.send(tensor, dst=1)
    else:
        dist.recv(tensor, src=0)
    return tensor


def return_without_communicating(rank, world_size, tensor):
    return tensor


def blocking_send_first(rank, world_size, tensor):  # ring_shift that deadlocks
    received = torch.empty_like(tensor)
    dist.send(tensor, dst=(rank + 1) % world_size)
    dist.recv(received, src=(rank - 1) % world_size)
    return received


def shift_the_wrong_way(rank, world_size, tensor):
    received = torch.empty_like(tensor)
    requests = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, tensor, (rank - 1) % world_size),
        dist.P2POp(dist.irecv, received, (rank + 1) % world_size),
    ])
    for request in requests:
        request.wait()
    return received


def broadcast_with_a_collective(rank, world_size, tensor):
    dist.broadcast(tensor, src=0)
    return tensor


def linear_broadcast(rank, world_size, tensor):  # tree_broadcast: rank 0 sends to everyone
    if rank == 0:
        for other in range(1, world_size):
            dist.send(tensor, dst=other)
    else:
        dist.recv(tensor, src=0)
    return tensor


def chain_broadcast(rank, world_size, tensor):  # one send per rank, but n - 1 rounds
    if rank > 0:
        dist.recv(tensor, src=rank - 1)
    if rank < world_size - 1:
        dist.send(tensor, dst=rank + 1)
    return tensor


@pytest.mark.parametrize("name, mistake, says", [
    ("broadcast_from_p2p", broadcast_to_rank_one_only, "Is there a recv without a matching send"),
    ("broadcast_from_p2p", return_without_communicating, "On 2 ranks, rank 1: expected tensor("),
    ("broadcast_from_p2p", broadcast_with_a_collective,
     "rank 0 broke a rule: the task says: use only send and recv. Your code called "
     "dist.broadcast()."),
    ("ring_shift", blocking_send_first,
     "blocked in torch.distributed.send(), called from blocking_send_first"),
    ("ring_shift", blocking_send_first, "  rank 0: dist.send(dst=1)"),
    ("ring_shift", shift_the_wrong_way,
     "On 3 ranks, rank 0: expected tensor([2., 2., 2.]), got tensor([1., 1., 1.])"),
    ("tree_broadcast", linear_broadcast,
     "On 5 ranks: a rank sends at most ⌈log2 n⌉ times: rank 0 sent 4 times on 5 ranks, where 3 "
     "are enough."),
    ("tree_broadcast", chain_broadcast,
     "On 5 ranks: every rank has the data after ⌈log2 n⌉ rounds: rank 4 got the data in round 4 "
     "on 5 ranks, where 3 rounds are enough."),
])
def test_checker_rejects_a_typical_mistake(name, mistake, says):
    expect_rejection(name, mistake, says)
