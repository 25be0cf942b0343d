"""Memory over a step, not only its peak: what the tracker holds after every operation.

- `timeline_worker(rank, world_size, shape, plan)`: one step of `plan` on fake ranks (this
  process plays rank 0 of plan.gpus, launched alone with init_group=False), as
  accounting.account_worker runs it, under FSDPMemTracker (MemTracker with tensor parallelism),
  which records after every operation the bytes alive by kind. Returns {"kinds": {kind: [bytes
  after each operation]}, "phases": [(phase, index of its first operation)]}: the step's phases
  as accounting.train_step marks them, with "backward" parted where the loss's backward ends and
  the model's begins (the first gradient to reach the output head).
- `at_peak(found)`: {kind: bytes} at the step's peak, the tracker's peak snapshot
  (tests/test_at_scale.py compares them).
"""

from __future__ import annotations

from helpers.at_scale.accounting import join_fake_group, prepared, trackers, train_step


def recording(tracker_class, records: list):
    """`tracker_class` (one of accounting.trackers()) that also appends, after every operation,
    {kind: bytes alive} to `records`."""
    keep_peak = tracker_class._update_peak_stats

    def update(self, peak_state) -> None:
        keep_peak(self, peak_state)
        (snapshot,) = self._curr_mem_snap.values()  # one device
        records.append({getattr(kind, "value", kind): size for kind, size in snapshot.items()})

    return type(f"Recording{tracker_class.__name__}", (tracker_class,),
                {"_update_peak_stats": update})


def timeline_worker(rank, world_size, shape, plan):
    plan.check(shape)
    join_fake_group(plan.gpus)
    records, phases = [], []

    def mark(phase):
        phases.append((phase, len(records)))

    with prepared(shape, plan, fake=True) as (model, optimizer, tokens):
        def on_logits(module, inputs, logits) -> None:  # their gradient: the loss's backward done
            logits.register_hook(lambda gradient: mark("backward, the model's"))

        model.output.register_forward_hook(on_logits)
        FSDPMemTracker, MemTracker = trackers()
        if plan.tp == 1:
            tracker = recording(FSDPMemTracker, records)(model, optimizer)
        else:
            tracker = recording(MemTracker, records)()
            tracker.track_external(model, optimizer)
        with tracker:
            train_step(model, optimizer, tokens, plan, mark=mark)
    kinds = {kind: [record.get(kind, 0) for record in records] for kind in records[0]}
    return {"kinds": kinds, "phases": [("backward, the loss's" if phase == "backward" else phase,
                                        start) for phase, start in phases]}


def at_peak(found: dict) -> dict:
    """{kind: bytes} after the first operation at which the step's total peaks."""
    total = found["kinds"]["Total"]
    index = total.index(max(total))
    return {kind: values[index] for kind, values in found["kinds"].items()}
