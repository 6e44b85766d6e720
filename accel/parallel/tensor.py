"""Tensor parallelism for a Keras model (Megatron-LM's splits, Shoeybi et al. 2019,
arXiv:1909.08053, section 3, as Keras layers; the same written by hand on arrays is
``accel.parallel.megatron``).

``ColumnParallelDense``, ``RowParallelDense`` (one kernel shard per device) and
``HeadParallelAttention`` (a ``MultiHeadAttention`` with its heads split over the devices) are
Keras layers whose every device's forward and backward run on that device
(``accel.collectives.on_device``), and ``TensorParallel(model, devices, rules)`` converts a
``Sequential``'s matching ``Dense`` and ``MultiHeadAttention`` layers, top-level or inside a
block layer, by patterns on their paths (as Keras 3's ``LayoutMap`` maps weight paths to
layouts) into a Keras model you compile and ``fit``, then ``write_back()``.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence

import keras
import numpy as np
import tensorflow as tf

from accel import checks
from accel.collectives import on_device
from accel.parallel import graph
from accel.parallel import keras_model as km
from accel.parallel.form import Form, device_list, keras_optimizer_factory

__all__ = ["ColumnParallelDense", "RowParallelDense", "HeadParallelAttention", "TensorParallel"]


def _split_sizes(total: int, n: int, what: str) -> int:
    if total % n:
        raise ValueError(f"{what}={total} does not split evenly over {n} devices")
    return total // n


# regularizers that add up over shards: the penalty of the whole weight (or activation) is the
# sum of its shards' penalties, so each shard carrying the regularizer trains what fit trains
_SEPARABLE = (keras.regularizers.L1, keras.regularizers.L2, keras.regularizers.L1L2)


def separable_regularizer(what: str, regularizer):
    """``regularizer`` (an object, its name or config, or ``None``) as a Keras regularizer
    whose penalty adds up over shards (``L1``, ``L2``, ``L1L2``); ``ValueError`` for another."""
    if regularizer is None:
        return None
    made = keras.regularizers.get(regularizer)
    if type(made) not in _SEPARABLE:
        raise ValueError(f"{what}={type(made).__name__}: a sharded layer takes only regularizers "
                         "whose penalty is the sum of its shards' (keras.regularizers.L1, L2, "
                         "L1L2); leave this layer whole (no rule matching it) to keep it")
    return made


class _ShardedDense(keras.layers.Layer):
    """Shared by the column- and row-parallel Dense layers: one kernel shard per device. A
    kernel, bias or activity regularizer must add up over shards (``separable_regularizer``):
    each shard carries it, so the model's losses equal the whole ``Dense``'s."""

    def __init__(self, units: int, devices: Sequence[str], activation=None,
                 use_bias: bool = True, kernel_regularizer=None, bias_regularizer=None,
                 activity_regularizer=None, **kwargs):
        super().__init__(activity_regularizer=separable_regularizer(
            "activity_regularizer", activity_regularizer), **kwargs)
        self.units = checks.positive_int("units", units)
        self.devices = device_list(devices)
        self.activation = keras.activations.get(activation)
        self.use_bias = use_bias
        self.kernel_regularizer = separable_regularizer("kernel_regularizer", kernel_regularizer)
        self.bias_regularizer = separable_regularizer("bias_regularizer", bias_regularizer)

    def get_config(self):
        regs = {k: keras.regularizers.serialize(getattr(self, k)) if getattr(self, k) else None
                for k in ("kernel_regularizer", "bias_regularizer", "activity_regularizer")}
        return {**super().get_config(), "units": self.units, "devices": self.devices,
                "activation": keras.activations.serialize(self.activation),
                "use_bias": self.use_bias, **regs}


class ColumnParallelDense(_ShardedDense):
    """``Dense`` with its kernel split by output columns: device ``i`` holds columns
    ``i*k .. (i+1)*k`` (and that slice of the bias) and computes them from its copy of the
    input. Returns the column slices as a tuple, one per device (``gather_output=False``, to
    feed a ``RowParallelDense``: Megatron's MLP sends nothing in between), or the full output
    concatenated on ``devices[0]``. The activation, applied per column, runs on each device.
    Each device's forward and backward run on that device (``accel.collectives.on_device``)."""

    def __init__(self, units: int, devices: Sequence[str], activation=None,
                 use_bias: bool = True, gather_output: bool = True, **kwargs):
        super().__init__(units, devices, activation, use_bias, **kwargs)
        self.gather_output = gather_output
        self.shard_units = _split_sizes(self.units, len(self.devices), "units")

    def build(self, input_shape):
        fan_in = int(input_shape[-1])
        self.kernels, self.biases = [], []
        for i, d in enumerate(self.devices):
            with tf.device(d):
                self.kernels.append(self.add_weight(shape=(fan_in, self.shard_units),
                                                    initializer="glorot_uniform",
                                                    regularizer=self.kernel_regularizer,
                                                    name=f"kernel_{i}"))
                if self.use_bias:
                    self.biases.append(self.add_weight(shape=(self.shard_units,),
                                                       initializer="zeros",
                                                       regularizer=self.bias_regularizer,
                                                       name=f"bias_{i}"))

    def call(self, x):
        ys = []
        for i, d in enumerate(self.devices):
            def shard(x, i=i):
                y = tf.matmul(x, self.kernels[i].value)
                if self.use_bias:
                    y = y + self.biases[i].value
                return self.activation(y)
            ys.append(on_device(shard, d, x))
        if not self.gather_output:
            return tuple(ys)
        with tf.device(self.devices[0]):
            return tf.concat(ys, -1)

    def compute_output_spec(self, x):
        shape = tuple(x.shape[:-1])
        if self.gather_output:
            return keras.KerasTensor((*shape, self.units), dtype=self.compute_dtype)
        return tuple(keras.KerasTensor((*shape, self.shard_units), dtype=self.compute_dtype)
                     for _ in self.devices)

    def get_config(self):
        return {**super().get_config(), "gather_output": self.gather_output}

    def set_full_weights(self, kernel, bias=None) -> None:
        """Load a full ``Dense`` kernel (and bias): each device gets its columns."""
        k = self.shard_units
        for i in range(len(self.devices)):
            self.kernels[i].assign(kernel[:, i * k:(i + 1) * k])
            if self.use_bias:
                self.biases[i].assign(bias[i * k:(i + 1) * k])

    def full_weights(self) -> list[np.ndarray]:
        """The full kernel (and bias), as one ``Dense`` would hold them."""
        out = [np.concatenate([w.numpy() for w in self.kernels], axis=1)]
        return out + ([np.concatenate([b.numpy() for b in self.biases])] if self.use_bias
                      else [])


class RowParallelDense(_ShardedDense):
    """``Dense`` with its kernel split by input rows: device ``i`` multiplies its slice of the
    input (the tuple a ``ColumnParallelDense(gather_output=False)`` returns, or a tensor split
    here along its last axis) by its rows; the partial sums are added on ``devices[0]``, where
    the bias and the activation follow. Returns one tensor, on ``devices[0]``: by design, so that
    an ordinary Keras layer or a residual add can take it (a Keras layer may return a tuple, as
    ``ColumnParallelDense`` does); the partial sums meet on one device, a reduce. The all-reduce
    form, with every device keeping a copy, is ``row_parallel_dense``."""

    def build(self, input_shape):
        n = len(self.devices)
        if isinstance(input_shape, (list, tuple)) and input_shape \
                and isinstance(input_shape[0], (list, tuple)):
            if len(input_shape) != n:
                raise ValueError(f"got {len(input_shape)} input shards for {n} devices")
            rows = int(input_shape[0][-1])
        else:
            rows = _split_sizes(int(input_shape[-1]), n, "input features")
        self.kernels = []
        for i, d in enumerate(self.devices):
            with tf.device(d):
                self.kernels.append(self.add_weight(shape=(rows, self.units),
                                                    initializer="glorot_uniform",
                                                    regularizer=self.kernel_regularizer,
                                                    name=f"kernel_{i}"))
        if self.use_bias:
            with tf.device(self.devices[0]):
                self.bias = self.add_weight(shape=(self.units,), initializer="zeros",
                                            regularizer=self.bias_regularizer, name="bias")

    def call(self, x):
        parts = list(x) if isinstance(x, (list, tuple)) else \
            tf.split(x, len(self.devices), axis=-1)
        partial = [on_device(lambda p, i=i: tf.matmul(p, self.kernels[i].value), d, p)
                   for i, (p, d) in enumerate(zip(parts, self.devices, strict=True))]
        with tf.device(self.devices[0]):
            y = tf.add_n(partial) if len(partial) > 1 else partial[0]
            if self.use_bias:
                y = y + self.bias.value
            return self.activation(y)

    def compute_output_spec(self, x):
        first = x[0] if isinstance(x, (list, tuple)) else x
        return keras.KerasTensor((*first.shape[:-1], self.units), dtype=self.compute_dtype)

    def set_full_weights(self, kernel, bias=None) -> None:
        """Load a full ``Dense`` kernel (and bias): each device gets its rows."""
        k = kernel.shape[0] // len(self.devices)
        for i in range(len(self.devices)):
            self.kernels[i].assign(kernel[i * k:(i + 1) * k])
        if self.use_bias:
            self.bias.assign(bias)

    def full_weights(self) -> list[np.ndarray]:
        """The full kernel (and bias), as one ``Dense`` would hold them."""
        out = [np.concatenate([w.numpy() for w in self.kernels], axis=0)]
        return out + ([self.bias.numpy()] if self.use_bias else [])


class HeadParallelAttention(keras.layers.Layer):
    """``keras.layers.MultiHeadAttention(num_heads, key_dim)`` with its heads split over
    ``devices``. Device ``i`` holds the heads ``i*h .. (i+1)*h - 1`` (``h = num_heads /
    len(devices)``): their query, key and value kernels ``(width, h, key_dim)`` and biases
    ``(h, key_dim)`` and the rows of the output projection that read them ``(h, key_dim,
    width)``; it computes those heads' attention (``softmax(q k^T / sqrt(key_dim)) v``) and its
    partial output projection, forward and backward on that device. The partial outputs are added
    on ``devices[0]``, where the output bias is added once: one output tensor, by design, so that an
    ordinary Keras layer can take it; this is a reduce (the all-reduce form is ``tp_block``).

    Called as ``MultiHeadAttention`` is: ``layer(query, value, key=None, training=None)`` on
    ``[batch, seq, features]`` inputs (self-attention: ``query`` is ``value``; cross-attention
    too). Supported: no attention mask (``ValueError``; a Keras mask carried by the inputs is not
    applied either), no causal mask, no returned scores, dropout 0, ``value_dim == key_dim``, the
    default attention axis and output shape (``HeadParallelAttention.from_attention`` refuses
    other MultiHeadAttention settings). ``set_full_weights(*mha.get_weights())`` loads a
    MultiHeadAttention's weights; ``full_weights()`` returns them in its ``get_weights()`` order
    (query kernel, bias, key kernel, bias, value kernel, bias, output kernel, bias)."""

    _PROJECTIONS = ("query", "key", "value")

    def __init__(self, num_heads: int, key_dim: int, devices: Sequence[str],
                 use_bias: bool = True, kernel_regularizer=None, bias_regularizer=None,
                 **kwargs):
        super().__init__(**kwargs)
        self.num_heads = checks.positive_int("num_heads", num_heads)
        self.key_dim = checks.positive_int("key_dim", key_dim)
        self.devices = device_list(devices)
        self.heads_per_device = _split_sizes(self.num_heads, len(self.devices), "num_heads")
        self.use_bias = use_bias
        # as MultiHeadAttention: on every projection's kernel (bias), each head's shard its own
        self.kernel_regularizer = separable_regularizer("kernel_regularizer", kernel_regularizer)
        self.bias_regularizer = separable_regularizer("bias_regularizer", bias_regularizer)

    @classmethod
    def from_attention(cls, mha, devices: Sequence[str]) -> HeadParallelAttention:
        """An (unbuilt) head-split copy of ``mha``'s configuration; ``ValueError`` for the
        MultiHeadAttention settings this layer does not compute."""
        if not isinstance(mha, keras.layers.MultiHeadAttention):
            raise ValueError(f"{mha.name} is a {type(mha).__name__}, not a MultiHeadAttention")
        cfg = mha.get_config()
        bad = {"value_dim": cfg.get("value_dim") not in (None, cfg["key_dim"]),
               "dropout": bool(cfg.get("dropout")), "output_shape": bool(cfg.get("output_shape")),
               "attention_axes": cfg.get("attention_axes") not in (None, 1, (1,), [1]),
               "use_gate": bool(cfg.get("use_gate")),
               "sliding_window": cfg.get("sliding_window") is not None}
        bad.update({k: cfg.get(k) is not None for k in (
            "activity_regularizer", "kernel_constraint", "bias_constraint")})
        unsupported = {k: cfg.get(k) for k, is_bad in bad.items() if is_bad}
        if unsupported:
            raise ValueError(f"MultiHeadAttention {mha.name} has {unsupported}: the head-split "
                             "layer supports value_dim == key_dim, dropout 0, the default "
                             "attention axis and output shape, no gate, sliding window, "
                             "activity regularizer or constraints; leave this layer whole (no "
                             "rule matching it) to keep them")
        if cfg["num_heads"] % len(devices):
            raise ValueError(f"{mha.name}: num_heads={cfg['num_heads']} is not a multiple of the "
                             f"{len(devices)} devices")
        return cls(cfg["num_heads"], cfg["key_dim"], devices, use_bias=cfg["use_bias"],
                   kernel_regularizer=cfg.get("kernel_regularizer"),
                   bias_regularizer=cfg.get("bias_regularizer"),
                   name=f"{mha.name}_heads", dtype=cfg["dtype"], trainable=cfg["trainable"])

    def build(self, query_shape, value_shape, key_shape=None):
        key_shape = value_shape if key_shape is None else key_shape
        if len(query_shape) != 3 or len(value_shape) != 3 or len(key_shape) != 3:
            raise ValueError(f"{self.name} takes [batch, seq, features] inputs, got query "
                             f"{tuple(query_shape)}, value {tuple(value_shape)}, key "
                             f"{tuple(key_shape)}")
        widths = {"query": int(query_shape[-1]), "key": int(key_shape[-1]),
                  "value": int(value_shape[-1])}
        self.width, h = widths["query"], self.heads_per_device
        self.shards = []
        for i, d in enumerate(self.devices):
            shard = {}
            with tf.device(d):
                for p in self._PROJECTIONS:
                    shard[f"{p}_kernel"] = self.add_weight(
                        shape=(widths[p], h, self.key_dim), initializer="glorot_uniform",
                        regularizer=self.kernel_regularizer, name=f"{p}_kernel_{i}")
                    if self.use_bias:
                        shard[f"{p}_bias"] = self.add_weight(
                            shape=(h, self.key_dim), initializer="zeros",
                            regularizer=self.bias_regularizer, name=f"{p}_bias_{i}")
                shard["output_kernel"] = self.add_weight(
                    shape=(h, self.key_dim, self.width), initializer="glorot_uniform",
                    regularizer=self.kernel_regularizer, name=f"output_kernel_{i}")
            self.shards.append(shard)
        if self.use_bias:
            with tf.device(self.devices[0]):
                self.output_bias = self.add_weight(shape=(self.width,), initializer="zeros",
                                                   regularizer=self.bias_regularizer,
                                                   name="output_bias")

    def _heads(self, i: int, query, value, key):
        """Device ``i``'s heads: their attention and their part of the output projection."""
        s = self.shards[i]

        def project(x, p):
            y = tf.einsum("btw,wnh->btnh", x, s[f"{p}_kernel"].value)
            return y + s[f"{p}_bias"].value if self.use_bias else y

        q, k, v = project(query, "query"), project(key, "key"), project(value, "value")
        logits = tf.einsum("btnh,bsnh->bnts", q, k)
        if logits.dtype.size < 4:  # as Keras: the softmax in float32 at least
            logits = tf.cast(logits, tf.float32)
        # 1 / sqrt(key_dim) rounded to float32, as Keras's tf.cast of the Python float does
        scale = float(np.float32(1.0 / np.sqrt(self.key_dim)))
        probs = tf.nn.softmax(logits * scale, axis=-1)
        o = tf.einsum("bnts,bsnh->btnh", tf.cast(probs, v.dtype), v)
        return tf.einsum("btnh,nhw->btw", o, s["output_kernel"].value)

    def call(self, query, value, key=None, attention_mask=None, use_causal_mask=False,
             return_attention_scores=False, training=None):
        if attention_mask is not None or use_causal_mask or return_attention_scores:
            raise ValueError(f"{self.name}: attention_mask, use_causal_mask and "
                             "return_attention_scores are not supported by the head-split "
                             "attention (give neither)")
        key = value if key is None else key
        # each distinct tensor once: given the same tensor twice, on_device's inner tape would
        # return its whole gradient for each, and the sum would count it twice
        inputs: list = []
        for t in (query, value, key):
            if not any(t is u for u in inputs):
                inputs.append(t)
        at = [next(j for j, u in enumerate(inputs) if t is u) for t in (query, value, key)]
        partial = [on_device(lambda *ts, i=i: self._heads(i, *(ts[j] for j in at)), d, *inputs)
                   for i, d in enumerate(self.devices)]
        with tf.device(self.devices[0]):
            y = tf.add_n(partial) if len(partial) > 1 else partial[0]
            return y + self.output_bias.value if self.use_bias else y

    def compute_output_spec(self, query, value, key=None, **kwargs):
        return keras.KerasTensor(tuple(query.shape), dtype=self.compute_dtype)

    def get_config(self):
        regs = {k: keras.regularizers.serialize(getattr(self, k)) if getattr(self, k) else None
                for k in ("kernel_regularizer", "bias_regularizer")}
        return {**super().get_config(), "num_heads": self.num_heads, "key_dim": self.key_dim,
                "devices": self.devices, "use_bias": self.use_bias, **regs}

    def set_full_weights(self, *weights) -> None:
        """Load a MultiHeadAttention's weights (``get_weights()`` order): device ``i`` gets its
        heads' query/key/value kernels and biases and its rows of the output kernel."""
        names = [f"{p}_{w}" for p in (*self._PROJECTIONS, "output")
                 for w in ("kernel", "bias") if self.use_bias or w == "kernel"]
        if len(weights) != len(names):
            raise ValueError(f"{self.name} takes {len(names)} arrays ({names}), got "
                             f"{len(weights)}")
        full = dict(zip(names, (np.asarray(w) for w in weights), strict=True))
        h = self.heads_per_device
        for i, shard in enumerate(self.shards):
            heads = slice(i * h, (i + 1) * h)
            for name, var in shard.items():
                axis = {"kernel": 1, "bias": 0}[name.rsplit("_", 1)[1]]
                if name == "output_kernel":
                    axis = 0
                var.assign(full[name][(slice(None),) * axis + (heads,)])
        if self.use_bias:
            self.output_bias.assign(full["output_bias"])

    def full_weights(self) -> list[np.ndarray]:
        """The weights as one MultiHeadAttention holds them (its ``get_weights()`` order)."""
        out = []
        for p in self._PROJECTIONS:
            out.append(np.concatenate([s[f"{p}_kernel"].numpy() for s in self.shards], axis=1))
            if self.use_bias:
                out.append(np.concatenate([s[f"{p}_bias"].numpy() for s in self.shards]))
        out.append(np.concatenate([s["output_kernel"].numpy() for s in self.shards], axis=0))
        return out + ([self.output_bias.numpy()] if self.use_bias else [])


# what each rule kind converts, and into what
_KINDS = {"column": keras.layers.Dense, "row": keras.layers.Dense,
          "heads": keras.layers.MultiHeadAttention}
# activations that mix a row's units (not element by element): a column shard cannot apply them
_ACROSS_UNITS = ("softmax", "log_softmax", "sparsemax")
_DENSE_UNSUPPORTED = ("kernel_constraint", "bias_constraint", "lora_rank")


def _sublayers(layer) -> list[tuple[str, keras.layers.Layer]]:
    """The sublayers ``layer`` holds in public attributes, in the order they were assigned; for
    a ``Sequential`` (a block's ``self.ffn = keras.Sequential([...])``), its layers by position
    (``"0"``, ``"1"``, ...: Keras's generated names depend on the process)."""
    if isinstance(layer, keras.Sequential):
        return [(str(i), sub) for i, sub in enumerate(layer.layers)]
    return [(name, value) for name, value in vars(layer).items()
            if not name.startswith("_") and isinstance(value, keras.layers.Layer)]


def _child(layer, name: str):
    """``layer``'s sublayer called ``name`` by ``_sublayers`` (``None`` if it has none)."""
    if isinstance(layer, keras.Sequential):
        return layer.layers[int(name)] if int(name) < len(layer.layers) else None
    return getattr(layer, name, None)


def _replace_child(layer, name: str, new) -> None:
    """Put ``new`` in place of ``layer``'s sublayer ``name`` (before ``layer`` is built): an
    attribute Keras tracks, or the position in a ``Sequential`` (its public ``pop`` / ``add``)."""
    if not isinstance(layer, keras.Sequential):
        setattr(layer, name, new)  # Keras tracks it: its variables are the block's
        return
    layers = list(layer.layers)
    layers[int(name)] = new
    for _ in range(len(layer.layers)):
        layer.pop(rebuild=False)
    for sub in layers:
        layer.add(sub, rebuild=False)


def _parallel_layer(layer, kind: str, devices: Sequence[str], gather_output: bool = True):
    """The unbuilt column-, row- or head-parallel layer for ``layer``."""
    if kind == "heads":
        return HeadParallelAttention.from_attention(layer, devices)
    cfg = layer.get_config()
    unsupported = {k: cfg[k] for k in _DENSE_UNSUPPORTED if cfg.get(k) is not None}
    if unsupported:
        raise ValueError(f"Dense {layer.name} has {unsupported}: the {kind}-parallel Dense "
                         "supports none of these; leave this layer whole (no rule matching "
                         "it) to keep them")
    activation = keras.activations.serialize(keras.activations.get(cfg["activation"]))
    name = activation if isinstance(activation, str) else str(activation)
    if kind == "column" and any(word in name for word in _ACROSS_UNITS):
        raise ValueError(f"Dense {layer.name} has activation {name!r}, which normalises over "
                         "all its units, while a column split computes each shard's units on "
                         "their own device: split a Dense without that activation (activation="
                         "None, then a keras.layers.Activation layer after it), or leave this "
                         "layer whole")
    common = {"units": cfg["units"], "devices": devices, "activation": cfg["activation"],
              "use_bias": cfg["use_bias"], "name": f"{layer.name}_{kind}",
              **{k: cfg.get(k) for k in ("kernel_regularizer", "bias_regularizer",
                                         "activity_regularizer")},
              "dtype": cfg["dtype"], "trainable": cfg["trainable"]}
    if kind == "column":
        return ColumnParallelDense(gather_output=gather_output, **common)
    return RowParallelDense(**common)


class TensorParallel(Form):
    """A Keras model's layers (a ``Sequential``, or a functional model: its graph of layer
    calls, ``accel.parallel.graph``) converted to tensor-parallel ones by rules, in the spirit
    of Keras 3's ``LayoutMap``: ``rules`` maps a regular expression to a kind, ``"column"`` or
    ``"row"`` for a ``Dense`` (``ColumnParallelDense`` / ``RowParallelDense``) and ``"heads"`` for
    a ``MultiHeadAttention`` (``HeadParallelAttention``). The first rule whose pattern is found
    (``re.search``) in a layer's **path** wins; unmatched layers are copied as they are, their
    variables on ``devices[0]``.

    A layer's path is its attribute path: a top-level layer's name (``"up1"``), then for a
    sublayer held in a public attribute of a block layer, ``/`` and the attribute name
    (``"block/attn"``, ``"block_1/up"``, deeper nesting likewise); the layers of a
    ``Sequential`` a block holds by their position (``"block/ffn/0"``, ``"block/ffn/2"``).
    A ``"column"`` Dense whose activation mixes its units (softmax) is refused, naming it.
    Keras's own variable paths name sublayers by generated names
    (``sequential/block/dense_1/kernel``) that depend on how many layers the process has made,
    so the rules match the names the block's code gives.

    A block layer with matching sublayers is rebuilt from its config (``from_config``, public
    Keras API: it must have ``get_config``) and its sublayers are replaced, before it is built,
    by the parallel ones (Keras tracks a sublayer assigned to an attribute, so their variables are
    the block's and the model's and the optimizer trains them; the replaced, never-built
    originals hold no variables). Sublayers a block creates in ``build`` cannot be replaced
    (``ValueError``). Every converted layer is checked once, on random input, to compute what
    the original does.

    A ``"column"`` layer directly followed by a ``"row"`` one hands its column slices straight
    over, without a gather (Megatron's MLP): at the top level when the row layer is the one
    reader of the column layer's output (neighbours in a Sequential), in a
    block when the row layer is the next sublayer attribute after the column one and the block,
    run once with the slices handed over, gives the original's output; otherwise (the block uses
    the column output elsewhere) the column layer gathers its output. ``handoffs`` lists the
    (column path, row path) pairs that hand over.

    ``tp = TensorParallel(model, devices, {"attn$": "heads", "/up$": "column", "/down$": "row"},
    loss=..., optimizer=...)``; ``tp.model`` is a Keras model holding the same weights, sharded,
    compiled by Keras's ``compile`` with ``jit_compile=False`` (XLA would compile every
    device's ops into one cluster and drop their placement) and a copy of ``optimizer`` built
    beside the shards (``compile(optimizer, loss)`` does it later, if they are left out). Then
    ``tp.fit(...)`` (``accel.parallel.form.Form``'s, Keras's habits, each batch one
    ``train_on_batch`` of ``tp.model``; ``tp.model.fit`` works as well) and ``tp.write_back()``
    puts the trained weights into ``model`` (full kernels gathered from the shards). ``kinds``
    maps each converted path to its kind, ``parallel_layers`` each converted path to its
    parallel layer, ``layers`` are ``tp.model``'s layers."""

    name = "tensor"
    options = ("rules",)

    def __init__(self, model, devices: Sequence[str], rules: Mapping[str, str], *,
                 loss=None, optimizer=None):
        if (loss is None) != (optimizer is None):
            raise ValueError("give both loss and optimizer (or neither, and call compile)")
        self.original_model = model
        self.graph = graph.model_graph(model)  # a Sequential's chain, or a functional graph
        calls = self.graph.calls
        layers = [c.layer for c in calls]
        self.devices = device_list(devices)
        compiled = []
        for pattern, kind in rules.items():
            checks.one_of(f"rules[{pattern!r}]", kind, tuple(_KINDS))
            compiled.append((re.compile(pattern), kind))
        self.kinds: dict[str, str] = {}
        paths: list[str] = []

        seen: set[int] = set()

        def match(layer, path):
            if id(layer) in seen:  # a layer held twice, or a reference back up
                return
            seen.add(id(layer))
            paths.append(path)
            kind = next((k for p, k in compiled if p.search(path)), None)
            if kind is None:
                for name, child in _sublayers(layer):
                    match(child, f"{path}/{name}")
            elif type(layer) is not _KINDS[kind]:
                raise ValueError(f"rule for {kind!r} matches {path} ({type(layer).__name__}): "
                                 f"{kind!r} splits a {_KINDS[kind].__name__}")
            else:
                self.kinds[path] = kind

        for layer in layers:
            match(layer, layer.name)
        if not self.kinds:
            raise ValueError(f"no layer path matches the rules {list(rules)}: the paths are "
                             f"{paths}")
        self.original, self.handoffs, self.parallel_layers = layers, [], {}
        self._leaves: list[list] = []  # per top-level layer: (original, parallel, path)
        readers: dict = {}  # tensor -> the calls that read it
        for i, c in enumerate(calls):
            for ref in c.reads():
                readers.setdefault(ref, []).append(i)
        rng = np.random.default_rng(0)
        ref_values = {ref: _sample(rng, *self.graph.specs[ref]) for ref in self.graph.inputs}
        par_values = dict(ref_values)
        new = []
        with tf.device(self.devices[0]):
            for c, layer in zip(calls, layers, strict=True):
                # a column layer whose one output only a row layer reads hands its slices over
                after = readers.get(c.outputs[0], []) if len(c.outputs) == 1 else []
                feeds_row = (len(after) == 1 and c.outputs[0] not in self.graph.outputs
                             and self.kinds.get(calls[after[0]].name) == "row")
                args_ref, kwargs_ref = _call_values(c, ref_values)
                args, kwargs = _call_values(c, par_values)
                x_ref = layer(*args_ref, training=False, **kwargs_ref)
                copy, leaves, handoffs = self._convert(layer, args, kwargs, handoff=True,
                                                       feeds_row=feeds_row)
                y = None if handoffs is None else copy(*args, training=False, **kwargs)
                if handoffs is None or (handoffs and not _close(y, x_ref, layers)):
                    copy, leaves, handoffs = self._convert(layer, args, kwargs, handoff=False)
                    y = copy(*args, training=False, **kwargs)
                if feeds_row and layer.name in self.kinds:
                    handoffs = [(layer.name, calls[after[0]].name)]
                if not isinstance(y, tuple) and not _close(y, x_ref, layers):
                    raise ValueError(f"the converted {layer.name} does not compute what the "
                                     "original does on random input (its call uses a replaced "
                                     "sublayer in a way the parallel layer does not support)")
                self.handoffs += handoffs
                self._leaves.append(leaves)
                self.parallel_layers.update({p: cp for _, cp, p in leaves})
                new.append(copy)
                _store(c.outputs, x_ref, ref_values)
                _store(c.outputs, y, par_values, handed_over=isinstance(y, tuple))
            self.model = _rebuilt(model, self.graph, new)
        self.layers = new
        if loss is not None:
            self.compile(optimizer, loss)

    def _convert(self, layer, args, kwargs, handoff: bool, feeds_row: bool = False):
        """``(copy, leaves, handoffs)``: ``layer``'s copy, built on its call's ``args`` and
        ``kwargs`` and holding its weights,
        with the matching (sub)layers parallel; ``handoffs`` is ``None`` when the copy with
        slices handed over failed to run."""
        path = layer.name
        if path in self.kinds:
            copy = _parallel_layer(layer, self.kinds[path], self.devices, not feeds_row)
            leaves, handoffs = [(layer, copy, path)], []
        else:
            copy = layer.__class__.from_config(layer.get_config())
            leaves, handoffs = [], []
            self._swap(layer, copy, path, handoff, leaves, handoffs)
        try:
            with warnings.catch_warnings():  # about the replaced sublayers, never built
                warnings.filterwarnings("ignore", message=".*does not have a `build",
                                        category=UserWarning)
                copy(*args, training=False, **kwargs)  # builds the rest, here
        except Exception:
            if not handoffs:
                raise
            return copy, leaves, None
        _transfer(layer, copy, leaves, to_copy=True)
        return copy, leaves, handoffs

    def _swap(self, orig, copy, path, handoff, leaves, handoffs) -> None:
        """Replace ``copy``'s sublayers whose paths match by parallel ones (recursively)."""
        children = _sublayers(orig)
        for j, (name, child) in enumerate(children):
            sub = f"{path}/{name}"
            target = _child(copy, name)
            if not isinstance(target, keras.layers.Layer):
                if sub in self.kinds or any(p.startswith(sub + "/") for p in self.kinds):
                    raise ValueError(f"{sub}: the {type(copy).__name__} rebuilt from its config "
                                     f"has no sublayer {name!r} before it is built (made in "
                                     "build()?), so it cannot be replaced")
                continue
            kind = self.kinds.get(sub)
            if kind is None:
                if any(p.startswith(sub + "/") for p in self.kinds):
                    self._swap(child, target, sub, handoff, leaves, handoffs)
                continue
            nxt = f"{path}/{children[j + 1][0]}" if j + 1 < len(children) else None
            feeds = handoff and kind == "column" and self.kinds.get(nxt) == "row"
            new = _parallel_layer(child, kind, self.devices, gather_output=not feeds)
            with keras.name_scope(copy.name):  # its variables' paths, as the block's own
                _build_like(new, child)
            _replace_child(copy, name, new)
            leaves.append((child, new, sub))
            if feeds:
                handoffs.append((sub, nxt))

    def compile(self, optimizer, loss, **kwargs) -> None:
        """``self.model.compile`` with ``jit_compile=False`` and a copy of ``optimizer`` (the
        user's is never bound to the shards), built first, here, so that each slot sits beside
        its variable (built inside ``fit``'s function, Keras would put every slot on one
        device).

        The optimizer sees the shards as variables: the per-element rule of the sharded forms
        applies (``accel.parallel.form.keras_optimizer_factory``: SGD, Adam, AdamW, RMSprop,
        Adagrad; ``global_clipnorm`` is fine, the norm over all shards being the norm over all
        kernels; ``clipnorm``, whole-variable optimizers and loss scaling: ``ValueError``)."""
        if kwargs.get("jit_compile"):
            raise ValueError("jit_compile=True: XLA would compile every device's ops into one "
                             "cluster and drop their placement; leave it False")
        keras_optimizer_factory(optimizer)  # the per-element rule; raises what it refuses
        optimizer = self.make_optimizer(optimizer)
        optimizer.build(self.model.trainable_variables)
        self.model.compile(optimizer=optimizer, loss=loss, jit_compile=False, **kwargs)

    def _step(self, x, y):
        if self.model.optimizer is None:
            raise ValueError("the tensor-parallel model is not compiled: give loss= and "
                             "optimizer=, or call compile(optimizer, loss)")
        self.model.reset_metrics()  # the batch's own loss, not a running mean
        return self.model.train_on_batch(x, y, return_dict=True)["loss"]

    def write_back(self) -> None:
        """The trained weights into the original model (shards gathered into full kernels)."""
        for layer, copy, leaves in zip(self.original, self.layers, self._leaves, strict=True):
            _transfer(layer, copy, leaves, to_copy=False)

    def user_model(self):
        return self.original_model

    def working_variables(self) -> list:
        return list(self.model.weights)

    def optimizer_variables(self) -> list:
        return [] if self.model.optimizer is None else list(self.model.optimizer.variables)


def _sample(rng, shape, dtype) -> tf.Tensor:
    """Two random examples of a model input: normal floats, or 0/1 for integer inputs (token
    ids valid for any vocabulary)."""
    dtype = tf.as_dtype(dtype)
    if dtype.is_integer:
        return tf.constant(rng.integers(0, 2, size=(2, *shape)), dtype=dtype)
    return tf.constant(rng.normal(size=(2, *shape)), dtype=dtype)


def _call_values(call, values) -> tuple[list, dict]:
    """A call's arguments with the graph's tensors filled in from ``values`` (no
    ``training``: the caller gives it)."""
    args, kwargs = graph.fill(call.args, values), graph.fill(call.kwargs, values)
    return args, {k: v for k, v in kwargs.items() if k != "training"}


def _store(refs, out, values, handed_over: bool = False) -> None:
    """A call's output(s) under its references (column slices handed over: one value)."""
    outs = [out] if handed_over or not isinstance(out, list | tuple) else list(out)
    values.update(zip(refs, outs, strict=True))


def _rebuilt(model, model_graph: graph.ModelGraph, layers: list):
    """A Keras model calling ``layers`` (aligned with the graph's calls) as ``model`` calls
    its own: a ``Sequential`` for a ``Sequential``, else a functional model."""
    if isinstance(model, keras.Sequential):
        return keras.Sequential([keras.Input(km.input_shape_of(model),
                                             dtype=model.inputs[0].dtype), *layers])
    inputs = [keras.Input(model_graph.specs[r][0], dtype=model_graph.specs[r][1], name=r[0])
              for r in model_graph.inputs]
    values = dict(zip(model_graph.inputs, inputs, strict=True))
    for call, layer in zip(model_graph.calls, layers, strict=True):
        args, kwargs = _call_values(call, values)
        out = layer(*args, **kwargs)
        _store(call.outputs, out, values, handed_over=isinstance(out, tuple)
               and len(call.outputs) == 1)
    outputs = [values[r] for r in model_graph.outputs]
    return keras.Model(inputs if len(inputs) > 1 else inputs[0],
                       outputs if len(outputs) > 1 else outputs[0])


def _build_like(parallel, layer) -> None:
    """Build a parallel layer for the input widths of the built ``layer`` it replaces, here
    (eagerly: a block without ``build`` is built by Keras tracing its call in a stateless scope,
    whose variables are created when the trace ends, outside each shard's device scope)."""
    if isinstance(parallel, HeadParallelAttention):
        q, k, v = (layer.get_weights()[i].shape[0] for i in ((0, 2, 4) if layer.use_bias
                                                             else (0, 1, 2)))
        parallel.build((None, None, q), (None, None, v), (None, None, k))
    else:
        parallel.build((None, layer.get_weights()[0].shape[0]))


# the unit roundoff of the half-precision compute dtypes (mixed policies): a sum of partial
# products in another order differs from the original's by a few of these
_HALF_EPS = {"bfloat16": 2.0**-8, "float16": 2.0**-11}


def _close(y, ref, layers) -> bool:
    """``y`` equals ``ref`` within what ``layers``' compute dtypes round to, after the layers
    so far (each converted one summing in another order)."""
    eps = max([_HALF_EPS.get(str(la.compute_dtype), 0.0) for la in layers] or [0.0])
    tol = max(1e-3, 8 * eps)
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    scale = max(np.abs(ref).max(), 1e-30)
    return y.shape == ref.shape and bool(np.allclose(y, ref, rtol=tol, atol=tol * scale))


def _transfer(layer, copy, leaves, to_copy: bool) -> None:
    """Weights between a top-level layer and its copy: each converted (sub)layer's full weights,
    and every other variable in order (the copy's replaced originals hold none)."""
    mine = {id(w) for orig, _, _ in leaves for w in orig.weights}
    theirs = {id(w) for _, par, _ in leaves for w in par.weights}
    rest = [w for w in layer.weights if id(w) not in mine]
    rest_copy = [w for w in copy.weights if id(w) not in theirs]
    shapes = [tuple(w.shape) for w in rest], [tuple(w.shape) for w in rest_copy]
    if shapes[0] != shapes[1]:
        raise ValueError(f"{layer.name}'s copy holds other variables than the original "
                         f"({shapes[1]} vs {shapes[0]})")
    for w, c in zip(rest, rest_copy, strict=True):
        (c.assign(w.numpy()) if to_copy else w.assign(c.numpy()))
    for orig, par, _ in leaves:
        if to_copy:
            par.set_full_weights(*orig.get_weights())
        else:
            orig.set_weights(par.full_weights())
