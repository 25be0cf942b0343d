"""Reference solution of lesson 15's exercise (helpers.on_a_cluster.exercises)."""


def batch_script(nodes: int, ranks_per_node: int) -> str:
    """Every rank a Slurm task: srun starts nodes x ranks_per_node copies of the capstone, and
    each reads its rank from Slurm. srun's block distribution puts tasks 0 to k-1 on the first
    node, k to 2k-1 on the second: rank r on node r // ranks_per_node. The rendezvous is
    init_process_group's own (env://): rank 0 hosts a store at MASTER_ADDR:MASTER_PORT, the
    first node's address. A requeue runs the script again with the same arguments: the capstone
    saved when Slurm's SIGTERM reached every task, and goes on from there."""
    return f"""#!/bin/bash
#SBATCH --job-name=capstone
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node={ranks_per_node}
#SBATCH --cpus-per-task=1
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue

nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
export MASTER_ADDR=$(scontrol show node "${{nodes[0]}}" | grep -oP 'NodeAddr=\\K\\S+')
export MASTER_PORT=29500

srun --cpus-per-task="$SLURM_CPUS_PER_TASK" --kill-on-bad-exit=1 --distribution=block bash -c \\
    'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID \\
     exec python -m helpers.capstone.job "$@"' bash "$@"
"""


def hostnames(nodelist: str) -> list:
    """Split at the commas outside brackets; expand each name's brackets, the leftmost slowest."""
    import itertools
    import re

    names, depth, start = [], 0, 0
    for index, char in enumerate(nodelist + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            names.append(nodelist[start:index])
            start = index + 1
    expanded = []
    for name in filter(None, names):
        parts = re.split(r"\[([^\]]*)\]", name)  # text, bracket, text, bracket, ..., text
        choices = []
        for index, part in enumerate(parts):
            if index % 2 == 0:
                choices.append([part])
                continue
            numbers = []
            for item in part.split(","):
                low, _, high = item.partition("-")
                width = len(low)
                numbers += [str(n).zfill(width) for n in range(int(low), int(high or low) + 1)]
            choices.append(numbers)
        expanded += ["".join(combination) for combination in itertools.product(*choices)]
    return expanded
