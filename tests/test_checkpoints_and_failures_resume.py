"""Lesson 12, exact resume (helpers.checkpoints_and_failures.resume): a resumed run equals an
uninterrupted one and one process, and each piece left out of the checkpoint changes it at the
predicted step; async_save stages one copy of the state; the `resumable` checker rejects typical
mistakes.

No rounding can change these results (counts, messages, bit-for-bit comparisons of runs on the
same kernels, float64 against one process): the file is not marked numerical."""

import dataclasses
import functools
import os
import re
import tempfile

import pytest
import torch
from checker import expect_rejection
from compare import assert_same_state

from helpers import reference, run
from helpers.checkpoints_and_failures import resume


def resumed(experiment, directory, stop_after=5):
    run(resume.resumable_worker, 2, args=(experiment, directory),
        kwargs={"stop_after": stop_after}, show_output=False)
    return run(resume.resumable_worker, 2, args=(experiment, directory), show_output=False)[0]


@functools.cache
def uninterrupted(experiment, ranks=2):
    with tempfile.TemporaryDirectory() as directory:
        return run(resume.resumable_worker, ranks, args=(experiment, directory),
                   show_output=False)[0]


def test_a_resumed_run_equals_an_uninterrupted_one_and_one_process(tmp_path):
    experiment = resume.Experiment()
    whole = uninterrupted(experiment)
    second = resumed(experiment, str(tmp_path))
    assert sorted(second["losses"]) == [6, 7, 8, 9, 10]
    assert all(second["losses"][step] == whole["losses"][step] for step in second["losses"])
    assert_same_state(second["state"], whole["state"])
    alone = reference.train(experiment.model(), resume.global_batches(experiment, 2),
                            reference.lm_loss)
    torch.testing.assert_close(whole["losses"], alone.losses_by_step())
    torch.testing.assert_close(whole["state"]["model"], alone.parameters)
    # a checkpoint whose .metadata is missing (cut off) is skipped
    os.remove(tmp_path / "step-0010" / ".metadata")
    assert resume.latest_checkpoint(str(tmp_path)) == (str(tmp_path / "step-0005"), 5)


def test_each_piece_left_out_changes_the_resumed_run(tmp_path):
    experiment = resume.Experiment()
    whole = uninterrupted(experiment)
    first_wrong_step = {"optimizer": 7, "sampler": 6, "rng": 6}
    leaky = [dataclasses.replace(experiment, leave_out=(piece,)) for piece in first_wrong_step]
    directories = [str(tmp_path / piece) for piece in first_wrong_step]
    run(resume.each_worker, 2, args=(leaky, directories), kwargs={"stop_after": 5},
        show_output=False)
    resumed_runs = run(resume.each_worker, 2, args=(leaky, directories), show_output=False)[0]
    for (piece, step), second in zip(first_wrong_step.items(), resumed_runs):
        wrong = [s for s in second["losses"] if second["losses"][s] != whole["losses"][s]]
        assert wrong[0] == step, piece
        # by more than rounding: a wrong batch or a restarted AdamW moves the loss by its own size
        assert abs(second["losses"][step] - whole["losses"][step]) > 1e-6, piece


def test_async_save_stages_one_copy_of_the_state_and_trains_the_same(tmp_path):
    experiment = resume.Experiment(save_every=3)
    out = {asynchronous: run(resume.async_save_worker, 2,
                             args=(experiment, str(tmp_path / str(asynchronous))),
                             kwargs={"asynchronous": asynchronous}, show_output=False)
           for asynchronous in (False, True)}
    assert_same_state(out[True][0]["state"], out[False][0]["state"])
    model = experiment.model()
    parameters = list(model.parameters())
    # rank 0's half of every parameter (each splits evenly in two), and AdamW's two averages of
    # it, in float64; AdamW's step count per parameter (a float32 scalar); rank 0's RNG state
    expected = (sum(p.numel() for p in parameters) // 2 * 8 * 3 + 4 * len(parameters)
                + torch.get_rng_state().numel())
    assert out[True][0]["staged bytes"] == expected
    stages = [event for event in out[True][0]["events"] if event[0] == "stage"]
    writes = [event for event in out[True][0]["events"] if event[0] == "write"]
    assert len(stages) == len(writes) == 3
    # the checkpoint written in the background loads: resumed from step 9, the run ends as one
    # never interrupted
    loaded = run(resume.resumable_worker, 2, args=(experiment, str(tmp_path / "True")),
                 show_output=False)[0]
    assert sorted(loaded["losses"]) == [10]
    assert_same_state(loaded["state"], uninterrupted(resume.Experiment())["state"])


# --- the exercise's checker ----------------------------------------------------------------------

def resumable_with(scheduler=True, rng_key="rng.rank{rank}", checkpoints=True):
    """The reference solution, with one thing done wrong: the scheduler's state not saved, every
    rank's RNG state under one shared key (DCP then saves one rank's, for all), or no checkpoint
    at all (every run starts over: it ends right, but the second run redoes every step)."""
    def resumable(rank, world_size, job, directory):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from helpers import strategies
        from helpers.checkpoints_and_failures.resume import checkpoint_path, latest_checkpoint
        from helpers.checkpoints_and_failures.sharded import full_state
        from helpers.launcher.result import get_device

        model, optimizer = strategies.build("fully_shard", job.model())
        lr_scheduler = job.scheduler(optimizer)
        sampler = job.sampler(rank, world_size)
        torch.manual_seed(job.seed + rank)

        def state(epoch, offset):
            model_state, optimizer_state = get_state_dict(model, optimizer)
            held = {"model": model_state, "optimizer": optimizer_state, "epoch": epoch,
                    "offset": offset, rng_key.format(rank=rank): torch.get_rng_state()}
            if scheduler:
                held["scheduler"] = lr_scheduler.state_dict()
            return held

        epoch = offset = 0
        path, step = latest_checkpoint(directory) if checkpoints else (None, 0)
        if path is not None:
            held = state(0, 0)
            dcp.load(held, checkpoint_id=path)
            set_state_dict(model, optimizer, model_state_dict=held["model"],
                           optim_state_dict=held["optimizer"])
            epoch, offset = held["epoch"], held["offset"]
            torch.set_rng_state(held[rng_key.format(rank=rank)])
            if scheduler:
                lr_scheduler.load_state_dict(held["scheduler"])
        losses = {}
        while step < job.steps:
            batch = job.batch(sampler, epoch, offset).to(get_device())
            optimizer.zero_grad()
            loss = reference.lm_loss(model(batch.inputs), batch.targets)
            loss.backward()
            optimizer.step()
            lr_scheduler.step()
            step += 1
            epoch, offset = divmod(step, job.steps_per_epoch(world_size))
            total = loss.detach().clone()
            torch.distributed.all_reduce(total)
            losses[step] = total.item() / world_size
            if checkpoints and step % job.save_every == 0:
                dcp.save(state(epoch, offset), checkpoint_id=checkpoint_path(directory, step))
        return losses, full_state(model, optimizer)

    return resumable


@pytest.mark.parametrize("mistake", [resumable_with(scheduler=False),
                                     resumable_with(rng_key="rng")])
def test_resumable_checker_rejects_a_typical_mistake(mistake):
    # each fails at the first kill: two launches
    text = expect_rejection("resumable", mistake, "the second run's losses, by step")
    # the expected loss and the learner's, side by side at the same precision (6 digits here,
    # trailing zeros kept)
    expected, got = re.search(r"expected (\S+), got (\S+)$", text.splitlines()[1]).groups()
    assert all(number == f"{float(number):#.6g}" for number in (expected, got)), text
    assert expected != got


def test_a_float_differing_in_a_far_digit_is_shown_with_the_digits_that_differ():
    from helpers.exercises import _compare

    assert _compare(3.5519 + 1e-9, 3.5519, rel_tol=1e-12) == \
        "expected 3.551900000, got 3.551900001"  # (got, expected)
    assert _compare(3.5519 + 1e-9, 3.5519) is None  # the default tolerance, 1e-4 relative
    assert _compare(0.002, 0.001) == "expected 0.00100000, got 0.00200000"


def test_resumable_checker_rejects_a_loop_that_starts_over():
    expect_rejection("resumable", resumable_with(checkpoints=False),
                     "the steps the second run trained: expected [7, 8, 9, 10]")
