"""Lesson 04's exercises, checked by `helpers.exercises.check(name, your_function)`."""

import math

from helpers.cost_model import BUSBW_FACTORS, bandwidths
from helpers.exercises import Exercise


def _two_level_seconds(size_bytes, nodes, gpus_per_node, intra_bandwidth, inter_bandwidth):
    """Reduce-scatter inside each node, all-reduce of each GPU's 1/g piece across the nodes (a
    ring over the nodes), all-gather inside each node; each phase at its own link's bandwidth."""
    g = gpus_per_node
    inside = BUSBW_FACTORS["reduce_scatter"](g) * size_bytes / intra_bandwidth
    across = BUSBW_FACTORS["all_reduce"](nodes) * size_bytes / g / inter_bandwidth
    return inside + across + inside


def _whole_array(op, world_size, input_bytes):
    """nccl-tests' S from one rank's input: all_gather's S is the gathered output, n inputs;
    every other collective's S is its input (reduce_scatter's input is the whole array)."""
    return input_bytes * world_size if op == "all_gather" else input_bytes


def _bus_bandwidth_hint(got, expected, op, world_size, input_bytes, seconds):
    """The two usual mistakes, recognised: algbw returned for busbw, and all_gather's S taken as
    one rank's input."""
    if not isinstance(got, int | float):
        return None
    whole = _whole_array(op, world_size, input_bytes)
    algbw = bandwidths(op, world_size, whole, seconds)["algbw"]
    if math.isclose(got, algbw, rel_tol=1e-6) and not math.isclose(algbw, expected, rel_tol=1e-6):
        return ("that is algbw, S / t. busbw is what each rank's link carries: algbw times the "
                "collective's factor.")
    if whole != input_bytes and math.isclose(got * whole / input_bytes, expected, rel_tol=1e-6):
        return (f"{op}'s input is one rank's piece; nccl-tests' S is the gathered output, "
                f"{world_size} pieces.")
    return None


EXERCISES = {
    "bus_bandwidth": Exercise(
        "given op, world size n, the bytes of the input tensor each rank passes to the call, and "
        "the time t in seconds, return busbw in bytes/s with nccl-tests' factors; careful: "
        "nccl-tests' S is the whole array, which is not always the input",
        [("all_reduce", 4, 2**26, 0.05), ("reduce_scatter", 8, 2**24, 0.01),
         ("broadcast", 2, 2**20, 0.001), ("all_gather", 3, 2**20, 0.002),
         ("all_to_all", 4, 2**22, 0.004), ("reduce", 6, 2**20, 0.003)],
        lambda op, n, input_bytes, seconds: bandwidths(
            op, n, _whole_array(op, n, input_bytes), seconds)["busbw"],
        distributed=False, hint_for=_bus_bandwidth_hint,
        hint="which factor does nccl-tests give this collective? The table under \"algbw and "
             "busbw\" has one for each."),
    "alpha_beta_from_two_points": Exercise(
        "given two measurements (size1, t1) and (size2, t2) of t = alpha + size / beta, "
        "return (alpha, beta)",
        # alpha, beta, size1, size2: size1 / beta at least five times alpha, so that an alpha
        # taken as t1 (size1 / beta not taken off) is far outside the comparison's tolerance
        [(1e-3, 2e9, 1e7, 1e8), (5e-6, 4e10, 2**20, 2**30)],
        lambda alpha, beta, size1, size2: (alpha, beta),
        inputs=lambda alpha, beta, size1, size2: (size1, alpha + size1 / beta,
                                                  size2, alpha + size2 / beta),
        distributed=False, names=("alpha", "beta")),
    "two_level_all_reduce_seconds": Exercise(
        "given S bytes on each of `nodes` x `gpus_per_node` GPUs, the bandwidth of the links "
        "inside a node and of each GPU's link between nodes (bytes/s, one direction), return the "
        "bandwidth-only time of a two-level all-reduce: reduce-scatter inside each node, "
        "all-reduce of each GPU's piece across the nodes, all-gather inside each node",
        [(2**30, 4, 8, 450e9, 50e9), (2**28, 1, 8, 450e9, 50e9), (2**28, 16, 1, 450e9, 50e9),
         (10**9, 2, 4, 300e9, 25e9)],
        _two_level_seconds,
        distributed=False, points=2),
}
