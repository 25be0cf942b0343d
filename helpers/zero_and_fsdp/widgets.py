"""Lesson 07's control: the memory calculator."""

import ipywidgets as widgets
import matplotlib.pyplot as plt

from helpers.explorer import explorer
from helpers.zero_and_fsdp import plots
from helpers.zero_and_fsdp.memory import largest_model

# Model sizes to choose from, in billions of parameters: a slider on a grid that holds the
# starting size exactly (a log slider's grid did not hold 7.5, and its readout said 7.94 where
# the picture was drawn for 7.5).
SIZES = (0.1, 0.3, 1, 3, 7.5, 13, 30, 70, 175, 405, 1000)


def _sizes_with(billions: float) -> list:
    return [(f"{size:g}", size) for size in sorted({*SIZES, billions})]


def memory_calculator(billions: float = 7.5, world_size: int = 64, precision: str = "mixed",
                      memory_gb: float = 80.0):
    """Sliders for the model's size and the number of ranks, a choice of precision: the
    model-state bytes per rank at each stage, and the largest model each stage fits."""
    def show(billions, world_size, precision, memory_gb):
        plots.plot_calculator(billions * 1e9, world_size, precision, memory_gb)
        plt.show()
        fits = ", ".join(
            f"{plots.STAGE_NAMES[stage]} "
            f"{largest_model(memory_gb * 1e9, world_size, stage, precision) / 1e9:.1f} B"
            for stage in range(4))
        print(f"the largest model whose states fit in {memory_gb:g} GB per rank: {fits}")

    return explorer(
        show,
        billions=widgets.SelectionSlider(options=_sizes_with(billions), value=billions,
                                         description="B params"),
        world_size=widgets.IntSlider(value=world_size, min=1, max=1024, description="ranks"),
        precision=widgets.Dropdown(options=["mixed", "float32"], value=precision,
                                   description="precision"),
        memory_gb=widgets.FloatSlider(value=memory_gb, min=8, max=192, step=8,
                                      description="GB each"),
    )
