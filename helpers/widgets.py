"""ipywidgets controls that re-run a lesson's worker and redraw it.

Lesson 03 (notebooks/03_collectives.ipynb): pick a collective and a world size.
Lesson 04 (notebooks/04_measuring_communication.ipynb): a progress bar for long sweeps.
"""

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import display

from helpers import collectives, plots
from helpers.launch import run


def show_collective(collective: str, world_size: int):
    """Run one collective on `world_size` ranks and draw every rank's buffers before and after."""
    out = run(collectives.collective_worker, world_size, args=(collective,), show_output=False)
    plots.plot_collective(collective, out.results, collectives.RULES[collective],
                          reduced=collective in collectives.REDUCING)
    plt.show()


def collective_explorer(collective: str = "all_reduce", world_size: int = 4, max_world_size: int = 6):
    """A dropdown of collectives and a world-size slider; every change runs it again (~0.1 s)."""
    return widgets.interactive(
        show_collective,
        collective=widgets.Dropdown(options=collectives.COLLECTIVES, value=collective,
                                    description="collective"),
        world_size=widgets.IntSlider(value=world_size, min=2, max=max_world_size,
                                     description="world size", continuous_update=False),
    )


def progress_bar(total: int, description: str = "") -> widgets.IntProgress:
    """Show a progress bar of `total` steps; advance it with `bar.value += 1`."""
    bar = widgets.IntProgress(value=0, min=0, max=total, description=description,
                              style={"description_width": "initial"})
    display(bar)
    return bar
