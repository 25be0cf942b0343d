"""Compute, communication and their overlap, read from the Chrome trace `torch.profiler` writes on
one rank of a CPU (gloo) run.

    read_trace(path)        the trace's complete events ("ph": "X") on this process's threads
    intervals(events)       {"compute", "communication", "blocked"}: merged (start, end) pairs
    collectives(events)     {c10d operation: how many calls}
    owners(events)          the same split by whose collectives they are: FSDP2's or DTensor's
    breakdown(path)         seconds of each, their overlap, and the collectives, for one rank
    merge, length, intersect, subtract
                            union, total, and set arithmetic of lists of (start, end) pairs

What the trace holds, under gloo (torch 2.13, `ProfilerActivity.CPU`):

- Each collective this rank launches is a `c10d::` operation on the thread that called it:
  FSDP2's all-gather `c10d::_allgather_base_` and reduce-scatter `c10d::_reduce_scatter_base_`,
  called with async_op=False: the operation only launches it, and torch.distributed's Python
  then waits for it (`Work.wait()`, which the trace does not write as an operation), inside
  whatever runs FSDP2's hook (in backward mostly an autograd node, an operation of the trace;
  the root's reduce-scatter, from autograd's final callback, outside any); DTensor's
  functional collectives (tensor parallelism, the gradients' norm, loss_parallel)
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
  Each process group has worker threads of its own, though, and a thread's transfers follow
  launches of its group: `owners` names each worker thread by the launches that most of its
  transfers follow (the latest launch before each), FSDP2's or DTensor's.

The definitions, all on one rank and its own clock, each a union of intervals:

- communication: the time at least one collective is in flight, the union of the `gloo:` events
  on gloo's worker threads. A collective waiting in a worker's queue behind another is not yet
  in flight; one whose peer has not arrived yet is.
- compute: the time any other thread (the main thread, which on CPU also runs backward: there
  is no autograd thread) is inside a PyTorch operation (category "cpu_op") that is not a
  collective: the union of those operations, less the blocked time. Python between
  operations, FSDP's hooks, and annotations (`record_function`, "ProfilerStep#N") are neither.
- blocked: the time the computing threads spend launching collectives or waiting for them: the
  union of those `c10d::` and `_c10d_functional::` operations, and of FSDP2's transfers (the
  `gloo:` events on the worker threads of FSDP2's group, `thread_owners`), which its caller
  waits for as they run.
- overlap: the time in both communication and compute; exposed: the time in communication and
  not in compute (this rank had a collective in flight and computed nothing); overlap share:
  overlap / communication.
- by owner (`owners`): FSDP2's communication is the union of the `gloo:` events on the threads
  FSDP2's launches feed (the "dp" group's: its one all-reduce a step for the clipping norm,
  DTensor's, goes there too), DTensor's the rest; each owner's overlap and exposed time as
  above, against all of compute (FSDP2's overlap is then nil: its caller waits); and where the
  computing thread was while communication was exposed: waiting for FSDP2 (in its launches or
  its transfers), inside one of DTensor's calls (launches and `wait_tensor`), or elsewhere
  (Python between operations). An owner's exposed time may coincide with the other's: the
  owners' add up to more than the rank's exposed time when both groups are in flight at once.
- the collectives: each outermost `c10d::` operation on a computing thread is one collective
  (one `gloo:` event). A dispatch mode active while profiling (the course's TensorParallelBytes,
  for one) can write an operation twice, one inside the other: it is counted once. Such a mode
  also runs Python inside every operation, which the trace counts as compute.
"""

from __future__ import annotations

import bisect
import collections
import json

GLOO = "gloo:"  # the transfer, on gloo's worker threads
COLLECTIVE_CALLS = ("c10d::", "_c10d_functional::")  # launches and waits, on the caller's thread
FSDP2_CALLS = ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_")  # FSDP2's launches
OWNERS = ("FSDP2", "DTensor")
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
    workers, owned = gloo_threads(events), thread_owners(events)
    callers = [event for event in events if event["tid"] not in workers]
    in_flight = [span(event) for event in events
                 if event["tid"] in workers and event["name"].startswith(GLOO)]
    synchronous = [span(event) for event in events
                   if owned.get(event["tid"]) == "FSDP2" and event["name"].startswith(GLOO)]
    blocked = merge([*(span(event) for event in callers
                       if event["name"].startswith(COLLECTIVE_CALLS)), *synchronous])
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


def owner_of(name: str) -> str:
    """Whose collective a `c10d::` or `_c10d_functional::` operation launches or waits for."""
    return "FSDP2" if name in FSDP2_CALLS else "DTensor"


def thread_owners(events) -> dict:
    """{gloo worker thread: "FSDP2" or "DTensor"}: whose launches most of its transfers follow
    (for each transfer, the latest outermost `c10d::` launch on a computing thread that started
    before it)."""
    workers = gloo_threads(events)
    launches = sorted((event["ts"], owner_of(event["name"])) for event in outermost(
        events, lambda event: event["tid"] not in workers and event["name"].startswith("c10d::")))
    starts = [start for start, _ in launches]
    votes = collections.defaultdict(collections.Counter)
    for event in events:
        if event["tid"] in workers and event["name"].startswith(GLOO):
            latest = bisect.bisect_right(starts, event["ts"]) - 1
            if latest >= 0:
                votes[event["tid"]][launches[latest][1]] += 1
    return {thread: counted.most_common(1)[0][0] for thread, counted in votes.items()}


def owners(events, found: dict | None = None) -> dict:
    """{owner: {"communication", "overlap", "exposed", "waiting"}} in merged pairs, for "FSDP2"
    and "DTensor" (the module's docstring defines them; "waiting": the computing threads inside
    the owner's calls, or waiting for FSDP2's transfers), and "exposed_where": {"FSDP2",
    "DTensor", "elsewhere"}, the rank's exposed time split by where its computing thread was.
    `found`: intervals(events), if already read."""
    found, owned = found or intervals(events), thread_owners(events)
    workers = gloo_threads(events)
    compute = found["compute"]
    calls = [event for event in events if event["tid"] not in workers
             and event["name"].startswith(COLLECTIVE_CALLS)]
    split = {}
    for owner in OWNERS:
        in_flight = merge(span(event) for event in events
                          if owned.get(event["tid"]) == owner and event["name"].startswith(GLOO))
        waiting = [span(event) for event in calls if owner_of(event["name"]) == owner]
        if owner == "FSDP2":  # its caller waits for the transfer itself
            waiting += in_flight
        split[owner] = {"communication": in_flight, "overlap": intersect(in_flight, compute),
                        "exposed": subtract(in_flight, compute), "waiting": merge(waiting)}
    exposed = subtract(found["communication"], compute)
    fsdp2 = intersect(exposed, split["FSDP2"]["waiting"])
    dtensor = intersect(subtract(exposed, fsdp2), split["DTensor"]["waiting"])
    split["exposed_where"] = {"FSDP2": fsdp2, "DTensor": dtensor,
                              "elsewhere": subtract(subtract(exposed, fsdp2), dtensor)}
    return split


def breakdown(path) -> dict:
    """One rank's trace, in seconds: compute_s, communication_s, overlap_s, exposed_s,
    blocked_s, overlap_share (of communication; 0 without any), collectives {name: calls}, and
    owners: `owners`' split, each list of pairs as its seconds."""
    events = read_trace(path)
    found = intervals(events)
    by_owner = {owner: {what: length(spans) * MICROSECONDS for what, spans in parts.items()}
                for owner, parts in owners(events, found).items()}
    compute, communication = found["compute"], found["communication"]
    overlap = length(intersect(communication, compute))
    return {"compute_s": length(compute) * MICROSECONDS,
            "communication_s": length(communication) * MICROSECONDS,
            "overlap_s": overlap * MICROSECONDS,
            "exposed_s": length(subtract(communication, compute)) * MICROSECONDS,
            "blocked_s": length(found["blocked"]) * MICROSECONDS,
            "overlap_share": overlap / length(communication) if communication else 0.0,
            "collectives": collectives(events), "owners": by_owner}
