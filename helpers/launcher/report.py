"""What the student reads after `helpers.run`: grouped output, tracebacks, where each rank hung.

Everything here runs in the notebook kernel, on data the ranks sent back or left in files. Used by
`helpers.launcher.launch`; shown first in notebooks/01_processes_and_groups.ipynb.
"""

from __future__ import annotations

import html
import linecache
import os
import re
import signal
import sysconfig

import torch
import typing_extensions

from helpers.launcher import rank as _rank

# gloo's own log line, one per connection made: not the student's output.
_NOISE = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks")
# torch's C++ log prefix, e.g. "[rank0]:[E1122 14:24:43.236103785 ProcessGroupGloo.cpp:67] ".
_CPP_LOG_PREFIX = re.compile(r"^(\[rank\d+\]:)?\[[EWIF]\d{4} [\d:.]+ [\w.]+:\d+\] ")
# gloo's source location and the peer's port: they change with every build and every run.
_GLOO_SOURCE = re.compile(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*")
_PEER_PORT = re.compile(r"(\[[0-9a-fA-F.:]+\]):\d+")
_FRAME = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+) in (?P<name>.+)$')
_TORCH_DIR = os.path.dirname(torch.__file__)
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]
_LAUNCHER_DIR = os.path.dirname(os.path.abspath(__file__))
_HELPERS_DIR = os.path.dirname(_LAUNCHER_DIR)
_LAUNCHER_FILES = {os.path.join(_LAUNCHER_DIR, name) for name in ("rank.py", "launch.py")}
# helpers.instrument wraps torch.distributed's calls (the exercise checker's rules, the lessons'
# observer), and typing_extensions' @deprecated wraps some of torch's own (all_gather_into_tensor):
# a rank blocked in a wrapped call is blocked in torch's, called from the code above
_WRAPPERS = {os.path.join(_HELPERS_DIR, "instrument.py"), typing_extensions.__file__}
_REPR_LINES = 8
# Seconds apart that errors count as one bug seen by several ranks: any two, and two of the same
# type further apart. On a loaded machine, ranks that detect a mismatch in the same collective
# raise more than 50 ms apart (seen: lesson 12's DETAIL mismatch named rank 3 once, rank 0 else).
SIMULTANEOUS_S = 0.05
SAME_BUG_S = 1.0


class WorkerError(RuntimeError):
    """A rank raised (or died). Names the root-cause rank, its exception and its traceback.

    `others` maps every other rank that raised or died to what it reported: usually a consequence
    ("Connection closed by peer"), kept out of the message because it varies from run to run.
    """

    def __init__(self, rank, type_name, message, traceback_text, others, summary):
        self.rank, self.type_name, self.message = rank, type_name, message
        self.traceback, self.others = traceback_text, others
        super().__init__(summary)

    @classmethod
    def from_reports(cls, errors: dict, died: dict, finished: list, outputs: list, world_size: int):
        """Pick the root cause: a rank that died without a word, else the earliest exception that
        does not merely echo a peer's failure.

        When one rank fails, its peers fail a moment later ("Connection closed by peer"), or wait
        until they are stopped; those are consequences.
        """
        if died:
            rank = min(died)
            type_name, message = "died", _death(died[rank])
            traceback_text = _tail(outputs[rank])
            head = f"rank {rank} {message}"
        else:
            rank = _root_cause(errors)
            type_name, message = errors[rank].type_name, stable_message(errors[rank].message)
            traceback_text = format_traceback(errors[rank].frames, type_name, message, rank)
            head = f"rank {rank} raised {type_name}: {headline(message)}"
        others = {r: _death(code) for r, code in died.items() if r != rank}
        others.update({r: f"{e.type_name}: {tidy_message(e.message)}"
                       for r, e in errors.items() if r != rank})
        lines = [head, "", traceback_text]
        stopped = [r for r in range(world_size) if r != rank and r not in finished]
        if stopped:
            lines += ["", f"{_ranks(stopped)} stopped or failed after rank {rank} "
                          "(what they reported is in this error's .others)."]
        if finished:
            lines += [f"{_ranks(finished)} had finished."]
        lines += [f"Hint: {hint}" for pattern, hint in HINTS if pattern in message]
        return cls(rank, type_name, message, traceback_text, others, "\n".join(lines))


HEADLINE_CHARACTERS = 200


def headline(message: str) -> str:
    """A message's first line, cut to HEADLINE_CHARACTERS: the error's first line names it, and
    the traceback below ends with the whole message (a torch error can run to pages; once is
    enough)."""
    first = message.split("\n", 1)[0]
    cut = first if len(first) <= HEADLINE_CHARACTERS else first[:HEADLINE_CHARACTERS] + " ..."
    return cut + (" (the whole message is at the end of the traceback)" if cut != message else "")


# What a message means, for errors whose cause is not in their words: (text in the message, hint).
HINTS = [
    ("EADDRINUSE", "another program already listens on MASTER_PORT. Code that sets MASTER_PORT "
                   "itself collides with any other run using the same port; without that line, "
                   "helpers.spawn gives every launch a free port."),
]


class _StoppedRanks:
    """What a timeout and an interrupt both say: why every rank was stopped, then where each one
    was (`where`: rank -> where its stack shows it blocked)."""

    def __init__(self, why: str, stacks: dict, messages: dict, died: dict, world_size: int):
        self.stacks = stacks
        self.where = {rank: where_blocked(text) for rank, text in stacks.items()}
        super().__init__("\n".join(
            [f"run() {why}, so every rank was stopped. Where each rank was:"]
            + _where_each_rank(self.where, messages, died, world_size)))


class WorkerTimeout(_StoppedRanks, TimeoutError):
    """The run outlived its timeout. Says where each unfinished rank was blocked."""

    def __init__(self, timeout, stacks: dict, messages: dict, died: dict, world_size: int):
        self.timeout = timeout
        super().__init__(f"did not finish within {timeout:g} s", stacks, messages, died,
                         world_size)


class WorkerInterrupted(_StoppedRanks, KeyboardInterrupt):
    """The learner interrupted the run (Esc, I, I in Jupyter; Ctrl-C in a shell). Says where each
    unfinished rank was, from its stack. The interrupt, which Jupyter sends to the kernel's
    process group, does not reach the ranks (each leaves for a group of its own: rank.rank_main):
    they are stopped here."""

    def __init__(self, seconds, stacks: dict, messages: dict, died: dict, world_size: int):
        self.seconds = seconds
        super().__init__(f"was interrupted after {seconds:.0f} s", stacks, messages, died,
                         world_size)


def _where_each_rank(where: dict, messages: dict, died: dict, world_size: int) -> list:
    lines = []
    for rank in range(world_size):
        if rank in where:
            lines.append(f"  rank {rank}: {where[rank]}")
        elif rank in died:
            lines.append(f"  rank {rank}: {_death(died[rank])}")
        elif messages.get(rank, ("ok",))[0] != "ok":
            lines.append(f"  rank {rank}: raised {messages[rank][1].type_name}: "
                         f"{tidy_message(messages[rank][1].message)}")
        else:
            lines.append(f"  rank {rank}: finished")
    return lines


def read_outputs(out_dir: str, world_size: int) -> list:
    """Each rank's captured stdout+stderr, gloo's connection lines removed."""
    outputs = []
    for rank in range(world_size):
        path = _rank.output_path(out_dir, rank)
        text = ""
        if os.path.exists(path):
            with open(path, errors="replace") as captured:
                text = captured.read()
        outputs.append("".join(
            _CPP_LOG_PREFIX.sub("", line)
            for line in text.splitlines(keepends=True) if not _NOISE.match(line)
        ))
    return outputs


def clear_outputs(out_dir: str, world_size: int) -> None:
    """Forget a discarded attempt's output (the launch is being made again)."""
    for rank in range(world_size):
        for path in (_rank.output_path(out_dir, rank), _rank.stack_path(out_dir, rank)):
            if os.path.exists(path):
                os.remove(path)


def print_outputs(outputs: list) -> None:
    """Print every rank's output, grouped by rank in rank order, each line tagged with its rank."""
    for rank, text in enumerate(outputs):
        for line in text.splitlines():
            print(f"[rank {rank}] {line}")


def format_traceback(frames, type_name, message, rank) -> str:
    """Like Python's traceback, but each run of frames inside torch is one line of function names
    (their paths and line numbers say nothing to a student and differ from machine to machine)."""
    lines = [f"Traceback from rank {rank} (most recent call last):"]
    torch_names = []
    for filename, lineno, name in frames + [("", 0, "")]:
        if filename.startswith(_TORCH_DIR):
            if name not in ("wrapper", "inner"):
                torch_names.append(name)
            continue
        if torch_names:
            lines.append(f"  [inside torch: {' > '.join(torch_names)}]")
            torch_names = []
        if filename:
            lines.append(f'  File "{display_filename(filename)}", line {lineno}, in {name}')
            source = linecache.getline(filename, lineno).strip()
            if source:
                lines.append(f"    {source}")
    lines.append(f"{type_name}: {message}")
    return "\n".join(lines)


# What launch._dump_stacks gives for a rank whose process is stopped: it cannot dump its stack.
STOPPED = "(the process is stopped)"
NOT_STARTED = "(the process was not started)"  # a rank an interrupt kept from starting


def where_blocked(stack_dump: str) -> str:
    """Turn a faulthandler dump into 'blocked in torch.distributed.send(), called from worker at
    <file>, line <n>: <source>'."""
    if stack_dump == NOT_STARTED:
        return "not started yet: the launch was interrupted while it started the ranks"
    if stack_dump == STOPPED:
        return ("stopped (by SIGSTOP, or a debugger): it runs no code, so it cannot say where it "
                "is; its sockets stay open, and its peers wait")
    frames = [  # most recent call first, as faulthandler writes them
        (m["file"], int(m["line"]), m["name"])
        for m in map(_FRAME.match, stack_dump.splitlines()) if m
    ]
    if not frames:
        return "no Python stack could be read (the rank was starting or exiting)"
    # The worker, and what it called, are the frames above the launcher's own.
    launcher = next((i for i, (path, _, _) in enumerate(frames) if path in _LAUNCHER_FILES),
                    len(frames))
    user = next((i for i, (path, _, _) in enumerate(frames[:launcher]) if _is_user_code(path)),
                None)
    if user is None:  # not in the worker: joining or leaving the group, or in torch itself
        path, lineno, name = frames[min(launcher, len(frames) - 1)]
        return f'in {name} at "{display_filename(path)}", line {lineno} (outside the worker)'
    path, lineno, name = frames[user]
    torch_calls = [
        f for f in frames[:user] if f[0].startswith(_TORCH_DIR)
        and not f[2].startswith("_") and f[2] not in ("wrapper", "inner")
    ]
    call = f"blocked in {_torch_name(*torch_calls[-1])}(), called from" if torch_calls else "in"
    where = f'{call} {name} at "{display_filename(path)}", line {lineno}'
    source = linecache.getline(path, lineno).strip()
    return f"{where}: {source}" if source else f"{where} (its source is not available)"


def _is_user_code(path: str) -> bool:
    return not (path.startswith((_TORCH_DIR, _STDLIB_DIR)) or path in _LAUNCHER_FILES
                or path in _WRAPPERS)


def _torch_name(path: str, _lineno: int, name: str) -> str:
    module = os.path.relpath(path, os.path.dirname(_TORCH_DIR))[:-3].replace(os.sep, ".")
    if module.startswith("torch.distributed.distributed_c10d"):
        module = "torch.distributed"
    return f"{module}.{name}"


def display_filename(path: str) -> str:
    """'Cell In[7]' for notebook cells, 'helpers/x.py' for the package, else the path."""
    try:
        cell = get_ipython().compile.format_code_name(path)  # noqa: F821 - IPython builtin
        if cell:
            return " ".join(cell)  # ("Cell", "In[7]")
    except (NameError, AttributeError):
        pass
    if path.startswith(_HELPERS_DIR):
        return os.path.relpath(path, os.path.dirname(_HELPERS_DIR))
    return path


def stable_message(message: str) -> str:
    """The message without gloo's source locations and peer ports (they change every run)."""
    return _PEER_PORT.sub(r"\1", _GLOO_SOURCE.sub("", message))


def tidy_message(message: str) -> str:
    """The first sentence of `stable_message`, for one-line summaries."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    return stable_message(first.split(". ")[0])


# What a rank reports when a *peer* failed: a closed connection, or an error relayed to it.
_CONSEQUENCES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                 "received errors while waiting for send/recv from rank")


def is_consequence(message: str) -> bool:
    """Whether an error message only echoes a peer's failure (a closed connection, ...)."""
    return any(marker in message for marker in _CONSEQUENCES)


def _root_cause(errors: dict) -> int:
    """The earliest error that does not merely echo a peer's failure. Errors raised within
    SIMULTANEOUS_S of it, or of its type within SAME_BUG_S, count as simultaneous (several ranks
    detecting the same bug): the lowest rank among them is named, so the same bug gives the same
    report every run."""
    candidates = {r: e for r, e in errors.items() if not is_consequence(e.message)} or errors
    first = min(candidates.values(), key=lambda error: error.raised_at)
    return min(r for r, e in candidates.items()
               if e.raised_at <= first.raised_at + (SAME_BUG_S if e.type_name == first.type_name
                                                    else SIMULTANEOUS_S))


def _ranks(ranks) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _death(exitcode) -> str:
    if exitcode is not None and exitcode < 0:
        return f"died from signal {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode} without returning"


def _tail(text: str, lines: int = 15) -> str:
    kept = stable_message(text).rstrip().splitlines()[-lines:]
    return "Its last output:\n" + "\n".join(f"  {line}" for line in kept) if kept else ""


def format_results(results: list, backend: str) -> str:
    lines = [f"RunResult: {len(results)} ranks, {backend}"]
    for rank, value in enumerate(results):
        text = _short_repr(value).splitlines() or [""]
        lines.append(f"  rank {rank}: {text[0]}")
        lines += [f"          {line}" for line in text[1:]]
    return "\n".join(lines)


def results_html(results: list, backend: str) -> str:
    rows = "".join(
        f"<tr><td style='text-align:right'>rank {rank}</td>"
        f"<td style='text-align:left'><pre style='margin:0'>"
        f"{html.escape(_short_repr(value))}</pre></td></tr>"
        for rank, value in enumerate(results)
    )
    return (f"<div><b>RunResult</b>: {len(results)} ranks, {html.escape(backend)}"
            f"<table>{rows}</table></div>")


def _short_repr(value) -> str:
    lines = repr(value).splitlines()
    if len(lines) > _REPR_LINES:
        lines = lines[:_REPR_LINES] + [f"... ({len(lines) - _REPR_LINES} more lines)"]
    return "\n".join(lines)
