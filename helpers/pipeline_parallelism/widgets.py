"""Lesson 09's control: the schedules with ideal times, for any p, m and schedule."""

import ipywidgets as widgets
import matplotlib.pyplot as plt

from helpers.explorer import explorer
from helpers.pipeline_parallelism import plots
from helpers.pipeline_parallelism.ideal import bubble, simulate
from helpers.pipeline_parallelism.schedule import SCHEDULES, bubble_formula

LABELS = {"description_width": "120px"}  # "micro-batches m" whole, not "micro-ba..."


def schedule_explorer(num_stages: int = 4, num_micro_batches: int = 8, schedule: str = "1f1b"):
    """Sliders for p and m and a choice of schedule: its ideal Gantt chart and bubble."""
    def show(num_stages, num_micro_batches, schedule):
        plots.plot_ideal(num_stages, num_micro_batches, (schedule,))
        plt.show()
        events = simulate(schedule, num_stages, num_micro_batches)
        most = max(e.stored_bytes for rank in events for e in rank)
        print(f"bubble {100 * bubble(events):.1f} % (formula for GPipe and 1F1B: "
              f"{100 * bubble_formula(num_stages, num_micro_batches):.1f} %); at most {most} "
              f"micro-batches' activations kept on a rank")

    return explorer(
        show,
        num_stages=widgets.IntSlider(value=num_stages, min=2, max=8, description="stages p",
                                     style=LABELS),
        num_micro_batches=widgets.IntSlider(value=num_micro_batches, min=1, max=16,
                                            description="micro-batches m", style=LABELS),
        schedule=widgets.Dropdown(options=SCHEDULES, value=schedule, description="schedule",
                                  style=LABELS),
    )
