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

* ``interleaved_schedule(m, p, v)``: each of the ``p`` devices holds ``v`` model chunks, so
  the model is cut into ``p * v`` *virtual stages*; virtual stage ``s`` runs on device
  ``s % p`` (Megatron's placement: device 0 holds stages 0, p, 2p, ...). Devices run one
  micro-batch chunk after another in groups of ``p`` micro-batches, with Megatron's warm-up of
  ``2 (p - d - 1) + (v - 1) p`` forwards on device ``d`` (Narayanan et al. 2021, section 2.2;
  ``m`` must be a multiple of ``p``). A task is a chunk, ``1/v`` of a full stage.

**The backward split in two** (Qi et al. 2023, "Zero Bubble Pipeline Parallelism",
arXiv:2401.10241, ICLR 2024, section 2): a schedule may also hold phase ``"W"``. In a schedule
that holds W tasks, ``"B"`` is the gradient with respect to the stage's *inputs* only (what the
previous stage waits for) and ``"W"`` the gradient with respect to the stage's *weights*, for
the same ``(stage, microbatch)``; every stage then runs ``3m`` tasks. W needs B's output
gradients and the stashed activations, and nothing waits for W but the optimizer step, so W
fills bubbles. A schedule without W keeps the meaning above (B = the whole backward).

* ``zb_h1_schedule(m, p)``: ZB-H1 (Qi et al., section 2.1, Figure 3 top): 1F1B's warm-up
  of ``p - j - 1`` forwards, then ``j`` pairs of one forward and one input-gradient B whose W
  is put off, then F, B, W in turn, then B, W, then the ``j`` W put off. Every stage holds
  ``p`` micro-batches at its peak (1F1B's first stage: the same peak activation memory), and
  with F, B and W one tick each the bubble is a third of 1F1B's (see ``bubble_fraction``). The
  order is the authors' DeepSpeed one (``ZeroBubbleH1Pipeline`` with exact semantics,
  microsoft/Megatron-DeepSpeed ``megatron/core/pipeline_parallel/deepspeed_zbh1_schedule.py``),
  also PyTorch's zero-bubble warm-up (``_get_1f1b_rank_ops`` with ``enable_zero_bubble``,
  ``torch/distributed/pipelining/schedules.py``).
* ``zb_v_schedule(m, p)``: ZB-V (Qi et al., section 6): the model is cut into ``2p`` chunks
  (virtual stages) placed as a V, device ``d`` holding chunks ``d`` and ``2p - 1 - d``
  (``placement="v"``): the forward goes down the devices and back up, so the last chunk is on
  device 0, which both starts the forward and computes the loss. Each device warms up with
  forwards of its first chunk, then of both, then runs F, B, W in turn on each chunk, and
  puts W off to fill the drain (the authors' hand-built order, ``get_zb_v_schedule`` in
  sail-sg/zero-bubble-pipeline-parallelism ``megatron/core/pipeline_parallel/
  handcrafted_zb_v``, the same as PyTorch's ``ScheduleZBVZeroBubble``). With F, B and W of
  equal time (per chunk) each device idles ``p - 1`` chunk-ticks of ``6m + p - 1`` for
  ``m >= 2p - 1`` (half of ZB-H1's ``p - 1`` stage-ticks, as a chunk is half a stage), and
  each device holds at most ``2p`` chunk activations, ``p`` whole stages': 1F1B's first
  stage's peak.

All of them come from per-device task orders placed on the clock by ``clock_schedule``: a task
runs at the first tick after the tasks it depends on (``dependencies``: the forward on the
previous stage; for a backward, its own forward and the backward, B, on the next stage; for a
W, its own B) and after its device's previous task. With every task one tick long the idle
fraction of the clock is ``bubble_fraction(m, p) = (p-1)/(m+p-1)`` for GPipe and 1F1B,
``bubble_fraction(m, p, v) = (p-1)/(v m + p-1)`` interleaved, ``(p-1)/(3m+p-1)`` for
ZB-H1 and ``(p-1)/(6m+p-1)`` for ZB-V (``idle_fraction`` measures it on a schedule).

Where a function takes ``num_devices``, stages are virtual, placed by ``placement``:
``"loop"`` (the default: stage ``s`` on device ``s % num_devices``, as interleaved 1F1B wants)
or ``"v"`` (``2 * num_devices`` stages, stage ``s`` on ``v_shape_device(s, num_devices)``, as
ZB-V wants; ``stage_device`` says which device for either); left out, every stage has a device
of its own. The tick format does not say where stages run: give the same placement to every
function that reads a schedule (``SCHEDULE_PLACEMENT`` names each schedule's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from accel import checks

__all__ = ["PHASES", "Task", "gpipe_orders", "one_f_one_b_orders", "interleaved_orders",
           "zb_h1_orders", "zb_v_orders", "PLACEMENTS", "SCHEDULE_PLACEMENT",
           "v_shape_device", "stage_device", "infer_placement", "clock_schedule", "dependencies",
           "splits_backward", "gpipe_schedule",
           "one_f_one_b_schedule", "interleaved_schedule", "zb_h1_schedule", "zb_v_schedule",
           "SCHEDULES", "make_schedule", "validate_schedule", "stage_orders", "device_orders",
           "bubble_fraction", "idle_fraction", "peak_in_flight", "format_schedule", "simulate",
           "interval_idle_fractions"]

PHASES = ("F", "B", "W")  # forward, backward (input gradient where a schedule has W), weights
Task = tuple[int, int, str]  # (stage, microbatch, phase)
_TASK = "(stage, microbatch, 'F', 'B' or 'W')"


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


def interleaved_orders(num_microbatches: int, num_stages: int,
                       num_chunks: int) -> list[list[Task]]:
    """Interleaved 1F1B's task order on each of ``num_stages`` devices, each holding
    ``num_chunks`` chunks: tasks name virtual stages ``c * p + d`` (chunk ``c`` of device
    ``d``). Forwards go through the chunks in groups of ``p`` micro-batches (micro-batches
    0..p-1 on chunk 0, the same on chunk 1, ..., then micro-batches p..2p-1); backwards the
    same with the chunks reversed; device ``d`` runs ``2 (p - d - 1) + (v - 1) p`` warm-up
    forwards, then one forward and one backward in turn, then the remaining backwards."""
    _check_sizes(num_microbatches, num_stages)
    checks.positive_int("num_chunks", num_chunks)
    m, p, v = num_microbatches, num_stages, num_chunks
    if m % p:
        raise ValueError(f"interleaved 1F1B needs num_microbatches a multiple of num_stages: "
                         f"got num_microbatches={m}, num_stages={p}")
    total = m * v

    def task(d: int, k: int, phase: str) -> Task:
        chunk = (k // p) % v
        if phase == "B":
            chunk = v - 1 - chunk
        return (chunk * p + d, (k // (p * v)) * p + k % p, phase)

    orders = []
    for d in range(p):
        warmup = min(2 * (p - d - 1) + (v - 1) * p, total)
        order = [task(d, k, "F") for k in range(warmup)]
        for k in range(total - warmup):
            order += [task(d, warmup + k, "F"), task(d, k, "B")]
        order += [task(d, k, "B") for k in range(total - warmup, total)]
        orders.append(order)
    return orders


def zb_h1_orders(num_microbatches: int, num_stages: int) -> list[list[Task]]:
    """ZB-H1's task order on each stage (Qi et al. 2023, section 2.1, Figure 3 top; the order
    of the authors' ``ZeroBubbleH1Pipeline.steps`` with exact semantics): stage ``j`` runs
    ``min(p - j - 1, m)`` warm-up forwards, then up to ``j`` pairs F, B whose W is put off, then
    F, B, W in turn while forwards remain, then B, W, then the W put off, oldest first. B is
    the input gradient, W the weight gradient (module docstring)."""
    _check_sizes(num_microbatches, num_stages)
    m, p = num_microbatches, num_stages
    orders = []
    for j in range(p):
        warmup = min(p - j - 1, m)
        put_off = min(j, m - warmup)  # F, B pairs without their W
        order = [(j, i, "F") for i in range(warmup)]
        for k in range(put_off):
            order += [(j, warmup + k, "F"), (j, k, "B")]
        for k in range(m - warmup - put_off):
            order += [(j, warmup + put_off + k, "F"), (j, put_off + k, "B"), (j, k, "W")]
        w = m - warmup - put_off  # the W run so far
        for k in range(m - warmup, m):
            order += [(j, k, "B"), (j, w, "W")]
            w += 1
        order += [(j, k, "W") for k in range(w, m)]
        orders.append(order)
    return orders


def zb_v_orders(num_microbatches: int, num_devices: int) -> list[list[Task]]:
    """ZB-V's task order on each of ``num_devices`` devices (Qi et al. 2023, section 6): tasks
    name the ``2p`` virtual stages placed as a V, device ``d`` holding stage ``d`` (its chunk
    0) and stage ``2p - 1 - d`` (its chunk 1). Device ``d`` runs ``2 (p - d) - 1`` forwards
    of chunk 0, then ``d`` pairs (forward of chunk 1, forward of chunk 0), then ``p - d``
    triples F, B, W of chunk 1; then, while forwards remain, F, B, W of chunk 0 followed by F,
    B, W of chunk 1; then ``d`` pairs (B of chunk 0, B of chunk 1) and ``p - d`` pairs (B, W of
    chunk 0) whose W are the oldest put off, then the W still put off, chunk 1's first. This is
    the authors' hand-built order (``get_zb_v_schedule`` in
    sail-sg/zero-bubble-pipeline-parallelism ``megatron/core/pipeline_parallel/
    handcrafted_zb_v``; PyTorch's ``ScheduleZBVZeroBubble._calculate_single_rank_operations``
    is the same), built for ``max(m, 2p - 1)`` micro-batches and the tasks of micro-batches
    ``>= m`` left out, as both do."""
    _check_sizes(num_microbatches, num_devices)
    m, p = num_microbatches, num_devices
    n = max(m, 2 * p - 1)
    orders = []
    for d in range(p):
        c0, c1 = d, 2 * p - 1 - d  # the device's two virtual stages
        f0 = f1 = b0 = b1 = 0
        order: list[Task] = []
        for _ in range(2 * (p - d) - 1):
            order.append((c0, f0, "F"))
            f0 += 1
        for _ in range(d):
            order += [(c1, f1, "F"), (c0, f0, "F")]
            f0, f1 = f0 + 1, f1 + 1
        for _ in range(p - d):
            order += [(c1, f1, "F"), (c1, b1, "B"), (c1, b1, "W")]
            f1, b1 = f1 + 1, b1 + 1
        while f1 < f0 or f0 < n:  # the steady state
            if f0 < n:
                order.append((c0, f0, "F"))
                f0 += 1
            order += [(c0, b0, "B"), (c0, b0, "W"), (c1, f1, "F"), (c1, b1, "B"), (c1, b1, "W")]
            b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
        w0, w1 = b0, b1  # the drain: W put off, then run oldest first
        for _ in range(d):
            order += [(c0, b0, "B"), (c1, b1, "B")]
            b0, b1 = b0 + 1, b1 + 1
        for _ in range(p - d):
            order += [(c0, b0, "B"), (c0, w0, "W")]
            b0, w0 = b0 + 1, w0 + 1
        order += [(c1, i, "W") for i in range(w1, b1)] + [(c0, i, "W") for i in range(w0, b0)]
        orders.append([task for task in order if task[1] < m])
    return orders


PLACEMENTS = ("loop", "v")
# the placement each named schedule's virtual stages need (``make_schedule``'s names)
SCHEDULE_PLACEMENT = {"gpipe": "loop", "1f1b": "loop", "interleaved": "loop",
                      "zb-h1": "loop", "zb-v": "v"}


def v_shape_device(stage: int, num_devices: int) -> int:
    """The device of virtual stage ``stage`` of ``2 * num_devices`` placed as a V (ZB-V,
    Qi et al. section 6; ``generate_stage_to_rank_mapping(..., style="v")`` in PyTorch's
    ``torch/distributed/pipelining/schedules.py``): ``stage`` if ``stage < p``, else
    ``2p - 1 - stage``: down the devices, then back up."""
    checks.positive_int("num_devices", num_devices)
    checks.non_negative_int("stage", stage)
    p = num_devices
    if stage >= 2 * p:
        raise ValueError(f"stage {stage} is not one of the {2 * p} stages a V places on "
                         f"{p} devices")
    return stage if stage < p else 2 * p - 1 - stage


def stage_device(stage: int, num_stages: int, num_devices: int,
                 placement: str = "loop") -> int:
    """The device that runs virtual stage ``stage`` of ``num_stages`` on ``num_devices``:
    ``stage % num_devices`` with ``placement="loop"``, ``v_shape_device`` with ``"v"``
    (which needs ``num_stages == 2 * num_devices``)."""
    _check_placement(num_stages, num_devices, placement)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage!r} is not one of the {num_stages} stages")
    return stage % num_devices if placement == "loop" else v_shape_device(stage, num_devices)


def _check_placement(num_stages: int, num_devices: int, placement: str) -> None:
    _check_virtual(num_stages, num_devices)
    checks.one_of("placement", placement, PLACEMENTS)
    if placement == "v" and num_stages != 2 * num_devices:
        raise ValueError(f"placement 'v' puts 2 stages on each device: {num_stages} stages "
                         f"on {num_devices} devices need placement 'loop'")


def _devices_of(num_stages: int, num_devices: int, placement: str) -> list[int]:
    """Each stage's device: ``stage_device`` for every stage."""
    _check_placement(num_stages, num_devices, placement)
    return [s % num_devices if placement == "loop" else v_shape_device(s, num_devices)
            for s in range(num_stages)]


def infer_placement(stage_devices: Sequence) -> tuple[list, str]:
    """The distinct devices (first seen first) of a list naming each stage's device, and the
    placement they follow: ``"loop"`` (stage ``s`` on device ``s % p``, one device per stage
    included) or ``"v"`` (2p stages, stage ``s`` on ``v_shape_device(s, p)``). ``ValueError``
    for any other list."""
    names = list(stage_devices)
    devices = list(dict.fromkeys(names))
    p = len(devices)
    if not p:
        raise ValueError("no stage: give one device per stage")
    for placement in PLACEMENTS:
        if (placement == "loop" or len(names) == 2 * p) and len(names) % p == 0 and \
                names == [devices[d] for d in _devices_of(len(names), p, placement)]:
            return devices, placement
    raise ValueError(f"stage devices {names}: give one device per stage, {p} devices repeated "
                     f"in order (stage s on the device of stage s % {p}), or {p} devices down "
                     f"and back up as a V (stage s on the device of stage {2 * p - 1} - s)")


def splits_backward(schedule: Sequence[Sequence[Task]]) -> bool:
    """Whether ``schedule`` (ticks, or per-device orders) holds W tasks: then its B tasks are
    input gradients only, and W the weight gradients (module docstring)."""
    return any(task[2] == "W" for tasks in schedule for task in tasks)


def dependencies(task: Task, num_stages: int) -> list[Task]:
    """The tasks ``task`` waits for: the forward of its micro-batch on the previous stage (a
    forward); its own forward and the backward B on the next stage (a backward: B, never the
    next stage's W, which is what lets W wait); its own B (a W)."""
    stage, mb, phase = task
    if phase == "F":
        return [(stage - 1, mb, "F")] if stage > 0 else []
    if phase == "W":
        return [(stage, mb, "B")]
    deps = [(stage, mb, "F")]
    return deps + ([(stage + 1, mb, "B")] if stage < num_stages - 1 else [])


def clock_schedule(orders: Sequence[Sequence[Task]], num_stages: int | None = None,
                   placement: str = "loop") -> list[list[Task]]:
    """Place per-device task orders on a clock of unit-length ticks: each task at the first tick
    after its dependencies and its device's previous task. ``orders[d]`` lists device ``d``'s
    tasks; with ``num_stages`` (virtual stages, default one per device) a task's stage must sit
    on its device by ``placement`` (``stage_device``: ``"loop"``, stage ``s`` on device
    ``s % len(orders)``, or ``"v"``). ``ValueError`` if the orders deadlock (a task waits for
    one that its own device can only run later)."""
    p = len(orders)
    if p == 0:
        raise ValueError("orders is empty: give one task list per device")
    num_stages = p if num_stages is None else num_stages
    device_of = _devices_of(num_stages, p, placement)
    rule = f"stage % {p} == {{j}}" if placement == "loop" else f"placement {placement!r}"
    for j, order in enumerate(orders):
        for task in order:
            if not (isinstance(task, tuple) and len(task) == 3 and task[2] in PHASES
                    and isinstance(task[0], int) and 0 <= task[0] < num_stages
                    and device_of[task[0]] == j):
                raise ValueError(f"device {j}'s order holds {task!r}: tasks must be "
                                 f"{_TASK} with a stage < {num_stages} "
                                 f"placed on device {j} ({rule.format(j=j)})")
    done: dict[Task, int] = {}
    position = [0] * p
    ticks: list[list[Task]] = []
    while any(position[j] < len(orders[j]) for j in range(p)):
        tick = len(ticks)
        ready = []
        for j in range(p):
            if position[j] < len(orders[j]):
                task = orders[j][position[j]]
                if all(done.get(d, tick) < tick for d in dependencies(task, num_stages)):
                    ready.append(task)
        if not ready:
            waiting = [orders[j][position[j]] for j in range(p) if position[j] < len(orders[j])]
            raise ValueError(f"the stage orders deadlock at tick {tick}: every next task waits "
                             f"for another ({waiting})")
        for task in ready:
            done[task] = tick
            position[device_of[task[0]]] += 1
        ticks.append(ready)
    return ticks


def _check_virtual(num_stages: int, num_devices: int) -> int:
    checks.positive_int("num_stages", num_stages)
    checks.positive_int("num_devices", num_devices)
    if num_stages % num_devices:
        raise ValueError(f"{num_stages} stages do not spread evenly over {num_devices} devices: "
                         "num_stages must be a multiple of num_devices")
    return num_stages


def gpipe_schedule(num_microbatches: int, num_stages: int) -> list[list[Task]]:
    """GPipe on the clock (see the module docstring)."""
    return clock_schedule(gpipe_orders(num_microbatches, num_stages))


def one_f_one_b_schedule(num_microbatches: int, num_stages: int) -> list[list[Task]]:
    """1F1B on the clock (see the module docstring)."""
    return clock_schedule(one_f_one_b_orders(num_microbatches, num_stages))


def zb_h1_schedule(num_microbatches: int, num_stages: int) -> list[list[Task]]:
    """ZB-H1 on the clock: forward, input-gradient backward (B) and weight gradient (W) tasks,
    one tick each (module docstring)."""
    return clock_schedule(zb_h1_orders(num_microbatches, num_stages))


def zb_v_schedule(num_microbatches: int, num_devices: int) -> list[list[Task]]:
    """ZB-V on the clock: ``num_devices`` devices, ``2 * num_devices`` virtual stages placed as
    a V (``placement="v"``), F, B and W one tick each (module docstring)."""
    return clock_schedule(zb_v_orders(num_microbatches, num_devices), 2 * num_devices, "v")


def interleaved_schedule(num_microbatches: int, num_stages: int,
                         num_chunks: int) -> list[list[Task]]:
    """Interleaved 1F1B on the clock: ``num_stages`` devices, ``num_chunks`` chunks each,
    tasks on virtual stages ``0 .. num_stages * num_chunks - 1`` (module docstring)."""
    return clock_schedule(interleaved_orders(num_microbatches, num_stages, num_chunks),
                          num_stages * num_chunks)


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")


def make_schedule(name: str, num_microbatches: int, num_stages: int,
                  num_chunks: int | None = None) -> list[list[Task]]:
    """A schedule by name (``SCHEDULES``) on ``num_stages`` devices; ``num_chunks`` (chunks per
    device) > 1 only for ``"interleaved"``; ``"zb-v"`` puts two chunks on each device
    (``num_chunks`` 2 or left out) placed as a V (``SCHEDULE_PLACEMENT``)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {SCHEDULES}")
    if name == "zb-v":
        if num_chunks not in (None, 2):
            raise ValueError(f"num_chunks={num_chunks!r}: 'zb-v' puts 2 chunks on each device "
                             "(give num_chunks=2 or leave it out)")
        return zb_v_schedule(num_microbatches, num_stages)
    num_chunks = checks.positive_int("num_chunks", 1 if num_chunks is None else num_chunks)
    if name == "interleaved":
        return interleaved_schedule(num_microbatches, num_stages, num_chunks)
    if num_chunks != 1:
        raise ValueError(f"num_chunks={num_chunks} needs the 'interleaved' schedule; {name!r} "
                         "puts one chunk on each device")
    build = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule,
             "zb-h1": zb_h1_schedule}[name]
    return build(num_microbatches, num_stages)


def validate_schedule(schedule: Sequence[Sequence[Task]], num_stages: int,
                      num_microbatches: int, num_devices: int | None = None,
                      placement: str = "loop") -> None:
    """``ValueError`` naming the first problem unless ``schedule`` runs every forward and every
    backward exactly once (and every W, if it holds any: then all of them), at most one task
    per device per tick (stage on device by ``placement``, ``stage_device``; default: a device
    per stage), and no task before the tasks it depends on (``dependencies``)."""
    _check_sizes(num_microbatches, num_stages)
    num_devices = num_stages if num_devices is None else num_devices
    device_of = _devices_of(num_stages, num_devices, placement)
    when: dict[Task, int] = {}
    for tick, tasks in enumerate(schedule):
        for task in tasks:
            if not (isinstance(task, tuple) and len(task) == 3 and task[2] in PHASES
                    and isinstance(task[0], int) and isinstance(task[1], int)
                    and 0 <= task[0] < num_stages and 0 <= task[1] < num_microbatches):
                raise ValueError(f"tick {tick}: {task!r} is not a (stage < {num_stages}, "
                                 f"microbatch < {num_microbatches}, 'F', 'B' or 'W') task")
            if task in when:
                raise ValueError(f"task {task!r} runs twice (ticks {when[task]} and {tick})")
            when[task] = tick
        devices = [device_of[t[0]] for t in tasks]
        if len(set(devices)) != len(devices):
            what = "a stage" if num_devices == num_stages else "a device"
            raise ValueError(f"tick {tick}: {what} runs two tasks at once ({list(tasks)})")
    phases = PHASES if splits_backward(schedule) else PHASES[:2]
    for j in range(num_stages):
        for i in range(num_microbatches):
            for phase in phases:
                if (j, i, phase) not in when:
                    raise ValueError(f"the schedule drops task {(j, i, phase)!r}")
    for task, tick in when.items():
        for dep in dependencies(task, num_stages):
            if when[dep] >= tick:
                raise ValueError(f"task {task!r} at tick {tick} runs before {dep!r} "
                                 f"(tick {when[dep]}) that it needs")


def stage_orders(schedule: Sequence[Sequence[Task]], num_stages: int) -> list[list[Task]]:
    """The order in which each stage runs its tasks."""
    orders: list[list[Task]] = [[] for _ in range(num_stages)]
    for tasks in schedule:
        for task in sorted(tasks):
            orders[task[0]].append(task)
    return orders


def device_orders(schedule: Sequence[Sequence[Task]], num_devices: int,
                  placement: str = "loop") -> list[list[Task]]:
    """The order in which each device runs its tasks (what a device's log should show), stage
    ``s`` on device ``s % num_devices`` (``placement="loop"``) or ``v_shape_device(s,
    num_devices)`` (``"v"``)."""
    checks.positive_int("num_devices", num_devices)
    checks.one_of("placement", placement, PLACEMENTS)
    device = (lambda s: s % num_devices) if placement == "loop" else (
        lambda s: v_shape_device(s, num_devices))
    orders: list[list[Task]] = [[] for _ in range(num_devices)]
    for tasks in schedule:
        for task in sorted(tasks):
            orders[device(task[0])].append(task)
    return orders


def bubble_fraction(num_microbatches: int, num_stages: int, num_chunks: int = 1,
                    schedule: str = "1f1b") -> float:
    """The idle share of a synchronous pipeline's clock on ``num_stages`` devices, every task
    one tick: (p - 1) / (v m + p - 1) for ``schedule`` ``"gpipe"``, ``"1f1b"`` (``v =
    num_chunks`` = 1) and ``"interleaved"``; (p - 1) / (3m + p - 1) for ``"zb-h1"`` (m >= p);
    (p - 1) / (6m + p - 1) for ``"zb-v"`` (m >= 2p - 1; ``num_chunks`` 2, or 1 for the
    default).

    ZB-V, F, B and W of a chunk one tick each: device ``p - 1`` cannot start before micro-batch
    0's forward has crossed the ``p - 1`` devices above it, and device 0 runs the last W, so
    the clock holds ``6m`` tasks per device in ``6m + p - 1`` ticks: ``p - 1`` idle ticks on
    every device (the authors' hand-built chart shifts device ``d``'s row by ``d`` ticks and
    leaves no other gap). In stage-ticks (a chunk is half a stage) that is half a tick per
    stage boundary, against ZB-H1's whole one; the README of
    sail-sg/zero-bubble-pipeline-parallelism rates both ZB-V's and ZB-H2's bubble 0 (for
    large ``m``). Below ``m = 2p - 1`` the warm-up is cut short and the bubble is larger.

    ZB-H1, F, B and W one tick each: stage 0's first B waits for micro-batch 0's forward to
    reach the last stage (tick p - 1) and its B to come back (ticks p .. 2p - 1), so stage 0
    starts B0 at tick 2p - 1 after p forwards; from then on its orders leave no gap, so the
    clock is (2p - 1) + (3m - p) = 3m + p - 1 ticks long for 3m tasks per stage, every stage
    ending on the same tick. The bubble is p - 1 ticks per stage against 1F1B's 3(p - 1) on
    the same clock, where 1F1B's backward is B and W together (two ticks): a third, as Qi et
    al. say (section 2.1); per tick of work, (p - 1)/3m against (p - 1)/m, the bubble rates in
    the README of sail-sg/zero-bubble-pipeline-parallelism (T_F = T_B = T_W)."""
    _check_sizes(num_microbatches, num_stages)
    checks.positive_int("num_chunks", num_chunks)
    checks.one_of("schedule", schedule, SCHEDULES)
    m, p = num_microbatches, num_stages
    if schedule == "zb-v":
        if num_chunks not in (1, 2) or m < 2 * p - 1:
            raise ValueError(f"the ZB-V formula holds for 2 chunks per device and "
                             f"num_microbatches >= 2 num_stages - 1: got num_chunks="
                             f"{num_chunks}, num_microbatches={m}, num_stages={p}")
        return (p - 1) / (6 * m + p - 1)
    if schedule == "zb-h1":
        if num_chunks != 1 or m < p:
            raise ValueError(f"the ZB-H1 formula holds for one chunk and num_microbatches >= "
                             f"num_stages: got num_chunks={num_chunks}, num_microbatches={m}, "
                             f"num_stages={p}")
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (num_chunks * m + p - 1)


def idle_fraction(schedule: Sequence[Sequence[Task]], num_stages: int) -> float:
    """Idle device-ticks over all device-ticks of ``schedule`` (every task one tick long);
    ``num_stages``: the number of devices (rows) the schedule runs on."""
    checks.positive_int("num_stages", num_stages)
    if not schedule:
        raise ValueError("schedule is empty")
    busy = sum(len(tasks) for tasks in schedule)
    return 1.0 - busy / (num_stages * len(schedule))


def peak_in_flight(schedule: Sequence[Sequence[Task]], num_stages: int,
                   num_devices: int | None = None, placement: str = "loop") -> list[int]:
    """For each stage, the most micro-batches whose forward has run and backward has not (its
    W, where the schedule holds W tasks: W needs the activations): how many micro-batches'
    activations the stage must stash at once. With ``num_devices`` (virtual stages placed by
    ``placement``): for each device, the most (stage, micro-batch) activations its stages hold
    together at once, each a chunk's (``1 / v`` of a whole stage's, ``v`` stages a device)."""
    checks.positive_int("num_stages", num_stages)
    rows = num_stages if num_devices is None else num_devices
    device_of = (list(range(num_stages)) if num_devices is None
                 else _devices_of(num_stages, num_devices, placement))
    held, peak = [0] * rows, [0] * rows
    release = "W" if splits_backward(schedule) else "B"
    for tasks in schedule:
        for stage, _, phase in tasks:
            row = device_of[stage]
            held[row] += 1 if phase == "F" else -1 if phase == release else 0
            peak[row] = max(peak[row], held[row])
    return peak


def format_schedule(schedule: Sequence[Sequence[Task]], num_stages: int,
                    num_devices: int | None = None, placement: str = "loop") -> str:
    """The schedule as text: one row per stage (per device with ``num_devices``, stages placed
    by ``placement``), one column per tick, ``F3`` / ``B3`` / ``W3`` for the forward / backward
    / weight gradient of micro-batch 3 (``F3c1``: on the device's chunk 1, with virtual stages:
    its second stage down the model), ``.`` where the row idles."""
    checks.positive_int("num_stages", num_stages)
    rows_n = num_stages if num_devices is None else num_devices
    device_of = _devices_of(num_stages, rows_n, placement)
    cells = [["."] * len(schedule) for _ in range(rows_n)]
    for t, tasks in enumerate(schedule):
        for stage, mb, phase in tasks:
            chunk = f"c{stage // rows_n}" if rows_n != num_stages else ""
            cells[device_of[stage]][t] = f"{phase}{mb}{chunk}"
    width = max(2, *(len(c) for row in cells for c in row))
    label = "stage" if rows_n == num_stages else "device"
    head = f"{'tick':<{len(label) + 3}}" + " ".join(f"{t:>{width}}" for t in range(len(schedule)))
    rows = [f"{label} {j} " + " ".join(f"{c:>{width}}" for c in row)
            for j, row in enumerate(cells)]
    return "\n".join([head, *rows])


def simulate(orders: Sequence[Sequence[Task]], durations: Callable[[Task], float],
             num_stages: int | None = None) -> list[list[tuple[Task, float, float]]]:
    """Per-device task orders played out with real durations (``durations(task)`` seconds, so
    per phase: F, B and W may differ): each task starts when its device is free and the tasks
    it depends on (``dependencies``) have ended (``num_stages``: virtual stages, as in
    ``clock_schedule``). Returns each device's
    ``(task, start, end)`` list: a timeline predicted from measured task times."""
    p = len(orders)
    if p == 0:
        raise ValueError("orders is empty: give one task list per device")
    num_stages = p if num_stages is None else _check_virtual(num_stages, p)
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
            deps = dependencies(task, num_stages)
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
