"""Lesson 05's controls: step through the ring, and vary the topology model."""

import ipywidgets as widgets
import matplotlib.pyplot as plt

from helpers.explorer import Explorer, explorer
from helpers.how_all_reduce_works import plots


def ring_stepper(traces: list) -> Explorer:
    """A slider over the recorded steps of the ring all-reduce (`workers.ring_trace_worker`),
    labelled as the panel's title numbers them: "start", then step 0, 1, ..."""
    def show(index):
        fig, ax = plt.subplots(figsize=(4.5, 2.6))
        plots.draw_ring_step(ax, traces, index)
        plt.show()

    labels = [("start" if step < 0 else str(step), index)
              for index, (step, _, _) in enumerate(traces[0])]
    return explorer(show, index=widgets.SelectionSlider(options=labels, description="step"))


def topology_explorer(n: int = 64, megabytes: float = 100.0, device_gb_s: float = 50.0):
    """Sliders for the device count, the data size and each device's bandwidth (topology model)."""
    def show(devices, megabytes, device_gb_s):
        plots.plot_topologies(devices, megabytes * 1e6, device_gb_s * 1e9)
        plt.show()

    return explorer(
        show,
        devices=widgets.IntSlider(value=n, min=4, max=1024, step=4, description="devices"),
        megabytes=widgets.FloatLogSlider(value=megabytes, base=10, min=0, max=4,
                                         description="MB each"),
        device_gb_s=widgets.FloatSlider(value=device_gb_s, min=10, max=900, step=10,
                                        description="GB/s each"),
    )
