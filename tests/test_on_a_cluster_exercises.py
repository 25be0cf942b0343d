"""Lesson 15's exercises, checked for real: the batch script submitted to a cluster the checker
starts, and node lists expanded as Slurm's own scontrol does. Marked `cluster` (see
tests/test_on_a_cluster.py)."""

import os

import pytest

from helpers.exercises import check, solution
from helpers.on_a_cluster import exercises, slurm
from helpers.on_a_cluster.cluster import Cluster, unavailable

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(
    unavailable() is not None and not os.environ.get("REQUIRE_CLUSTER"),
    reason=f"no cluster here: {unavailable()}")]


@pytest.mark.starts_first  # the tier's longest test: two jobs, each against plain torchrun
def test_the_batch_script_solution_passes():
    result = check("batch_script", solution("batch_script"))
    assert result.passed, repr(result)


def test_the_batch_script_checker_rejects_torchrun_where_srun_must_start_the_ranks():
    with open(slurm.SCRIPT) as file:
        lesson_script = file.read()
    with Cluster.start() as cluster:  # as in the lesson, whose cluster is up: the checker uses it
        result = check("batch_script", lambda nodes, ranks_per_node: lesson_script)
        # its job ran here (the check stops at the first case that fails: one folder)
        assert len([name for name in os.listdir(cluster.directory)
                    if name.startswith("batch_script-")]) == 1
        assert cluster.run(["squeue", "-h"]).strip() == ""  # no job of the check's left
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


def test_the_recorded_node_lists_are_slurms_own():
    """What the checker expects where Slurm is not installed is what scontrol says."""
    for nodelist, names in exercises.RECORDED_HOSTNAMES.items():
        assert exercises._slurms_hostnames(nodelist) == names, nodelist


def test_the_node_list_solution_passes_and_typical_mistakes_do_not():
    assert check("hostnames", solution("hostnames")).passed
    assert not check("hostnames", lambda nodelist: nodelist.split(",")).passed

    def unpadded(nodelist):  # gpu[01-03] read as gpu1, gpu2, gpu3
        names = solution("hostnames")(nodelist)
        return [name.replace("gpu0", "gpu") for name in names]

    result = check("hostnames", unpadded)
    assert not result.passed and "gpu01" in repr(result)


def test_each_typical_node_list_mistake_gets_its_own_hint():
    def split_at_every_comma(nodelist):  # gpu[01-03,07] cut into "gpu[01-03" and "07]"
        return [name for piece in nodelist.split(",")
                for name in (solution("hostnames")(piece) if "[" in piece and "]" in piece
                             else [piece])]

    def brackets_left(nodelist):  # gpu[01-03,07] kept whole
        names, depth, name = [], 0, ""
        for char in nodelist + ",":
            depth += {"[": 1, "]": -1}.get(char, 0)
            if char == "," and depth == 0:
                names.append(name)
                name = ""
            else:
                name += char
        return names

    def unpadded(nodelist):  # gpu[01-03] read as gpu1, gpu2, gpu3
        return [name.replace("gpu0", "gpu") for name in solution("hostnames")(nodelist)]

    def widest(nodelist):  # n[8-10] padded to n08, n09, n10
        return [name if not name[1:].isdigit() else name[0] + name[1:].zfill(2)
                for name in solution("hostnames")(nodelist)]

    def last_bracket_slowest(nodelist):  # rack[1-2]-node[1-2] as rack1-node1, rack2-node1, ...
        names = solution("hostnames")(nodelist)
        if nodelist.startswith("rack"):
            return sorted(names, key=lambda name: name.split("-node")[::-1])
        return names

    def range_ends_excluded(nodelist):  # range(low, high), the last number lost
        names = solution("hostnames")(nodelist)
        return [name for name in names if name not in ("n2", "gpu03", "n10", "rack2-node2")]

    hints = {}
    for mistake in (split_at_every_comma, brackets_left, unpadded, widest,
                    last_bracket_slowest, range_ends_excluded):
        result = check("hostnames", mistake)
        assert not result.passed, mistake.__name__
        hints[mistake.__name__] = [line for line in result.lines if line.startswith("Hint:")]
    assert all(len(hint) == 1 for hint in hints.values()), hints
    assert len({hint[0] for hint in hints.values()}) == len(hints) - 1, hints  # unpadded, widest:
    assert hints["unpadded"] == hints["widest"]  # one hint: a number as wide as it is written
    assert "commas outside brackets" in hints["split_at_every_comma"][0]
    assert "a bracket is left" in hints["brackets_left"][0]
    assert "first bracket's numbers change slowest" in hints["last_bracket_slowest"][0]
    assert "both included" in hints["range_ends_excluded"][0]

