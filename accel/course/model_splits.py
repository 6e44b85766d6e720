"""Chapter 07's rules of thumb, counted: the bytes that cross devices per training step when a
network is split by layers, by neurons, or along its architecture (two towers, AlexNet style).

Each ``*_step`` builds one training step's gradients as a ``tf.function`` over two devices;
``count_splits(devices)`` runs them through ``accel.parallel.trace.transfers_of`` and returns the
bytes forward and backward per split, counted from the placed graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from accel.parallel import trace

__all__ = ["dense_by_layers", "dense_by_neurons", "two_tower_cnn", "count_splits",
           "format_splits", "SPLIT_BATCH", "DENSE_WIDTH", "DENSE_LAYERS", "CNN_LAYERS",
           "TOWER_CROSSINGS"]

SPLIT_BATCH, DENSE_WIDTH, DENSE_LAYERS = 32, 256, 4


def _var(rng, shape, device):
    with tf.device(device):
        return tf.Variable(rng.normal(0, shape[0] ** -0.5, shape).astype(np.float32))


def _gradient_fn(forward, variables, loss_device: str):
    """A tf.function running one SGD step on sum(forward(x)). ``tf.gradients`` puts each
    gradient op on its forward op's device; ``GradientTape.gradient`` would put them all under
    the device scope it is called in (and pull every activation there)."""
    @tf.function
    def step(x):
        with tf.device(loss_device):
            loss = tf.reduce_sum(forward(x))
        grads = tf.gradients(loss, variables)
        for g, v in zip(grads, variables, strict=True):
            with tf.device(v.device):  # an SGD update where the variable lives
                v.assign_sub(1e-3 * g)
    return step


def dense_by_layers(devices: Sequence[str], seed: int = 0):
    """A ReLU MLP of ``DENSE_LAYERS`` square layers; the first half on ``devices[0]``, the rest
    on ``devices[1]``. Returns ``(gradient_fn, input)``."""
    rng = np.random.default_rng(seed)
    half = DENSE_LAYERS // 2
    ws = [_var(rng, (DENSE_WIDTH, DENSE_WIDTH), devices[int(i >= half)])
          for i in range(DENSE_LAYERS)]

    def forward(x):
        for i, w in enumerate(ws):
            with tf.device(devices[int(i >= half)]):
                x = tf.nn.relu(x @ w)
        return x
    return _gradient_fn(forward, ws, devices[1]), tf.ones((SPLIT_BATCH, DENSE_WIDTH))


def dense_by_neurons(devices: Sequence[str], seed: int = 0):
    """The same MLP with every layer's matrix split by columns (output neurons): device ``i``
    computes half of each layer's outputs and needs *all* of the previous layer's outputs."""
    rng = np.random.default_rng(seed)
    w2 = DENSE_WIDTH // 2
    ws = [[_var(rng, (DENSE_WIDTH, w2), d) for d in devices[:2]] for _ in range(DENSE_LAYERS)]

    def forward(x):
        halves = None
        for layer in ws:
            outs = []
            for d, w in zip(devices[:2], layer, strict=True):
                with tf.device(d):  # each device gathers the full input of the layer itself
                    inp = x if halves is None else tf.concat(halves, axis=1)
                    outs.append(tf.nn.relu(inp @ w))
            halves = outs
        with tf.device(devices[0]):
            return tf.concat(halves, axis=1)
    return _gradient_fn(forward, [w for layer in ws for w in layer], devices[0]), \
        tf.ones((SPLIT_BATCH, DENSE_WIDTH))


def _conv(x, w, pool: bool):
    y = tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME"))
    return tf.nn.max_pool2d(y, 2, 2, "VALID") if pool else y


CNN_LAYERS = (  # (kernel, output channels per tower, max-pool after)
    (5, 16, True), (3, 32, True), (3, 32, False), (3, 32, True))
TOWER_CROSSINGS = (2,)  # conv layers that read both towers (conv3, as in AlexNet)


def two_tower_cnn(devices: Sequence[str], cross: Sequence[int] = TOWER_CROSSINGS,
                  seed: int = 0):
    """A small two-column CNN: one tower of channels per device, four conv layers then a fully
    connected one. A conv layer listed in ``cross`` reads both towers' previous outputs (the
    other tower's cross the link); the others read their own tower only. The fully connected
    layer always reads both towers' features. ``cross=TOWER_CROSSINGS`` is AlexNet's 2012
    split; ``cross=(1, 2, 3)`` splits every layer by channels (the 'by neurons' split)."""
    rng = np.random.default_rng(seed)
    d = list(devices[:2])
    kernels, c_in = [], 3
    for i, (k, c, _) in enumerate(CNN_LAYERS):
        fan_in = 2 * c_in if i in cross else c_in
        kernels.append([_var(rng, (k, k, fan_in, c), dv) for dv in d])
        c_in = c
    fc = [_var(rng, (2 * 4 * 4 * c_in, 64), dv) for dv in d]

    def forward(x):
        h = [x, x]
        for i, (_, _, pool) in enumerate(CNN_LAYERS):
            out = []
            for t, dv in enumerate(d):
                with tf.device(dv):  # a crossing layer gathers both towers on each device
                    inp = tf.concat(h, axis=3) if i in cross else h[t]
                    out.append(_conv(inp, kernels[i][t], pool))
            h = out
        feats, outs = [], []
        for t, dv in enumerate(d):
            with tf.device(dv):
                feats.append(tf.reshape(h[t], (SPLIT_BATCH, -1)))
        for t, dv in enumerate(d):
            with tf.device(dv):  # the fully connected layer reads both towers' features
                outs.append(tf.nn.relu(tf.concat(feats, axis=1) @ fc[t]))
        with tf.device(d[0]):
            return tf.concat(outs, axis=1)
    variables = [k for layer in kernels for k in layer] + fc
    return _gradient_fn(forward, variables, d[0]), tf.ones((SPLIT_BATCH, 32, 32, 3))


def count_splits(devices: Sequence[str]) -> dict[str, dict[str, int]]:
    """Bytes crossing devices per step (forward, backward, total) for each split, counted from
    the partition graphs of one run."""
    if len(devices) < 2:
        raise ValueError(f"count_splits needs 2 devices, got {list(devices)}")
    out = {}
    for name, build in (("dense, split by layers", dense_by_layers),
                        ("dense, split by neurons", dense_by_neurons),
                        ("CNN, two towers (AlexNet)", two_tower_cnn),
                        ("CNN, split by channels", lambda d: two_tower_cnn(d, (1, 2, 3)))):
        fn, x = build(devices)
        out[name] = trace.crossing_bytes(trace.transfers_of(fn, x))
    return out


def format_splits(counts: dict[str, dict[str, int]]) -> str:
    """``count_splits``'s result as a table in KiB."""
    width = max(len(k) for k in counts)
    lines = [f"{'split':{width}}  {'forward':>10}  {'backward':>10}  {'total':>10}"]
    for name, c in counts.items():
        lines.append(f"{name:{width}}  " + "  ".join(f"{c[k] / 1024:>6.0f} KiB"
                                                     for k in ("forward", "backward", "total")))
    return "\n".join(lines)
