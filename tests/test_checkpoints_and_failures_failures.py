"""Lesson 12, failures and desyncs (helpers.checkpoints_and_failures.failures): a killed rank's
peers learn from its broken connection, a frozen one's at their timeout; a rank out of step is
found by DETAIL, monitored_barrier and the flight recorder; the `fell_out_of_step` checker rejects
typical mistakes.

No rounding can change these results (counts, messages, bit-for-bit comparisons of runs on the
same kernels, float64 against one process): the file is not marked numerical."""

import pytest
from checker import expect_rejection

from helpers import run
from helpers.checkpoints_and_failures import failures
from helpers.checkpoints_and_failures.solutions import fell_out_of_step
from helpers.launcher.report import WorkerError, WorkerTimeout


def test_a_killed_ranks_peers_learn_from_the_connection_a_frozen_ones_at_the_timeout(tmp_path):
    # The killed rank's peers are told by the broken connection, not by their group's timeout:
    # the error says so, and with a timeout of 60 s the wait stays far below it on any load.
    with pytest.raises(WorkerError) as killed:
        run(failures.peer_view_worker, 3, kwargs=dict(
            victim=2, step=3, how="SIGKILL", timeout_s=60, directory=str(tmp_path / "kill")),
            show_output=False)
    assert killed.value.rank == 2 and killed.value.message == "died from signal SIGKILL"
    views = failures.peer_views(str(tmp_path / "kill"))
    assert [(view["rank"], view["step"], view["error"]) for view in views] == [
        (0, 3, "a peer's connection broke"), (1, 3, "a peer's connection broke")]
    assert all(view["waited"] < 60 for view in views)
    # A frozen rank breaks nothing: its peers wait out their timeout (1 s), never less.
    with pytest.raises(WorkerTimeout) as frozen:
        run(failures.peer_view_worker, 3, kwargs=dict(
            victim=2, step=3, how="SIGSTOP", timeout_s=1, directory=str(tmp_path / "stop")),
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
    dumps = run(failures.skipped_worker, 4, env=failures.FLIGHT_RECORDER, show_output=False,
                kwargs=dict(steps=3, skipping_rank=2, skipped_step=1, timeout_s=1))
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
        run(failures.skipped_worker, 4, timeout=2, show_output=False, kwargs=dict(
            steps=3, skipping_rank=1, skipped_step=0, timeout_s=60))
    assert "all_gather_into_tensor(), called from skipped_worker at" in hung.value.where[1]
    assert "all_reduce(), called from skipped_worker at" in hung.value.where[0]


# --- the exercise's checker ----------------------------------------------------------------------

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


def newest_entries_only(dumps):
    """Looks for a rank whose newest entry differs, and assumes there is one: `next` raises
    StopIteration where every rank's newest entry is the same collective."""
    newest = [dump["entries"][-1]["profiling_name"] for dump in dumps]
    return next(rank for rank, call in enumerate(newest) if newest.count(call) == 1)


def test_fell_out_of_step_checker_shows_where_the_learners_code_raised_and_on_which_case():
    text = expect_rejection("fell_out_of_step", newest_entries_only,
                            "For the case case='skipped a loss all-reduce', your function "
                            "raised StopIteration (with no message)")
    lines = text.splitlines()
    # the traceback starts at the learner's function (the checker's own frames left out) and
    # shows its line
    start = lines.index("Traceback (most recent call last):")
    assert lines[start + 1].endswith(", in newest_entries_only")
    assert lines[start + 2].strip() == ("return next(rank for rank, call in enumerate(newest) "
                                        "if newest.count(call) == 1)")
    assert "exercises.py" not in text
