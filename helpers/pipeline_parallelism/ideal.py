"""The schedules with ideal timings: every stage takes the same time, communication takes none
(lesson 09). The same rules as `schedule.pipeline_step`, played out with a clock: a forward of
micro-batch i on rank r starts once rank r - 1 has finished its forward of i and rank r is free;
a backward once rank r + 1 has finished its backward of i. zb's weight gradients W are placed by
the same rule as in pipeline_step (`schedule.next_action`), one whole W at a time; the rest run
at the end."""

from __future__ import annotations

from helpers.pipeline_parallelism.schedule import Event, next_action, schedule_order


def simulate(schedule: str, num_stages: int, num_micro_batches: int, forward: float = 1.0,
             backward: float = 2.0) -> list:
    """Every rank's Events (stored_bytes counts micro-batches kept). For zb, a backward takes
    `backward` / 2 and its W the other half."""
    p, m = num_stages, num_micro_batches
    split = schedule == "zb"
    b_time = backward / 2 if split else backward
    orders = [list(schedule_order(schedule, r, p, m)) for r in range(p)]
    done = {}  # (kind, rank, micro_batch) -> end time
    clock, events = [0.0] * p, [[] for _ in range(p)]
    pending_w, kept = [[] for _ in range(p)], [set() for _ in range(p)]

    def ready_at(rank, kind, i):
        if kind == "F":
            return 0.0 if rank == 0 else done.get(("F", rank - 1, i))
        return done.get(("F", rank, i)) if rank == p - 1 else done.get(("B", rank + 1, i))

    def run(rank, kind, i, start, duration):
        end = start + duration
        if kind == "F":
            kept[rank].add(i)
        elif kind == "W" or not split:
            kept[rank].discard(i)
        events[rank].append(Event(kind, i, start, end, len(kept[rank])))
        done[kind, rank, i] = clock[rank] = end

    while any(orders):
        progressed = False
        for rank in range(p):
            while orders[rank]:
                kind, i = orders[rank][0]
                ready = ready_at(rank, kind, i)
                if ready is None:
                    break  # waits for another rank, which must move first
                while next_action(kind, len(pending_w[rank]), len(kept[rank]), p, rank,
                                  message_ready=ready <= clock[rank]) == "W":
                    run(rank, "W", pending_w[rank].pop(0), clock[rank], backward - b_time)
                orders[rank].pop(0)
                run(rank, kind, i, max(clock[rank], ready), forward if kind == "F" else b_time)
                if split and kind == "B":
                    pending_w[rank].append(i)
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule deadlocks")
    for rank in range(p):
        for i in pending_w[rank]:
            run(rank, "W", i, clock[rank], backward - b_time)
    return events


def bubble(events: list, start: float = 0.0) -> float:
    """The idle share of a step: over every rank, the time not spent computing, divided by the
    step's time (from `start`, when every rank began, to the last event of any rank)."""
    total = max(event.end for rank in events for event in rank) - start
    busy = sum(event.end - event.start for rank in events for event in rank)
    return 1 - busy / (total * len(events))
