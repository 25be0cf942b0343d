"""The alpha-beta model of one data-parallel training step: when each all_reduce starts and ends,
and how long the step takes, for the naive loop and for DDP with or without buckets. Lesson 06
(notebooks/06_data_parallelism.ipynb) checks it against measured steps and its widget draws it.

The model's assumptions:
- backward produces the gradients in the reverse order of the parameters, each after a share of
  the backward time proportional to its size;
- one all_reduce runs at a time (they queue on the communicator, as on one NCCL stream; gloo
  has 2 worker threads and may run two at once);
- an all_reduce of S bytes on n ranks takes alpha + 2(n-1)/n * S / beta: lesson 04's fit
  (helpers.cost_model.model_seconds);
- communication and computation do not slow each other down (on a GPU, NCCL's kernels take a
  few of the compute units and some memory bandwidth; on this machine's two cores, gloo's
  threads and the backward pass compete for the cores, which the measurement shows and the
  model does not).
"""

from __future__ import annotations

from itertools import accumulate

from helpers.cost_model import model_seconds
from helpers.data_parallelism.ddp import bucket_indices


def predict_step(grad_bytes: list, forward_s: float, backward_s: float, step_s: float,
                 strategy: str, world_size: int, alpha: float, beta: float,
                 bucket_bytes: float | None = None) -> dict:
    """The events of one step, [(label, start_s, end_s)], in the format the measuring worker
    (`workers.timeline_worker`) returns, and the step's time.

    `grad_bytes` lists the parameters' gradient sizes in parameter order. `strategy` is "naive"
    (every all_reduce after backward, one after another) or "ddp" (each bucket's all_reduce
    launched as soon as its last gradient is ready; `bucket_bytes=None`: one per gradient)."""
    def all_reduce_seconds(size):
        return model_seconds(alpha, beta, "all_reduce", world_size, size)

    backward_order = list(reversed(grad_bytes))
    backward_end = forward_s + backward_s
    events = [("forward", 0.0, forward_s), ("backward", forward_s, backward_end)]
    if strategy == "naive":
        clock = backward_end
        for size in backward_order:
            events.append(("all_reduce", clock, clock + all_reduce_seconds(size)))
            clock = events[-1][2]
        events.append(("naive all_reduces", backward_end, clock))
    elif strategy == "ddp":
        total = sum(backward_order)
        ready = [forward_s + backward_s * done / total for done in accumulate(backward_order)]
        link_free = 0.0
        for bucket in bucket_indices(backward_order, bucket_bytes):
            start = max(ready[bucket[-1]], link_free)
            link_free = start + all_reduce_seconds(sum(backward_order[i] for i in bucket))
            events.append(("all_reduce", start, link_free))
        clock = max(backward_end, link_free)
        events.append(("wait", backward_end, clock))
    else:
        raise ValueError(f"strategy must be 'naive' or 'ddp', got {strategy!r}")
    events.append(("step", clock, clock + step_s))
    return {"events": events, "step_seconds": clock + step_s}


def predict_averaging(bucket_bytes: list, world_size: int, alpha: float, beta: float) -> float:
    """Seconds to average gradients packed in buckets of these sizes (bytes), one all_reduce
    after another: sum(alpha + 2(n-1)/n * S / beta). Bucketing saves alpha per call it removes."""
    return sum(model_seconds(alpha, beta, "all_reduce", world_size, size) for size in bucket_bytes)
