"""Pipeline schedules as plain data: which stage runs which micro-batch, forward or backward, at
each tick of a clock. No TensorFlow here: a schedule can be built, checked, drawn and reasoned
about before any device runs it (``accel.parallel.pipeline_exec`` runs one).

A schedule is a list of clock ticks; each tick is a list of ``(stage, microbatch, phase)``
tuples, phase ``"F"`` (forward) or ``"B"`` (backward), at most one per stage. With ``p`` stages
and ``m`` micro-batches every stage runs ``2m`` tasks:

* ``gpipe_schedule(m, p)``: all forwards, then all backwards in reverse (Huang et al. 2019,
  "GPipe", arXiv:1811.06965). The forward of micro-batch ``i`` on stage ``j`` runs at tick
  ``i + j``. Every stage holds the activations of all ``m`` micro-batches at once.
* ``one_f_one_b_schedule(m, p)``: stage ``j`` runs ``p - j - 1`` warm-up forwards, then
  alternates one forward and one backward, then drains the remaining backwards (the
  non-interleaved "1F1B" of PipeDream-Flush, Narayanan et al. 2021, arXiv:2104.04473). Same
  length of clock, but a stage never holds more than ``p - j`` micro-batches.

Both schedules come from per-stage task orders placed on the clock by ``clock_schedule``: a task
runs at the first tick after the tasks it depends on (the forward on the previous stage, the
backward on the next stage, its own forward) and after its stage's previous task. With every
task one tick long the idle fraction of the clock is ``bubble_fraction(p, m) = (p-1)/(m+p-1)``
for both schedules (``idle_fraction`` measures it on a schedule).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from accel import checks

__all__ = ["PHASES", "Task", "gpipe_orders", "one_f_one_b_orders", "clock_schedule",
           "gpipe_schedule", "one_f_one_b_schedule", "validate_schedule", "stage_orders",
           "bubble_fraction", "idle_fraction", "peak_in_flight", "format_schedule", "simulate",
           "interval_idle_fractions"]

PHASES = ("F", "B")
Task = tuple[int, int, str]  # (stage, microbatch, phase)


def _check_sizes(num_microbatches: int, num_stages: int) -> None:
    checks.positive_int("num_microbatches", num_microbatches)
    checks.positive_int("num_stages", num_stages)


def gpipe_orders(num_microbatches: int, num_stages: int) -> list[list[Task]]:
    """GPipe's task order on each stage: forwards 0..m-1, then backwards m-1..0."""
    _check_sizes(num_microbatches, num_stages)
    m = num_microbatches
    return [[(j, i, "F") for i in range(m)] + [(j, i, "B") for i in reversed(range(m))]
            for j in range(num_stages)]


def one_f_one_b_orders(num_microbatches: int, num_stages: int) -> list[list[Task]]:
    """1F1B's task order on each stage: ``min(p - j - 1, m)`` warm-up forwards, then one forward
    and one backward in turn, then the remaining backwards."""
    _check_sizes(num_microbatches, num_stages)
    m, p = num_microbatches, num_stages
    orders = []
    for j in range(p):
        warmup = min(p - j - 1, m)
        order = [(j, i, "F") for i in range(warmup)]
        for k in range(m - warmup):
            order += [(j, warmup + k, "F"), (j, k, "B")]
        order += [(j, i, "B") for i in range(m - warmup, m)]
        orders.append(order)
    return orders


def _dependencies(task: Task, num_stages: int) -> list[Task]:
    stage, mb, phase = task
    if phase == "F":
        return [(stage - 1, mb, "F")] if stage > 0 else []
    deps = [(stage, mb, "F")]
    return deps + ([(stage + 1, mb, "B")] if stage < num_stages - 1 else [])


def clock_schedule(orders: Sequence[Sequence[Task]]) -> list[list[Task]]:
    """Place per-stage task orders on a clock of unit-length ticks: each task at the first tick
    after its dependencies and its stage's previous task. ``orders[j]`` lists stage ``j``'s tasks
    (each ``(j, microbatch, phase)``). ``ValueError`` if the orders deadlock (a task waits for
    one that its own stage can only run later)."""
    p = len(orders)
    if p == 0:
        raise ValueError("orders is empty: give one task list per stage")
    for j, order in enumerate(orders):
        for task in order:
            if task[0] != j or task[2] not in PHASES:
                raise ValueError(f"stage {j}'s order holds {task!r}: tasks must be "
                                 f"({j}, microbatch, 'F' or 'B')")
    done: dict[Task, int] = {}
    position = [0] * p
    ticks: list[list[Task]] = []
    while any(position[j] < len(orders[j]) for j in range(p)):
        tick = len(ticks)
        ready = []
        for j in range(p):
            if position[j] < len(orders[j]):
                task = orders[j][position[j]]
                if all(done.get(d, tick) < tick for d in _dependencies(task, p)):
                    ready.append(task)
        if not ready:
            waiting = [orders[j][position[j]] for j in range(p) if position[j] < len(orders[j])]
            raise ValueError(f"the stage orders deadlock at tick {tick}: every next task waits "
                             f"for another ({waiting})")
        for task in ready:
            done[task] = tick
            position[task[0]] += 1
        ticks.append(ready)
    return ticks


def gpipe_schedule(num_microbatches: int, num_stages: int) -> list[list[Task]]:
    """GPipe on the clock (see the module docstring)."""
    return clock_schedule(gpipe_orders(num_microbatches, num_stages))


def one_f_one_b_schedule(num_microbatches: int, num_stages: int) -> list[list[Task]]:
    """1F1B on the clock (see the module docstring)."""
    return clock_schedule(one_f_one_b_orders(num_microbatches, num_stages))


def validate_schedule(schedule: Sequence[Sequence[Task]], num_stages: int,
                      num_microbatches: int) -> None:
    """``ValueError`` naming the first problem unless ``schedule`` runs every forward and every
    backward exactly once, at most one task per stage per tick, and no task before the tasks it
    depends on (the previous stage's forward, the next stage's backward, its own forward)."""
    _check_sizes(num_microbatches, num_stages)
    when: dict[Task, int] = {}
    for tick, tasks in enumerate(schedule):
        stages = [t[0] if isinstance(t, tuple) and len(t) == 3 else None for t in tasks]
        for task in tasks:
            if not (isinstance(task, tuple) and len(task) == 3 and task[2] in PHASES
                    and 0 <= task[0] < num_stages and 0 <= task[1] < num_microbatches):
                raise ValueError(f"tick {tick}: {task!r} is not a (stage < {num_stages}, "
                                 f"microbatch < {num_microbatches}, 'F' or 'B') task")
            if task in when:
                raise ValueError(f"task {task!r} runs twice (ticks {when[task]} and {tick})")
            when[task] = tick
        if len(set(stages)) != len(stages):
            raise ValueError(f"tick {tick}: a stage runs two tasks at once ({list(tasks)})")
    for j in range(num_stages):
        for i in range(num_microbatches):
            for phase in PHASES:
                if (j, i, phase) not in when:
                    raise ValueError(f"the schedule drops task {(j, i, phase)!r}")
    for task, tick in when.items():
        for dep in _dependencies(task, num_stages):
            if when[dep] >= tick:
                raise ValueError(f"task {task!r} at tick {tick} runs before {dep!r} "
                                 f"(tick {when[dep]}) that it needs")


def stage_orders(schedule: Sequence[Sequence[Task]], num_stages: int) -> list[list[Task]]:
    """The order in which each stage runs its tasks (what a device's log should show)."""
    orders: list[list[Task]] = [[] for _ in range(num_stages)]
    for tasks in schedule:
        for task in sorted(tasks):
            orders[task[0]].append(task)
    return orders


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """The idle share of a synchronous pipeline's clock, (p - 1) / (m + p - 1)."""
    _check_sizes(num_microbatches, num_stages)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def idle_fraction(schedule: Sequence[Sequence[Task]], num_stages: int) -> float:
    """Idle stage-ticks over all stage-ticks of ``schedule`` (every task one tick long)."""
    checks.positive_int("num_stages", num_stages)
    if not schedule:
        raise ValueError("schedule is empty")
    busy = sum(len(tasks) for tasks in schedule)
    return 1.0 - busy / (num_stages * len(schedule))


def peak_in_flight(schedule: Sequence[Sequence[Task]], num_stages: int) -> list[int]:
    """For each stage, the most micro-batches whose forward has run and backward has not: how
    many micro-batches' activations the stage must stash at once."""
    checks.positive_int("num_stages", num_stages)
    held, peak = [0] * num_stages, [0] * num_stages
    for tasks in schedule:
        for stage, _, phase in tasks:
            held[stage] += 1 if phase == "F" else -1
            peak[stage] = max(peak[stage], held[stage])
    return peak


def format_schedule(schedule: Sequence[Sequence[Task]], num_stages: int) -> str:
    """The schedule as text: one row per stage, one column per tick, ``F3`` / ``B3`` for the
    forward / backward of micro-batch 3, ``.`` where the stage idles."""
    checks.positive_int("num_stages", num_stages)
    cells = [["."] * len(schedule) for _ in range(num_stages)]
    for t, tasks in enumerate(schedule):
        for stage, mb, phase in tasks:
            cells[stage][t] = f"{phase}{mb}"
    width = max(2, *(len(c) for row in cells for c in row))
    head = "tick    " + " ".join(f"{t:>{width}}" for t in range(len(schedule)))
    rows = [f"stage {j} " + " ".join(f"{c:>{width}}" for c in row) for j, row in enumerate(cells)]
    return "\n".join([head, *rows])


def simulate(orders: Sequence[Sequence[Task]],
             durations: Callable[[Task], float]) -> list[list[tuple[Task, float, float]]]:
    """Per-stage task orders played out with real durations (``durations(task)`` seconds): each
    task starts when its stage is free and the tasks it depends on have ended. Returns each
    stage's ``(task, start, end)`` list: a timeline predicted from measured task times."""
    p = len(orders)
    if p == 0:
        raise ValueError("orders is empty: give one task list per stage")
    end: dict[Task, float] = {}
    free, position = [0.0] * p, [0] * p
    out: list[list[tuple[Task, float, float]]] = [[] for _ in range(p)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for j in range(p):
            if position[j] == len(orders[j]):
                continue
            task = orders[j][position[j]]
            deps = _dependencies(task, p)
            if all(d in end for d in deps):
                start = max([free[j], *(end[d] for d in deps)])
                seconds = checks.non_negative_number(f"durations({task!r})", durations(task))
                end[task] = free[j] = start + seconds
                out[j].append((task, start, end[task]))
                position[j] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the stage orders deadlock: every next task waits for another")
    return out


def interval_idle_fractions(logs: Sequence[Sequence[tuple[Task, float, float]]]) -> list[float]:
    """Each stage's idle share of the whole span (first start to last end), from its busy
    intervals ``(task, start, end)``: measured logs or ``simulate``'s prediction alike."""
    entries = [e for log in logs for e in log]
    if not entries:
        raise ValueError("the logs hold no task")
    span = max(e for _, _, e in entries) - min(s for _, s, _ in entries)
    if span <= 0:
        raise ValueError("the logs span no time")
    return [1.0 - sum(e - s for _, s, e in log) / span for log in logs]
