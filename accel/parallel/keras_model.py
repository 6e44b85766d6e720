"""The one way to hand ``accel`` a model: a Keras model, a Keras loss and a Keras optimizer.

Every parallel form that cuts a model into parts (model parallelism, pipelines) works the same
way, written once here:

* ``sequential_layers(model)``: the layers of a built ``keras.Sequential`` in order, checked
  (a form that needs layers in order takes a ``Sequential``; a transformer is a ``Sequential``
  of block layers, each block a layer with its residuals inside);
* ``copy_layers(layers, device, input_shape)``: *working copies* of layers, rebuilt on a device
  with ``from_config`` and ``set_weights`` (Keras 3 creates a layer's variables on the device in
  effect when it is built, and a Keras optimizer creates each slot next to its variable, so the
  copies and their optimizer state live where the form wants them);
* ``balance_layers`` and ``copy_parts``: the layers cut into consecutive parts (by count,
  parameter bytes or an explicit list, ``accel.parallel.partition``) and each part copied onto
  its device;
* ``write_back(layers, copies)``: the copies' weights (trainable and not, e.g. BatchNorm's
  moving statistics) back into the user's layers, so that ``model.predict``, ``model.save``
  and ``model.evaluate`` see the trained model;
* ``fresh_optimizer(optimizer)`` and ``loss_function(loss)``: a Keras optimizer (an object or a
  name such as ``"adam"``) copied from its config, so that the user's optimizer is never bound
  to the copies' variables, and a Keras loss (an object, a name, or a function of
  ``(y_true, y_pred)``) whose mean over a batch is the training loss;
* ``call_layers(layers, x)`` and ``training_loss(loss_fn, y, y_pred, added)``: what every form
  trains, the loss Keras's ``Trainer.compute_loss`` gives ``fit``: the compiled loss's mean over
  the batch **plus every term of** ``model.losses`` (kernel, bias and activity regularizers,
  ``add_loss``), each summed, as ``Trainer._aggregate_additional_loss`` does. A form that splits
  the batch (replicas, micro-batches) gives each part its share of the whole, as Keras does
  under a ``tf.distribute`` strategy (``losses.loss.scale_loss_for_distribution`` divides the
  compiled loss *and* each added term by the number of replicas, whose gradients are then
  summed): the weight regularizers then count once per step, and a term that is a mean over the
  examples (a VAE's KL term) equals the whole batch's; a term that *sums* over the examples (an
  activity regularizer) counts the mean over the parts, as under ``MirroredStrategy``;
* ``merge_gradients(grads, coefficients)``: ``sum_i c_i g_i`` for dense gradients and, for the
  ``tf.IndexedSlices`` an ``Embedding`` produces, the slices concatenated with their values
  scaled, so that the optimizer sees every row of every part as ``model.fit`` sees the whole
  batch's (Keras's Adam squares each slice separately: densifying first would change the update).

No private Keras attribute is used: only ``get_config``, ``from_config``, ``get_weights``,
``set_weights``, ``trainable_weights``, ``non_trainable_weights`` and calling the layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import keras
import tensorflow as tf

from accel import checks
from accel.devices import parse_device
from accel.parallel import partition
from accel.placement import short_device

__all__ = ["sequential_layers", "input_shape_of", "balance_layers", "copy_model", "copy_layers",
           "copy_parts", "output_shape_of", "write_back", "fresh_optimizer", "loss_function",
           "variable_devices", "call_layers", "added_loss", "training_loss",
           "merge_gradients", "is_sparse", "loss_scale"]


def sequential_layers(model) -> list:
    """The layers of ``model`` in order: a built ``keras.Sequential`` (``ValueError``
    otherwise, saying how to make one)."""
    if not isinstance(model, keras.Sequential):
        raise ValueError(f"model must be a keras.Sequential (layers in order; a transformer as a "
                         f"Sequential of block layers), got {type(model).__name__}")
    if not model.built or not model.layers:
        raise ValueError("the Sequential has no built layers: start it with keras.Input(shape) "
                         "or call it once on a batch before handing it over")
    return list(model.layers)


def input_shape_of(model) -> tuple:
    """One example's input shape (no batch axis) of a built model."""
    shape = tuple(model.inputs[0].shape[1:]) if getattr(model, "inputs", None) else None
    if shape is None or any(d is None for d in shape):
        raise ValueError(f"the model's input shape per example must be known, got {shape}: "
                         "start the Sequential with keras.Input(shape)")
    return shape


def balance_layers(layers: Sequence, num_parts: int, balance="count") -> list[int]:
    """Layers per part: ``"count"`` (as equal as possible), ``"bytes"`` (parameter bytes; a
    layer without weights counts 1 byte), or an explicit list checked against the layers."""
    n = len(layers)
    if n < num_parts:
        raise ValueError(f"the model has {n} layers, fewer than the {num_parts} parts to cut it "
                         "into")
    if isinstance(balance, str):
        checks.one_of("balance", balance, ("count", "bytes"))
        if balance == "count":
            return partition.balance_by_count(n, num_parts)
        costs = [sum(int(w.numpy().nbytes) for w in layer.weights) or 1 for layer in layers]
        return partition.balance_by_cost(costs, num_parts)
    sizes = partition.check_balance(balance, n)
    if len(sizes) != num_parts:
        raise ValueError(f"balance {sizes} has {len(sizes)} parts; this form cuts the model into "
                         f"{num_parts}")
    return sizes


def copy_parts(layers: Sequence, sizes: Sequence[int], devices: Sequence[str],
               input_shape: Sequence[int]) -> tuple[list[list], list[list]]:
    """``(parts, copies)``: the layers cut by ``sizes``, and each part copied onto its device
    (``devices[i]`` for part ``i``)."""
    parts, copies, shape = [], [], tuple(input_shape)
    for r, device in zip(partition.part_ranges(sizes), devices, strict=True):
        part = [layers[i] for i in r]
        made = copy_layers(part, device, shape)
        shape = output_shape_of(made, shape)
        parts.append(part)
        copies.append(made)
    return parts, copies


def copy_model(model, device: str):
    """A copy of any Keras model (``keras.models.clone_model``: Sequential, functional or a
    subclass with ``get_config``) with its variables created on ``device``, holding the same
    weights."""
    device = parse_device(device).to_string()
    with tf.device(device):
        try:
            twin = keras.models.clone_model(model)
        except Exception as exc:  # a subclassed model or layer without get_config
            raise ValueError(f"the model cannot be rebuilt from its config: "
                             f"{_rebuild_advice(exc)}") from exc
        if not twin.built:
            twin.build(model.inputs[0].shape if getattr(model, "inputs", None) else None)
    twin.set_weights(model.get_weights())
    return twin


def _rebuild_advice(exc: BaseException) -> str:
    """What to do when Keras cannot rebuild a layer or model from its config (the forms make
    their copies that way), read from the exception Keras raised."""
    text = str(exc)
    if "unexpected keyword argument" in text:
        return ("its __init__ does not take the arguments Keras passes to every layer (name, "
                "dtype, trainable): add **kwargs to __init__ and pass them on with "
                "super().__init__(**kwargs)")
    if isinstance(exc, NotImplementedError):
        return ("its class does not implement get_config(), which Keras needs to make a "
                "copy: give it get_config() returning its constructor's arguments (with "
                "**kwargs in __init__)")
    first = text.splitlines()[0][:200] if text else ""
    return (f"{type(exc).__name__}: {first}; give custom layers get_config() returning "
            "their constructor's arguments, and **kwargs in __init__")


def copy_layers(layers: Sequence, device: str, input_shape: Sequence[int]) -> list:
    """Copies of ``layers`` (consecutive, the first taking inputs of ``input_shape`` per example)
    with their variables created on ``device`` and holding the same weights."""
    device = parse_device(device).to_string()
    copies = []
    with tf.device(device):
        x = tf.zeros((1, *input_shape), dtype=_input_dtype(layers[0]))
        for layer in layers:
            try:
                copy = layer.__class__.from_config(layer.get_config())
            except Exception as exc:  # a custom layer without get_config / from_config
                raise ValueError(
                    f"layer {layer.name} ({type(layer).__name__}) cannot be rebuilt from its "
                    f"config: {_rebuild_advice(exc)}") from exc
            x = copy(x, training=False)  # builds it here, on the device
            copy.set_weights(layer.get_weights())
            copies.append(copy)
    return copies


def output_shape_of(layers: Sequence, input_shape: Sequence[int]) -> tuple:
    """One example's output shape after ``layers`` (run in inference mode on zeros)."""
    x = tf.zeros((1, *input_shape), dtype=_input_dtype(layers[0]))
    for layer in layers:
        x = layer(x, training=False)
    return tuple(x.shape[1:])


def _input_dtype(layer) -> str:
    policy = getattr(layer, "dtype_policy", None)
    return getattr(policy, "compute_dtype", None) or keras.config.floatx()


def write_back(layers: Sequence, copies: Sequence) -> None:
    """Each copy's weights into the layer it was copied from (same order)."""
    for layer, copy in zip(layers, copies, strict=True):
        layer.set_weights(copy.get_weights())


def fresh_optimizer(optimizer):
    """A new Keras optimizer with ``optimizer``'s configuration (an optimizer object or a name
    such as ``"adam"``): the form's own, built on the form's variables."""
    if isinstance(optimizer, str):
        try:
            return keras.optimizers.get(optimizer)
        except ValueError as exc:
            raise ValueError(f"unknown optimizer {optimizer!r}: give a keras.optimizers "
                             f"object or a name such as 'adam' or 'sgd'") from exc
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(f"optimizer must be a keras.optimizers.Optimizer or its name, got "
                         f"{type(optimizer).__name__}")
    return optimizer.__class__.from_config(optimizer.get_config())


def loss_function(loss) -> Callable:
    """``fn(y_true, y_pred)`` whose mean over the examples is the loss to train: a Keras loss
    object with the default reduction (mean over the batch), a name (``"mse"``), or a function
    returning per-example losses."""
    if isinstance(loss, str):
        try:
            return keras.losses.get(loss)
        except ValueError as exc:
            raise ValueError(f"unknown loss {loss!r}: give a keras.losses object or a name such "
                             "as 'mse'") from exc
    if isinstance(loss, keras.losses.Loss):
        if loss.reduction not in ("sum_over_batch_size", "mean"):
            raise ValueError(f"loss reduction {loss.reduction!r}: the forms need the mean over "
                             "the batch ('sum_over_batch_size', Keras's default)")
        return loss
    if callable(loss):
        return loss
    raise ValueError(f"loss must be a keras.losses.Loss, its name or a function, got "
                     f"{type(loss).__name__}")


def call_layers(layers: Sequence, x, training: bool = True):
    """``(output, terms)``: ``x`` through ``layers`` in order, and the terms each layer put in
    its ``losses`` during the call (``add_loss``, activity regularizers) plus its weights'
    regularizers (Keras clears a layer's added losses at the start of each outermost call, so
    they are read right after it)."""
    terms = []
    for layer in layers:
        x = layer(x, training=training)
        terms.extend(layer.losses)
    return x, terms


def added_loss(terms: Sequence, dtype=None):
    """The sum of ``model.losses``-style ``terms`` as ``fit`` adds them (each term summed,
    cast to ``dtype``, default ``keras.config.floatx()``), or ``None`` for no terms."""
    if not terms:
        return None
    dtype = dtype or keras.config.floatx()
    summed = [tf.cast(tf.reduce_sum(t), dtype) for t in terms]
    return tf.add_n(summed) if len(summed) > 1 else summed[0]


def training_loss(loss_fn: Callable, y, y_pred, terms: Sequence = ()):
    """The training loss of one batch as ``fit`` computes it: the mean of ``loss_fn(y,
    y_pred)`` plus ``added_loss(terms)`` (``model.losses`` after the call)."""
    loss = tf.reduce_mean(loss_fn(y, y_pred))
    extra = added_loss(terms, loss.dtype)
    return loss if extra is None else loss + extra


def loss_scale(optimizer, dtype="float32"):
    """The factor Keras's ``fit`` multiplies the loss by before taking gradients
    (``optimizer.scale_loss``: a ``LossScaleOptimizer``'s current scale, or the optimizer's
    ``loss_scale_factor``), as a tensor of ``dtype``; ``None`` where it is 1 (no scaling) or
    ``optimizer`` is a plain learning rate. A form seeds its backward pass with it
    (``output_gradients``), and the optimizer divides it out again when it applies."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        return None
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and \
            optimizer.loss_scale_factor is None:
        return None
    return tf.cast(optimizer.scale_loss(tf.ones((), "float32")), dtype)


def is_sparse(gradient) -> bool:
    """Whether ``gradient`` is a ``tf.IndexedSlices`` (an embedding's gradient)."""
    return isinstance(gradient, tf.IndexedSlices)


def merge_gradients(grads: Sequence, coefficients: Sequence[float] | None = None):
    """``sum_i c_i * grads[i]`` (``None`` entries skipped; ``coefficients`` default 1): dense
    tensors added; if any is a ``tf.IndexedSlices``, the result is one ``IndexedSlices`` with
    every part's rows, values scaled by their ``c_i`` (dense parts become slices of every row).
    Runs on the current device."""
    coefficients = [1.0] * len(grads) if coefficients is None else list(coefficients)
    pairs = [(g, c) for g, c in zip(grads, coefficients, strict=True) if g is not None]
    if not pairs:
        return None
    if not any(is_sparse(g) for g, _ in pairs):
        terms = [g if c == 1.0 else tf.cast(c, g.dtype) * g for g, c in pairs]
        return tf.add_n(terms) if len(terms) > 1 else terms[0]
    values, indices, shape = [], [], None
    for g, c in pairs:
        if not is_sparse(g):  # a dense gradient: every row a slice
            g = tf.IndexedSlices(g, tf.range(tf.shape(g, out_type=tf.int64)[0]),
                                 tf.shape(g, out_type=tf.int64))
        shape = g.dense_shape if shape is None else shape
        values.append(g.values if c == 1.0 else tf.cast(c, g.values.dtype) * g.values)
        indices.append(tf.cast(g.indices, tf.int64))
    return tf.IndexedSlices(tf.concat(values, 0), tf.concat(indices, 0), shape)


def variable_devices(layers: Sequence) -> set[str]:
    """The devices that hold ``layers``' variables, as the variables report them (local
    devices without the ``/job:localhost/replica:0/task:0`` prefix)."""
    return {short_device(w.value.device) for layer in layers for w in layer.weights}
