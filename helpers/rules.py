"""The rules an exercise states ("only send and recv", "every rank creates every group"), enforced
while the learner's function runs in the ranks.

Inside each rank a `CallRecorder` wraps torch.distributed's communication calls for the duration
of the function. Every call is logged to a file of the rank's own, which the checker reads even
when the run failed or hung; a call that a rule forbids raises `RuleBroken` at once, quoting the
rule. After the run, each rule looks at every rank's log (`Rule.broken_by`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from typing import NamedTuple

from torch.utils._python_dispatch import TorchDispatchMode

from helpers.instrument import COLLECTIVES, POINT_TO_POINT, Observer

MARKS = ("wait", "compute")  # log entries that are not calls: a Work's wait(), a computation


class Call(NamedTuple):
    """One logged call, as read back from a rank's log: an `instrument.Record`'s name, detail,
    numel and the span it ran in (None outside any)."""
    name: str
    detail: object
    numel: int | None
    span: str | None = None


class RuleBroken(RuntimeError):
    """The learner's function broke a rule of the task."""


class Rule:
    """One rule of a task. `text` is the rule as the task states it; messages quote it."""

    def __init__(self, text: str):
        self.text = text

    def forbids(self, call: str, detail) -> bool:
        """Checked in the rank at every call: True stops the function with `RuleBroken`."""
        return False

    def broken_by(self, logs: dict, world_size: int, args: tuple = (),
                  finished: bool = True) -> str | None:
        """Checked after the run on every rank's calls (a list of `Call`), given the case's
        arguments: a sentence, or None. `finished` is False when the run hung or failed: the
        logs then stop where each rank stopped, and a rule about what a rank must still do
        judges only what it did so far."""
        return None


class Only(Rule):
    """Of torch.distributed's communication calls, only `calls` may be used."""

    def __init__(self, *calls: str, text: str):
        super().__init__(text)
        self.calls = calls

    def forbids(self, call, detail):
        return call in POINT_TO_POINT + COLLECTIVES and call not in self.calls


class SameGroups(Rule):
    """Every rank creates every group (`new_group`), with the same members, in the same order.
    Groups made with use_local_synchronization=True are named by their members, not by counting,
    so only their members need to create them: they do not count here."""

    def __init__(self, text: str = "every rank must create every group, in the same order"):
        super().__init__(text)

    def broken_by(self, logs, world_size, args=(), finished=True):
        created = {rank: [call.detail["ranks"] for call in calls
                          if call.name == "new_group" and not call.detail["local"]]
                   for rank, calls in logs.items()}
        if len({json.dumps(groups) for groups in created.values()}) <= 1:
            return None
        listed = "; ".join(f"rank {rank} created {groups}"
                           for rank, groups in sorted(created.items()))
        return f"{self.text} ({listed})."


class AtMostSends(Rule):
    """Each rank sends at most `limit(rank, world_size)` tensors (send, isend, or an isend in
    batch_isend_irecv)."""

    def __init__(self, limit, text: str):
        super().__init__(text)
        self.limit = limit

    def broken_by(self, logs, world_size, args=(), finished=True):
        for rank, calls in sorted(logs.items()):
            count, allowed = len(sends(calls)), self.limit(rank, world_size)
            if count > allowed:
                return (f"{self.text}: rank {rank} sent {count} times on {world_size} ranks, "
                        f"where {allowed} {'is' if allowed == 1 else 'are'} enough.")
        return None


class AtMostCollectives(Rule):
    """Each rank makes at most `limit` collective calls (any of instrument.COLLECTIVES)."""

    def __init__(self, limit: int, text: str):
        super().__init__(text)
        self.limit = limit

    def broken_by(self, logs, world_size, args=(), finished=True):
        for rank, calls in sorted(logs.items()):
            made = [call.name for call in calls if call.name in COLLECTIVES]
            if len(made) > self.limit:
                return (f"{self.text}: rank {rank} made {_calls(len(made))} ({', '.join(made)}) "
                        f"on {world_size} ranks, where {self.limit} "
                        f"{'is' if self.limit == 1 else 'are'} enough.")
        return None


def sends(calls) -> list:
    """The ranks a rank sent to, in order, from its log."""
    peers = []
    for call in calls:
        if call.name in ("send", "isend"):
            peers.append(call.detail)
        elif call.name == "batch_isend_irecv":
            peers += [peer for op, peer in call.detail if op == "isend"]
    return peers


class SendsTo(Rule):
    """Each rank sends to exactly the ranks `peers(rank, world_size, *args)` (args: the case's),
    in that order. `who` names what the rule describes in the message ("the tree sends to")."""

    def __init__(self, peers, text: str, who: str = "the task"):
        super().__init__(text)
        self.peers, self.who = peers, who

    def broken_by(self, logs, world_size, args=(), finished=True):
        for rank in range(world_size):
            sent, wanted = sends(logs.get(rank, [])), self.peers(rank, world_size, *args)
            if not _as_far_as_it_went(sent, wanted, finished):
                return (f"{self.text}: on {world_size} ranks, rank {rank} sent to {sent}, where "
                        f"{self.who} sends to {wanted}.")
        return None


class CallSizes(Rule):
    """Each rank's calls of `call`, in order, pass tensors of exactly `sizes(world_size, *args)`
    elements: so many calls, each of the size the task's rule gives."""

    def __init__(self, call: str, sizes, text: str):
        super().__init__(text)
        self.call, self.sizes = call, sizes

    def broken_by(self, logs, world_size, args=(), finished=True):
        wanted = list(self.sizes(world_size, *args))
        for rank, calls in sorted(logs.items()):
            made = [entry.numel for entry in calls if entry.name == self.call]
            if not _as_far_as_it_went(made, wanted, finished):
                return (f"{self.text}: rank {rank}'s {self.call} calls held {made} elements "
                        f"({_calls(len(made))}), where the task's rule gives {wanted} "
                        f"({_calls(len(wanted))}).")
        return None


def _as_far_as_it_went(made: list, wanted: list, finished: bool) -> bool:
    """A finished run made exactly `wanted`; one that stopped early, its beginning."""
    return made == wanted if finished else made == wanted[:len(made)]


def _calls(count: int) -> str:
    return f"{count} call" if count == 1 else f"{count} calls"


def _starts_a_receive(call) -> bool:
    return call.name == "irecv" or (call.name == "batch_isend_irecv"
                                     and any(op == "irecv" for op, _ in call.detail))


class OverlapsCompute(Rule):
    """Every computation (a matrix product) happens while a receive (irecv, or a
    batch_isend_irecv with one) is in flight: started and not yet waited for. Only after the
    last receive has been waited for may a rank compute with nothing in flight. (`marks_compute`
    makes CallRecorder log the products, and each request's wait().)"""

    marks_compute = True

    def broken_by(self, logs, world_size, args=(), finished=True):
        for rank, calls in sorted(logs.items()):
            in_flight, started = set(), 0
            total = sum(_starts_a_receive(call) for call in calls)
            for index, call in enumerate(calls):
                if _starts_a_receive(call):
                    in_flight.add(index)
                    started += 1
                elif call.name == "wait":
                    in_flight.discard(call.detail)
                elif call.name == "compute" and not in_flight and started < total:
                    when = (f"after waiting for receive number {started} and before starting "
                            f"number {started + 1}" if started else
                            "before starting its first transfer")
                    return (f"{self.text}: on {world_size} ranks, rank {rank} computed with no "
                            f"transfer in flight, {when}, so that transfer could not overlap "
                            "the computation.")
        return None


class OffTheWorld(Rule):
    """`calls` must name a group other than the whole world."""

    def __init__(self, *calls: str, text: str):
        super().__init__(text)
        self.calls = calls

    def forbids(self, call, detail):
        return call in self.calls and detail is None


def log_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank{rank}.jsonl")


def read_logs(log_dir: str, world_size: int) -> dict:
    """rank -> [(call, detail)], for every rank that logged anything."""
    logs = {}
    for rank in range(world_size):
        with contextlib.suppress(FileNotFoundError), open(log_path(log_dir, rank)) as log:
            logs[rank] = [Call(*json.loads(line)) for line in log]
    return logs


def log2_ceil(rank, world_size) -> int:
    """⌈log2 n⌉: the rounds of a binomial tree, or of recursive doubling, on n ranks."""
    return math.ceil(math.log2(world_size))


class CallRecorder(Observer):
    """While active, torch.distributed's communication calls (`instrument.Observer`, wrapping the
    learner's own references too) are logged to `log_file` as they happen, so the checker can
    read them even after a hang, and checked against `rules`: a forbidden call raises."""

    def __init__(self, rules, log_file: str, function):
        super().__init__(function)
        self.rules, self.log_file = rules, log_file
        self.written, self.last, self.index_of = 0, None, {}
        self.products = (_MarkProducts(self) if any(getattr(rule, "marks_compute", False)
                                                    for rule in rules) else None)

    def __enter__(self):
        self.log = open(self.log_file, "a")  # noqa: SIM115 - closed in __exit__
        if self.products is not None:
            self.products.__enter__()
        return super().__enter__()

    def __exit__(self, *exc_info):
        super().__exit__(*exc_info)
        if self.products is not None:
            self.products.__exit__(*exc_info)
        self.log.close()

    def write(self, name, detail=None, numel=None, span=None):
        self.log.write(json.dumps([name, detail, numel, span]) + "\n")
        self.log.flush()
        self.written, self.last = self.written + 1, name

    def before(self, record):
        self.index_of[id(record)] = self.written
        self.write(record.name, record.detail, record.numel, record.span)
        for rule in self.rules:
            if rule.forbids(record.name, record.detail):
                raise RuleBroken(f"the task says: {rule.text}. Your code called "
                                 f"dist.{record.name}().")

    def returned(self, record, result):
        """Where a rule marks computation, a point-to-point call's requests log their wait()
        (the call's index in the log)."""
        if (self.products is None or result is None
                or record.name not in ("isend", "irecv", "batch_isend_irecv")):
            return result
        index = self.index_of[id(record)]
        if isinstance(result, list):
            return [_LoggedWork(work, self, index) for work in result]
        return _LoggedWork(result, self, index)


class _LoggedWork:
    """A request whose wait() is logged as ("wait", the index of the call that made it)."""

    def __init__(self, work, recorder: CallRecorder, index: int):
        self.work, self.recorder, self.index = work, recorder, index

    def wait(self, *args, **kwargs):
        self.recorder.write("wait", self.index)
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


class _MarkProducts(TorchDispatchMode):
    """Logs ("compute") when a matrix product or an attention kernel runs, once between two
    other entries."""

    PRODUCTS = ("mm", "bmm", "addmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention")

    def __init__(self, recorder: CallRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        if op.overloadpacket.__name__ in self.PRODUCTS and self.recorder.last != "compute":
            self.recorder.write("compute")
        return op(*args, **(kwargs or {}))
