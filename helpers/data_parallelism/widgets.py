"""Lesson 06's control: bucket size and world size, with the modelled step redrawn."""

import ipywidgets as widgets
import matplotlib.pyplot as plt

from helpers.data_parallelism import plots
from helpers.explorer import explorer

BUCKET_CHOICES = [(f"{mib:g} MiB", mib * 2**20) for mib in (0.25, 0.5, 1, 2, 4, 8, 16, 64)]


def scaled_compute(measured: dict, world_size: int, measured_world_size: int = 2) -> tuple:
    """Forward, backward and optimizer-step seconds at `world_size` ranks, from `measured` (a
    step at `measured_world_size` ranks, same global batch): forward and backward shrink with
    the local batch; the optimizer step updates the whole replica whatever the batch."""
    shrink = measured_world_size / world_size
    return measured["forward"] * shrink, measured["backward"] * shrink, measured["step"]


def ring_alpha(alpha_at_2: float, world_size: int) -> float:
    """The latency of one all_reduce on `world_size` ranks, from the one measured on 2: a ring
    takes 2(n-1) steps, each paying a latency (lesson 05), and alpha_at_2 paid 2."""
    return alpha_at_2 * (world_size - 1)


def draw_bucket_model(grad_bytes: list, measured: dict, alpha: float, beta: float,
                      bucket_bytes: float = 2 * 2**20, world_size: int = 2):
    """The explorer's picture for one bucket size and world size (by default, its starting
    state): the alpha-beta model's step for the naive loop, per-gradient all_reduces, and
    buckets."""
    forward, backward, step = scaled_compute(measured, world_size)
    runs = plots.modelled_steps(grad_bytes, forward, backward, step, world_size,
                                ring_alpha(alpha, world_size), beta, bucket_bytes)
    return plots.plot_step_timelines(runs, what=f"model, {world_size} ranks")


def bucket_explorer(grad_bytes: list, measured: dict, alpha: float, beta: float,
                    bucket_bytes: float = 2 * 2**20, world_size: int = 2):
    """A slider for the bucket size and one for the world size: the alpha-beta model's step for
    the naive loop, one all_reduce per gradient, and buckets, redrawn at each change. `alpha`
    and `beta` were measured on 2 ranks; alpha grows with the ring's steps (ring_alpha)."""
    def show(bucket_bytes, world_size):
        draw_bucket_model(grad_bytes, measured, alpha, beta, bucket_bytes, world_size)
        plt.show()

    return explorer(
        show,
        bucket_bytes=widgets.SelectionSlider(options=BUCKET_CHOICES, value=bucket_bytes,
                                             description="bucket"),
        world_size=widgets.IntSlider(value=world_size, min=2, max=64, description="ranks"),
    )
