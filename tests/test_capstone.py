"""Lesson 14: the capstone's run equals one process (float64, on three layouts), resumes exactly,
refuses what it cannot run, and learns: the corpus, its baseline, the schedule; its exercises'
checkers reject typical mistakes."""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from checker import expect_rejection

from helpers import exercises, reference
from helpers.capstone import corpus, job
from helpers.capstone import exercises as capstone_exercises
from helpers.capstone.train import Config, lr_factor, one_process, train_worker
from helpers.checkpoints_and_failures.elastic import torchrun_command, torchrun_environment
from helpers.checkpoints_and_failures.resume import latest_checkpoint
from helpers.launcher import WorkerError, run

# Small enough for a few seconds: 2 blocks of width 64, 8 sequences of 32 bytes a step.
TINY = Config(layers=2, dim=64, heads=4, kv_heads=2, seq_len=32, batch=8, micro_batches=2,
              steps=4, warmup=1, lr=1e-2, bf16=False, float64=True, eval_every=2,
              eval_sequences=8, save_every=0)


def close(got: dict, expected: dict) -> None:
    # float64 over 4 AdamW steps: rounding ~1e-16 of each sum's size stays far below AdamW's eps
    # (helpers.tolerance's docstring); assert_close's float64 default (1e-7) holds with room.
    torch.testing.assert_close(got, expected)


# In make test the notebook runs dp 2 x tp 2 with recompute "op" (nbval compares its verdict); the
# soak and other-CPU tiers run these: each layout, and each mode of recomputation, once.
@pytest.mark.numerical
@pytest.mark.soak
@pytest.mark.parametrize("layout", [dict(dp=2, tp=2, recompute="none"),
                                    dict(dp=4, tp=1, recompute="op"),
                                    dict(dp=1, tp=2, recompute="full")],
                         ids=lambda layout: "dp{dp} x tp{tp}, recompute {recompute}".format(
                             **layout))
def test_the_run_equals_one_process_in_float64(layout):
    config = dataclasses.replace(TINY, **layout)
    ranks = run(train_worker, config.ranks, args=(config,), kwargs={"weights": True},
                show_output=False, timeout=120).results
    alone = one_process(config)
    close(ranks[0].losses(), alone.losses())
    close({step: record["norm"] for step, record in ranks[0].steps.items()},
          {step: record["norm"] for step, record in alone.steps.items()})
    close(ranks[0].weights, alone.weights)
    assert all(rank.losses() == ranks[0].losses() for rank in ranks)  # every rank the same record


# --- resuming -----------------------------------------------------------------------------------

@pytest.mark.numerical
@pytest.mark.soak  # 4 s of make test's 8 minutes
def test_a_checkpoint_resumes_on_another_layout_of_the_same_model(tmp_path):
    """DCP reshards: a dp 2 x tp 2 checkpoint goes on as dp 4, equal to one process."""
    config = dataclasses.replace(TINY, save_every=2)
    run(train_worker, 4, args=(config, str(tmp_path)), kwargs={"stop_after": 2},
        show_output=False)
    other = dataclasses.replace(config, dp=4, tp=1)
    resumed = run(train_worker, 4, args=(other, str(tmp_path)), kwargs={"weights": True},
                  show_output=False).results[0]
    alone = one_process(config)
    assert resumed.started_after == 2
    close(resumed.losses(), {step: loss for step, loss in alone.losses().items() if step > 2})
    close(resumed.weights, alone.weights)


def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path):
    config = dataclasses.replace(TINY, save_every=2, steps=2)
    run(train_worker, 4, args=(config, str(tmp_path)), show_output=False)
    wider = dataclasses.replace(config, dim=128, steps=4)
    with pytest.raises(WorkerError) as refused:
        run(train_worker, 4, args=(wider, str(tmp_path)), show_output=False)
    assert refused.value.type_name == "CheckpointMismatch"
    assert "step-0002 holds another model: tok_embeddings.weight is (256, 64) there, " \
           "(256, 128) here" in str(refused.value)


# --- what it refuses before anything runs -------------------------------------------------------

@pytest.mark.parametrize(("change", "says"), [
    (dict(dp=2, tp=1), "a mesh of dp 2 x tp 1 needs 2 ranks, not 4"),
    (dict(batch=6), "a batch of 6 sequences does not split into dp 2 x 2 micro-batches"),
    (dict(heads=3), "tp 2 does not divide the 3 heads"),
    (dict(bf16=True), "bf16 and float64 are two different precisions: choose one"),
])
def test_a_config_that_cannot_run_says_why_before_anything_runs(change, says):
    with pytest.raises(ValueError, match=says):
        dataclasses.replace(TINY, **change).check(world_size=4)


def test_a_missing_or_too_small_corpus_says_so(tmp_path):
    with pytest.raises(corpus.CorpusError, match="no standard library source at"):
        corpus.python_source(str(tmp_path / "absent"))
    (tmp_path / "tiny.py").write_text("x = 1\n")
    with pytest.raises(corpus.CorpusError, match="holds 1 .py files, 6 bytes to train on and 0 "
                                                 "held out: too little text"):
        corpus.python_source(str(tmp_path))


# --- the corpus, its baseline, the schedule -----------------------------------------------------

def test_the_corpus_holds_out_every_tenth_module_whole():
    text = corpus.python_source()
    train, held_out = text.files
    names = sorted(train + held_out)
    assert held_out == tuple(names[9::10])
    assert len(text.validation) == sum(os.path.getsize(os.path.join(text.root, name))
                                       for name in held_out)


def test_a_batch_is_the_same_for_a_step_whatever_asks_and_windows_of_the_text():
    text = corpus.python_source()
    first, again = text.batch("train", 7, 4, 32), text.batch("train", 7, 4, 32)
    assert torch.equal(first, again) and not torch.equal(first, text.batch("train", 8, 4, 32))
    raw = bytes(text.train.tolist())
    assert all(bytes(row.tolist()) in raw for row in first)


def test_the_unigram_baseline_is_the_held_out_texts_cross_entropy_under_add_one_counts():
    text = corpus.python_source()
    counts = [1] * 256
    for byte in bytes(text.train.tolist()):
        counts[byte] += 1
    total = sum(counts)
    held_out = bytes(text.validation.tolist())
    expected = -sum(math.log2(counts[byte] / total) for byte in held_out) / len(held_out)
    assert corpus.unigram_bits(text) == pytest.approx(expected, rel=1e-9)
    # on windows, the bytes they predict: each window's first byte is an input only
    windows = text.batch("validation", 0, 3, 16, seed=1)
    targets = [byte for row in windows.tolist() for byte in row[1:]]
    expected = -sum(math.log2(counts[byte] / total) for byte in targets) / len(targets)
    assert corpus.unigram_bits(text, windows) == pytest.approx(expected, rel=1e-9)


def test_the_learning_rate_warms_up_linearly_then_falls_as_half_a_cosine():
    config = dataclasses.replace(TINY, steps=12, warmup=4, final_lr_share=0.1)
    shares = [lr_factor(config, step) for step in range(config.steps)]
    assert shares[:4] == [0.25, 0.5, 0.75, 1.0]
    assert shares[-1] == pytest.approx(0.1)
    assert shares[7] == pytest.approx(0.55)  # halfway down (4 of 8 steps): peak and floor's mean
    assert all(later < earlier for earlier, later in zip(shares[3:], shares[4:]))


# --- the capstone exercise rejects typical mistakes (its solution passes: test_exercises.py) ----

# Each mistake runs in the ranks as the reference solution with one thing changed. A mistake in
# every step fails the checker's first run, the whole one (one launch of 4 ranks); a mistake in
# resuming, the run after the kill (three launches).

def without_recomputation(rank, world_size, job, directory, recompute):
    from helpers.capstone.solutions import capstone
    return capstone(rank, world_size, job, directory, False)


def counting_from_zero_again(rank, world_size, job, directory, recompute):
    from helpers.capstone import solutions
    found = solutions.latest_checkpoint
    solutions.latest_checkpoint = lambda directory: (found(directory)[0], 0)
    return solutions.capstone(rank, world_size, job, directory, recompute)


def resuming_without_the_optimizers_state(rank, world_size, job, directory, recompute):
    from helpers.capstone import solutions
    solutions.NOT_NEEDED = (*solutions.NOT_NEEDED, "optimizer")  # neither saved nor loaded
    return solutions.capstone(rank, world_size, job, directory, recompute)


def clipping(norm_of):
    """The solution, clipping every gradient by `norm_of(local pieces)` instead of the global
    norm, as clip_grad_norm_ scales them."""
    def capstone(rank, world_size, job, directory, recompute):
        from helpers.capstone import solutions

        def clip_to_norm(model, max_norm):
            pieces = [parameter.grad.to_local() for parameter in model.parameters()]
            scale = min(1.0, max_norm / (norm_of(pieces) + 1e-6))
            for piece in pieces:
                piece.mul_(scale)

        solutions.clip_to_norm = clip_to_norm
        return solutions.capstone(rank, world_size, job, directory, recompute)

    return capstone


def each_ranks_own_norm(pieces):
    return torch.linalg.vector_norm(torch.stack([piece.norm() for piece in pieces])).item()


def every_ranks_pieces_summed(pieces):
    """Every rank's pieces' squares, summed over all 4 ranks: what both tp partners hold (all
    but the blocks' cut layers) counts twice."""
    import torch.distributed as dist

    total = sum(piece.pow(2).sum() for piece in pieces).reshape(1)
    dist.all_reduce(total)
    return total.sqrt().item()


def counted_by_placements(rank, world_size, job, directory, recompute):
    """The solution, clipping by a norm that counts each gradient DTensor's piece on coordinate 0
    of the mesh dimensions its placements replicate (the global_norm exercise's rule): a
    parameter tensor parallelism did not touch is a DTensor on the dp mesh alone, (Shard(0),),
    and both tp partners count it."""
    import torch.distributed as dist

    from helpers.capstone import solutions

    def clip_to_norm(model, max_norm):
        gradients = [parameter.grad for parameter in model.parameters()]
        total = torch.zeros(1, dtype=torch.float64)
        for gradient in gradients:
            coordinate = gradient.device_mesh.get_coordinate()
            if all(where == 0 for where, placement in zip(coordinate, gradient.placements)
                   if placement.is_replicate()):
                total += gradient.to_local().double().pow(2).sum()
        dist.all_reduce(total)
        scale = min(1.0, max_norm / (total.sqrt().item() + 1e-6))
        for gradient in gradients:
            gradient.to_local().mul_(scale)

    solutions.clip_to_norm = clip_to_norm
    return solutions.capstone(rank, world_size, job, directory, recompute)


def without_clipping(rank, world_size, job, directory, recompute):
    from helpers.capstone import solutions
    solutions.clip_to_norm = lambda model, max_norm: None
    return solutions.capstone(rank, world_size, job, directory, recompute)


def losses(of_the_halves):
    """The solution, returning `of_the_halves(this rank's half's loss, the dp group)` for each
    step's loss."""
    def capstone(rank, world_size, job, directory, recompute):
        from helpers.capstone import solutions
        solutions.mean_over = of_the_halves
        return solutions.capstone(rank, world_size, job, directory, recompute)

    return capstone


def summed(value, group):
    import torch.distributed as dist

    value = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(value, group=group)
    return value.item()


def gradients_summed_over_the_halves(rank, world_size, job, directory, recompute):
    """FSDP sums each gradient over dp instead of averaging it: twice the batch's."""
    from torch.distributed.fsdp import FSDPModule

    from helpers.capstone import solutions
    sharded = solutions.layouts.apply_fsdp

    def apply_fsdp(model, mesh, **options):
        sharded(model, mesh, **options)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
        return model

    solutions.layouts.apply_fsdp = apply_fsdp
    return solutions.capstone(rank, world_size, job, directory, recompute)


def every_rank_alone(rank, world_size, job, directory, recompute):
    """Every rank trains the whole model on the whole batch: right numbers, no parallelism."""
    import torch.distributed.checkpoint as dcp

    from helpers import layouts, reference
    from helpers.capstone.solutions import NOT_NEEDED
    from helpers.checkpoints_and_failures import resume

    model = layouts.apply_ac(job.model(), "full" if recompute else "none")
    optimizer = job.optimizer(model.parameters())
    path, step = resume.latest_checkpoint(directory)
    if path is not None:
        resume.load_training(path, model, optimizer, {}, leave_out=NOT_NEEDED)
    losses = {}
    while step < job.steps:
        batch = job.batch(step)
        optimizer.zero_grad()
        loss = reference.lm_loss(model(batch.inputs), batch.targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), job.max_norm)
        optimizer.step()
        step += 1
        losses[step] = loss.item()
        if step % job.save_every == 0:
            dcp.save(resume.training_state(model, optimizer, {}, leave_out=NOT_NEEDED),
                     checkpoint_id=resume.checkpoint_path(directory, step))
    return losses, {name: value.detach().clone() for name, value in model.named_parameters()}


WHOLE = "For the case kill_after=4: the whole run (recompute=False, never killed): "
RESUMED = ("For the case kill_after=4: the resumed run (recompute=True, new processes on the "
           "killed run's directory): ")
RECOGNISED = "Hint: the whole run differs from one process already: "


@pytest.mark.soak  # 4 ranks, once for a mistake in every step, three times for one in resuming
@pytest.mark.parametrize(("mistake", "says", "hint"), [
    # in every step: the whole run differs, its first wrong step named
    pytest.param(clipping(every_ranks_pieces_summed), WHOLE + "its losses, by step: 2: expected",
                 RECOGNISED + "the norm counts twice what both tp partners hold",
                 id="the norm counts what both tp partners hold twice"),
    pytest.param(counted_by_placements, WHOLE + "its losses, by step: 2: expected",
                 RECOGNISED + "the norm counts twice the pieces tensor parallelism did not touch",
                 id="the norm counts by placements, pieces on the dp mesh alone twice"),
    pytest.param(clipping(each_ranks_own_norm), WHOLE + "its losses, by step: 2: expected",
                 "Hint: step 1's loss is right and step 2's differs: the update of step 1",
                 id="each rank clips by its own pieces' norm"),
    pytest.param(without_clipping, WHOLE + "its losses, by step: 2: expected",
                 RECOGNISED + "these are the losses of a run that does not clip",
                 id="no clipping"),
    pytest.param(losses(lambda value, group: value), WHOLE + "its losses, by step: 1: expected",
                 RECOGNISED + "the losses are one data-parallel half's alone",
                 id="the local half's loss"),
    pytest.param(losses(summed), WHOLE + "its losses, by step: 1: expected",
                 RECOGNISED + "the losses are twice the whole batch's: the two data-parallel "
                              "halves' summed", id="the halves' losses summed"),
    pytest.param(gradients_summed_over_the_halves, WHOLE + "its losses, by step: 8: expected",
                 RECOGNISED + "the gradients are twice the whole batch's",
                 id="the halves' gradients summed"),
    pytest.param(every_rank_alone, WHOLE + "fewer bytes kept for backward than one process "
                                           "keeps for half the batch: expected True, got False",
                 "Hint: without recomputation a rank keeps as many bytes",
                 id="every rank alone"),
    # in resuming: the whole run matched, the resumed one differs
    pytest.param(counting_from_zero_again,
                 RESUMED + "the steps it trained: expected [4, 5, 6, 7, 8], got [1, 2, 3, 4, 5, "
                           "6, 7, 8]",
                 "Hint: the resumed run counted from step 1 again, on weights that were already "
                 "trained", id="counting from zero again"),
    pytest.param(resuming_without_the_optimizers_state,
                 RESUMED + "its losses, by step: 5: expected",
                 "Hint: these are the losses of a run that resumed step 3's weights with a new "
                 "AdamW", id="no optimizer state in the checkpoint"),
    pytest.param(without_recomputation,
                 RESUMED + "fewer bytes kept for backward a step than the whole run keeps: "
                           "expected True, got False",
                 "Hint: with `recompute`, the blocks' activations must be recomputed",
                 id="without recomputation"),
])
def test_the_capstone_checker_rejects(mistake, says, hint):
    """The message names the run that differed; the hint, the mistake."""
    text = expect_rejection("capstone", mistake, says)
    assert hint in text, text


# The capstone's hints recognise a mistake by what it trains to, in one process: here each
# result is made with reference.train itself (not the checker's simulation of the mistake), no
# launch. float64 in one process, so a mistake's losses match the checker's simulation of it to
# rounding (~1e-16 of each sum), far within the checker's 1e-9.

def test_the_capstone_checker_knows_lesson_08s_plan():
    """Which parameters the checker's simulation of a norm counting tp partners twice takes as
    cut over tp: Megatron-LM's (the paper's section 3), written out here."""
    names = {name for name, _ in reference.make_lm(vocab=64, dim=32, heads=4, layers=1,
                                                    max_seq_len=16).named_parameters()}
    cut = {f"blocks.0.{layer}.{kind}" for layer in (
        "attention.q", "attention.k", "attention.v", "feed_forward.up") for kind in (
        "weight", "bias")} | {"blocks.0.attention.out.weight", "blocks.0.feed_forward.down.weight"}
    assert {name for name in names if capstone_exercises._cut_over_tp(name)} == cut & names


def capstone_hint(kill_after, **changed):
    """The hint the capstone checker gives for its expected result with `changed` elements
    (by name: whole_losses, steps, resumed_losses)."""
    exercise = exercises.exercises()["capstone"]
    expected = exercise.expected(kill_after)
    got = list(expected)
    for name, value in changed.items():
        got[{"whole_losses": 0, "steps": 3, "resumed_losses": 4}[name]] = value
    return exercise.hint_for(tuple(got), expected, kill_after)


def by_step(losses, first=1) -> dict:
    return {step: loss for step, loss in enumerate(losses, start=first)}


@pytest.mark.numerical
def test_the_capstone_hints_name_a_mistake_in_every_step_by_what_it_trains_to():
    model, batches = capstone_exercises.JOB.model(), capstone_exercises.JOB.batches()
    clipped = reference.train(model, batches, reference.lm_loss,
                              max_grad_norm=capstone_exercises.JOB.max_norm)
    unclipped = reference.train(model, batches, reference.lm_loss)
    assert "does not clip" in capstone_hint(4, whole_losses=by_step(unclipped.losses))
    assert "the two data-parallel halves' summed" in capstone_hint(
        4, whole_losses=by_step([2 * loss for loss in clipped.losses]))
    shifted = by_step([loss * (1 + 1e-6) for loss in clipped.losses])  # no mistake of the list
    assert capstone_hint(4, whole_losses=shifted).startswith(
        "step 1's loss, computed before any update, already differs")


@pytest.mark.numerical
@pytest.mark.parametrize("kill_after", [4, 6])
def test_the_capstone_hint_names_a_checkpoint_without_the_optimizers_state(kill_after):
    """One process trains to the newest checkpoint, then goes on with a new AdamW from its
    weights: the losses of a resume that left the optimizer's state out."""
    job, newest = capstone_exercises.JOB, kill_after // 3 * 3
    model, batches = job.model(), job.batches()
    before = reference.train(model, batches[:newest], reference.lm_loss,
                             max_grad_norm=job.max_norm)
    model.load_state_dict(before.parameters)
    after = reference.train(model, batches[newest:], reference.lm_loss,
                            max_grad_norm=job.max_norm)
    assert capstone_hint(kill_after, resumed_losses=by_step(after.losses, newest + 1)).startswith(
        f"these are the losses of a run that resumed step {newest}'s weights with a new AdamW")


@pytest.mark.parametrize(("steps", "says"), [
    (range(1, 9), "the resumed run started again from step 1, from the first weights"),
    (range(5, 9), "the resumed run went on from step 5, after the last step the killed run "
                  "finished"),
    (range(3, 9), "the resumed run trained step 3 again"),
    (range(4, 8), "the resumed run trained steps 4 to 7: the newest checkpoint was saved after "
                  "step 3 (rank 3 died loading step 5's batch), so the resumed run trains steps "
                  "4 to 8"),
    ([], "the resumed run trained no step"),
])
def test_the_capstone_hint_says_which_steps_a_resumed_run_must_train(steps, says):
    """(Killed loading step 5's batch, the newest checkpoint step 3's.) The losses of a run
    that started again from scratch are the whole run's."""
    whole = exercises.exercises()["capstone"].expected(4)[0]
    losses = {step: whole[step] for step in steps}
    assert capstone_hint(4, steps=list(steps), resumed_losses=losses).startswith(says)


def until_a_step(directory, seconds: float = 60) -> None:
    """Wait until rank 0 of a job in `directory` has trained a step (job.py's events)."""
    events = directory / "events.rank0.jsonl"
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if events.exists() and '"event": "step"' in events.read_text():
            return
        time.sleep(0.05)
    raise TimeoutError(f"no step in {events} after {seconds:g} s")


# --- the torchrun job ---------------------------------------------------------------------------

# The notebook's torchrun job (make test) is killed and resumes bit for bit; here, the other way
# a job stops.
@pytest.mark.soak
def test_ctrl_c_saves_where_it_stopped_and_the_same_command_goes_on(tmp_path):
    config = dataclasses.replace(TINY, bf16=True, float64=False, steps=20, save_every=100,
                                 recompute="op")
    command = torchrun_command("helpers.capstone.job", [str(tmp_path), *job.arguments_for(config)],
                               str(tmp_path), nproc=4, max_restarts=0)
    process = subprocess.Popen(command, env=torchrun_environment(), start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    until_a_step(tmp_path)
    os.killpg(process.pid, signal.SIGINT)  # as a terminal's Ctrl-C (torchrun sends it on)
    process.wait(timeout=60)
    stopped = torch.load(tmp_path / "final.pt", weights_only=False)
    last = max(stopped.steps)
    assert 1 <= last < config.steps
    assert latest_checkpoint(str(tmp_path))[1] == last  # saved where it stopped, not at 100
    finished = job.torchrun_job(str(tmp_path), config, max_restarts=0)
    whole = run(train_worker, 4, args=(config,), show_output=False).results[0]
    assert finished.result.started_after == last
    assert finished.result.losses() == {step: loss for step, loss in whole.losses().items()
                                        if step > last}
    steps, _ = job.records(str(tmp_path))  # both attempts' steps, as a plot reads them
    assert {step: record["loss"] for step, record in steps.items()} == whole.losses()


# --- make train (python -m helpers.capstone) tells the truth ------------------------------------

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_train(directory, *options, **popen):
    """`make train`'s command on `directory`, a warmup of one step (so that a few steps make a
    schedule)."""
    command = [sys.executable, "-m", "helpers.capstone", "--directory", str(directory),
               "--warmup", "1", *options]
    if popen:
        return subprocess.Popen(command, cwd=REPOSITORY, text=True, **popen)
    return subprocess.run(command, cwd=REPOSITORY, capture_output=True, text=True, timeout=600)


@pytest.mark.soak  # short runs of make train's recipe under torchrun
@pytest.mark.parametrize("before", ["nothing", "a finished run"])
def test_make_train_with_a_rank_killed_says_so_and_exits_non_zero(tmp_path, before):
    """Whatever the directory held: a finished run's final.pt once made it print a sample and
    exit 0."""
    if before == "a finished run":
        finished = make_train(tmp_path, "--steps", "3")
        assert finished.returncode == 0, finished.stderr
        assert "what the model writes" in finished.stdout
        assert "torch.distributed is disabled" not in finished.stderr
    failed = make_train(tmp_path, "--steps", "6", "--kill-rank", "3", "--kill-after", "4")
    assert failed.returncode not in (0, None)
    assert "what the model writes" not in failed.stdout
    assert "the run did not finish: rank 3 failed" in failed.stderr
    assert ("its newest checkpoint is step 3" if before == "a finished run"
            else "no checkpoint in") in failed.stderr


@pytest.mark.soak
def test_make_train_stopped_by_ctrl_c_says_where_without_a_traceback(tmp_path):
    process = make_train(tmp_path, "--steps", "40", start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    until_a_step(tmp_path)
    os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
    _, stderr = process.communicate(timeout=180)
    assert process.returncode == 130, stderr
    step = latest_checkpoint(str(tmp_path))[1]
    assert f"stopped by Ctrl-C; its newest checkpoint is step {step}" in stderr
    assert "Traceback" not in stderr and "SignalException" not in stderr


# --- the global norm exercise rejects typical mistakes ------------------------------------------

def counting(counts):
    """A global norm that adds the squares of each piece for which `counts(name, placements,
    coordinate)` is true, then all-reduces them: one all_reduce of one number, as the task asks."""
    def global_norm(rank, world_size, pieces):
        import math

        import torch.distributed as dist

        total = torch.zeros(1, dtype=torch.float64)
        for name, piece in pieces.items():
            if counts(name, piece.placements, piece.device_mesh.get_coordinate()):
                total += piece.to_local().double().pow(2).sum()
        dist.all_reduce(total)
        return math.sqrt(total.item())

    return global_norm


def replicated_along_first(*dimensions):
    """Counted on coordinate 0 of each of `dimensions` (0: dp, 1: tp) the piece is replicated
    along; the others ignored."""
    return lambda name, placements, coordinate: all(
        coordinate[dim] == 0 for dim in dimensions if placements[dim].is_replicate())


def by_dtensors_own_reduction(rank, world_size, pieces):
    """Right, as DTensor computes it: its own reductions over dp, then tp (not dist.all_reduce:
    the rule sees none)."""
    return torch.nn.utils.get_total_norm(list(pieces.values())).full_tensor().item()


def one_all_reduce_per_dimension(rank, world_size, pieces):
    """Right, as DTensor does it: over dp, then over tp (what the task's rule forbids)."""
    import math

    import torch.distributed as dist

    sums = torch.zeros(2, dtype=torch.float64)  # [cut over tp, replicated over tp]
    mesh = None
    for piece in pieces.values():
        mesh = piece.device_mesh
        dp_place, tp_place = piece.placements
        if dp_place.is_shard() or mesh.get_coordinate()[0] == 0:
            sums[int(tp_place.is_replicate())] += piece.to_local().double().pow(2).sum()
    dist.all_reduce(sums, group=mesh.get_group("dp"))
    cut = sums[:1].clone()
    dist.all_reduce(cut, group=mesh.get_group("tp"))
    return math.sqrt((cut + sums[1]).item())


@pytest.mark.parametrize(("mistake", "says"), [
    pytest.param(counting(lambda name, placements, coordinate: True),
                 "Hint: each piece counts once, however many ranks hold it",
                 id="every piece on every rank"),
    pytest.param(counting(lambda name, placements, coordinate: name.startswith("blocks.")
                          or coordinate[1] == 0),
                 "Hint: a name does not say how a piece is laid out",
                 id="by name, the old rule"),
    pytest.param(counting(replicated_along_first(1)),
                 "Hint: a piece can be replicated over dp too", id="replicated over tp only"),
    pytest.param(counting(replicated_along_first(0)),
                 "Hint: a piece both tp partners hold (Replicate() on \"tp\") counts twice",
                 id="replicated over dp only"),
    pytest.param(by_dtensors_own_reduction,
                 "rank 0's all_reduce calls held [] elements (0 calls)",
                 id="DTensor's own reductions"),
    pytest.param(one_all_reduce_per_dimension,
                 "rank 0's all_reduce calls held [2, 1] elements (2 calls)",
                 id="one all_reduce per dimension"),
])
def test_the_global_norm_checker_rejects(mistake, says):
    expect_rejection("global_norm", mistake, says)


def each_piece_made_whole(rank, world_size, pieces):
    return {name: piece.full_tensor() for name, piece in pieces.items()}


@pytest.mark.parametrize(("world_size", "seed"), [(4, 0), (8, 2)])
def test_a_global_norm_piece_is_what_its_placements_say(world_size, seed):
    """DTensor's own full_tensor() gathers each rank's pieces into the whole gradient that the
    checker's expected norm is taken from: the placements say what each rank holds."""
    exercise = exercises.exercises()["global_norm"]
    with tempfile.TemporaryDirectory() as log_dir:
        out = run(exercise.worker(each_piece_made_whole, log_dir), world_size, args=(seed,),
                  show_output=False)
    for whole in out:
        torch.testing.assert_close(whole, capstone_exercises._gradients(seed), rtol=0, atol=0)


# --- one step of the recipe: its checker's rejections -------------------------------------------

def recipe_step_with(weighting="share", sync="last", schedule="step", upcast="bfloat16",
                     clipped_norm=False):
    """The reference step with one thing done otherwise (a function of this module: the
    checker's tests send this module's functions to the ranks by value)."""
    options = dict(weighting=weighting, sync=sync, schedule=schedule, upcast=upcast,
                   clipped_norm=clipped_norm)

    def step(model, optimizer, scheduler, parts, config):
        return _recipe_step(model, optimizer, scheduler, parts, config, **options)

    return step


def _recipe_step(model, optimizer, scheduler, parts, config, *, weighting, sync, schedule, upcast,
                 clipped_norm):
    import torch.nn.functional as F

    from helpers.capstone import train
    from helpers.layouts import clip_to_norm

    sequences = sum(len(part) for part in parts)
    loss_sum = 0.0
    for index, part in enumerate(parts):
        if sync == "last":
            model.set_requires_gradient_sync(index == len(parts) - 1)
        with train.parallel_loss(config):
            logits = model(part[:, :-1]).flatten(0, 1)
            if upcast == "always" or (upcast == "bfloat16" and config.bf16):
                logits = logits.float()
            loss = F.cross_entropy(logits, part[:, 1:].flatten())
            loss = {"share": loss * len(part) / sequences, "parts": loss / len(parts),
                    "sum": loss}[weighting]
            loss.backward()
        loss_sum += train.whole(loss.detach()).item()
        if schedule == "part":
            scheduler.step()
    norm = train.whole(clip_to_norm(model, config.clip)).item()
    optimizer.step()
    if schedule == "step":
        scheduler.step()
    optimizer.zero_grad()
    return loss_sum, min(norm, config.clip) if clipped_norm else norm


RECIPE = "For the case sizes=(3, 1), precision='float64': "


@pytest.mark.soak  # 4 ranks, 3 steps, for each mistake
@pytest.mark.parametrize(("mistake", "says", "hint"), [
    pytest.param(recipe_step_with(weighting="parts"),
                 RECIPE + "the whole batch's loss, by step: 1: expected",
                 "Hint: every micro-batch's mean counted alike", id="micro-batches alike"),
    pytest.param(recipe_step_with(weighting="sum"),
                 RECIPE + "the whole batch's loss, by step: 1: expected",
                 "Hint: the micro-batches' losses were added up", id="micro-batches summed"),
    pytest.param(recipe_step_with(sync="every"),
                 RECIPE + "reduce-scatters a step (FSDP2's: once a unit, whatever the "
                          "micro-batches): expected 3, got 6",
                 "Hint: FSDP2 reduce-scattered after every micro-batch", id="sync every part"),
    pytest.param(recipe_step_with(schedule="never"),
                 RECIPE + "the learning rate each step ran at: 2: expected 0.0100000, got "
                          "0.00500000",
                 "Hint: every step ran at the first step's rate", id="no schedule"),
    pytest.param(recipe_step_with(schedule="part"),
                 RECIPE + "the learning rate each step ran at: 2: expected",
                 "Hint: the rate moved more than once a step", id="schedule every part"),
    pytest.param(recipe_step_with(clipped_norm=True),
                 RECIPE + "the gradient norm before clipping, by step: 1: expected",
                 "Hint: the norm returned is the clipped one", id="the clipped norm"),
    pytest.param(recipe_step_with(upcast="always"),
                 RECIPE + "the logits each loss was taken on: expected 'float64', got 'float32'",
                 "Hint: in a float64 run the logits are float64 already", id="float64 rounded"),
    pytest.param(recipe_step_with(upcast="never"),
                 "For the case sizes=(2, 2), precision='bfloat16': the logits each loss was "
                 "taken on: expected 'float32 or wider', got 'bfloat16'",
                 "Hint: the loss must be taken on logits of float32", id="bfloat16 loss"),
])
def test_the_recipe_step_checker_rejects(mistake, says, hint):
    text = expect_rejection("recipe_step", mistake, says)
    assert hint in text, text


def test_the_recipe_steps_cases_cut_a_ranks_sequences_unequally():
    """A step that weights micro-batches alike is right only when they are equal: two of the
    three cases make them unequal, and every case cuts a rank's whole share."""
    from helpers.capstone.exercises import RECIPE as CONFIG
    from helpers.capstone.exercises import RECIPE_CASES

    share = CONFIG.batch // CONFIG.dp
    assert all(sum(sizes) == share for sizes, _ in RECIPE_CASES)
    assert sum(len(set(sizes)) > 1 for sizes, _ in RECIPE_CASES) == 2


# --- the torchrun entry point: its checker's rejections -----------------------------------------

def entry_point_with(handled=(signal.SIGINT, signal.SIGTERM), agreed=True, stops=True):
    """The reference entry point with one thing done otherwise: the signals it handles, whether
    the ranks agree on stopping (an all_reduce of the flag) or each asks its own, whether the
    flag stops the run at all. (A function of this module: its rejections' tests send this
    module's functions to the ranks by value.)"""

    def entry_point(job):
        import os
        import signal as signals
        import sys

        import torch.distributed as dist

        dist.init_process_group()
        asked = []
        for number in handled:
            signals.signal(number, lambda number, frame: asked.append(number))

        def stop(step):
            if not agreed:
                return bool(asked)
            flag = torch.tensor([float(bool(asked))])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return stops and bool(flag.item())

        job.train(stop)
        dist.barrier()
        sys.stdout.flush()
        os._exit(0)

    return entry_point


ENTRY = "For the case rank=1, after=2, signal_name='SIGTERM': "


# The soak tier runs a third of the cases a commit, in the turns given (conftest.py): by their
# seconds in the soak runs of 2026-11-30/12-01 (SIGTERM only 49, no agreement 42, the others
# 22), beside the turns of the reference solutions' checks (tests/test_exercises.py, SLOW_TURNS).
@pytest.mark.soak  # torchrun of 4 ranks, twice a case
@pytest.mark.parametrize(("mistake", "says", "hint"), [
    pytest.param(entry_point_with(handled=()),
                 ENTRY + "how the signalled run ended: expected 'exit code 0', got 'exit code 1; "
                         "rank 1 exited with -15",
                 "Hint: SIGTERM ended rank 1 at once", id="no handler",
                 marks=pytest.mark.turn(1)),
    pytest.param(entry_point_with(handled=(signal.SIGTERM,)),
                 "For the case rank=3, after=4, signal_name='SIGINT': how the signalled run "
                 "ended: expected 'exit code 0', got 'exit code 1",
                 "Hint: Python turns SIGINT into KeyboardInterrupt", id="SIGTERM only",
                 marks=pytest.mark.turn(0)),
    pytest.param(entry_point_with(stops=False),
                 ENTRY + "the step each rank stopped after: expected [2], got [6]",
                 "Hint: the run went on to the end", id="never stops", marks=pytest.mark.turn(2)),
    # the checker waits out its torchrun timeout (90 s for a learner; 40 s here, where the run
    # has reached its signal long before: the ranks' last events say so)
    pytest.param(entry_point_with(agreed=False),
                 ENTRY + "the signalled run did not end within 40 s and was killed: some rank "
                         "waited for the others: rank 0 had",
                 "Hint: when one rank stops and the others go on", id="no agreement",
                 marks=[pytest.mark.starts_first, pytest.mark.turn(0)]),
])
def test_the_entry_point_checker_rejects(mistake, says, hint, monkeypatch, request):
    if request.node.callspec.id == "no agreement":
        monkeypatch.setattr(capstone_exercises, "ENTRY_TIMEOUT", 40)
    text = expect_rejection("entry_point", mistake, says)
    assert hint in text, text
    assert "had not started" not in text and "had started after step 0" not in text, text


def test_the_entry_point_checker_says_how_a_torchrun_ended_and_where_each_rank_was(tmp_path):
    """From torchrun's agent lines: the exit code, which rank died of which signal, and the first
    worker exception (the rank that failed first), not torchrun's own ChildFailedError; from the
    ranks' events: where each one was when a hung run was killed."""
    from helpers.capstone.exercises import _ended, _last_events
    from helpers.checkpoints_and_failures.elastic import Job

    agent = [(1.0, "[default0]:I1129 api.py] Starting worker group"),
             (2.0, "[rank3]: KeyboardInterrupt"),
             (2.5, "[rank0]: RuntimeError: Connection closed by peer"),
             (3.0, "E1129 api.py] failed (exitcode: -2) local_rank: 3 (pid: 7) of binary: x"),
             (3.1, "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:")]
    assert _ended(Job(1, agent, [], None, 0.0)) == (
        "exit code 1; rank 3 exited with -2 (SIGINT); KeyboardInterrupt")
    assert _ended(Job(0, agent, [], None, 0.0)) == "exit code 0"
    for rank, events in {0: [("started", 0), ("step", 1), ("step", 2)], 1: [("saved", 2)],
                         2: [("returned", 2)]}.items():
        (tmp_path / f"events.rank{rank}.jsonl").write_text("".join(
            json.dumps({"event": event, "step": step}) + "\n" for event, step in events))
    assert _last_events(str(tmp_path)) == ("rank 0 had ended step 2, rank 1 had saved step 2, "
                                           "rank 2 had returned after step 2, rank 3 had not "
                                           "started")
