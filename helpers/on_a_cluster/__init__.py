"""Lesson 15, on a real cluster: notebooks/15_on_a_cluster.ipynb.

Lesson 14's capstone submitted to a real Slurm of two nodes that this machine runs itself,
followed, requeued mid-run and resumed exactly, broken in the four ways a first cluster breaks,
and swept with a job array; the batch scripts are capstone.sbatch (srun and torchrun's c10d
rendezvous) and sweep.sbatch (a job array). network: hosts of their own, each in a network
namespace with its own address, host name and /tmp, joined by links of a set bandwidth
(benchmarks/topology.py measures them). cluster: two compute nodes and a login node on that
network, with munge, slurmctld and a slurmd a node, started and stopped by process id (`make
cluster`). slurm: sbatch, squeue, scontrol and sacct from the kernel. training: the training
submitted, and the same under plain torchrun. failures: the four mistakes and what they print.
storage: a checkpoint in a node's own /tmp, not found when the job is requeued onto another node
(scratch.sbatch). bandwidth: every rank says what Slurm and torchrun gave it, and the link is
timed; the first step of the batch script for a GPU cluster, gpu.sbatch (a rank a GPU, NCCL's
settings, a time limit that requeues).
__main__: a requeued job recorded for the key figure
(requeued.json). plots: drawn in the kernel. exercises: the checked exercises;
solutions: their reference solutions.
"""

NOTEBOOK = "15_on_a_cluster.ipynb"
NEEDS = (12, 14)  # lessons to do first (helpers.lessons)
# After the lesson, a student can (docs/syllabus.md):
CAN_DO = ("run that loop under Slurm on several nodes, requeued when preempted")
# Its notebook and its tests run against a real Slurm cluster, in a tier of their own
# (make cluster-tests; helpers/lessons.py).
TIER = "cluster"
SLOW = True  # its notebook is the cluster tier's longest file: it starts first

# The names this lesson takes from earlier lessons (tests/test_structure.py checks the imports):
BUILDS_ON = {
    "capstone.train:Config": "lesson 14's recipe",
    "capstone.job:arguments_for": "lesson 14's torchrun script, whose flags a job passes",
    "capstone.job:torchrun_job": "lesson 14's torchrun script on one machine: the reference",
    "capstone.corpus:bits_per_byte": "lesson 14's unit of loss",
    "checkpoints_and_failures.elastic:torchrun_environment": "lesson 12's torchrun settings",
}
