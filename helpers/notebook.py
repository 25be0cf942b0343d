"""Small conveniences for the notebooks: show a function's source instead of copying it into a
cell (notebooks/02_point_to_point.ipynb onwards), a progress bar for long cells, and the indicator
shown while the worker pool warms up (`import helpers` in a kernel).
"""

import inspect
import threading

from IPython.display import Code, display


def show_code(function):
    """The source of a function from `helpers`, highlighted (text/plain is the source itself)."""
    return Code(inspect.getsource(function), language="python")


def progress_bar(total: int, description: str = ""):
    """Show a progress bar of `total` steps; advance it with `bar.value += 1`."""
    import ipywidgets

    bar = ipywidgets.IntProgress(value=0, min=0, max=total, description=description,
                                 style={"description_width": "initial"})
    display(bar)
    return bar


class WarmUpIndicator:
    """A line of text and a progress bar that creeps towards the end over about
    `expected_seconds`, then turns green at `done()`: an indicator, not silence."""

    def __init__(self, expected_seconds: float = 3.0):
        import ipywidgets

        print("Warming up: starting the worker pool, which imports torch once per kernel "
              "(a few seconds). Later launches take about 0.1 s.", flush=True)
        self.bar = ipywidgets.FloatProgress(value=0.0, max=1.0, description="warming up",
                                            bar_style="info")
        display(self.bar)
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
        self.bar.value, self.bar.bar_style, self.bar.description = 1.0, "success", "ready"
