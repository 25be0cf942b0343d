"""Lesson 04's exercises, checked by `helpers.exercises.check(name, your_function)`."""

from helpers.exercises import Exercise
from helpers.measuring_communication.workers import bandwidths

EXERCISES = {
    "bus_bandwidth": Exercise(
        "given op, world size n, size S in bytes and time t in seconds, return busbw in "
        "bytes/s with nccl-tests' factors",
        [("all_reduce", 4, 2**26, 0.05), ("reduce_scatter", 8, 2**24, 0.01),
         ("broadcast", 2, 2**20, 0.001), ("all_gather", 3, 3 * 2**20, 0.002)],
        lambda op, n, size, seconds: bandwidths(op, n, size, seconds)["busbw"],
        distributed=False),
    "alpha_beta_from_two_points": Exercise(
        "given two measurements (size1, t1) and (size2, t2) of t = alpha + size / beta, "
        "return (alpha, beta)",
        [(1e-3, 2e9, 1e3, 1e8), (5e-6, 4e10, 4096, 2**30)],  # alpha, beta, size1, size2
        lambda alpha, beta, size1, size2: (alpha, beta),
        inputs=lambda alpha, beta, size1, size2: (size1, alpha + size1 / beta,
                                                  size2, alpha + size2 / beta),
        distributed=False),
}
