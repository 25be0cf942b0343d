"""`python -m helpers.on_a_cluster record`: the lesson's requeued job once more, recorded for its
key figure (requeued.json, committed; `make figures` draws it): squeue's states, every rank's
events and plain torchrun's losses. About a minute, as root with Slurm installed."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from helpers.capstone.job import arguments_for
from helpers.on_a_cluster import slurm, training
from helpers.on_a_cluster.cluster import Cluster
from helpers.timing import timestamp

RECORD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "requeued.json")


def record(path: str = RECORD, requeue_after: int = 5) -> dict:
    config = training.LESSON_CONFIG
    with Cluster.start() as cluster:
        directory = cluster.path("capstone")
        submitted = timestamp()
        job = slurm.submit(cluster, slurm.SCRIPT, directory, *arguments_for(config))
        moments = slurm.follow(cluster, job,
                               until=lambda: slurm.last_step(directory) >= requeue_after)
        requeued = slurm.requeue(cluster, job)
        moments += slurm.follow(cluster, job, timeout=120)
        events = slurm.events(directory)
    recorded = {"submitted": submitted, "requeued": requeued,
                "moments": [dataclasses.asdict(moment) for moment in moments],
                "events": events,
                "reference": training.reference_losses(config)}
    with open(path, "w") as file:
        json.dump(recorded, file, indent=1)
    return recorded


def load(path: str = RECORD) -> dict:
    """The record, its moments as slurm.Moment and the reference's steps as ints."""
    with open(path) as file:
        recorded = json.load(file)
    recorded["moments"] = [slurm.Moment(**moment) for moment in recorded["moments"]]
    recorded["reference"] = {int(step): loss for step, loss in recorded["reference"].items()}
    return recorded


if __name__ == "__main__":
    if sys.argv[1:] != ["record"]:
        sys.exit("usage: python -m helpers.on_a_cluster record")
    recorded = record()
    print(f"wrote {RECORD}: {len(recorded['events'])} events")
