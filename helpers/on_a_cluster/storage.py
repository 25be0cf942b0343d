"""Where a checkpoint must go on a cluster, shown: scratch.sbatch saves lesson 14's capstone to
its node's own /tmp; requeued onto another node (the first drained, as for its maintenance), the
job finds no checkpoint there and starts over.

- `moved_to_another_node(cluster, directory, arguments)`: submit scratch.sbatch, let rank 0
  train `after` steps, drain its node and requeue it; once it has started on the other node,
  cancel it, return the node to service and wait until both nodes are idle. Returns a Moved:
  where each run ran, the step the first stopped at, the checkpoints on the first node's disk,
  the step the second started from.

The kernel reads each node's /tmp from outside (`cluster.network.scratch(node)`), as an
administrator could; the job's own log, in the shared folder, says what each run found.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from helpers.on_a_cluster import slurm
from helpers.on_a_cluster.cluster import NODES, Cluster
from helpers.timing import timestamp

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scratch.sbatch")
CHECKPOINTS = "capstone"  # the folder in a node's /tmp that scratch.sbatch saves to


@dataclass
class Moved:
    nodes: list  # the node of each run: [first, second]
    stopped_at: int  # the step the first run stopped and saved at
    on_first_node: list  # the checkpoints in the first node's /tmp/capstone: ["step-0003"]
    started_from: int  # the step the second run started from (0: from scratch)
    log: list  # the job's own log: what each run found


def node_events(cluster: Cluster, node: str) -> list:
    """Every event the capstone's ranks wrote to `node`'s /tmp/capstone."""
    return slurm.events(os.path.join(cluster.network.scratch(node), CHECKPOINTS))


def moved_to_another_node(cluster: Cluster, directory: str, arguments: list, after: int = 3,
                          timeout: float = 90) -> Moved:
    """Submit scratch.sbatch in `directory` with the capstone's `arguments`; once rank 0 has
    trained `after` steps, drain its node and requeue the job; once the requeued run has
    started on the other node, cancel it, and return the drained node to service."""
    job = slurm.submit(cluster, SCRIPT, directory, *arguments)
    first = None

    def trained() -> bool:
        nonlocal first
        running = cluster.run(["squeue", "-h", "-j", job, "-o", "%N"], check=False).strip()
        first = running or first
        return first in NODES and any(event["event"] == "step" and event["rank"] == 0
                                      and event["step"] >= after
                                      for event in node_events(cluster, first))

    try:
        slurm.follow(cluster, job, until=trained, timeout=timeout)
        if not trained():
            raise RuntimeError(f"job {job} ended before step {after}:\n" + cluster.report())
        cluster.run(["scontrol", "update", f"NodeName={first}", "State=DRAIN",
                     "Reason=maintenance"])
        slurm.requeue(cluster, job)
        second = next(node for node in NODES if node != first)
        deadline = timestamp() + timeout
        while not [event for event in node_events(cluster, second)
                   if event["event"] == "started" and event["rank"] == 0]:
            if timestamp() > deadline:
                raise RuntimeError(f"job {job} did not start again on {second}:\n"
                                   + cluster.report())
            time.sleep(0.5)
    finally:
        cluster.run(["scancel", job], check=False)
        if first in NODES:
            cluster.run(["scontrol", "update", f"NodeName={first}", "State=RESUME"],
                        check=False)
    slurm.wait_all(cluster, job)
    cluster.wait_until_idle()
    stopped = [event["step"] for event in node_events(cluster, first)
               if event["event"] == "stopping" and event["rank"] == 0]
    started = [event["step"] for event in node_events(cluster, second)
               if event["event"] == "started" and event["rank"] == 0]
    folder = os.path.join(cluster.network.scratch(first), CHECKPOINTS)
    with open(os.path.join(directory, f"scratch-{job}.out")) as log:
        lines = [line.rstrip() for line in log if line.startswith("restart ")]
    return Moved([first, second], stopped[0] if stopped else -1,
                 sorted(name for name in os.listdir(folder) if name.startswith("step-")),
                 started[0], lines)
