"""OpenMP's wait policy under the course's load: the same work with PyTorch's threads spinning
while they wait for work, and asleep (the launcher's default, helpers/launcher/pool.py).

    python benchmarks/openmp_wait.py [--jobs 2] [--repeats 3]

The work is a test tier's on a laptop: `--jobs` processes at once (make test's two pytest
workers), each training lesson 07's ZeRO stages 0-3 on 2 and on 4 ranks beside the single-process
reference they are checked against (tests/test_zero_and_fsdp.py,
test_every_stage_trains_like_one_process). OpenMP reads its settings once, as torch loads it, so
each policy runs in fresh processes; the policies take turns, `--repeats` rounds. Three policies:
- libgomp's default where nothing is set: a thread spins 300,000 times, then sleeps
  (GOMP_SPINCOUNT=300000, the value libgomp reports for an unset OMP_WAIT_POLICY);
- OMP_WAIT_POLICY=ACTIVE: it spins (libgomp: 30 billion times);
- OMP_WAIT_POLICY=PASSIVE: it sleeps at once.
For each, the median wall seconds of a round and the machine's busy CPU seconds in it (from
/proc/stat: run it on an otherwise idle machine, Linux only), and their ratios to PASSIVE.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

POLICIES = {"spins a while (default)": {"GOMP_SPINCOUNT": "300000"},
            "ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
            "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}}


def work():
    """One job: every ZeRO stage on 2 and 4 ranks, and the single-process reference of each."""
    from helpers import reference, run
    from helpers.zero_and_fsdp import workers

    model, batches = reference.in_float64(reference.make_lm(tie_weights=True, seed=0),
                                          reference.lm_data(seed=1, batch_size=8, steps=5))
    for world_size in (2, 4):
        for stage in (0, 1, 2, 3):
            reference.train(model, batches, reference.lm_loss, optimizer="adamw", lr=1e-2)
            run(workers.training_worker, world_size, args=(stage, model, batches),
                show_output=False)


def busy_cpu_seconds() -> float:
    """The machine's CPU seconds spent outside idle and I/O wait since boot (/proc/stat)."""
    with open("/proc/stat") as stat:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, stat.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def one_round(settings: dict, jobs: int) -> tuple:
    """(wall seconds, busy CPU seconds) of `jobs` jobs at once under `settings`."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | settings
    cpu, start = busy_cpu_seconds(), time.perf_counter()
    started = [subprocess.Popen([sys.executable, __file__, "--work"], env=env)
               for _ in range(jobs)]
    if any(job.wait() for job in started):
        sys.exit("a job failed")
    return time.perf_counter() - start, busy_cpu_seconds() - cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.work:
        return work()
    measured = {name: [] for name in POLICIES}
    for _ in range(options.repeats):
        for name, settings in POLICIES.items():
            measured[name].append(one_round(settings, options.jobs))
    print(f"{options.jobs} jobs at once on {os.cpu_count()} CPUs, median of {options.repeats}")
    print(f"{'policy':>24} | {'wall (s)':>8} | {'CPU (s)':>7} | wall / PASSIVE | CPU / PASSIVE")
    passive = [statistics.median(part) for part in zip(*measured["PASSIVE"])]
    for name, rounds in measured.items():
        wall, cpu = (statistics.median(part) for part in zip(*rounds))
        print(f"{name:>24} | {wall:8.1f} | {cpu:7.1f} | {wall / passive[0]:13.2f}x | "
              f"{cpu / passive[1]:12.2f}x")


if __name__ == "__main__":
    main()
