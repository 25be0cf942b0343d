"""ipywidgets controls that re-run a lesson's worker and redraw it.

Lesson 03 (notebooks/03_collectives.ipynb): pick a collective and a world size.
Lesson 04 (notebooks/04_measuring_communication.ipynb): a progress bar for long sweeps.
Lesson 05 (notebooks/05_how_all_reduce_works.ipynb): the ring stepper, the topology cost model.
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


def ring_stepper(traces: list) -> widgets.interactive:
    """A slider over the recorded steps of the ring all-reduce (`algorithms.ring_trace_worker`)."""
    def show(step):
        fig, ax = plt.subplots(figsize=(4.5, 2.6))
        plots.draw_ring_step(ax, traces, step)
        plt.show()

    return widgets.interactive(show, step=widgets.IntSlider(
        value=0, min=0, max=len(traces[0]) - 1, description="step"))


def topology_explorer(n: int = 64, megabytes: float = 100.0, device_gb_s: float = 50.0):
    """Sliders for the device count, the data size and each device's bandwidth (topology model)."""
    def show(devices, megabytes, device_gb_s):
        plots.plot_topologies(devices, megabytes * 1e6, device_gb_s * 1e9)
        plt.show()

    return widgets.interactive(
        show,
        devices=widgets.IntSlider(value=n, min=4, max=1024, step=4, description="devices"),
        megabytes=widgets.FloatLogSlider(value=megabytes, base=10, min=0, max=4, description="MB each"),
        device_gb_s=widgets.FloatSlider(value=device_gb_s, min=10, max=900, step=10,
                                        description="GB/s each"),
    )
