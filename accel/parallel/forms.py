"""Every Keras form of ``accel.parallel`` by name: ``FORMS`` and ``make_form``.

``make_form(name, model, devices, loss=..., optimizer=..., **options)`` builds any form the
same way, so that code that runs forms without knowing them (``accel.distributed.keras_remote``,
which runs them across processes; the contract test) goes through this table and the forms'
public methods (``accel.parallel.form.Form``), never their internals:

===============  ===============================  ==========================================
name             form                             options
===============  ===============================  ==========================================
``data``         towers (``DataParallel``)        ``variable_device``
``model``        split, or hybrid with            ``balance``, ``replicas`` (then no
                 ``replicas`` (``ModelParallel``) ``devices``)
``pipeline``     GPipe, 1F1B, interleaved,        ``num_microbatches``, ``schedule``,
                 ZB-H1, ZB-V (``Pipeline``)       ``num_chunks``, ``balance``, ``recompute``
``tensor``       ``TensorParallel``               ``rules``
``zero``         ZeRO 0-3 (``Zero``)              ``stage``, ``accumulation_steps``, ...
``offload``      ``Offload``                      ``host``, ``accumulation_steps``, ...
``accumulate``   ``Accumulating``                 ``accumulation_steps``, ... (one device)
===============  ===============================  ==========================================
"""

from __future__ import annotations

from collections.abc import Sequence

from accel import checks
from accel.parallel.accumulate import Accumulating
from accel.parallel.data import DataParallel
from accel.parallel.form import Form, device_list
from accel.parallel.model import ModelParallel
from accel.parallel.offload import Offload
from accel.parallel.pipeline_exec import Pipeline
from accel.parallel.tensor import TensorParallel
from accel.parallel.zero import Zero

__all__ = ["FORMS", "make_form"]

FORMS: dict[str, type[Form]] = {cls.name: cls for cls in (
    DataParallel, ModelParallel, Pipeline, TensorParallel, Zero, Offload, Accumulating)}


def make_form(name: str, model, devices: Sequence[str] | None, *, loss, optimizer,
              **options) -> Form:
    """The form ``name`` (a key of ``FORMS``) for ``model`` on ``devices`` with the form's own
    ``options`` (``ValueError`` naming an option the form does not take, and those it takes)."""
    checks.one_of("form", name, FORMS)
    cls = FORMS[name]
    if devices is not None:
        devices = device_list(devices)  # every form's one rule, before its own
    unknown = sorted(set(options) - set(cls.options))
    if unknown:
        raise ValueError(f"{name} form: unknown options {unknown}; it takes {list(cls.options)}")
    if cls is ModelParallel and "replicas" in options:
        return cls(model, loss=loss, optimizer=optimizer, **options)
    if cls is TensorParallel:
        if "rules" not in options:
            raise ValueError("tensor form: give rules={pattern: 'column' | 'row' | 'heads'}")
        return cls(model, devices, options["rules"], loss=loss, optimizer=optimizer)
    if cls is Accumulating:
        if devices is not None and len(devices) != 1:
            raise ValueError(f"accumulate form: one device, got {list(devices)}")
        return cls(model, device=devices[0] if devices else None, loss=loss,
                   optimizer=optimizer, **options)
    return cls(model, devices, loss=loss, optimizer=optimizer, **options)
