"""The input side of data parallelism: examples in TFRecord files, read back with ``tf.data``.

* ``write_tfrecords(x, y, directory, num_files)``: one ``tf.train.Example`` per row, spread
  round-robin over a few files (as real data sets are sharded);
* ``temporary_tfrecords(x, y, num_files)``: the same in a temporary directory, removed on exit;
* ``parse_examples(serialized, features, outputs)``: a batch of serialized examples -> ``(x, y)``;
* ``tfrecord_dataset(files, features, outputs, batch_size, towers=...)``: read, batch, parse,
  split per tower, prefetch.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import tensorflow as tf

from accel import checks
from accel.parallel.data import split_batch

__all__ = ["write_tfrecords", "temporary_tfrecords", "parse_examples", "tfrecord_dataset"]


def _example(x_row: np.ndarray, y_row: np.ndarray) -> bytes:
    feature = {
        "x": tf.train.Feature(float_list=tf.train.FloatList(value=x_row.ravel().tolist())),
        "y": tf.train.Feature(float_list=tf.train.FloatList(value=y_row.ravel().tolist())),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def write_tfrecords(x, y, directory: str | Path, num_files: int = 4,
                    prefix: str = "train") -> list[str]:
    """Write rows of ``x`` (features) and ``y`` (targets) as ``tf.train.Example`` records.

    Row ``i`` goes to file ``i % num_files``, named ``{prefix}-0000i-of-0000N.tfrecord``.
    Returns the file names, sorted. Reading the files in order with ``cycle_length=num_files``
    (as ``tfrecord_dataset`` does) gives the rows back in their original order.
    """
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    if x.ndim != 2 or y.ndim != 2 or len(x) != len(y):
        raise ValueError(f"x and y must be 2-D with the same number of rows, got shapes "
                         f"{x.shape} and {y.shape}")
    checks.positive_int("num_files", num_files)
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"directory {str(directory)!r} does not exist")
    names = [str(directory / f"{prefix}-{i:05d}-of-{num_files:05d}.tfrecord")
             for i in range(num_files)]
    writers = [tf.io.TFRecordWriter(name) for name in names]
    try:
        for i, (xr, yr) in enumerate(zip(x, y, strict=True)):
            writers[i % num_files].write(_example(xr, yr))
    finally:
        for w in writers:
            w.close()
    return names


@contextlib.contextmanager
def temporary_tfrecords(x, y, num_files: int = 4) -> Iterator[list[str]]:
    """``write_tfrecords`` into a fresh temporary directory, deleted when the block ends."""
    with tempfile.TemporaryDirectory(prefix="accel-tfrecords-") as tmp:
        yield write_tfrecords(x, y, tmp, num_files)


def parse_examples(serialized: tf.Tensor, features: int, outputs: int = 1):
    """A batch of serialized examples (strings) -> ``(x [batch, features], y [batch, outputs])``."""
    spec = {"x": tf.io.FixedLenFeature([features], tf.float32),
            "y": tf.io.FixedLenFeature([outputs], tf.float32)}
    parsed = tf.io.parse_example(serialized, spec)
    return parsed["x"], parsed["y"]


def tfrecord_dataset(files: str | Sequence[str], features: int, outputs: int = 1,
                     batch_size: int = 64, towers: int | None = None,
                     shuffle_buffer: int = 0, seed: int = 0) -> tf.data.Dataset:
    """The input pipeline: files -> records -> batches -> parsed -> per-tower shards -> prefetch.

    Files are read interleaved, one record from each in turn (the order ``write_tfrecords``
    wrote them in); ``shuffle_buffer > 0`` shuffles records reproducibly from ``seed``. Batches
    are whole (``drop_remainder=True``), so every step has the same global batch. With
    ``towers=n`` each element is ``(xs, ys)``, tuples of ``n`` per-tower shards (``batch_size``
    must then be a multiple of ``n``), else a plain ``(x, y)``.
    """
    if isinstance(files, (str, bytes)) or hasattr(files, "__fspath__"):
        files = [files]  # one file name, not a sequence of characters
    files = [os.fsdecode(f) for f in files]
    if not files:
        raise ValueError("files is empty: nothing to read")
    checks.positive_int("batch_size", batch_size)
    if towers is not None and (checks.positive_int("towers", towers) and batch_size % towers):
        raise ValueError(f"batch_size {batch_size} must be a positive multiple of towers={towers}")
    ds = tf.data.Dataset.from_tensor_slices(list(files))
    ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=len(files), block_length=1)
    if shuffle_buffer:
        ds = ds.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=False)
    ds = ds.batch(batch_size, drop_remainder=True)
    ds = ds.map(lambda s: parse_examples(s, features, outputs))
    if towers is not None:
        ds = ds.map(lambda x, y: tuple(zip(*split_batch((x, y), towers), strict=True)))
    return ds.prefetch(tf.data.AUTOTUNE)
