"""Compute, communication and their overlap, read from the Chrome trace `torch.profiler` writes on
one rank of a CPU (gloo) run.

    read_trace(path)        the trace's complete events ("ph": "X") on this process's threads
    intervals(events)       {"compute", "communication", "blocked"}: merged (start, end) pairs
    collectives(events)     {c10d operation: how many calls}
    breakdown(path)         seconds of each, their overlap, and the collectives, for one rank
    merge, length, intersect, subtract
                            union, total, and set arithmetic of lists of (start, end) pairs

What the trace holds, under gloo (torch 2.13, `ProfilerActivity.CPU`):

- Each collective this rank launches is a `c10d::` operation on the thread that called it:
  FSDP2's all-gather `c10d::_allgather_base_` and reduce-scatter `c10d::_reduce_scatter_base_`,
  synchronous here (their asyncOp argument is False): the operation lasts until the transfer ends;
  DTensor's functional collectives (tensor parallelism, the gradients' norm, loss_parallel)
  `c10d::allgather_into_tensor_coalesced_`, `c10d::reduce_scatter_tensor_coalesced_` and
  `c10d::allreduce_`, each inside a `_c10d_functional::` operation of the same name, which only
  launches it; the caller waits later, in `_c10d_functional::wait_tensor`, often nested inside
  the compute operation that first reads the result. Selective activation checkpointing's
  recomputation writes a `_c10d_functional::reduce_scatter_tensor` with no `c10d::` operation
  inside: it hands back the saved result and moves nothing.
- The transfer itself runs on gloo's worker threads (named pt_gloo_runloop, two for each process
  group) as a `gloo:all_gather` or `gloo:all_reduce` event, from the moment a worker picks the
  collective up until it ends, waiting for the slowest peer included. gloo runs a reduce-scatter
  as an all-reduce of the whole input, so its event is a `gloo:all_reduce`.
- No event carries the collective's name, group or message size ("record_param_comms" is not
  written under gloo): the shapes of the operation's inputs, with record_shapes=True, are all.

The definitions, all on one rank and its own clock, each a union of intervals:

- communication: the time at least one collective is in flight, the union of the `gloo:` events
  on gloo's worker threads. A collective waiting in a worker's queue behind another is not yet
  in flight; one whose peer has not arrived yet is.
- compute: the time any other thread (the main thread, which on CPU also runs backward: there
  is no autograd thread) is inside a PyTorch operation (category "cpu_op") that is not a
  collective: the union of those operations, less the union of the `c10d::` and
  `_c10d_functional::` operations (launches and waits) on those threads. Python between
  operations, FSDP's hooks, and annotations (`record_function`, "ProfilerStep#N") are neither.
- blocked: the union of those `c10d::` and `_c10d_functional::` operations: the time the
  computing threads spend launching collectives or waiting for them.
- overlap: the time in both communication and compute; exposed: the time in communication and
  not in compute (this rank had a collective in flight and computed nothing); overlap share:
  overlap / communication.
- the collectives: each outermost `c10d::` operation on a computing thread is one collective
  (one `gloo:` event). A dispatch mode active while profiling (the course's TensorParallelBytes,
  for one) can write an operation twice, one inside the other: it is counted once. Such a mode
  also runs Python inside every operation, which the trace counts as compute.
"""

from __future__ import annotations

import collections
import json

GLOO = "gloo:"  # the transfer, on gloo's worker threads
COLLECTIVE_CALLS = ("c10d::", "_c10d_functional::")  # launches and waits, on the caller's thread
MICROSECONDS = 1e-6  # the trace's unit


def read_trace(path) -> list[dict]:
    """The complete events ("ph": "X") of the profiled process's threads, in the trace's order;
    the profiler's own span (pid "Spans") left out."""
    with open(path) as file:
        trace = json.load(file)
    return [event for event in trace["traceEvents"]
            if event.get("ph") == "X" and isinstance(event.get("tid"), int)]


def span(event) -> tuple[float, float]:
    """(start, end) of an event, in microseconds."""
    return event["ts"], event["ts"] + event["dur"]


def merge(spans) -> list[tuple[float, float]]:
    """The union of (start, end) pairs, as sorted pairs that neither overlap nor touch."""
    merged = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        elif end > start:
            merged.append((start, end))
    return merged


def length(spans) -> float:
    """The total length of merged pairs."""
    return sum(end - start for start, end in spans)


def intersect(first, second) -> list[tuple[float, float]]:
    """The pairs of time in both of two merged lists."""
    both, i, j = [], 0, 0
    while i < len(first) and j < len(second):
        start, end = max(first[i][0], second[j][0]), min(first[i][1], second[j][1])
        if start < end:
            both.append((start, end))
        if first[i][1] < second[j][1]:
            i += 1
        else:
            j += 1
    return both


def subtract(first, second) -> list[tuple[float, float]]:
    """The pairs of time in `first` and not in `second`, both merged lists."""
    left, j = [], 0
    for start, end in first:
        while j < len(second) and second[j][1] <= start:
            j += 1
        k = j
        while k < len(second) and second[k][0] < end:
            if second[k][0] > start:
                left.append((start, second[k][0]))
            start = max(start, second[k][1])
            k += 1
        if start < end:
            left.append((start, end))
    return left


def gloo_threads(events) -> set:
    """The threads that run gloo's transfers: those with a `gloo:` event."""
    return {event["tid"] for event in events if event["name"].startswith(GLOO)}


def intervals(events) -> dict:
    """{"compute", "communication", "blocked"}: merged (start, end) pairs in microseconds, as the
    module's docstring defines them."""
    workers = gloo_threads(events)
    callers = [event for event in events if event["tid"] not in workers]
    in_flight = [span(event) for event in events
                 if event["tid"] in workers and event["name"].startswith(GLOO)]
    blocked = merge(span(event) for event in callers
                    if event["name"].startswith(COLLECTIVE_CALLS))
    operations = merge(span(event) for event in callers if event.get("cat") == "cpu_op")
    return {"compute": subtract(operations, blocked), "communication": merge(in_flight),
            "blocked": blocked}


def outermost(events, wanted) -> list[dict]:
    """The events for which `wanted(event)` holds and that are not inside another event of the
    same name on the same thread."""
    found, open_ends = [], collections.defaultdict(list)  # thread: [(end, name)] enclosing
    for event in sorted(events, key=lambda event: (event["tid"], event["ts"], -event["dur"])):
        enclosing = open_ends[event["tid"]]
        while enclosing and enclosing[-1][0] <= event["ts"]:
            enclosing.pop()
        if wanted(event) and all(name != event["name"] for _, name in enclosing):
            found.append(event)
        enclosing.append((span(event)[1], event["name"]))
    return found


def collectives(events) -> dict:
    """{name: calls} of the outermost `c10d::` operations on the computing threads: the
    collectives this rank launched, each one `gloo:` event on a worker thread."""
    workers = gloo_threads(events)
    launched = outermost(events, lambda event: event["tid"] not in workers
                         and event["name"].startswith("c10d::"))
    return dict(collections.Counter(event["name"] for event in launched))


def breakdown(path) -> dict:
    """One rank's trace, in seconds: compute_s, communication_s, overlap_s, exposed_s,
    blocked_s, overlap_share (of communication; 0 without any) and collectives {name: calls}."""
    events = read_trace(path)
    found = intervals(events)
    compute, communication = found["compute"], found["communication"]
    overlap = length(intersect(communication, compute))
    return {"compute_s": length(compute) * MICROSECONDS,
            "communication_s": length(communication) * MICROSECONDS,
            "overlap_s": overlap * MICROSECONDS,
            "exposed_s": length(subtract(communication, compute)) * MICROSECONDS,
            "blocked_s": length(found["blocked"]) * MICROSECONDS,
            "overlap_share": overlap / length(communication) if communication else 0.0,
            "collectives": collectives(events)}
