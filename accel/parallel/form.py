"""``Form``: what every Keras form of ``accel.parallel`` shares, written once.

A *form* trains a user's Keras model on several devices in its own way (towers, a split,
replicas of a split, a pipeline, tensor-parallel layers, ZeRO, offload, accumulation). What is
not its own is here:

* **devices**: ``device_list`` is the one rule every form applies to the devices it is given
  (a list of names, at least one, none twice, in any spelling ``parse_device`` reads);
* **the training loss**: ``accel.parallel.keras_model.training_loss`` (the compiled loss plus
  ``model.losses``, as Keras's ``Trainer.compute_loss``), each form giving each replica, stage
  or micro-batch its share;
* **the optimizer policy**: ``Form.make_optimizer`` copies the user's optimizer from its config
  (the user's object is never built on the form's variables); ``per_element=True`` adds the rule
  for forms that update slices or shards of variables (``keras_optimizer_factory``);
* **fit** with Keras's habits: ``batch_size`` 32 by default, ``shuffle=True`` by default (each
  epoch in a new order from NumPy's global generator, which ``keras.utils.set_random_seed``
  seeds), the last partial batch kept (refused, with the sizes that would work, when it does not
  split into the form's parts), ``verbose="auto"``, Keras callbacks, ``stop_training``, a
  ``History`` whose epoch loss is the mean over the epoch's examples, as Keras logs it;
* ``train_step(x, y)`` returning a dict of logs (``{"loss": float}``), as Keras's does;
* tracing: every form traces its steps with ``tf.function(..., autograph=False)``, as Keras 3's
  trainer wraps its step in ``tf.autograph.experimental.do_not_convert``
  (``keras/src/backend/tensorflow/trainer.py``). A Keras model's ``call`` already runs on
  symbolic tensors when the model is built, so it needs no conversion; AutoGraph would convert
  every function the step calls, which cost about 15% of the Keras forms' test time.

A form implements ``_step(x, y)`` (one batch: the loss), ``batch_parts()`` (how many equal
parts a batch must split into), ``write_back()`` (its weights into the user's model),
``working_variables()`` and ``optimizer_variables()`` (what it trains and where: public, so that
``accel.distributed.keras_remote`` reports them without reaching into a form).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

from accel import checks
from accel.devices import parse_device
from accel.parallel import keras_model as km

__all__ = ["Form", "device_list", "SHARDABLE_OPTIMIZERS", "keras_optimizer_factory"]


def device_list(devices, what: str = "devices") -> list[str]:
    """``devices`` in canonical spelling: the one device rule of every form. ``ValueError``
    for a string instead of a list, an empty list, or a device named twice (in any spelling)."""
    if isinstance(devices, str) or devices is None:
        raise ValueError(f"{what} must be a list of device names, got {devices!r}")
    names = [parse_device(d).to_string() for d in devices]
    if not names:
        raise ValueError(f"{what} is empty: give at least one device name")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{what} {list(devices)} name {twice} more than once: give each "
                         "device once")
    return names


SHARDABLE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad")
_REFUSED_OPTIONS = {
    "clipnorm": "it clips each variable by its own norm, which a slice of it does not know; "
                "global_clipnorm is supported",
    "use_ema": "a moving average of the weights is not kept by the sharded forms",
    "gradient_accumulation_steps": "give the form accumulation_steps= instead",
    "loss_scale_factor": "a fixed loss scale is not supported by the sharded forms; wrap the "
                         "optimizer in keras.optimizers.LossScaleOptimizer instead",
}


def keras_optimizer_factory(optimizer, exclude_from_weight_decay: Sequence[str] | None = None,
                            accepts_accumulation: bool = False):
    """``(make, global_clipnorm)`` for the forms whose optimizer updates slices or shards of
    variables: ``make()`` returns a new Keras optimizer with ``optimizer``'s configuration (an
    object or a name such as ``"adam"``), to be built on one device's variables;
    ``global_clipnorm`` is the clipping the form applies itself (``None``: none).

    A Keras optimizer applied to a flat slice of a variable equals the same optimizer applied to
    the whole variable only when its update is per element. Read from Keras 3's source
    (``keras/src/optimizers``): ``SGD`` (momentum, Nesterov), ``Adam`` and ``AdamW`` (amsgrad
    too), ``RMSprop`` (momentum, centered) and ``Adagrad`` update each element from that
    element's gradient and slots, with scalars (learning rate, step count) shared; padding
    elements (gradient 0) stay 0. ``clipvalue`` clips per element. ``weight_decay``
    (``w -= w * wd * lr``, AdamW's and any optimizer's) is per element; Keras applies it per
    variable by name, so every slice carries its variable's name and the variables whose names
    match a pattern of ``exclude_from_weight_decay`` (as Keras's ``var_names``) are not decayed
    (exclusions set on the user's optimizer object are not part of its config and are not
    carried). ``global_clipnorm``: the form all-reduces the squared norms of the slices and
    scales every slice as Keras does. A ``LossScaleOptimizer`` around such an optimizer:
    ``make()`` wraps each new optimizer in one with the same scale settings; the form gives every
    device the same finiteness verdict (``accel.parallel.replicas.KerasReplicas``). Refused with
    a ``ValueError``: other classes (Lamb and Adafactor use per-variable norms or factored
    statistics, Muon orthogonalises whole matrices; Lion, Nadam, Adamax, Ftrl... are not verified
    here) and the options ``clipnorm``, ``use_ema``, ``loss_scale_factor`` and
    ``gradient_accumulation_steps`` (unless ``accepts_accumulation``: the form reads it with
    ``accumulation_steps_of``)."""
    opt, scaling = km.fresh_optimizer(optimizer), None
    if isinstance(opt, keras.optimizers.LossScaleOptimizer):
        scaling = {k: v for k, v in opt.get_config().items()
                   if k in ("initial_scale", "dynamic_growth_steps")}
        opt = opt.inner_optimizer
    cls = type(opt)
    if cls.__name__ not in SHARDABLE_OPTIMIZERS or cls is not getattr(keras.optimizers,
                                                                      cls.__name__):
        raise ValueError(f"optimizer {cls.__name__} is not supported by the sharded forms: the "
                         f"update must be per element; supported: {list(SHARDABLE_OPTIMIZERS)}")
    config = opt.get_config()
    if accepts_accumulation:
        config["gradient_accumulation_steps"] = None
    for option, why in _REFUSED_OPTIONS.items():
        if config.get(option):
            raise ValueError(f"optimizer option {option}={config[option]!r} is not supported "
                             f"by the sharded forms: {why}")
    exclude = list(exclude_from_weight_decay or [])
    if not all(isinstance(p, str) for p in exclude):
        raise ValueError(f"exclude_from_weight_decay must be a list of name patterns (str), got "
                         f"{exclude_from_weight_decay!r}")
    clip = config.pop("global_clipnorm", None)

    def make():
        made = cls.from_config({**config, "global_clipnorm": None})
        if exclude:
            made.exclude_from_weight_decay(var_names=exclude)
        return made if scaling is None else keras.optimizers.LossScaleOptimizer(made, **scaling)

    return make, clip


class Form:
    """The base of every Keras form (see the module docstring). ``name`` is the form's
    registry name (``accel.parallel.registry``); ``model`` the user's model."""

    name = ""
    model: keras.Model

    # -- what each form implements -------------------------------------------------------------
    def _step(self, x, y):
        """One training step on the batch ``(x, y)``; returns the batch's loss."""
        raise NotImplementedError

    def batch_parts(self) -> int:
        """How many equal parts a batch must split into (replicas x micro-batches)."""
        return 1

    def write_back(self) -> None:
        """The form's trained weights (trainable and not) into the user's model."""
        raise NotImplementedError

    def working_variables(self) -> list:
        """The variables the form trains (its copies, shards or slices)."""
        raise NotImplementedError

    def optimizer_variables(self) -> list:
        """The form's optimizers' variables (their slots beside what they update)."""
        raise NotImplementedError

    def user_model(self):
        """The user's model (the one ``write_back`` fills, which callbacks see)."""
        return self.model

    # -- shared ------------------------------------------------------------------------------
    @staticmethod
    def make_optimizer(optimizer):
        """A new Keras optimizer with ``optimizer``'s configuration (the user's is never bound
        to the form's variables)."""
        return km.fresh_optimizer(optimizer)

    def train_step(self, x, y) -> dict:
        """One step on the batch ``(x, y)``; Keras's logs: ``{"loss": the batch's loss}``."""
        x, y = tf.nest.map_structure(tf.convert_to_tensor, (x, y))  # several inputs: a list
        return {"loss": float(self._step(x, y))}

    def fit(self, x, y=None, batch_size: int | None = None, epochs: int = 1, verbose="auto",
            callbacks=None, shuffle: bool = True, sample_weight=None, class_weight=None):
        """Keras's ``fit`` for the form: ``x, y`` arrays (in batches of ``batch_size``, 32 by
        default, the last one partial if the data does not divide; reshuffled every epoch
        unless ``shuffle=False``) or a ``tf.data.Dataset`` of ``(x, y)`` batches; Keras's
        progress bar (``verbose="auto"`` or 1; 0: none) and ``callbacks`` (called as Keras's
        ``fit`` calls them, with the user's model as their model; ``model.stop_training = True``
        ends training after the batch). ``write_back()`` runs before every ``on_epoch_end``
        (so also before ``on_train_end``), so that callbacks that read or save the model see the
        trained weights. Returns the ``keras.callbacks.History`` (each epoch's loss: the mean
        over its examples). ``sample_weight`` / ``class_weight``: ``ValueError``."""
        checks.positive_int("epochs", epochs)
        for name, value in (("sample_weight", sample_weight), ("class_weight", class_weight)):
            if value is not None:
                raise ValueError(f"{name} is not supported by the accel forms: every example "
                                 "weighs the same in their loss. Fold the weights into the "
                                 "loss function you pass, or repeat the examples to weigh")
        parts = self.batch_parts()
        if isinstance(x, tf.data.Dataset):
            if y is not None:
                raise ValueError("with a tf.data.Dataset, give y inside it, not as y=")
            steps = int(x.cardinality()) if int(x.cardinality()) > 0 else None
            epoch_batches = lambda: iter(x)  # noqa: E731
        else:
            batch_size = 32 if batch_size is None else checks.positive_int("batch_size",
                                                                           batch_size)
            if y is None:
                raise ValueError("give y, the labels (or a tf.data.Dataset of (x, y) as x)")
            # a model with several inputs or outputs: a list of arrays, each cut alike
            x, y = (tf.nest.map_structure(np.asarray, v, check_types=False) for v in (x, y))
            n = len(tf.nest.flatten(x)[0])
            if any(len(a) != n for a in tf.nest.flatten((x, y))):
                raise ValueError(f"y (and every input) must hold one row per example of x "
                                 f"({n})")
            steps = math.ceil(n / batch_size)
            last = n - (steps - 1) * batch_size
            if batch_size % parts or last % parts:
                raise ValueError(
                    f"{n} examples in batches of {batch_size}: every batch (the last has "
                    f"{last}) must split into {parts} equal parts (this form's replicas x "
                    f"micro-batches): give a batch_size that is a multiple of {parts} and "
                    f"examples that leave a last batch that is one too")

            def epoch_batches():
                order = np.random.permutation(n) if shuffle else np.arange(n)
                for k in range(steps):
                    idx = order[k * batch_size:(k + 1) * batch_size]
                    yield tf.nest.map_structure(lambda a, i=idx: a[i], (x, y))

        verbose = 1 if verbose == "auto" else verbose
        model = self.user_model()
        hooks = keras.callbacks.CallbackList(list(callbacks or []), add_history=True,
                                             add_progbar=bool(verbose), model=model,
                                             verbose=verbose, epochs=epochs, steps=steps)
        model.stop_training = False
        hooks.on_train_begin()
        for epoch in range(epochs):
            hooks.on_epoch_begin(epoch)
            total = count = 0
            for k, (xb, yb) in enumerate(epoch_batches()):
                hooks.on_train_batch_begin(k)
                size = int(tf.nest.flatten(xb)[0].shape[0])
                total += self.train_step(xb, yb)["loss"] * size
                count += size
                hooks.on_train_batch_end(k, {"loss": total / count})
                if model.stop_training:
                    break
            self.write_back()
            hooks.on_epoch_end(epoch, {"loss": total / max(count, 1)})
            if model.stop_training:
                break
        hooks.on_train_end()  # the last epoch's weights were written back before its end
        return next(c for c in hooks.callbacks if isinstance(c, keras.callbacks.History))
