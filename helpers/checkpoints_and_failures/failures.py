"""When a rank dies, hangs or falls out of step (lesson 12,
notebooks/12_checkpoints_and_failures.ipynb).

A rank dies (SIGKILL: out of memory, a preemption). Its peers are in the middle of a collective
with it. The kernel closes a killed process's sockets, and gloo tells each peer at once
("Connection closed by peer"), on this machine or another. A rank that hangs instead (here
SIGSTOP: frozen, sockets open, as a deadlocked or swapping process), or a host or link that dies,
tells its peers nothing: they wait until their group's timeout.

    peer_view_worker(rank, world_size, victim, step, how, timeout_s, directory)
        every rank all-reduces step after step; at `step` the victim is SIGKILLed or SIGSTOPped.
        Each peer writes what it saw to `directory` (read back with peer_views).

A rank that falls out of step calls its collectives in another order than its peers, or skips
one; its peers then wait in a collective it never joins, or exchange the wrong tensors. Three
ways to find it, from the ranks' own records:

    TORCH_DISTRIBUTED_DEBUG=DETAIL   before every collective the ranks compare its fingerprint
                                     (sequence number, op, tensor count, shapes, dtypes,
                                     devices): a mismatch raises at once, naming both ranks'
                                     collectives (mismatch_worker)
    dist.monitored_barrier           rank 0 waits for every rank, each with a timeout, and names
                                     the ranks that did not arrive (gloo only;
                                     extra_collective_worker)
    the flight recorder              each rank keeps its last N collectives (TORCH_FR_BUFFER_SIZE,
                                     default 2000; 0: off); flight_records() returns them
                                     (skipped_worker), compared in the kernel (records, compare)

What the flight recorder records for gloo (torch 2.13, read from its dumps): each collective's
sequence number in its group, its name ("gloo:all_reduce"), input and output sizes and dtypes,
the group, the timeout, and the Python stack that issued it, down to the worker's own line. Its
state stays "scheduled" and its start and completion times stay empty: gloo reports neither.
On NCCL the records also carry when the watchdog saw each collective complete (and start, with
TORCH_NCCL_ENABLE_TIMING=1). The watchdog is NCCL's alone, not run here: a thread that polls the
GPU's work and, when a collective outlives its timeout, dumps the recorder (by default,
TORCH_NCCL_DUMP_ON_TIMEOUT) and ends the process (TORCH_NCCL_ASYNC_ERROR_HANDLING: 3,
ProcessGroupNCCL's own default, without aborting the communicators; 1 aborts them first, and is
what torchrun's agent exports to its workers unless it is set).
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import re
import signal

import torch
import torch.distributed as dist

from helpers.timing import Clock

FLIGHT_RECORDER = {"TORCH_FR_BUFFER_SIZE": "64"}  # env for run(): each rank's last 64 (of 2000)
DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}


# --- a rank dies, or freezes --------------------------------------------------------------------

def peer_view_worker(rank, world_size, victim, step, how, timeout_s, directory):
    """All-reduce a tensor `step` + 2 times on a group whose timeout is `timeout_s`; before its
    `step`-th all-reduce the victim sends itself `how` ("SIGKILL" or "SIGSTOP"). Every other
    rank writes to `directory` the step where its all-reduce failed, the seconds it waited there,
    and the error's first words; then it returns."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    tensor = torch.ones(1024)
    for current in range(step + 2):
        if rank == victim and current == step:
            os.kill(os.getpid(), getattr(signal, how))
        clock = Clock()
        try:
            dist.all_reduce(tensor, group=group)
        except RuntimeError as error:
            seen = {"rank": rank, "step": current, "waited": clock(),
                    "error": gist(str(error))}
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, f"peer{rank}.json"), "w") as file:
                json.dump(seen, file)
            return seen
    return None


def peer_views(directory) -> list:
    """What each peer of peer_view_worker saw, in rank order."""
    views = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("peer"):
            with open(os.path.join(directory, name)) as file:
                views.append(json.load(file))
    return sorted(views, key=lambda view: view["rank"])


# What a gloo error says happened, without its file, line and port (which vary from run to run).
GISTS = {"Connection closed by peer": "a peer's connection broke",
         "Connection reset by peer": "a peer's connection broke",
         "Timed out": "timed out"}


def gist(message: str) -> str:
    return next((gist for words, gist in GISTS.items() if words in message),
                message.splitlines()[0][:80])


# --- a rank out of step -------------------------------------------------------------------------

def mismatch_worker(rank, world_size, odd_rank):
    """Each rank all-reduces twice; `odd_rank` broadcasts instead the second time. Run with
    env=DETAIL: the second collective raises on every rank, naming the mismatch."""
    tensor = torch.ones(8)
    dist.all_reduce(tensor)
    if rank == odd_rank:
        dist.broadcast(tensor, src=0)
    else:
        dist.all_reduce(tensor)


def extra_collective_worker(rank, world_size, odd_rank, timeout_s):
    """`odd_rank` calls an all-reduce that no other rank calls (a statistic only it logs, say),
    and waits in it; the others go on to a monitored_barrier, where rank 0 waits `timeout_s` for
    each rank and raises, naming every rank that did not arrive (wait_all_ranks=True). The
    extra all-reduce gives up later, at its group's timeout."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=4 * timeout_s))
    if rank == odd_rank:
        dist.all_reduce(torch.ones(1), group=group)
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)


def skipped_worker(rank, world_size, steps, skipping_rank, skipped_step, timeout_s):
    """A training step's collectives, `steps` times: an all-gather of weights, a reduce-scatter
    of gradients (an all-reduce stands in for it here, by choice: gloo has reduce_scatter too),
    an all-reduce of the loss. At `skipped_step` the skipping rank leaves out its loss
    all-reduce (a rank that skipped logging, say): its next all-gather meets its peers'
    all-reduce, and the ranks wait until the group's timeout. Run with env=FLIGHT_RECORDER;
    returns this rank's dump."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    weights, gradients = torch.ones(16), torch.ones(16 * world_size)
    try:
        for step in range(steps):
            gathered = torch.empty(16 * world_size)
            dist.all_gather_into_tensor(gathered, weights, group=group)
            dist.all_reduce(gradients, group=group)
            loss = torch.tensor([float(step)])
            if not (rank == skipping_rank and step == skipped_step):
                dist.all_reduce(loss, group=group)
    except RuntimeError:
        pass  # the timeout; the dump below says where each rank was
    return flight_records()


def flight_records() -> dict:
    """This rank's flight-recorder dump: torch._C._distributed_c10d._dump_fr_trace() unpickled,
    {"version", "pg_config", "pg_status", "entries": [one dict per collective, oldest first]}.
    A private function: torch has no public one that returns the dump in the process
    (torch.distributed.debug.start_debug_server serves it over HTTP; torchfrtrace reads dumps
    written to files)."""
    return pickle.loads(torch._C._distributed_c10d._dump_fr_trace())


def records(dump: dict) -> list:
    """A flight-recorder dump's collectives, oldest first, as (sequence number, collective,
    input sizes, the worker's line that issued it)."""
    rows = []
    for entry in dump.get("entries", []):
        name = entry["profiling_name"].split(":")[-1]
        rows.append((entry["collective_seq_id"], name, entry["input_sizes"], _caller(entry)))
    return sorted(rows)


def _caller(entry) -> str:
    """The innermost frame outside torch and the course's launcher: the worker's own line."""
    for frame in entry["frames"]:
        path = frame["filename"]
        if "/torch/" not in path and "typing_extensions" not in path and "/launcher/" not in path:
            return f"{frame['name']}, line {frame['line']}"
    return "?"


def compare(dumps: list) -> list:
    """Line the ranks' records up by sequence number: one row per number, (number, {rank:
    collective or None}): the two numbers before the first where the ranks differ, that one, and
    the next (at most 4 rows)."""
    by_rank = [{seq: name for seq, name, _, _ in records(dump)} for dump in dumps]
    last = max((max(seqs, default=0) for seqs in by_rank), default=0)
    rows = [(seq, {rank: seqs.get(seq) for rank, seqs in enumerate(by_rank)})
            for seq in range(1, last + 1)]
    first = next((index for index, (_, calls) in enumerate(rows)
                  if len(set(calls.values())) > 1), len(rows))
    return rows[max(first - 2, 0):first + 2]


_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\("
                          r"SequenceNumber=(\d+), OpType=(\w+), TensorShape=(\[[^\]]*\])")


def fingerprints(message: str) -> list:
    """The collectives a DETAIL mismatch error names: [(rank, sequence number, op, shape)]."""
    return [(int(rank), int(seq), op, shape)
            for rank, seq, op, shape in _FINGERPRINT.findall(message)]
