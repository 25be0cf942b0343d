"""Reference solutions of lesson 04's exercises. Try the exercise first."""

from helpers.cost_model import BUSBW_FACTORS


def bus_bandwidth(op, world_size, input_bytes, seconds):
    # nccl-tests' S: all_gather's is its output, n inputs; the others' is their input
    size_bytes = input_bytes * world_size if op == "all_gather" else input_bytes
    return size_bytes / seconds * BUSBW_FACTORS[op](world_size)


def alpha_beta_from_two_points(size1, seconds1, size2, seconds2):
    beta = (size2 - size1) / (seconds2 - seconds1)
    return seconds1 - size1 / beta, beta


def two_level_all_reduce_seconds(size_bytes, nodes, gpus_per_node, intra_bandwidth,
                                 inter_bandwidth):
    g, n = gpus_per_node, nodes
    reduce_scatter = (g - 1) / g * size_bytes / intra_bandwidth  # each GPU keeps S/g, summed
    all_reduce = 2 * (n - 1) / n * (size_bytes / g) / inter_bandwidth  # only S/g leaves the node
    all_gather = (g - 1) / g * size_bytes / intra_bandwidth
    return reduce_scatter + all_reduce + all_gather
