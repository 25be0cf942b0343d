"""Small conveniences for the notebooks: show a function's source instead of copying it into a
cell (notebooks/02_point_to_point.ipynb onwards), a progress bar for long cells, and the indicator
shown while the worker pool warms up (`import helpers` in a kernel).
"""

import inspect
import threading

from IPython.display import HTML, Code, display


def show_code(function):
    """The source of a function from `helpers`, highlighted (text/plain is the source itself)."""
    return Code(inspect.getsource(function), language="python")


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
