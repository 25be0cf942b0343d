"""Lesson 03's controls: pick a collective and a world size, and see it run."""

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import display

from helpers.collectives import plots
from helpers.collectives.workers import COLLECTIVES, EXAMPLES, REDUCING, RULES, collective_worker
from helpers.explorer import explorer
from helpers.launcher import run
from helpers.notebook import show_code


def show_collective(collective: str, world_size: int):
    """Show the call (the example's code), run it on `world_size` ranks, and draw every rank's
    buffers before and after."""
    display(show_code(EXAMPLES[collective]))
    out = run(collective_worker, world_size, args=(collective,), show_output=False)
    plots.plot_collective(collective, out.results, RULES[collective],
                          reduced=collective in REDUCING)
    plt.show()


def collective_explorer(collective: str = "all_reduce", world_size: int = 4,
                        max_world_size: int = 6):
    """A dropdown of collectives and a world-size slider; every change runs it again (~0.1 s)."""
    return explorer(
        show_collective,
        collective=widgets.Dropdown(options=COLLECTIVES, value=collective,
                                    description="collective"),
        world_size=widgets.IntSlider(value=world_size, min=2, max=max_world_size,
                                     description="world size", continuous_update=False),
    )
