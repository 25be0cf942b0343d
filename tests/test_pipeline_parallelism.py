"""Lesson 09 (helpers.pipeline_parallelism): the lecture's forward as it is and its backward;
pipeline_step with every schedule equal to single-process gradients for m < p, m = p and m > p,
and to torch.distributed.pipelining; the ideal schedules against the bubble formula; the
activations kept; the exercises."""

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from checker import expect_rejection
from compare import labelled
from torch import nn

from helpers import WorkerError, exercises, reference, run, spawn
from helpers.instrument import saved_activations, saved_bytes
from helpers.pipeline_parallelism import ideal, lecture, plots, schedule, stages, widgets, workers

# Results that are numbers: `make test` runs these again on other CPU kernels (Makefile).
pytestmark = pytest.mark.numerical

LAYERS, WIDTH, BATCH = 8, 16, 24


def mlp_case():
    return (reference.make_mlp(WIDTH, LAYERS, bias=True),
            reference.mlp_data(seed=3, batch_size=BATCH, dim=WIDTH)[0])


def merged(results):
    grads = {}
    for result in results:
        grads |= result["grads"]
    return grads


def test_the_lectures_forward_runs_unchanged():
    data = reference.seeded_randn(0, 8, 32)
    result = spawn(lecture.pipeline_parallelism_main, args=(2, data, 4, 4), nprocs=2,
                   show_output=False)
    lines = result.stdout[0].strip().splitlines()
    assert len(lines) == 4 and all(line.startswith(
        "[pipeline_parallelism] Rank 0: sending 2x32[") for line in lines)
    assert result.stdout[1].strip() == ""


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_lectures_pipeline_with_its_backward_equals_one_process(world_size):
    data = reference.seeded_randn(0, 16, 32)
    out = run(lecture.pipeline_with_backward, world_size, args=(data, 4, 4), show_output=False)
    got = [grad for rank in out for grad in rank]
    for grad, expected in zip(got, lecture.dense_gradients(data, 4), strict=True):
        torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("micro_batches", [1, 2, 4, 6])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", schedule.SCHEDULES)
def test_every_schedule_gives_the_single_process_gradients(name, world_size, micro_batches):
    """m < p, m = p and m > p micro-batches."""
    model, batch = mlp_case()
    expected = reference.gradients(model, batch, reference.mse_loss)
    out = run(workers.step_worker, world_size, show_output=False, kwargs=dict(
        model=model, batch=batch, num_micro_batches=micro_batches, schedule=name))
    grads = merged(out)
    assert set(grads) == set(expected)
    for param, grad in expected.items():
        torch.testing.assert_close(grads[param], grad, msg=labelled(param))
    assert out[-1]["loss"] == pytest.approx(
        reference.mse_loss(model(batch.inputs), batch.targets).item(), rel=1e-5)
    assert all(result["loss"] is None for result in out[:-1])
    kinds = "FBW" if name == "zb" else "FB"
    for rank, result in enumerate(out):  # the events are the schedule's, in its order
        done = [(e.kind, e.micro_batch) for e in result["events"] if e.kind != "W"]
        assert done == schedule.schedule_order(name, rank, world_size, micro_batches)
        assert {e.kind for e in result["events"]} == set(kinds)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_torch_pipelining_gives_the_same_gradients(name):
    model, batch = mlp_case()
    expected = reference.gradients(model, batch, reference.mse_loss)
    for world_size in (2, 4):
        out = run(workers.torch_step_worker, world_size, show_output=False, kwargs=dict(
            model=model, batch=batch, num_micro_batches=4, schedule=name))
        grads = merged(out)
        for param, grad in expected.items():
            torch.testing.assert_close(grads[param], grad, msg=labelled(param))


def test_torchs_1f1b_refuses_fewer_micro_batches_than_stages_where_ours_runs():
    model, batch = mlp_case()
    with pytest.raises(WorkerError, match="must be greater than or equal to the number of"):
        run(workers.torch_step_worker, 4, kwargs=dict(
            model=model, batch=batch, num_micro_batches=2, schedule="1f1b"), show_output=False)


def test_the_kept_activations_peak_at_m_for_gpipe_and_at_p_minus_rank_for_1f1b():
    model, batch = mlp_case()
    p, m = 4, 6
    per_micro_batch = []
    for rank in range(p):  # what one forward of one micro-batch saves, in one process
        stage = stages.mlp_stage(model, rank, p)
        inputs = batch.inputs.chunk(m)[0].clone().requires_grad_(rank > 0)
        targets = batch.targets.chunk(m)[0].clone()
        with saved_activations(stage) as saved:
            out = stage(inputs)
            if rank == p - 1:
                reference.mse_loss(out, targets)
        per_micro_batch.append(saved_bytes(saved))
    for name, most in (("gpipe", lambda rank: m), ("1f1b", lambda rank: p - rank)):
        out = run(workers.step_worker, p, kwargs=dict(
            model=model, batch=batch, num_micro_batches=m, schedule=name), show_output=False)
        for rank, result in enumerate(out):
            peak = max(event.stored_bytes for event in result["events"])
            assert peak == most(rank) * per_micro_batch[rank], (name, rank)
            assert result["events"][-1].stored_bytes == 0


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 4), (4, 8), (3, 7), (8, 2)])
def test_the_ideal_schedules_match_the_bubble_formula_and_zb_beats_them(p, m):
    bubbles = {name: ideal.bubble(ideal.simulate(name, p, m)) for name in schedule.SCHEDULES}
    assert bubbles["gpipe"] == pytest.approx((p - 1) / (m + p - 1))
    assert bubbles["1f1b"] == pytest.approx((p - 1) / (m + p - 1))
    assert bubbles["zb"] < bubbles["1f1b"]
    kept = {name: [max(e.stored_bytes for e in rank) for rank in ideal.simulate(name, p, m)]
            for name in schedule.SCHEDULES}
    assert kept["gpipe"] == [m] * p
    assert kept["1f1b"] == [min(p - rank, m) for rank in range(p)]
    assert kept["zb"] == kept["1f1b"]  # its put-off W's never keep more micro-batches


def test_the_1f1b_order_runs_every_forward_before_its_backward():
    for p, m in ((4, 8), (4, 2), (2, 1)):
        for rank in range(p):
            order = schedule.schedule_order("1f1b", rank, p, m)
            assert sorted(order) == sorted([("F", i) for i in range(m)]
                                           + [("B", i) for i in range(m)])
            assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(m))


def refusing_worker(rank, world_size, case):
    model, batch = mlp_case()
    stage = stages.mlp_stage(model, rank, world_size)
    if case == "not sequential":
        stage = nn.ModuleList(stage)
        schedule.pipeline_step(stage, batch.inputs, batch.targets, reference.mse_loss, 4, "zb")
    else:
        schedule.pipeline_step(stage, batch.inputs, batch.targets, reference.mse_loss, 5,
                               "1f1b")


@pytest.mark.parametrize("case,says", [
    ("not sequential", "the zb schedule needs an nn.Sequential stage"),
    ("uneven", "divides into 5 micro-batches"),
])
def test_pipeline_step_refuses_what_it_cannot_do(case, says):
    with pytest.raises(WorkerError, match=says):
        run(refusing_worker, 2, args=(case,), show_output=False)


def test_step_times_are_measured_for_every_contender():
    model, batch = mlp_case()
    times = run(workers.step_times_worker, 2, kwargs=dict(
        model=model, batch=batch, num_micro_batches=4, iterations=1), show_output=False)[0]
    assert set(times) == set(workers.CONTENDERS)
    assert all(seconds > 0 for seconds in times.values())


@pytest.mark.once  # no rounding changes what it checks
def test_the_pictures_and_the_explorer_draw():
    model, batch = mlp_case()
    out = run(workers.step_worker, 2, kwargs=dict(
        model=model, batch=batch, num_micro_batches=4, schedule="1f1b"), show_output=False)
    events = [result["events"] for result in out]
    start = min(result["start"] for result in out)
    figures = [plots.plot_gantt({"1f1b": (events, start)}), plots.plot_ideal(4, 8),
               plots.plot_bubbles({"1f1b": {2: 0.4, 4: 0.25}}, 2, {"1f1b": {2: 0.33, 4: 0.2}}),
               plots.plot_memory({"1f1b": (events, start)})]
    assert all(figure.axes for figure in figures)
    explorer = widgets.schedule_explorer()
    assert [child.description for child in explorer.children[:3]] == [
        "stages p", "micro-batches m", "schedule"]


# The exercises: a typical mistake each checker must reject.

def order_without_the_warm_up_limit(rank, num_stages, num_micro_batches):
    warmup = num_stages - rank - 1  # more warm-up forwards than there are micro-batches
    order = [("F", i) for i in range(warmup)]
    for i in range(num_micro_batches - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(max(num_micro_batches - warmup, 0),
                                            num_micro_batches)]


def forward_broadcasting_the_activations(rank, world_size, weight, micro_batches,
                                         num_micro_batches, shape):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    outputs = []
    for i in range(num_micro_batches):
        x = micro_batches[i] if rank == 0 else torch.empty(shape)
        if rank > 0:
            dist.recv(x, src=rank - 1)
        out = F.gelu(x @ weight)
        for later in range(rank + 1, world_size):  # to every later rank, not just the next
            dist.send(out, dst=later)
        outputs.append(out)
    return outputs if rank == world_size - 1 else None


def backward_without_dividing_by_m(rank, world_size, weight, micro_batches, num_micro_batches,
                                   shape):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    weight = weight.clone().requires_grad_()
    kept = []
    for i in range(num_micro_batches):
        x = micro_batches[i] if rank == 0 else torch.empty(shape)
        if rank > 0:
            dist.recv(x, src=rank - 1)
            x.requires_grad_()
        out = F.gelu(x @ weight)
        if rank < world_size - 1:
            dist.send(out.detach(), dst=rank + 1)
        kept.append((x, out))
    for x, out in kept:
        if rank == world_size - 1:
            out.square().mean().backward()  # each micro-batch's mean, not divided by m
        else:
            grad = torch.empty(shape)
            dist.recv(grad, src=rank + 1)
            out.backward(grad)
        if rank > 0:
            dist.send(x.grad, dst=rank - 1)
    return weight.grad


def untagged_step(rank, world_size, weight, micro_batches, m, shape, order, blocking):
    """The step in `order` with untagged messages: a receive takes the next message from its
    neighbour, whichever micro-batch it carries. With blocking sends, in 1F1B's steady phase
    neighbours both send (a deadlock); with isend, it is right only where neighbours take the
    micro-batches in the same order."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    def send(tensor, dst):
        if blocking:
            dist.send(tensor, dst=dst)
        else:
            sends.append(dist.isend(tensor, dst=dst))

    weight = weight.clone().requires_grad_()
    kept, sends = {}, []
    for kind, i in order:
        if kind == "F":
            x = micro_batches[i] if rank == 0 else torch.empty(shape)
            if rank > 0:
                dist.recv(x, src=rank - 1)
                x.requires_grad_()
            out = F.gelu(x @ weight)
            if rank < world_size - 1:
                send(out.detach(), rank + 1)
            kept[i] = (x, out)
        else:
            x, out = kept.pop(i)
            if rank == world_size - 1:
                (out.square().mean() / m).backward()
            else:
                grad = torch.empty(shape)
                dist.recv(grad, src=rank + 1)
                out.backward(grad)
            if rank > 0:
                send(x.grad, rank - 1)
    for work in sends:
        work.wait()
    return weight.grad


def by_order_with_blocking_sends(rank, world_size, weight, micro_batches, m, shape, order):
    return untagged_step(rank, world_size, weight, micro_batches, m, shape, order, blocking=True)


def by_order_taking_messages_as_they_come(rank, world_size, weight, micro_batches, m, shape,
                                          order):
    return untagged_step(rank, world_size, weight, micro_batches, m, shape, order, blocking=False)


def one_f_one_b_with_blocking_sends(rank, world_size, weight, micro_batches, m, shape):
    return by_order_with_blocking_sends(rank, world_size, weight, micro_batches, m, shape,
                                        schedule.schedule_order("1f1b", rank, world_size, m))


@pytest.mark.parametrize("name,mistake,says", [
    ("one_f_one_b_step", one_f_one_b_with_blocking_sends, "did not finish within"),
    ("one_f_one_b_order", order_without_the_warm_up_limit,
     "For the input rank=0, num_stages=4, num_micro_batches=2"),
    ("pipeline_forward", forward_broadcasting_the_activations,
     "each rank but the last sends each micro-batch's activations to rank + 1, once"),
    ("pipeline_backward", backward_without_dividing_by_m, "On 2 ranks, rank 0:"),
    ("one_f_one_b_step", exercises.solution("pipeline_backward"),
     "send in 1F1B's order: each forward's activations to rank + 1"),
])
def test_checker_rejects_a_typical_mistake(name, mistake, says):
    expect_rejection(name, mistake, says)


def by_order_ignoring_the_order(rank, world_size, weight, micro_batches, m, shape, order):
    from helpers.pipeline_parallelism import solutions
    gpipe = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    return solutions.pipeline_by_order(rank, world_size, weight, micro_batches, m, shape, gpipe)


@pytest.mark.parametrize("mistake, says", [
    (by_order_with_blocking_sends, "did not finish within"),
    (by_order_taking_messages_as_they_come, "On 3 ranks, rank 0:"),
    (by_order_ignoring_the_order, "each activation once to rank + 1 and each gradient once to "
                                  "rank - 1, in your order"),
])
def test_pipeline_by_order_checker_rejects_a_typical_mistake(mistake, says):
    expect_rejection("pipeline_by_order", mistake, says)


def test_the_event_log_counts_compute_only_so_each_event_follows_its_message():
    """A forward starts after the previous rank's forward of that micro-batch ended, and a
    backward after the next rank's backward ended: waiting for the message is not in the span
    (one perf_counter clock for every process of the machine)."""
    model, batch = mlp_case()
    for name in ("1f1b", "zb"):
        out = run(workers.step_worker, 4, show_output=False, kwargs=dict(
            model=model, batch=batch, num_micro_batches=4, schedule=name))
        spans = [{(event.kind, event.micro_batch): event for event in result["events"]}
                 for result in out]
        for rank in range(1, 4):
            for i in range(4):
                assert spans[rank]["F", i].start >= spans[rank - 1]["F", i].end, (name, rank, i)
                assert spans[rank - 1]["B", i].start >= spans[rank]["B", i].end, (name, rank, i)
