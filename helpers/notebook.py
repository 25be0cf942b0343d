"""Small conveniences for the notebooks: show a function's source instead of copying it into a
cell (notebooks/02_point_to_point.ipynb onwards), a progress bar for long cells, the indicator
shown while the worker pool warms up, and the heartbeat of a cell that runs long (both from
`import helpers` in a kernel).
"""

import ast
import inspect
import itertools
import sys
import textwrap
import threading
import time

from IPython.display import HTML, Code, display

# The lines of a listing that a 1280 x 720 slide holds whole, at notebooks/rise.css's 16 px code
# (23 px a line; the sub-slide's 684 px less its cell's own line and margins). A longer one is
# shown in parts (show_code's `part`).
LISTING_LINES = 26


def show_code(function, part: int | None = None):
    """The source of a function or class from `helpers`, highlighted (text/plain is the source
    itself). One longer than LISTING_LINES is shown in parts, a cell each, so that each fits a
    slide: `show_code(f, part=1)`, then `part=2`, ... (`listing_parts` cuts it between
    statements); a part says which it is where it continues, and which follows."""
    source = inspect.getsource(function)
    if part is None:
        return Code(source, language="python")
    return Code(part_of(listing_parts(source), part, function.__qualname__), language="python")


def listing_parts(source: str, limit: int = LISTING_LINES) -> list:
    """`source` cut into the fewest parts of at most `limit` lines each, their line that says which
    part continues or follows included. A cut falls only where a statement starts that is not
    the first of its block, above the comments right over it: no expression, string or comment
    block is broken, and no part ends on a line that opens a block (`if ...:`, `else:`). Of the
    cuts that make the fewest parts, the shallowest win (between the function's own statements
    rather than inside a loop), then those that leave the first part more than its signature and
    docstring, then those between paragraphs (after a blank line, or above a comment), then the
    evenest; where the fewest parts need a cut two levels deep, one part more is taken if it cuts
    shallower. A source that fits is one part; one that no such cuts make fit is cut wherever
    they can."""
    lines = source.splitlines(keepends=True)
    if len(lines) <= limit:
        return [source]
    depth_at = {}  # a line where a cut may fall: how deeply its statement is nested

    def visit(body: list, depth: int) -> None:
        for position, node in enumerate(body):
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            start -= 1
            while start > 0 and lines[start - 1].lstrip().startswith("#"):
                start -= 1  # a comment goes with the statement under it
            if position > 0 and start > 0:
                depth_at.setdefault(start, depth)
            for inner in (getattr(node, field, None) for field in ("body", "orelse", "finalbody")):
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    visit(inner, depth + 1)
            for inner in [*getattr(node, "handlers", []), *getattr(node, "cases", [])]:
                visit(inner.body, depth + 1)

    bare = None  # the cut that would leave the first part its signature and docstring alone
    for top in ast.parse(textwrap.dedent(source)).body:  # the def or the class shown
        body = getattr(top, "body", [])
        visit(body, 0)
        if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant):
            bare = min(cut for cut in depth_at if cut >= body[0].end_lineno)
    cuts = sorted(depth_at)

    def paragraph(cut: int) -> bool:  # after a blank line, or above a comment
        return not lines[cut - 1].strip() or lines[cut].lstrip().startswith("#")

    def shown(edges: tuple) -> list:  # each part's lines, its line of which part included
        bounds = [0, *edges, len(lines)]
        return [b - a + (number > 0) + (number < len(edges))
                for number, (a, b) in enumerate(zip(bounds, bounds[1:]))]

    def judged(edges: tuple) -> tuple:  # shallow, not a bare first part, between paragraphs, even
        return (max(depth_at[e] for e in edges), edges[0] == bare,
                sum(not paragraph(e) for e in edges), sum(depth_at[e] for e in edges),
                max(shown(edges)))

    chosen, fewest = tuple(cuts), None  # where nothing fits: every cut
    for parts in range(2, min(len(cuts) + 1, 4) + 1):  # 4 parts hold about 100 lines
        fitting = [edges for edges in itertools.combinations(cuts, parts - 1)
                   if max(shown(edges)) <= limit]
        best = min(fitting, key=judged) if fitting else None
        if best and (fewest is None or judged(best)[0] < judged(chosen)[0]):
            chosen, fewest = best, fewest or parts
        # one part more only where the fewest cut two levels deep (inside a function's loop's
        # block, or a nested function's body)
        if fewest is not None and (parts > fewest or judged(chosen)[0] < 2):
            break
    bounds = [0, *chosen, len(lines)]
    return ["".join(lines[a:b]) for a, b in zip(bounds, bounds[1:])]


def paragraph_parts(text: str, limit: int = LISTING_LINES) -> list:
    """`text` (a batch script, a listing in another language) cut at blank lines into the fewest
    parts of at most `limit` lines each, their line that says which part continues or follows
    included (as `listing_parts` counts them), the evenest of those. A text that fits is one
    part; one whose paragraphs no such cuts make fit is cut at every blank line."""
    lines = text.splitlines(keepends=True)
    if len(lines) <= limit:
        return [text]
    cuts = [index + 1 for index, line in enumerate(lines[:-1]) if not line.strip()]

    def shown(edges: tuple) -> list:
        bounds = [0, *edges, len(lines)]
        return [b - a + (number > 0) + (number < len(edges))
                for number, (a, b) in enumerate(zip(bounds, bounds[1:]))]

    chosen = tuple(cuts)
    for parts in range(2, len(cuts) + 2):
        fitting = [edges for edges in itertools.combinations(cuts, parts - 1)
                   if max(shown(edges)) <= limit]
        if fitting:
            chosen = min(fitting, key=lambda edges: max(shown(edges)))
            break
    bounds = [0, *chosen, len(lines)]
    return ["".join(lines[a:b]) for a, b in zip(bounds, bounds[1:])]


def part_of(pieces: list, part: int, name: str) -> str:
    """The `part`-th of a listing's `pieces` (1, 2, ...), with a comment line saying which part it
    continues, where it does, and which follows."""
    if not 1 <= part <= len(pieces):
        raise ValueError(f"the listing of {name} has {len(pieces)} part(s): part is 1 to "
                         f"{len(pieces)}, not {part}")
    text = pieces[part - 1]
    if part > 1:
        text = f"# {name}, part {part} of {len(pieces)}\n" + text
    if part < len(pieces):
        text += f"# ... part {part + 1} of {len(pieces)} follows\n"
    return text


def half_of(items: list, part: int | None) -> list:
    """What a printout shown in two cells, so that each fits a slide, shows of `items`: all of
    them (part None), the first half (1; the larger, where they are odd) or the rest (2)."""
    if part not in (None, 1, 2):
        raise ValueError(f"part is 1 or 2 (or None, for all), not {part}")
    middle = (len(items) + 1) // 2
    return items if part is None else items[:middle] if part == 1 else items[middle:]


class ProgressBar:
    """An HTML progress bar, updated in place through its display id: `bar.value += 1`.

    Not a widget: a notebook read without a kernel shows its last state, and nbval compares it
    as tests/nbval_sanitize.cfg leaves it (the bar's position depends on timing)."""

    def __init__(self, total: float, label: str):
        self.total, self.label, self._value = total, label, 0
        self.handle = display(self._picture(), display_id=True)

    def _picture(self):
        return HTML(f'<progress class="helpers-progress" value="{self._value:.2f}" '
                    f'max="{self.total}"></progress> <span>{self.label}</span>')

    @property
    def value(self):
        return self._value

    @value.setter
    def value(self, value):
        self._value = value
        self.handle.update(self._picture())

    def finish(self, label: str):
        self.label = label
        self.value = self.total


def progress_bar(total: int, description: str = "") -> ProgressBar:
    """Show a progress bar of `total` steps; advance it with `bar.value += 1`."""
    return ProgressBar(total, description)


class Creeping:
    """A progress bar that creeps towards the end over about `expected_seconds`, for a wait whose
    steps cannot be counted (one run in a process of its own), then fills and says `finished`
    at `done()`: an indicator, not silence. Also a context manager."""

    def __init__(self, label: str, expected_seconds: float, finished: str = "done"):
        self.bar, self.finished = ProgressBar(1, label), finished
        self._finished = threading.Event()
        self._creeping = threading.Thread(target=self._creep, args=(expected_seconds,),
                                          daemon=True)
        self._creeping.start()

    def _creep(self, expected_seconds):  # approaches 1 without reaching it: the end is unknown
        while not self._finished.wait(0.1):
            self.bar.value += (0.95 - self.bar.value) * 0.3 / expected_seconds

    def done(self):
        self._finished.set()
        self._creeping.join()
        self.bar.finish(self.finished)

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        if kind is not None:
            self.finished = f"{self.bar.label}: stopped"
        self.done()


def waiting(label: str, expected_seconds: float) -> Creeping:
    """`with waiting("one fake step of Llama 3 8B", 20): ...`: a bar that creeps while it runs."""
    return Creeping(label, expected_seconds, finished=f"{label}: done")


class WarmUpIndicator(Creeping):
    """The worker pool's warm-up (`import helpers` in a kernel): a line of text, and a bar that
    says "ready" at `done()`."""

    def __init__(self, expected_seconds: float = 3.0):
        print("Warming up: starting the worker pool, which imports torch once per kernel "
              "(a few seconds). Later launches take about 0.1 s.", flush=True)
        super().__init__("worker pool: warming up", expected_seconds, "worker pool: ready")


# A cell still running after this many seconds says so (a line that counts its seconds), so that
# nothing on a slide or a page waits in silence for more than 2 s.
HEARTBEAT_AFTER_S = 1.0
HEARTBEAT = {"helpers": "heartbeat"}  # its output's metadata: `make notebooks` drops the output


class Heartbeat:
    """In a Jupyter kernel: a cell still running after `after` seconds shows, under what it has
    printed so far, "still running: 7 s (Esc, I, I stops it)", counted up each second, with what
    a launch waits for ("ranks 0 and 1 of 2 have not returned; the timeout stops them in 53 s"),
    and the line is emptied as the cell ends. A progress bar says how far; this says that it is
    alive, in every cell, the learner's own included. Its output carries HEARTBEAT in its metadata:
    `without_heartbeats` drops it from a committed notebook (helpers.slides), and nbval compares
    cells without it (conftest.py), since whether it shows depends on the machine's speed."""

    def __init__(self, shell, after: float = HEARTBEAT_AFTER_S):
        self.after, self._stop, self._thread = after, None, None
        shell.events.register("pre_run_cell", self._start)
        shell.events.register("post_run_cell", self._end)

    def _start(self, info=None):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(self._stop, time.monotonic()),
                                        name="helpers-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self, stop, start):
        if stop.wait(self.after):
            return
        handle = display(self._line(time.monotonic() - start), raw=True, display_id=True,
                         metadata=HEARTBEAT)
        while not stop.wait(1.0):
            handle.update(self._line(time.monotonic() - start), raw=True, metadata=HEARTBEAT)
        handle.update({"text/plain": "", "text/html": ""}, raw=True, metadata=HEARTBEAT)

    @staticmethod
    def _line(seconds):
        # Not loaded, or still being imported (a cell's `from helpers import run` takes seconds on
        # a loaded machine, and the module sits in sys.modules half made): no launch waits.
        waiting = getattr(sys.modules.get("helpers.launcher.launch"), "waiting", None)
        waits = waiting and waiting()
        text = (f"still running: {seconds:.0f} s" + (f": {waits}" if waits else "")
                + " (Esc, I, I stops it)")
        return {"text/plain": text,
                "text/html": f'<span class="helpers-heartbeat">&#8987; {text}</span>'}

    def _end(self, result=None):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()


def keep_a_heartbeat():
    """Start the heartbeat in this kernel, once (`import helpers` calls it)."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is not None and not hasattr(shell, "helpers_heartbeat"):
        shell.helpers_heartbeat = Heartbeat(shell)
        shell.helpers_heartbeat._start()  # the cell that imported helpers beats too, from now


def show_figures_with_their_text_size():
    """Have this kernel show a matplotlib figure as helpers.drawing.figure_bundle draws it: the
    inline backend's PNG, whose metadata says how large its smallest text is (`import helpers`
    calls it). Registered with IPython's mimebundle formatter, which comes before the PNG
    formatter that the inline backend sets up whenever it is loaded."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is not None:
        shell.display_formatter.mimebundle_formatter.for_type_by_name(
            "matplotlib.figure", "Figure", _figure_bundle)


def _figure_bundle(fig, include=None, exclude=None):
    from helpers.drawing import figure_bundle

    return figure_bundle(fig)


def without_heartbeats(outputs: list) -> list:
    """A cell's outputs without the heartbeat's, and the printed text it parted joined again: the
    cell's outputs where it ran fast enough to show none."""
    kept, parted = [], False
    for output in outputs:
        if output.get("metadata", {}).get("helpers") == HEARTBEAT["helpers"]:
            parted = True
            continue
        joined = parted and kept and output["output_type"] == "stream" == kept[-1]["output_type"]
        parted = False
        if joined and output["name"] == kept[-1]["name"]:
            kept[-1] = {**kept[-1], "text": _text(kept[-1]["text"]) + _text(output["text"])}
            continue
        kept.append(output)
    return kept


def _text(text) -> str:
    return text if isinstance(text, str) else "".join(text)
