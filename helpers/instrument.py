"""Watching a rank's communication and memory from inside it, without changing the code watched.

    Observer(function=None, memory_of=None)
                               while active, records every torch.distributed communication call
                               this rank makes (a `Record`: name, group, bytes, launch and
                               completion times, the span it ran in) and the compute spans it is
                               told about (`Span`: label, start, end and, given `memory_of`, the
                               bytes autograd saved in it); restores torch.distributed on exit, a
                               raise included
    span(label)                marks a compute region for the innermost active Observer, as
                               torch.profiler.record_function marks one for the profiler; free
                               when no Observer is active, so strategies may carry it
    Observer.module_spans(modules)
                               while active, every forward and backward of these modules is a
                               span, ("forward", key) or ("backward", key)
    peak_at_hooks(modules, measure)
                               the most `measure()` returns at these modules' hooks (the bytes
                               a strategy holds, read where they change)
    saved_activations(module, classify)
                               while active, records the tensors autograd saves for backward,
                               each of the kind `classify` names
    saved_bytes(saved)         their bytes, each storage once; saved_bytes_by_kind, by kind
    created_storages()         while active, records (weakly) the storage of every tensor an
                               operation creates; alive_bytes(created, leave_out): the bytes of
                               those still alive, whoever holds them (autograd's saved tensors,
                               selective checkpointing's cache)

Rank-side: imports neither matplotlib nor ipywidgets. The exercise rules (helpers.rules) are
predicates over the same records.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import inspect
import math
import threading
import time
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from helpers.cost_model import bus_bytes

POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
COLLECTIVES = (
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all", "all_to_all_single", "gather", "scatter", "barrier", "monitored_barrier",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
)
OBSERVED = POINT_TO_POINT + COLLECTIVES + ("new_group",)

# The argument that holds a collective's whole array S (cost_model): for all_gather the gathered
# output, for reduce_scatter the input. Collectives not listed (barrier, gather, the *_object
# calls, ...) are recorded with 0 bytes.
ARRAY = {"all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor",
         "all_gather_single": "output_tensor", "all_gather_into_tensor": "output_tensor",
         "all_gather": "tensor_list", "reduce_scatter_single": "input",
         "reduce_scatter_tensor": "input", "reduce_scatter": "input_list"}
TABLE_NAME = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
              "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter"}


@dataclass
class Record:
    """One communication call. `detail`: a new group's members, a point-to-point call's peer, a
    collective's group members (None for the whole world). `numel`: the elements of its first
    tensor argument. `sent`/`received`: bytes this rank sends and receives (a collective's on a
    ring, by the cost model's table; an all-to-all's exactly, its own rows left out).
    `completed`: perf_counter seconds when it ended, for async_op=True when its Work finished
    (its future's callback, or, for a Work without one, as gloo's reduce-scatter, a thread that
    waits for it, ObservedWork; None for point-to-point calls)."""
    name: str
    detail: object
    numel: int | None
    sent: float
    received: float
    span: str | None
    launched: float
    completed: float | None = None

    @property
    def seconds(self) -> float:
        return 0.0 if self.completed is None else self.completed - self.launched


class Span(NamedTuple):
    label: object  # a string, or a tuple such as ("F", 3)
    start: float
    end: float
    saved_bytes: int = 0  # given memory_of: what autograd saved inside, inner spans left out


_ACTIVE = []  # the Observers entered in this process, innermost last


def span(label):
    """Marks a compute region for the innermost active Observer; does nothing when none is."""
    return _ACTIVE[-1].span(label) if _ACTIVE else contextlib.nullcontext()


class Observer:
    """While active, torch.distributed's communication calls are recorded in `records`, and
    `span(label)` blocks in `spans`. Wraps the module attributes and, given `function`, the
    references to them in its globals and those of the functions it refers to (code written
    after `from torch.distributed import send` holds the original). torch's own calls inside a
    recorded one are not recorded again. Subclasses may check each call in `before`. Given
    `memory_of` (a module), each span also counts the bytes autograd saves in it, that module's
    parameters left out (`saved_activations`)."""

    def __init__(self, function=None, memory_of: nn.Module | None = None):
        self.function, self.memory_of = function, memory_of
        self.records, self.spans = [], []
        self._saved, self._span = [], None
        self._depth = threading.local()
        self._unfinished, self._waiting = [], False  # async calls whose Work has no future
        self._lock = threading.Lock()

    # --- what was seen ---------------------------------------------------------------------------

    def calls(self, span: str | None = None) -> dict:
        """{name: how many calls}, communication only (new_group left out)."""
        return dict(collections.Counter(record.name for record in self._comm(span)))

    def sent(self, span: str | None = None) -> dict:
        """{name: bytes this rank sent}."""
        return self._sum(span, lambda record: record.sent)

    def seconds(self, span: str | None = None) -> dict:
        """{name: seconds from launch to completion}: the whole call for gloo's synchronous
        collectives."""
        return self._sum(span, lambda record: record.seconds)

    def _comm(self, span):
        return [record for record in self.records
                if record.name != "new_group" and (span is None or record.span == span)]

    def _sum(self, span, value) -> dict:
        totals = {}
        for record in self._comm(span):
            totals[record.name] = totals.get(record.name, 0) + value(record)
        return totals

    @contextlib.contextmanager
    def span(self, label: str):
        """Times the block as a compute span; calls made inside carry its label."""
        outer, self._span = self._span, label
        counting = (saved_activations(self.memory_of) if self.memory_of is not None
                    else contextlib.nullcontext([]))
        start = time.perf_counter()
        try:
            with counting as saved:
                yield
        finally:
            self.spans.append(Span(label, start, time.perf_counter(), saved_bytes(saved)))
            self._span = outer

    @contextlib.contextmanager
    def module_spans(self, modules: dict):
        """While active, each forward and each backward of every module in `modules`, {key:
        module}, is a span labelled ("forward", key) or ("backward", key): from its pre-hook to
        its hook (a backward's ends when the gradients of the module's inputs are computed)."""
        begun = {}

        def begin(label):
            return lambda *_: begun.__setitem__(label, time.perf_counter())

        def end(label):
            def record(*_):
                if label in begun:  # (a backward hook can fire without its pre-hook)
                    self.spans.append(Span(label, begun.pop(label), time.perf_counter()))
            return record

        hooks = []
        for key, module in modules.items():
            hooks += [module.register_forward_pre_hook(begin(("forward", key))),
                      module.register_forward_hook(end(("forward", key))),
                      module.register_full_backward_pre_hook(begin(("backward", key))),
                      module.register_full_backward_hook(end(("backward", key)))]
        try:
            yield self
        finally:
            for hook in hooks:
                hook.remove()

    def before(self, record: Record) -> None:
        """Called before every recorded call runs; may raise to stop it."""

    def returned(self, record: Record, result):
        """Called with what every recorded call returns; what it returns, the caller gets."""
        return result

    # --- patching --------------------------------------------------------------------------------

    def __enter__(self):
        originals = {name: getattr(distributed_c10d, name) for name in OBSERVED}
        wrapped = {name: self._wrap(name, original) for name, original in originals.items()}
        by_identity = {id(original): name for name, original in originals.items()}
        namespaces = [dist, distributed_c10d, *_globals_of(self.function)]
        try:
            for namespace in namespaces:
                is_module = not isinstance(namespace, dict)
                items = vars(namespace) if is_module else namespace
                for key, value in list(items.items()):
                    name = by_identity.get(id(value))
                    if name is not None and (not is_module or key == name):
                        self._saved.append((namespace, key, value))
                        _set(namespace, key, wrapped[name])
        except BaseException:
            self.__exit__()
            raise
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc_info):
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        while self._saved:
            namespace, key, value = self._saved.pop()
            _set(namespace, key, value)

    def _on_completion(self, work, record):
        """Set record.completed when `work` ends: from its future's callback, or, for a Work
        without a future, from a thread that waits for it; then the caller gets an ObservedWork
        in its place. Returns what the caller gets."""
        def done(_):
            record.completed = time.perf_counter()
        try:
            work.get_future().then(done)
            return work
        except RuntimeError:  # this backend's Work has no future (gloo's reduce-scatter)
            observed = ObservedWork(work)
            with self._lock:
                self._unfinished.append((observed, record))
                if not self._waiting:
                    self._waiting = True
                    threading.Thread(target=self._wait_for_each, daemon=True).start()
            return observed

    def _wait_for_each(self):
        """In a thread of its own: wait for each future-less Work in turn, noting when it ended
        (no later than that, since they run in order on the group); return when none is left."""
        while True:
            with self._lock:
                if not self._unfinished:
                    self._waiting = False
                    return
                observed, record = self._unfinished.pop(0)
            with contextlib.suppress(Exception):  # an error reaches the caller's own wait()
                observed.work.wait()
            record.completed = time.perf_counter()
            observed.noted.set()

    def _wrap(self, name, original):
        signature = inspect.signature(original)

        def observed(*args, **kwargs):
            if getattr(self._depth, "value", 0):
                return original(*args, **kwargs)
            arguments = signature.bind_partial(*args, **kwargs).arguments
            sent, received = _bytes(name, arguments)
            record = Record(name, _detail(name, arguments), _numel(arguments), sent, received,
                            self._span, time.perf_counter())
            self.records.append(record)
            self.before(record)
            self._depth.value = 1
            try:
                result = original(*args, **kwargs)
            finally:
                self._depth.value = 0
            if arguments.get("async_op") and result is not None:
                result = self._on_completion(result, record)
            elif name not in ("isend", "irecv", "batch_isend_irecv"):
                record.completed = time.perf_counter()
            return self.returned(record, result)

        observed.__name__ = observed.__qualname__ = name
        observed.__wrapped__ = original  # an Observer inside this one reads its signature
        return observed


class ObservedWork:
    """What an Observer hands back for a Work that has no future: the Work itself, wrapped so
    that the caller's wait() returns only after the Observer's own thread has waited for it.
    gloo's reduce-scatter copies its result into the output at every wait(): the Observer's wait
    must not come after the caller's, which may already have changed the output."""

    def __init__(self, work):
        self.work, self.noted = work, threading.Event()

    def wait(self, *args, **kwargs):
        self.noted.wait()
        return self.work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self.noted.is_set()

    def __getattr__(self, name):
        return getattr(self.work, name)


def _size(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(tensor.numel() * tensor.element_size() for tensor in value)


def _bytes(name, arguments) -> tuple:
    """(sent, received) bytes of one call on this rank."""
    if name in ("send", "isend"):
        return _size(arguments["tensor"]), 0
    if name in ("recv", "irecv"):
        return 0, _size(arguments["tensor"])
    if name == "batch_isend_irecv":
        ops = arguments.get("p2p_op_list", [])
        return (sum(_size(op.tensor) for op in ops if op.op.__name__ == "isend"),
                sum(_size(op.tensor) for op in ops if op.op.__name__ == "irecv"))
    if name == "all_to_all_single":
        return _all_to_all_bytes(arguments)
    if name in ARRAY:
        group_size = dist.get_world_size(arguments.get("group"))
        sent = bus_bytes(TABLE_NAME.get(name, name), group_size, _size(arguments[ARRAY[name]]))
        return sent, sent
    return 0, 0


def _all_to_all_bytes(arguments) -> tuple:
    """The rows that leave and reach this rank: everything but its own split."""
    output, source = arguments["output"], arguments["input"]
    group = arguments.get("group")
    world_size, me = dist.get_world_size(group), dist.get_rank(group)

    def off_rank(tensor, splits):
        rows = tensor.shape[0]
        own = splits[me] if splits else rows // world_size
        return (rows - own) * math.prod(tensor.shape[1:]) * tensor.element_size()

    return (off_rank(source, arguments.get("input_split_sizes")),
            off_rank(output, arguments.get("output_split_sizes")))


def _detail(name, arguments):
    """What a record keeps of a call's peers: the members of a new group, the peer of a
    point-to-point call, the members of a collective's group (None for the whole world)."""
    if name == "new_group":
        ranks = arguments.get("ranks")
        return {"ranks": sorted(ranks) if ranks is not None else None,
                "local": bool(arguments.get("use_local_synchronization", False))}
    if name in ("send", "isend"):
        return arguments.get("dst")
    if name in ("recv", "irecv"):
        return arguments.get("src")
    if name == "batch_isend_irecv":
        return [[op.op.__name__, op.peer] for op in arguments.get("p2p_op_list", [])]
    group = arguments.get("group")
    if group is None or group is dist.GroupMember.WORLD:
        return None
    return dist.get_process_group_ranks(group)


def _numel(arguments) -> int | None:
    """The elements of a call's first tensor argument (a list of tensors: all of them)."""
    for value in arguments.values():
        if isinstance(value, torch.Tensor):
            return value.numel()
        if isinstance(value, (list, tuple)) and value and all(
                isinstance(item, torch.Tensor) for item in value):
            return sum(item.numel() for item in value)
    return None


def _globals_of(function):
    """The global namespaces of `function` and of the functions it refers to (one level)."""
    if function is None:
        return []
    namespaces = [getattr(function, "__globals__", {})]
    for value in list(namespaces[0].values()):
        inner = getattr(value, "__globals__", None)
        if inner is not None and all(inner is not seen for seen in namespaces):
            namespaces.append(inner)
    return namespaces


def _set(namespace, key, value):
    if isinstance(namespace, dict):
        namespace[key] = value
    else:
        setattr(namespace, key, value)


class Peak:
    """The most a measurement returned (`peak_at_hooks`)."""

    def __init__(self, measure):
        self.measure, self.value = measure, 0

    def sample(self, *_):
        self.value = max(self.value, self.measure())


@contextlib.contextmanager
def peak_at_hooks(modules, measure):
    """While active, `measure()` (bytes held, say) is taken at every forward and backward hook,
    before and after, of each of `modules`: yields a `Peak`, whose `value` is the most it
    returned. What is held only between two hooks is not seen: sample at the hooks of the
    smallest modules that allocate (every Linear), not only at the blocks'."""
    peak, hooks = Peak(measure), []
    for module in modules:
        hooks += [module.register_forward_pre_hook(peak.sample),
                  module.register_forward_hook(peak.sample),
                  module.register_full_backward_pre_hook(peak.sample),
                  module.register_full_backward_hook(peak.sample)]
    try:
        yield peak
    finally:
        for hook in hooks:
            hook.remove()


@contextlib.contextmanager
def saved_activations(module: nn.Module | None = None, classify=None):
    """While active, records every tensor autograd saves for backward, except `module`'s
    parameters (the weights a layer keeps are not activations): yields a list of (storage
    pointer, bytes, kind); count each storage once (`saved_bytes`, `saved_bytes_by_kind`).
    `classify(tensor)` names each tensor's kind, or returns None to leave it out (by default
    every tensor is kind "saved"). A DTensor counts as its local piece, the bytes this rank
    holds."""
    parameters = ({param.untyped_storage().data_ptr() for param in module.parameters()}
                  if module is not None else set())
    saved = []

    def pack(tensor):
        # a DTensor operation saved it: its local piece holds this rank's bytes
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        if storage.data_ptr() not in parameters:
            kind = "saved" if classify is None else classify(local)
            if kind is not None:
                saved.append((storage.data_ptr(), storage.nbytes(), kind))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield saved


def saved_bytes(saved: list) -> int:
    """The bytes of the distinct storages in a `saved_activations` record."""
    return sum({pointer: size for pointer, size, _ in saved}.values())


def saved_bytes_by_kind(saved: list) -> dict:
    """{kind: bytes} of the distinct storages in a `saved_activations` record, kinds in the
    order they were first saved (a storage saved twice counts once, as the kind it was saved
    as last)."""
    kinds = {}
    for pointer, size, kind in saved:
        kinds[pointer] = (kind, size)
    totals = collections.Counter()
    for kind, size in kinds.values():
        totals[kind] += size
    return dict(totals)


class _CreatedStorages(TorchDispatchMode):
    """Below autograd: every operation's output tensors, a weak reference to each storage."""

    def __init__(self, created: list):
        super().__init__()
        self.created = created

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        out = op(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, DTensor):
                value = value.to_local()  # (a view of the local tensor: the same storage)
            if isinstance(value, torch.Tensor):
                self.created.append(weakref.ref(value.untyped_storage()))
        return out


@contextlib.contextmanager
def created_storages():
    """While active, records a weak reference to the storage of every tensor an operation
    creates; yields the list (read it with `alive_bytes`)."""
    created = []
    with _CreatedStorages(created):
        yield created


def alive_bytes(created: list, leave_out=()) -> int:
    """The bytes of the distinct storages in a `created_storages` record that are still alive,
    less those of the tensors in `leave_out` (parameters, the output one holds). Garbage is
    collected first: a tensor held only by a reference cycle (a checkpointed region's frames)
    would otherwise count until the collector happens to run."""
    gc.collect()
    left_out = {tensor.untyped_storage().data_ptr() for tensor in leave_out}
    alive = {}
    for reference in created:
        storage = reference()
        if storage is None or not _valid(storage):
            continue
        if storage.data_ptr() not in left_out:
            alive[storage.data_ptr()] = storage.nbytes()
    return sum(alive.values())


def _valid(storage) -> bool:
    """False for a Python storage whose C++ storage is gone (torch.utils.swap_tensors, as FSDP2
    uses it, leaves such husks behind): it holds no memory."""
    try:
        storage.data_ptr()
    except RuntimeError:
        return False
    return True
