"""Lesson 12, the loop under torchrun (helpers.checkpoints_and_failures.elastic): torchrun's
restart after a killed rank ends equal to an uninterrupted run, bit for bit.

No rounding can change these results (counts, messages, bit-for-bit comparisons of runs on the
same kernels, float64 against one process): the file is not marked numerical."""

import pytest
from compare import assert_same_state

from helpers import run
from helpers.checkpoints_and_failures import elastic, resume


@pytest.mark.soak  # a real torchrun job, killed and restarted (notebook 12 runs one too)
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
    whole = run(resume.resumable_worker, 2, args=(experiment, str(tmp_path / "whole")),
                show_output=False)[0]
    assert all(job.result["losses"][step] == whole["losses"][step] for step in range(3, 7))
    assert_same_state(job.result["state"], whole["state"])
    story = [what for _, what in elastic.agent_story(job)]
    assert story == ["starts the workers", "rank 1 exited with -9", "group failed: restarts it",
                     "starts the workers", "finished"]


@pytest.mark.soak  # a real torchrun, left to hang for its timeout
def test_a_torchrun_past_its_timeout_is_killed_with_every_worker(tmp_path):
    """torch starts each worker in a session of its own: killing torchrun's process group alone
    left them running, orphaned, after the TimeoutError (a learner's hung entry point, lesson
    14's checker). Nothing of the job may outlive it."""
    import secrets

    import psutil

    mark = secrets.token_hex(8)  # in the workers' command line, to find them by
    with pytest.raises(TimeoutError, match="did not finish within 20 s"):
        elastic.run_torchrun("timeit", ["-n", "1", f"import time; time.sleep(600)  # {mark}"],
                             tmp_path, nproc=2, max_restarts=0, timeout=20)
    left = [process.info for process in psutil.process_iter(["pid", "cmdline"])
            if any(mark in part for part in process.info["cmdline"] or [])]
    assert left == []
