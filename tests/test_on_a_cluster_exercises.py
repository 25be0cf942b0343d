"""Lesson 15's exercises, checked for real: the batch script submitted to a cluster the checker
starts, and node lists expanded as Slurm's own scontrol does. Marked `cluster` (see
tests/test_on_a_cluster.py)."""

import os

import pytest

from helpers.exercises import check, solution
from helpers.on_a_cluster import slurm
from helpers.on_a_cluster.cluster import unavailable

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(
    unavailable() is not None and not os.environ.get("REQUIRE_CLUSTER"),
    reason=f"no cluster here: {unavailable()}")]


def test_the_batch_script_solution_passes():
    result = check("batch_script", solution("batch_script"))
    assert result.passed, repr(result)


def test_the_batch_script_checker_rejects_torchrun_where_srun_must_start_the_ranks():
    with open(slurm.SCRIPT) as file:
        lesson_script = file.read()
    result = check("batch_script", lambda nodes, ranks_per_node: lesson_script)
    assert not result.passed
    # for 2 nodes x 1 rank the script's two ranks a node give 4 ranks for a mesh of 2
    assert "For the case nodes=2, ranks_per_node=1" in repr(result)
    assert "ValueError: a mesh of dp 2 x tp 1 needs 2 ranks, not 4" in repr(result)


def test_the_batch_script_checker_rejects_ranks_dealt_round_robin_over_the_nodes():
    def cyclic(nodes, ranks_per_node):
        return solution("batch_script")(nodes, ranks_per_node).replace(
            "--distribution=block", "--distribution=cyclic")

    result = check("batch_script", cyclic)
    assert not result.passed
    assert "\"each rank's node\": 1: expected 0, got 1" in repr(result)  # rank 1 on node 1


def test_the_batch_script_checker_rejects_a_job_that_cannot_be_requeued():
    def never_again(nodes, ranks_per_node):
        return solution("batch_script")(nodes, ranks_per_node).replace(
            "#SBATCH --requeue", "#SBATCH --no-requeue")

    result = check("batch_script", never_again)
    assert not result.passed
    assert "'the job': expected 'COMPLETED', got 'refused a requeue" in repr(result)


def test_the_node_list_solution_passes_and_typical_mistakes_do_not():
    assert check("hostnames", solution("hostnames")).passed
    assert not check("hostnames", lambda nodelist: nodelist.split(",")).passed

    def unpadded(nodelist):  # gpu[01-03] read as gpu1, gpu2, gpu3
        names = solution("hostnames")(nodelist)
        return [name.replace("gpu0", "gpu") for name in names]

    result = check("hostnames", unpadded)
    assert not result.passed and "gpu01" in repr(result)
