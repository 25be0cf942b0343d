"""Lesson 15's batch-script checker rejects typical mistakes, each script submitted for real: the
fastest-failing ones. A file of their own so that the cluster tier (make cluster-tests, a worker a
file) runs them after the lesson's notebook, beside the solution's longer test
(tests/test_on_a_cluster_exercises.py), instead of after it on the same worker."""

import os

import pytest

from helpers.exercises import check, solution
from helpers.on_a_cluster import slurm
from helpers.on_a_cluster.cluster import unavailable

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(
    unavailable() is not None and not os.environ.get("REQUIRE_CLUSTER"),
    reason=f"no cluster here: {unavailable()}")]


def test_the_batch_script_checker_rejects_torchrun_where_srun_must_start_the_ranks():
    with open(slurm.SCRIPT) as file:
        lesson_script = file.read()
    result = check("batch_script", lambda nodes, ranks_per_node: lesson_script)
    assert not result.passed
    # for 2 nodes x 1 rank the script's two ranks a node give 4 ranks for a mesh of 2
    assert "For the case nodes=2, ranks_per_node=1" in repr(result)
    assert "ValueError: a mesh of dp 2 x tp 1 needs 2 ranks, not 4" in repr(result)


def test_the_batch_script_checker_rejects_a_job_that_cannot_be_requeued():
    def never_again(nodes, ranks_per_node):
        return solution("batch_script")(nodes, ranks_per_node).replace(
            "#SBATCH --requeue", "#SBATCH --no-requeue")

    result = check("batch_script", never_again)
    assert not result.passed
    assert "'the job': expected 'COMPLETED', got 'refused a requeue" in repr(result)
