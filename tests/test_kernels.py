"""accel.kernels: the kernel registry read per type attribute, portability gaps."""

import pytest
import tensorflow as tf

from accel import kernels


def test_registered_kernels_knows_the_int32_gap():
    variable = kernels.registered_kernels("VariableV2")
    assert variable["CPU"] == ["any"]
    assert "float32" in variable["GPU"] and "int32" not in variable["GPU"]
    matmul = kernels.registered_kernels("MatMul")
    assert "uint8" not in matmul["CPU"] and "float32" in matmul["CPU"]
    assert "GPU" not in kernels.registered_kernels("StringJoin")
    with pytest.raises(ValueError, match="unknown op type 'NoSuchOp'"):
        kernels.registered_kernels("NoSuchOp")


def test_kernel_gaps():
    def fn(tokens, weights):
        label = tf.strings.join(["a", "b"], name="label")
        return label, tf.matmul(tokens, tokens, name="bytes"), tf.matmul(weights, weights)

    args = (tf.ones((2, 2), tf.uint8), tf.ones((2, 2)))
    gpu = kernels.kernel_gaps(fn, *args, device_type="GPU")
    cpu = kernels.kernel_gaps(fn, *args, device_type="CPU")
    assert ("label", "StringJoin", "any") in gpu
    assert ("bytes", "MatMul", "uint8") in gpu
    assert cpu == [("bytes", "MatMul", "uint8")]


def test_registered_kernels_reads_the_data_attribute_only():
    """Sum has T (data) and Tidx (axis index type). Its GPU kernels take no int32 data (TF keeps
    int32 reductions on the host); merging Tidx's {int32, int64} in would claim they do."""
    assert kernels.data_attr("Sum") == "T" and kernels.data_attr("Range") == "Tidx"
    assert kernels.registered_kernels("Sum")["GPU"] == [
        "bfloat16", "complex128", "complex64", "float16", "float32", "float64", "int64"]
    assert kernels.registered_kernels("Sum", attr="Tidx")["GPU"] == ["int32", "int64"]
    assert kernels.registered_kernels("TopKV2", attr="index_type")["GPU"] == ["int32"]
    with pytest.raises(ValueError, match=r"op Sum has no type attribute 'dtype'; it has \['T', "
                                         r"'Tidx'\]"):
        kernels.registered_kernels("Sum", attr="dtype")


def test_kernel_gaps_device_type_any_case_and_unknown():
    def fn(x):
        return tf.strings.join(["a", "b"], name="label"), x * 2.0

    upper = kernels.kernel_gaps(fn, tf.ones(2), device_type="GPU")
    assert kernels.kernel_gaps(fn, tf.ones(2), device_type="gpu") == upper
    assert {row[1] for row in upper} == {"StringJoin", "Const"}  # strings live on the host
    assert {row[2] for row in upper if row[1] == "Const"} == {"string"}
    with pytest.raises(ValueError, match=r"device_type must be one of .* got 'NPU'"):
        kernels.kernel_gaps(fn, tf.ones(2), device_type="NPU")


def test_kernel_gaps_traces_a_tf_function_with_its_own_signature():
    fn = tf.function(lambda x: tf.matmul(x, x), input_signature=[tf.TensorSpec([2, 2], tf.uint8)])
    assert kernels.kernel_gaps(fn, device_type="GPU") == [("MatMul", "MatMul", "uint8")]


def test_host_memory_args_of_int32_gpu_kernels():
    # TensorFlow's own registrations (cwise_op_add_1.cc, shape_ops.cc): the int32 GPU AddV2 is
    # the CPU functor with x, y and z in host memory; float32 has no host-memory argument
    add = kernels.host_memory_args("AddV2")
    assert add.get("int32") == ["x", "y", "z"]
    assert "float32" not in add
    shape = kernels.host_memory_args("Shape", "gpu")
    assert shape["int32"] == ["input", "output"] and shape["float32"] == ["output"]
    assert kernels.host_memory_args("AddV2", "CPU") == {}
    with pytest.raises(ValueError, match="device_type must be one of"):
        kernels.host_memory_args("AddV2", "npu")


def test_default_kernels_serve_the_cpu_too():
    """NextIteration's float32 kernel is a DEFAULT registration only (no CPU one): the kernel
    lookup tries DEFAULT for the CPU as for any device, so it is no gap there."""
    table = kernels.registered_kernels("NextIteration")
    assert "float32" not in table.get("CPU", []) and "float32" in table["DEFAULT"]
    fn = tf.function(lambda x: tf.raw_ops.NextIteration(data=x))
    assert kernels.kernel_gaps(fn, tf.ones(2), device_type="CPU") == []


def test_tf2_variable_handle_has_no_int32_gpu_or_default_kernel():
    """Chapter 03's TF2 case: VarHandleOp (tf.Variable) has one unconstrained CPU kernel and
    DEFAULT kernels per dtype (resource_variable_ops.cc), int64 among them, int32 not; so an int32
    tf.Variable asked for a GPU is moved to the CPU by soft placement (or fails without it)."""
    table = kernels.registered_kernels("VarHandleOp")
    assert table["CPU"] == ["any"]
    assert "GPU" not in table
    assert {"float32", "int64"} <= set(table["DEFAULT"]) and "int32" not in table["DEFAULT"]
    fn = tf.function(lambda: tf.raw_ops.VarHandleOp(dtype=tf.int32, shape=[]))
    assert kernels.kernel_gaps(fn, device_type="GPU") == [("VarHandleOp", "VarHandleOp", "int32")]
    assert kernels.kernel_gaps(fn, device_type="CPU") == []
