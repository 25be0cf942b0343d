"""helpers.capstone.traces: interval arithmetic with known answers, a hand-made trace read as the
module's docstring defines it, and a real profiled step of FSDP2 + tensor parallelism on 4 gloo
ranks whose collectives are those the course's Observer, PyTorch's CommDebugMode and a formula
count."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from helpers.capstone import traces
from helpers.launcher import run

MAIN, WORKER = 1, 2  # thread ids of the hand-made trace


def test_merge_joins_overlapping_and_touching_pairs_and_drops_empty_ones():
    assert traces.merge([(5, 6), (0, 2), (1, 3), (6, 7), (9, 9)]) == [(0, 3), (5, 7)]
    assert traces.length([(0, 3), (5, 7)]) == 5


def test_intersect_and_subtract_have_known_answers():
    first, second = [(0, 10), (20, 30)], [(5, 25), (28, 40)]
    assert traces.intersect(first, second) == [(5, 10), (20, 25), (28, 30)]
    assert traces.subtract(first, second) == [(0, 5), (25, 28)]
    assert traces.subtract(second, first) == [(10, 20), (30, 40)]
    assert traces.subtract(first, []) == first and traces.intersect(first, []) == []
    # a pair cut in three by two holes inside it
    assert traces.subtract([(0, 10)], [(2, 3), (5, 6)]) == [(0, 2), (3, 5), (6, 10)]


def event(name, start, end, tid=MAIN, category="cpu_op"):
    return {"ph": "X", "cat": category, "name": name, "pid": 7, "tid": tid, "ts": start,
            "dur": end - start}


# One rank, in microseconds: compute 0-10; a functional all-reduce launched at 12-15, in flight
# on a gloo worker 14-35, waited for at 25-35 inside an rms_norm at 20-40; FSDP's synchronous
# all-gather 50-60 (written twice, one inside the other, as under a dispatch mode), in flight
# on its group's gloo worker 50-58, inside an FSDP annotation 45-70 that is neither compute nor
# communication.
HAND_MADE = [
    event("aten::mm", 0, 10),
    event("_c10d_functional::all_reduce", 12, 15), event("c10d::allreduce_", 13, 14),
    event("gloo:all_reduce", 14, 35, tid=WORKER, category="user_annotation"),
    event("aten::copy_", 30, 31, tid=WORKER),  # gloo's own copy: communication, not compute
    event("aten::rms_norm", 20, 40), event("_c10d_functional::wait_tensor", 25, 35),
    event("FSDP::pre_forward", 45, 70, category="user_annotation"),
    event("c10d::_allgather_base_", 50, 60), event("c10d::_allgather_base_", 51, 59),
    event("gloo:all_gather", 50, 58, tid=WORKER + 1, category="user_annotation"),
]


def test_a_hand_made_trace_splits_into_compute_communication_and_blocked_time():
    found = traces.intervals(HAND_MADE)
    assert found["compute"] == [(0, 10), (20, 25), (35, 40)]
    assert found["communication"] == [(14, 35), (50, 58)]
    assert found["blocked"] == [(12, 15), (25, 35), (50, 60)]
    assert traces.collectives(HAND_MADE) == {"c10d::allreduce_": 1, "c10d::_allgather_base_": 1}


# Two process groups, each with a gloo worker of its own: FSDP2's all-gather launched at 1-2 and in
# flight on FSDP_WORKER at 2-8, inside an autograd node (0-10) whose hook launched it and waits;
# DTensor's all-gather launched at 12-14, in flight on TP_WORKER at 13-30 and waited for at 15-30;
# FSDP2's reduce-scatter launched at 40-41 and in flight at 41-50, outside any operation.
FSDP_WORKER, TP_WORKER = 3, 4
OWNED = [
    event("autograd::engine::evaluate_function: AddBackward0", 0, 10),
    event("c10d::_allgather_base_", 1, 2),
    event("gloo:all_gather", 2, 8, tid=FSDP_WORKER, category="user_annotation"),
    event("_c10d_functional::all_gather_into_tensor", 12, 14),
    event("c10d::allgather_into_tensor_coalesced_", 12.5, 13.5),
    event("gloo:all_gather", 13, 30, tid=TP_WORKER, category="user_annotation"),
    event("_c10d_functional::wait_tensor", 15, 30),
    event("c10d::_reduce_scatter_base_", 40, 41),
    event("gloo:all_reduce", 41, 50, tid=FSDP_WORKER, category="user_annotation"),
]


def test_owners_split_communication_by_the_group_whose_launches_it_follows():
    assert traces.thread_owners(OWNED) == {FSDP_WORKER: "FSDP2", TP_WORKER: "DTensor"}
    assert traces.intervals(OWNED)["compute"] == [(0, 1), (8, 10)]  # not while FSDP2 waits
    found = traces.owners(OWNED)
    assert found["FSDP2"] == {"communication": [(2, 8), (41, 50)], "overlap": [],
                              "exposed": [(2, 8), (41, 50)], "waiting": [(1, 8), (40, 50)]}
    assert found["DTensor"] == {"communication": [(13, 30)], "overlap": [],
                                "exposed": [(13, 30)], "waiting": [(12, 14), (15, 30)]}
    # the rank's exposed time, 2-8, 13-30 and 41-50, by where its computing thread was
    assert found["exposed_where"] == {"FSDP2": [(2, 8), (41, 50)],
                                      "DTensor": [(13, 14), (15, 30)], "elsewhere": [(14, 15)]}


def test_breakdown_reads_the_file_and_gives_seconds():
    trace = {"traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 7, "tid": WORKER,
         "args": {"name": "thread 2 (pt_gloo_runloop)"}},
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans",
         "tid": "PyTorch Profiler", "ts": 0, "dur": 100},  # the profiler's own span: left out
        *HAND_MADE]}
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "rank0.json")
        with open(path, "w") as file:
            json.dump(trace, file)
        got = traces.breakdown(path)
    assert got.pop("collectives") == {"c10d::allreduce_": 1, "c10d::_allgather_base_": 1}
    # the exposed time, split by where the computing thread was, adds up to it
    assert sum(got.pop("owners")["exposed_where"].values()) == pytest.approx(24e-6)
    # communication 21 + 8; of it, 20-25 under compute; the rest exposed
    assert got == pytest.approx({"compute_s": 20e-6, "communication_s": 29e-6,
                                 "overlap_s": 5e-6, "exposed_s": 24e-6, "blocked_s": 23e-6,
                                 "overlap_share": 5 / 29})


def test_a_trace_without_collectives_has_no_communication():
    got = traces.intervals([event("aten::mm", 0, 10)])
    assert got == {"compute": [(0, 10)], "communication": [], "blocked": []}


LAYERS = 2


def expected_collectives(layers: int) -> dict:
    """One step of a Llama of `layers` blocks on a 2 x 2 mesh (FSDP2 over dp, torchtitan's tensor
    and sequence parallelism over tp, recompute="op", loss_parallel), per rank. FSDP2's units: the
    blocks and the root. All-gathers: every unit before forward, every block again before
    backward (the root keeps its parameters). Reduce-scatters: every unit's gradients. DTensor's
    all-gathers of the tokens: two per block in forward, again in the recomputation (op-level
    checkpointing saves the reduce-scatters' outputs, not the all-gathers'), and two in backward
    (the reduce-scatters' transposes), plus the output head's in forward and the embedding's in
    backward; reduce-scatters: two per block in forward and two in backward, plus the
    embedding's in forward and the head's in backward. All-reduces: three in loss_parallel's
    cross-entropy, one per sequence-parallel norm's weight gradient (two per block and the
    final norm), two for the gradients' norm (over dp, then tp)."""
    return {"c10d::_allgather_base_": 2 * layers + 1,
            "c10d::_reduce_scatter_base_": layers + 1,
            "c10d::allgather_into_tensor_coalesced_": 6 * layers + 2,
            "c10d::reduce_scatter_tensor_coalesced_": 4 * layers + 2,
            "c10d::allreduce_": 2 * layers + 6}


def profiled_step_worker(rank, world_size, layers):
    """A warm-up step, then one step under torch.profiler (CPU) and the course's Observer, then
    one under CommDebugMode (a dispatch mode, kept out of the profiled step). Returns the
    profiled step's breakdown, its `gloo:` events, and what the two others counted."""
    import torch
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.profiler import ProfilerActivity, profile

    from helpers import instrument
    from helpers.at_scale.accounting import train_step
    from helpers.layouts import Plan, lay_out, make_mesh
    from helpers.llama import Llama, Shape

    shape = Shape(layers=layers, dim=128, heads=4, kv_heads=2, ffn=384, vocab=256)
    plan = Plan(dp=2, tp=2, recompute="op", micro_batch=4, seq_len=256, bf16=True)
    mesh = make_mesh(plan)
    torch.manual_seed(0)
    model = lay_out(Llama(shape, max_seq_len=plan.seq_len), mesh, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, shape.vocab, (plan.micro_batch, plan.seq_len + 1))
    train_step(model, optimizer, tokens, plan)
    with profile(activities=[ProfilerActivity.CPU]) as profiler, instrument.Observer() as seen:
        train_step(model, optimizer, tokens, plan)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, f"rank{rank}.json")
        profiler.export_chrome_trace(path)
        found = traces.breakdown(path)
        events = traces.read_trace(path)
        transfers = [event["name"] for event in events if event["name"].startswith(traces.GLOO)]
        owned = traces.thread_owners(events)
        by_owner = [owned[event["tid"]] for event in events
                    if event["name"].startswith(traces.GLOO)]
    with CommDebugMode() as comm:
        train_step(model, optimizer, tokens, plan)
    return {**found, "gloo": {name: transfers.count(name) for name in set(transfers)},
            "transfers_by_owner": {owner: by_owner.count(owner) for owner in set(by_owner)},
            "observer": seen.calls(),
            "comm_debug": {str(op): count for op, count in comm.get_comm_counts().items()}}


@pytest.mark.soak  # 5 s; the notebook (make test) counts its profiled steps against the Observer
def test_a_profiled_step_holds_every_collective_the_formula_and_both_counters_count():
    expected = expected_collectives(LAYERS)
    gathers = ("c10d::_allgather_base_", "c10d::allgather_into_tensor_coalesced_")
    for got in run(profiled_step_worker, 4, args=(LAYERS,), show_output=False, timeout=120):
        assert got["collectives"] == expected
        # each launch is one transfer on gloo's workers; a reduce-scatter runs as an all-reduce
        assert got["gloo"] == {"gloo:all_gather": sum(expected[name] for name in gathers),
                               "gloo:all_reduce": sum(expected.values())
                               - sum(expected[name] for name in gathers)}
        # the Observer sees FSDP2's torch.distributed calls, not DTensor's functional ones
        assert got["observer"] == {"all_gather_single": expected["c10d::_allgather_base_"],
                                   "reduce_scatter_single": expected[
                                       "c10d::_reduce_scatter_base_"]}
        assert got["comm_debug"] == {
            "c10d._allgather_base_": expected["c10d::_allgather_base_"],
            "c10d._reduce_scatter_base_": expected["c10d::_reduce_scatter_base_"],
            "c10d_functional.all_gather_into_tensor":
                expected["c10d::allgather_into_tensor_coalesced_"],
            "c10d_functional.reduce_scatter_tensor":
                expected["c10d::reduce_scatter_tensor_coalesced_"],
            "c10d_functional.all_reduce": expected["c10d::allreduce_"]}
        # the "dp" group's workers carry FSDP2's collectives and the norm's all-reduce over dp
        fsdp2 = expected["c10d::_allgather_base_"] + expected["c10d::_reduce_scatter_base_"]
        assert got["transfers_by_owner"] == {"FSDP2": fsdp2 + 1,
                                             "DTensor": sum(expected.values()) - fsdp2 - 1}
        assert sum(got["owners"]["exposed_where"].values()) == pytest.approx(got["exposed_s"])
        assert 0 < got["overlap_s"] <= min(got["compute_s"], got["communication_s"])
        assert got["overlap_s"] + got["exposed_s"] == pytest.approx(got["communication_s"])
        assert got["overlap_share"] == pytest.approx(got["overlap_s"] / got["communication_s"])
