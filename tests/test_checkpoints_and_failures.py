"""Lesson 12 (helpers.checkpoints_and_failures): DCP's files tile their map and a load reads
exactly the pieces a rank holds; a checkpoint saved by FSDP on 4 ranks loads into FSDP on 2, DP x
TP on 2 x 2 and one process, equal to what was saved and to one process; a resumed run equals an
uninterrupted one and each piece left out changes it; async_save stages one copy of the state;
torchrun's restart after a killed rank ends equal to an uninterrupted run; a killed rank's peers
learn at once and a frozen one's at the timeout; a rank out of step is found by DETAIL,
monitored_barrier and the flight recorder.

No rounding can change these results (counts, messages, bit-for-bit comparisons of runs on the
same kernels, float64 against one process): the file is not marked numerical."""

import dataclasses
import functools
import os
import tempfile

import pytest
import torch
from checker import expect_rejection

from helpers import reference, run
from helpers.checkpoints_and_failures import elastic, failures, resume, sharded
from helpers.checkpoints_and_failures.solutions import fell_out_of_step
from helpers.launcher.report import WorkerError, WorkerTimeout

SHOWN = "model.blocks.0.feed_forward.down.weight"  # 32 x 128: FSDP cuts rows, TP columns


def model_and_batches():
    return reference.in_float64(reference.make_lm(seed=0),
                                reference.lm_data(seed=1, batch_size=8, steps=2))


@functools.cache
def saved(how, ranks, directory):
    return run(sharded.save_worker, ranks, args=(*model_and_batches(), directory, how),
               show_output=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The model trained 2 steps by FSDP on 4 ranks, saved with DCP."""
    directory = str(tmp_path_factory.mktemp("dcp4"))
    return directory, saved("dcp", 4, directory)


def assert_same_state(got, expected):
    """Bit for bit: a load copies bytes."""
    assert got["model"].keys() == expected["model"].keys()
    for name, value in expected["model"].items():
        assert torch.equal(got["model"][name], value), name
    assert got["optimizer"].keys() == expected["optimizer"].keys()
    for name, state in expected["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(got["optimizer"][name][key], value), (name, key)


# --- saving -------------------------------------------------------------------------------------

def test_each_dcp_file_is_exactly_its_pieces_and_the_pieces_tile_every_tensor(checkpoint):
    directory, out = checkpoint
    rows = sharded.pieces(directory)
    for rank in range(4):
        name = f"__{rank}_0.distcp"
        mine = sorted((row["offset"], row["length"]) for row in rows if row["file"] == name)
        assert mine[0][0] == 0
        assert all(a[0] + a[1] == b[0] for a, b in zip(mine, mine[1:]))  # back to back
        assert mine[-1][0] + mine[-1][1] == os.path.getsize(os.path.join(directory, name))
        assert out[rank]["written"][name] == os.path.getsize(os.path.join(directory, name))
    assert set(out[0]["written"]) == {"__0_0.distcp", ".metadata"}
    model = model_and_batches()[0]
    for name, parameter in model.named_parameters():
        covered = torch.zeros(parameter.shape, dtype=torch.int)
        for row in rows:
            if row["name"] == f"model.{name}":
                assert row["shape"] == tuple(parameter.shape)
                covered[tuple(slice(s, s + n) for s, n in zip(row["start"], row["piece"]))] += 1
        assert (covered == 1).all(), name  # every element stored exactly once


def test_a_full_state_dict_is_written_and_read_by_rank_0_alone(tmp_path):
    out = saved("full", 4, str(tmp_path))
    size = os.path.getsize(tmp_path / sharded.FULL_FILE)
    assert [rank["written"] for rank in out] == [{sharded.FULL_FILE: size}, {}, {}, {}]
    loaded = run(sharded.load_worker, 2, args=(model_and_batches()[0], str(tmp_path), "full"),
                 show_output=False)
    assert [rank["bytes read"] for rank in loaded] == [size, 0]
    assert_same_state(loaded[1]["state"], out[0]["state"])


# --- resharding ---------------------------------------------------------------------------------

@pytest.mark.parametrize("layout, ranks", [("fsdp", 2), ("dp×tp", 4), ("one process", 1)])
def test_a_4_rank_fsdp_checkpoint_loads_into_another_layout(checkpoint, layout, ranks):
    directory, out = checkpoint
    model, batches = model_and_batches()
    loaded = run(sharded.load_worker, ranks, args=(model, directory, "dcp", layout),
                 show_output=False)
    for rank in range(ranks):
        assert_same_state(loaded[rank]["state"], out[0]["state"])
    torch.testing.assert_close(loaded[0]["state"], sharded.one_process_state(model, batches))
    # the part of the shown weight each rank read is exactly the part it holds: FSDP on n ranks
    # holds 32/n rows; DP x TP (rank = 2 dp + tp) 16 rows and 64 columns (a row-parallel layer)
    for rank in range(ranks):
        held = torch.zeros(32, 128, dtype=torch.int)
        for piece in loaded[rank]["read"]:
            if piece.name == SHOWN:
                held[tuple(slice(s, s + n) for s, n in zip(piece.start, piece.sizes))] += 1
        expected = torch.zeros(32, 128, dtype=torch.int)
        if layout == "dp×tp":
            dp, tp = divmod(rank, 2)
            expected[16 * dp:16 * (dp + 1), 64 * tp:64 * (tp + 1)] = 1
        else:
            rows = 32 // ranks
            expected[rows * rank:rows * (rank + 1)] = 1
        assert torch.equal(held, expected), rank
        files = {piece.file for piece in loaded[rank]["read"] if piece.name == SHOWN}
        expected_files = ({f"__{2 * dp}_0.distcp", f"__{2 * dp + 1}_0.distcp"}
                          if layout == "dp×tp" else
                          {f"__{r}_0.distcp" for r in range(4 // ranks * rank,
                                                            4 // ranks * (rank + 1))})
        assert files == expected_files


# --- resume -------------------------------------------------------------------------------------

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
    losses, weights = resume.one_process_losses(experiment, 2)
    torch.testing.assert_close(whole["losses"], losses)
    torch.testing.assert_close(whole["state"]["model"], weights)
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


def test_torchrun_restarts_a_killed_rank_and_the_job_ends_equal_to_an_uninterrupted_run(
        tmp_path):
    experiment = resume.Experiment(steps=6, save_every=2)
    job = elastic.torchrun_job(str(tmp_path), nproc=2, kill=(1, 3), experiment=experiment)
    assert job.returncode == 0, "\n".join(line for _, line in job.agent[-30:])
    assert sorted({event["attempt"] for event in job.events}) == [0, 1]
    assert [event["rank"] for event in job.events if event["event"] == "killed"] == [1]
    started = {(event["attempt"], event["rank"]): event["step"] for event in job.events
               if event["event"] == "started"}
    assert started == {(0, 0): 0, (0, 1): 0, (1, 0): 2, (1, 1): 2}
    assert job.result["attempt"] == 1 and sorted(job.result["losses"]) == [3, 4, 5, 6]
    whole = uninterrupted(experiment)
    assert all(job.result["losses"][step] == whole["losses"][step] for step in range(3, 7))
    assert_same_state(job.result["state"], whole["state"])
    story = [what for _, what in elastic.agent_story(job)]
    assert story == ["starts the workers", "rank 1 exited with -9", "group failed: restarts it",
                     "starts the workers", "finished"]


# --- failures -----------------------------------------------------------------------------------

def test_a_killed_ranks_peers_learn_at_once_and_a_frozen_ones_at_their_timeout(tmp_path):
    with pytest.raises(WorkerError) as killed:
        run(failures.peer_view_worker, 3, args=(2, 3, "SIGKILL", 2, str(tmp_path / "kill")),
            show_output=False)
    assert killed.value.rank == 2 and killed.value.message == "died from signal SIGKILL"
    views = failures.peer_views(str(tmp_path / "kill"))
    assert [(view["rank"], view["step"], view["error"]) for view in views] == [
        (0, 3, "a peer's connection broke"), (1, 3, "a peer's connection broke")]
    assert all(view["waited"] < 1 for view in views)  # the group's timeout is 2 s
    with pytest.raises(WorkerTimeout) as frozen:
        run(failures.peer_view_worker, 3, args=(2, 3, "SIGSTOP", 1, str(tmp_path / "stop")),
            timeout=3, show_output=False)
    assert frozen.value.where[2].startswith("stopped (by SIGSTOP")
    views = failures.peer_views(str(tmp_path / "stop"))
    assert [(view["rank"], view["step"], view["error"]) for view in views] == [
        (0, 3, "timed out"), (1, 3, "timed out")]
    assert all(view["waited"] >= 1 for view in views)


def test_a_rank_out_of_step_is_named_by_detail_and_monitored_barrier():
    with pytest.raises(WorkerError) as mismatch:
        run(failures.mismatch_worker, 4, args=(2,), env=failures.DETAIL, show_output=False)
    assert sorted(failures.fingerprints(mismatch.value.message)) == [
        (mismatch.value.rank, 1, "ALLREDUCE", "[8]"), (2, 1, "BROADCAST", "[8]")]
    with pytest.raises(WorkerError) as late:
        run(failures.extra_collective_worker, 4, args=(3, 0.5), show_output=False)
    assert late.value.rank == 0
    assert "Ranks 3 failed to pass monitoredBarrier" in late.value.message


def test_the_flight_recorder_shows_which_rank_fell_out_of_step():
    dumps = run(failures.skipped_worker, 4, args=(3, 2, 1, 1), env=failures.FLIGHT_RECORDER,
                show_output=False)
    # 3 collectives a step; rank 2 skips step 1's loss all-reduce (#6), so its #6 is step 2's
    # all-gather while the others' #6 is the loss all-reduce
    rows = failures.compare(list(dumps))
    assert [number for number, _ in rows] == [4, 5, 6]  # two agreeing, then the first that differs
    assert rows[0][1] == {rank: "all_gather" for rank in range(4)}
    assert rows[2][1] == {0: "all_reduce", 1: "all_reduce", 2: "all_gather", 3: "all_reduce"}
    assert [seq for seq, *_ in failures.records(dumps[0])] == list(range(1, 7))
    assert all(line.startswith("skipped_worker, line ")
               for dump in dumps for *_, line in failures.records(dump))
    assert fell_out_of_step(list(dumps)) == 2


def test_the_launcher_sees_through_deprecated_wrappers_to_the_workers_line():
    with pytest.raises(WorkerTimeout) as hung:
        run(failures.skipped_worker, 4, args=(3, 1, 0, 60), timeout=2, show_output=False)
    assert "all_gather_into_tensor(), called from skipped_worker at" in hung.value.where[1]
    assert "all_reduce(), called from skipped_worker at" in hung.value.where[0]


# --- the exercises' checkers --------------------------------------------------------------------

def resumable_with(scheduler=True, rng_key="rng.rank{rank}", checkpoints=True):
    """The reference solution, with one thing done wrong: the scheduler's state not saved, every
    rank's RNG state under one shared key (DCP then saves one rank's, for all), or no checkpoint
    at all (every run starts over: it ends right, but the second run redoes every step)."""
    def resumable(rank, world_size, job, directory):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from helpers.checkpoints_and_failures.resume import checkpoint_path, latest_checkpoint
        from helpers.checkpoints_and_failures.sharded import build, full_state

        model, optimizer, _, _ = build("fsdp", world_size, job.model())
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
            batch = job.batch(sampler, epoch, offset)
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
    expect_rejection("resumable", mistake, "their losses, by step")


def test_resumable_checker_rejects_a_loop_that_starts_over():
    expect_rejection("resumable", resumable_with(checkpoints=False),
                     "the steps the second run trained: expected [7, 8, 9, 10]")


def positional(dumps):
    """Compares the ranks' entries by their place in the list, not by sequence number."""
    names = [[entry["profiling_name"] for entry in dump["entries"]] for dump in dumps]
    for index in range(min(map(len, names))):
        column = [calls[index] for calls in names]
        for rank, call in enumerate(column):
            if column.count(call) == 1:
                return rank
    return 0


def last_entry_only(dumps):
    """Looks only at each rank's newest entry: blind to a rank that stopped early."""
    last = [dump["entries"][-1]["profiling_name"] for dump in dumps]
    return next((rank for rank, call in enumerate(last) if last.count(call) == 1), 0)


@pytest.mark.parametrize("mistake", [positional, last_entry_only])
def test_fell_out_of_step_checker_rejects_a_typical_mistake(mistake):
    expect_rejection("fell_out_of_step", mistake, "expected")
