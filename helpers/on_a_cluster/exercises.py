"""Lesson 15's exercise, checked by `helpers.exercises.check(name, your_function)`: a batch
script, submitted for real to a cluster the checker starts."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import shutil
import subprocess
import tempfile

from helpers.capstone.job import arguments_for
from helpers.exercises import Exercise
from helpers.on_a_cluster import slurm
from helpers.on_a_cluster.cluster import RUNS, Cluster
from helpers.on_a_cluster.failures import errors_in
from helpers.on_a_cluster.training import LESSON_CONFIG, reference_losses

EXERCISES = {}

REQUEUE_AFTER = 3  # the checker requeues the job once rank 0 has finished this step
JOB_TIMEOUT = 90  # seconds a job may take (one takes about 15, a requeued one 30)
CASES = [(2, 1, False), (2, 2, True)]  # (nodes, ranks_per_node, requeued once): quick first
_SAID = {}  # what the last submitted job printed, for the hint


def config_for(nodes: int, ranks_per_node: int):
    """The capstone's recipe (lesson 15's small one) on a mesh of dp nodes x tp ranks_per_node."""
    return dataclasses.replace(LESSON_CONFIG, dp=nodes, tp=ranks_per_node, steps=6, save_every=4)


def _submitted(function, nodes: int, ranks_per_node: int, requeued: bool) -> dict:
    """Submit the learner's script to the cluster this process has up (the lesson's), else to
    one of its own; requeue it once if asked; what it did, as the task states it."""
    script = function(nodes, ranks_per_node)
    config = config_for(nodes, ranks_per_node)
    running = Cluster.running()
    with contextlib.nullcontext(running) if running else Cluster.start() as cluster:
        directory = tempfile.mkdtemp(prefix="batch_script-", dir=cluster.directory)
        job = slurm.submit(cluster, script, directory, *arguments_for(config))
        try:
            return _outcome(cluster, job, directory, requeued)
        finally:  # a job still queued leaves the lesson's cluster with the check
            cluster.run(["scancel", job], check=False)


def _outcome(cluster: Cluster, job: str, directory: str, requeued: bool) -> dict:
    """What the job did, as the task states it; requeued once first if `requeued`."""
    outcome = {}
    if requeued:
        with contextlib.suppress(slurm.StillQueued):  # said below, in which state
            slurm.follow(cluster, job, timeout=JOB_TIMEOUT,
                         until=lambda: slurm.last_step(directory) >= REQUEUE_AFTER)
        if slurm.last_step(directory) >= REQUEUE_AFTER:
            try:
                slurm.requeue(cluster, job)
            except subprocess.CalledProcessError as error:
                outcome["the job"] = ("refused a requeue: "
                                      + (error.stderr or error.stdout).strip())
    if "the job" not in outcome:
        try:
            slurm.follow(cluster, job, timeout=JOB_TIMEOUT)
            states = [row["State"] for row in slurm.finished(cluster) if row["JobID"] == job]
            outcome["the job"] = states[-1] if states else "?"
        except slurm.StillQueued as error:  # say in which state; it is cancelled
            outcome["the job"] = f"still {error.state} after {error.timeout:g} s"
    _SAID["lines"] = _tail(directory)
    _SAID["slurm"] = cluster.slurms_view() if outcome["the job"].startswith("still ") else []
    started = slurm.ranks(directory)
    first = [event for event in started if event["restart"] == 0]
    outcome["ranks"] = len(first)
    outcome["started by"] = sorted({"torchrun" if event["torchrun"] else
                                    "srun" if event["task"] is not None else "?"
                                    for event in started})
    order = sorted({event["node"] for event in first})
    outcome["each rank's node"] = {event["rank"]: order.index(event["node"])
                                   for event in first}
    if requeued:
        outcome["went on from the step it stopped at"] = _resumed_where_stopped(directory)
    steps = [event for event in slurm.events(directory)
             if event["event"] == "step" and event["rank"] == 0]
    outcome["losses"] = {event["step"]: event["loss"] for event in steps}
    return outcome


def _resumed_where_stopped(directory: str) -> bool:
    events = [event for event in slurm.events(directory) if event["rank"] == 0]
    stopped = [event["step"] for event in events if event["event"] == "stopping"]
    again = [event["step"] for event in events
             if event["event"] == "started" and event["restart"] > 0]
    return bool(stopped) and again[:1] == stopped[:1]


def _tail(directory: str) -> list:
    """What a learner reads first in the job's logs, whatever the script named them: every
    distinct error (failures.errors_in), then the last lines of each log."""
    names = sorted(name for name in os.listdir(directory) if name.endswith(".out")) \
        if os.path.isdir(directory) else []
    texts, tails = [], []
    for name in names:
        with open(os.path.join(directory, name), errors="replace") as file:
            texts.append(file.read())
        kept = [line for line in texts[-1].splitlines() if not line.startswith(("I1", "W1"))]
        tails += [f"{name}:", *kept[-4:]]
    return [*(f"error: {error}" for error in errors_in(texts)), *tails]


@functools.cache
def _reference_losses(nodes: int, ranks_per_node: int) -> dict:
    return reference_losses(config_for(nodes, ranks_per_node))


def _expected(nodes: int, ranks_per_node: int, requeued: bool) -> dict:
    expected = {"the job": "COMPLETED", "ranks": nodes * ranks_per_node,
                "started by": ["srun"],
                "each rank's node": {rank: rank // ranks_per_node
                                     for rank in range(nodes * ranks_per_node)}}
    if requeued:
        expected["went on from the step it stopped at"] = True
    expected["losses"] = _reference_losses(nodes, ranks_per_node)
    return expected


def _hint(got, expected, nodes, ranks_per_node, requeued) -> str | None:
    if isinstance(got, dict) and got.get("the job") != "COMPLETED":
        said = _SAID.get("lines") or ["(nothing)"]
        if _SAID.get("slurm"):
            said = [*said, "and what Slurm said of it then:", *_SAID["slurm"]]
        return ("what the job printed last:\n  " + "\n  ".join(said) + "\nA common cause: "
                "each task must find its own rank, and in the batch script $SLURM_PROCID is the "
                "first node's, the same for all (srun bash -c '...' reads it in each task)")
    return None


EXERCISES["batch_script"] = Exercise(
    "batch_script(nodes, ranks_per_node) returns the text of a batch script that trains lesson "
    "14's capstone (python -m helpers.capstone.job, given the job's directory and its flags as "
    "the script's arguments: --dp nodes --tp ranks_per_node and the recipe's) on `nodes` nodes "
    "with `ranks_per_node` ranks each. Every rank is a Slurm task of its own (srun starts the "
    "ranks, not torchrun), rank r runs on the job's node r // ranks_per_node (each "
    "tensor-parallel group on one node), the rendezvous is at the first node (on any port free "
    "there: each node is a host of its own), and the job can be requeued at any step: it then "
    "goes on from the step it stopped at, and ends with the losses of the same training under "
    "plain torchrun, bit for bit. Checked for 2 nodes x 1 rank, then 2 nodes x 2 ranks requeued "
    "after step 3",
    CASES, _expected, distributed=False,
    harness=_submitted,
    names=(),
    hint="under srun, each task finds its number in SLURM_PROCID, the task count in "
         "SLURM_NTASKS, its number on the node in SLURM_LOCALID",
    hint_for=_hint,
    rel_tol=0.0,  # the same operations in the same order as the torchrun run: equal, bit for bit
    points=3,
    by_hand="it submits jobs to the lesson's Slurm cluster, whose daemons run as root, and the "
            "grader's sandbox runs answers as another user, with no network but its own loopback",
)


# --- node lists ---------------------------------------------------------------------------------


# Slurm's own expansion of each node list, as `scontrol show hostnames` gave it (Slurm 22.05.8;
# tests/test_on_a_cluster_exercises.py checks it against scontrol where Slurm is installed): the
# checker's expected names where it is not, as on a laptop without Slurm.
RECORDED_HOSTNAMES = {
    "n[1-2]": ["n1", "n2"],
    "node7": ["node7"],
    "gpu[01-03,07],login1": ["gpu01", "gpu02", "gpu03", "gpu07", "login1"],
    "n[8-10]": ["n8", "n9", "n10"],
    "rack[1-2]-node[1-2]": ["rack1-node1", "rack1-node2", "rack2-node1", "rack2-node2"],
}
NODELISTS = [(nodelist,) for nodelist in RECORDED_HOSTNAMES]  # the checker's cases


def _expected_hostnames(nodelist: str) -> list:
    """Slurm's own expansion: scontrol's where Slurm is installed, else as recorded from it."""
    if shutil.which("scontrol") is None:
        return list(RECORDED_HOSTNAMES[nodelist])
    return _slurms_hostnames(nodelist)


def _slurms_hostnames(nodelist: str) -> list:
    """Slurm's own expansion (scontrol show hostnames), with a configuration of two lines: it
    needs no running cluster. Its configuration goes in runs/, or where that cannot be written
    (a grader's read-only sandbox, helpers/grading) in the temporary folder."""
    try:
        directory = tempfile.mkdtemp(prefix="hostnames-", dir=_runs())
    except OSError:
        directory = tempfile.mkdtemp(prefix="hostnames-")
    try:
        conf = os.path.join(directory, "slurm.conf")
        with open(conf, "w") as file:
            file.write("ClusterName=hostnames\nSlurmctldHost=localhost\n")
        done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                              text=True, env={**os.environ, "SLURM_CONF": conf}, check=True)
        return done.stdout.split()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _runs() -> str:
    os.makedirs(RUNS, exist_ok=True)
    return RUNS


def _hostnames_hint(got, expected, nodelist) -> str | None:
    """The hint for the typical mistake that `got` shows, if it shows one; else the general one."""
    if not isinstance(got, list) or not all(isinstance(name, str) for name in got):
        return "return a list of str, one host name each"
    if any(name.count("[") != name.count("]") for name in got):
        return ("a comma inside brackets separates numbers, not names: split the list only at "
                "commas outside brackets, then expand each name's brackets")
    if any(mark in name for name in got for mark in "[],"):
        return ("a bracket is left in a name: expand it, one name per number (\"n[1-2]\" is n1, "
                "n2; \"gpu[01-03,07]\" is gpu01, gpu02, gpu03, gpu07)")
    if sorted(got) == sorted(expected):
        return ("the names are right, their order is not: names in the order written, and in a "
                "name with two brackets the first bracket's numbers change slowest")
    unpadded = [re.sub(r"(?<!\d)0+(?=\d)", "", name) for name in expected]
    if [re.sub(r"(?<!\d)0+(?=\d)", "", name) for name in got] == unpadded:
        return ("a number is written as wide as it is in the list: \"gpu[01-03]\" gives gpu01, "
                "gpu02, gpu03 (the width of \"01\" kept), and \"n[8-10]\" gives n8, n9, n10 "
                "(no zeros where none are written)")
    if len(got) < len(expected) and set(got) <= set(expected):
        return ("some names are missing: a range gives every number from its first to its last, "
                "both included (\"n[8-10]\": n8, n9, n10), a single number one name (the 07 of "
                "\"gpu[01-03,07]\"), and two brackets every combination")
    return None


EXERCISES["hostnames"] = Exercise(
    "hostnames(nodelist) returns the list of host names in a Slurm node list such as "
    "SLURM_JOB_NODELIST, in the order `scontrol show hostnames` gives them: names separated by "
    "commas, a bracket of numbers and ranges (zero padding kept) giving one name each, two "
    "brackets in one name giving every combination; so that a script can find its first node "
    "where scontrol is not installed (a container)",
    NODELISTS, _expected_hostnames, distributed=False,
    hint="\"gpu[01-03,07]\" is gpu01, gpu02, gpu03, gpu07: the width of \"01\" is kept",
    hint_for=_hostnames_hint,
)
