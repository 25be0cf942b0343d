"""Lesson 14: the capstone's run equals one process (float64, on three layouts), resumes exactly,
refuses what it cannot run, and learns: the corpus, its baseline, the schedule; its exercises'
checkers reject typical mistakes."""

import dataclasses
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from checker import expect_rejection

from helpers.capstone import corpus, job
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


def test_the_learning_rate_warms_up_linearly_then_falls_as_half_a_cosine():
    config = dataclasses.replace(TINY, steps=12, warmup=4, final_lr_share=0.1)
    shares = [lr_factor(config, step) for step in range(config.steps)]
    assert shares[:4] == [0.25, 0.5, 0.75, 1.0]
    assert shares[-1] == pytest.approx(0.1)
    assert shares[7] == pytest.approx(0.55)  # halfway down (4 of 8 steps): peak and floor's mean
    assert all(later < earlier for earlier, later in zip(shares[3:], shares[4:]))


# --- the capstone exercise rejects typical mistakes (its solution passes: test_exercises.py) ----

def without_recomputation(rank, world_size, job, directory, recompute):
    from helpers.capstone.solutions import capstone
    return capstone(rank, world_size, job, directory, False)


def counting_from_zero_again(rank, world_size, job, directory, recompute):
    from helpers.capstone import solutions
    found = solutions.latest_checkpoint
    solutions.latest_checkpoint = lambda directory: (found(directory)[0], 0)
    return solutions.capstone(rank, world_size, job, directory, recompute)


def clipping_each_ranks_pieces(rank, world_size, job, directory, recompute):
    from helpers.capstone import solutions

    def local_norm(model, max_norm):
        pieces = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([piece.norm() for piece in pieces]))
        for piece in pieces:
            piece.mul_(min(1.0, max_norm / (norm.item() + 1e-6)))

    solutions.clip_to_norm = local_norm
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


@pytest.mark.soak  # each check launches 4 ranks several times
@pytest.mark.parametrize(("mistake", "says"), [
    (without_recomputation, "fewer bytes kept for backward with recompute:"),
    (every_rank_alone, "without recompute, fewer bytes kept than one process keeps for half "
                       "the batch: expected True, got False"),
    (counting_from_zero_again, "the steps the second run trained"),
    (clipping_each_ranks_pieces, "the second run's losses, by step: 4: expected"),
])
def test_the_capstone_checker_rejects(mistake, says):
    expect_rejection("capstone", mistake, says)


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

def counting_shared_pieces_twice(rank, world_size, pieces, dp_rank, tp_rank):
    import math

    import torch.distributed as dist

    total = torch.zeros(1, dtype=torch.float64)
    for piece in pieces.values():
        total += piece.double().pow(2).sum()
    dist.all_reduce(total)
    return math.sqrt(total.item())


def one_all_reduce_per_dimension(rank, world_size, pieces, dp_rank, tp_rank):
    """Right, as DTensor does it: over dp, then over tp (what the task's rule forbids)."""
    import math

    import torch.distributed as dist

    dp_groups = [dist.new_group([dp * 2 + tp for dp in range(world_size // 2)]) for tp in (0, 1)]
    tp_groups = [dist.new_group([dp * 2, dp * 2 + 1]) for dp in range(world_size // 2)]
    blocks = sum(piece.double().pow(2).sum() for name, piece in pieces.items()
                 if name.startswith("blocks."))
    shared = sum(piece.double().pow(2).sum() for name, piece in pieces.items()
                 if not name.startswith("blocks."))
    total = torch.stack([blocks, shared])
    dist.all_reduce(total, group=dp_groups[tp_rank])
    blocks_only = total[:1].clone()
    dist.all_reduce(blocks_only, group=tp_groups[dp_rank])
    return math.sqrt((blocks_only + total[1]).item())


@pytest.mark.parametrize(("mistake", "says"), [
    (counting_shared_pieces_twice, "Hint: does each piece count once?"),
    (one_all_reduce_per_dimension, "rank 0's all_reduce calls held [2, 1] elements (2 calls)"),
])
def test_the_global_norm_checker_rejects(mistake, says):
    expect_rejection("global_norm", mistake, says)
