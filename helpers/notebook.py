"""Small conveniences for the notebooks: show a worker's source instead of copying it into a
cell (notebooks/02_point_to_point.ipynb onwards), and the warm-up indicator of the first launch.
"""

import contextlib
import inspect
import threading

from IPython.display import Code, display


def show_code(function):
    """The source of a function from `helpers`, highlighted (text/plain is the source itself)."""
    return Code(inspect.getsource(function), language="python")


@contextlib.contextmanager
def warming_up(expected_seconds: float = 3.0):
    """While the block runs (the first launch of a kernel), show a progress bar that creeps
    towards the end over about `expected_seconds`, then turns green: an indicator, not silence."""
    import ipywidgets

    print("Warming up: starting the worker pool, which imports torch once per kernel "
          "(a few seconds). Later launches take about 0.1 s.", flush=True)
    bar = ipywidgets.FloatProgress(value=0.0, max=1.0, description="warming up",
                                   bar_style="info")
    display(bar)
    finished = threading.Event()

    def creep():  # approaches 1 without reaching it: the real end is unknown
        while not finished.wait(0.1):
            bar.value += (0.95 - bar.value) * 0.1 / expected_seconds * 3

    thread = threading.Thread(target=creep, daemon=True)
    thread.start()
    try:
        yield
    finally:
        finished.set()
        thread.join()
        bar.value, bar.bar_style, bar.description = 1.0, "success", "ready"
