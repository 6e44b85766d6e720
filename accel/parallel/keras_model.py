"""The one way to hand ``accel`` a model: a Keras model, a Keras loss and a Keras optimizer.

Every parallel form that cuts a model into parts (model parallelism, pipelines) works the same
way, written once here:

* ``sequential_layers(model)``: the layers of a built ``keras.Sequential`` in order, checked;
* ``copy_layer(layer)`` and ``copy_model(model, device)``: *working copies* rebuilt from
  configs (Keras 3 creates a layer's variables on the device in effect when it is built, and a
  Keras optimizer creates each slot next to its variable, so the copies and their optimizer
  state live where the form wants them); cutting a model into parts and copying each part onto
  its device is ``accel.parallel.graph``;
* ``write_back(layers, copies)``: the copies' weights (trainable and not, e.g. BatchNorm's
  moving statistics) back into the user's layers, so that ``model.predict``, ``model.save``
  and ``model.evaluate`` see the trained model;
* ``fresh_optimizer(optimizer)`` and ``loss_function(loss)``: a Keras optimizer (an object or a
  name such as ``"adam"``) copied from its config, so that the user's optimizer is never bound
  to the copies' variables, and a Keras loss (an object, a name, or a function of
  ``(y_true, y_pred)``) whose mean over a batch is the training loss;
* ``training_loss(loss_fn, y, y_pred, terms)`` (``outputs_loss`` for several outputs):
  what every form trains, the loss Keras's ``Trainer.compute_loss`` gives ``fit``: the
  compiled loss's mean over the batch **plus every term of** ``model.losses`` (kernel, bias
  and activity regularizers, ``add_loss``), each summed, as
  ``Trainer._aggregate_additional_loss`` does. A form that splits the batch (replicas,
  micro-batches) gives each part its share of the whole, as Keras does under a
  ``tf.distribute`` strategy (``losses.loss.scale_loss_for_distribution`` divides the compiled
  loss *and* each added term by the number of replicas, whose gradients are then summed): the
  weight regularizers then count once per step, and a term that is a mean over the examples
  (a VAE's KL term) equals the whole batch's; a term that *sums* over the examples (an
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

from accel.devices import parse_device
from accel.placement import short_device

__all__ = ["sequential_layers", "input_shape_of", "copy_model", "copy_layer", "write_back",
           "fresh_optimizer", "loss_function", "variable_devices", "added_loss", "training_loss",
           "merge_gradients", "is_sparse", "loss_scale", "bundle", "float_tensors",
           "outputs_loss"]


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


def copy_layer(layer):
    """A new, unbuilt layer made from ``layer``'s config (``ValueError`` saying what to do
    when Keras cannot rebuild it)."""
    try:
        return layer.__class__.from_config(layer.get_config())
    except Exception as exc:  # a custom layer without get_config / from_config
        raise ValueError(f"layer {layer.name} ({type(layer).__name__}) cannot be rebuilt from "
                         f"its config: {_rebuild_advice(exc)}") from exc


def write_back(layers: Sequence, copies: Sequence) -> None:
    """Each copy's weights into the layer it was copied from (same order), variable to
    variable (no trip through NumPy)."""
    for layer, copy in zip(layers, copies, strict=True):
        if len(layer.weights) != len(copy.weights):
            raise ValueError(f"layer {layer.name} has {len(layer.weights)} weights, its copy "
                             f"{len(copy.weights)}")
        for mine, theirs in zip(layer.weights, copy.weights, strict=True):
            mine.assign(theirs.value)


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


def bundle(x) -> tuple:
    """A model's input as a tuple of tensors: the inputs of a model with several, or one."""
    return tuple(x) if isinstance(x, list | tuple) else (x,)


def float_tensors(tensors) -> list:
    """The floating-point tensors of ``tensors`` (the ones a gradient flows through; token ids
    passed along do not)."""
    return [t for t in tensors if t.dtype.is_floating]


def outputs_loss(loss_fn: Callable, y, outputs: Sequence, terms: Sequence = ()):
    """``training_loss`` for a model's outputs: one output and its labels, or several outputs
    and as many labels (a list or tuple), each output's mean loss summed, as Keras's compiled
    loss does with one loss for every output."""
    if len(outputs) == 1:
        return training_loss(loss_fn, y, outputs[0], terms)
    ys = bundle(y)
    if len(ys) != len(outputs):
        raise ValueError(f"the model has {len(outputs)} outputs: give y as a list of as many "
                         f"label arrays, got {len(ys)}")
    losses = [tf.reduce_mean(loss_fn(yk, out)) for yk, out in zip(ys, outputs, strict=True)]
    loss = tf.add_n([tf.cast(v, losses[0].dtype) for v in losses])
    extra = added_loss(terms, loss.dtype)
    return loss if extra is None else loss + extra


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
