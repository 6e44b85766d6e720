"""accel.devices: setup(), device names, the device table and report, fresh-process probes."""

import logging

import numpy as np
import pytest
import tensorflow as tf

from accel import devices
from accel.procs import run_python

HAS_GPU = bool(tf.config.list_physical_devices("GPU"))


# ----------------------------------------------------------------------------- setup()
def test_setup_returns_four_logical_devices(four_devices):
    assert len(four_devices) == 4
    assert four_devices == [d.name for d in tf.config.list_logical_devices()][:4]
    kind = "GPU" if HAS_GPU else "CPU"
    assert all(name.startswith(f"/device:{kind}:") for name in four_devices)


def test_setup_is_idempotent(four_devices):
    assert devices.setup(4) == four_devices
    assert devices.setup(4, kind="auto") == four_devices


def test_setup_with_other_count_after_start_says_restart():
    with pytest.raises(RuntimeError, match="restart the kernel"):
        devices.setup(2)
    with pytest.raises(RuntimeError, match="restart the kernel"):
        devices.setup(4, kind="cpu")


@pytest.mark.parametrize("count", [0, -1, True, 2.0, "4"])
def test_setup_rejects_bad_count(count):
    with pytest.raises(ValueError, match=f"count must be an int >= 1, got {count!r}"):
        devices.setup(count)


def test_setup_rejects_bad_kind_memory_and_threads():
    with pytest.raises(ValueError, match=r"kind must be one of \['auto', 'cpu', 'gpu'\], got 'tpu"):
        devices.setup(4, kind="tpu")
    with pytest.raises(ValueError, match="gpu_memory_mb must be an int >= 1, got 0"):
        devices.setup(4, gpu_memory_mb=0)
    with pytest.raises(ValueError, match="intra_op_threads must be an int >= 1, got 0"):
        devices.setup(4, intra_op_threads=0)


def test_setup_with_other_memory_or_threads_after_start_says_restart():
    for kwargs in ({"gpu_memory_mb": 512}, {"intra_op_threads": 1}):
        with pytest.raises(RuntimeError, match="restart the kernel"):
            devices.setup(4, **kwargs)


def test_seed_everything_and_quiet_logging():
    devices.seed_everything(3)
    first = (np.random.rand(), float(tf.random.uniform(())))
    devices.seed_everything(3)
    second = (np.random.rand(), float(tf.random.uniform(())))
    assert first == second
    assert tf.get_logger().level == logging.ERROR
    with pytest.raises(ValueError, match="seed must be an int >= 0, got -1"):
        devices.seed_everything(-1)


@pytest.mark.skipif(HAS_GPU, reason="names logical CPUs")
@pytest.mark.slow
def test_setup_in_a_fresh_process_with_other_counts_and_threads():
    out = run_python(
        "import numpy as np, tensorflow as tf\n"
        "from accel import devices\n"
        "print(devices.setup(2, intra_op_threads=1, inter_op_threads=3))\n"
        "a = np.random.rand()\n"
        "print(devices.setup(2, intra_op_threads=1, inter_op_threads=3))\n"
        "print(a != np.random.rand())\n"  # a repeated call does not reseed
        "print(tf.config.threading.get_intra_op_parallelism_threads(),\n"
        "      tf.config.threading.get_inter_op_parallelism_threads())\n"
        "try:\n"
        "    devices.setup(2, intra_op_threads=2)\n"
        "except RuntimeError as e:\n"
        "    print('RuntimeError', e)\n", warm=True)
    lines = out.splitlines()
    assert lines[:4] == ["['/device:CPU:0', '/device:CPU:1']"] * 2 + ["True", "1 3"]
    assert lines[4].startswith("RuntimeError") and "restart the kernel" in lines[4]
    assert "count=2, kind='auto', intra_op_threads=1, inter_op_threads=3;" in lines[4]
    assert "so count=2, kind='auto', intra_op_threads=2 needs a fresh process" in lines[4]


@pytest.mark.slow
def test_setup_after_tensorflow_started_elsewhere():
    code = (
        "import tensorflow as tf\n"
        "tf.constant(1.0) + 1.0\n"
        "from accel import devices\n"
        "print(devices.setup(1, kind='cpu'))\n"
        "try:\n"
        "    devices.setup(3)\n"
        "except RuntimeError as e:\n"
        "    print('RuntimeError', e)\n"
    )
    out = run_python(code, warm=True)
    assert "['/device:CPU:0']" in out
    assert "restart the kernel" in out


@pytest.mark.skipif(HAS_GPU, reason="needs a machine without GPUs")
@pytest.mark.slow
def test_setup_gpu_kind_without_gpu_is_a_clear_error():
    out = run_python(
        "from accel import devices\n"
        "try:\n    devices.setup(2, kind='gpu')\nexcept RuntimeError as e:\n    print(e)\n",
        warm=True)
    assert "needs a physical GPU" in out


# ----------------------------------------------------------------------------- names
@pytest.mark.parametrize("name, expected", [
    ("/cpu:0", "/device:CPU:0"),
    ("/CPU:0", "/device:CPU:0"),
    ("/gpu:1", "/device:GPU:1"),
    ("/device:GPU:1", "/device:GPU:1"),
    ("/device:gpu:1", "/device:GPU:1"),
    ("/gpu:*", "/device:GPU:*"),
    ("/job:worker/replica:0/task:1/device:GPU:0", "/job:worker/replica:0/task:1/device:GPU:0"),
    ("/job:ps", "/job:ps"),
    ("/job:ps/task:0/cpu:0", "/job:ps/task:0/device:CPU:0"),
    ("", ""),
    ("CPU:0", "/device:CPU:0"),
    ("cpu:1", "/device:CPU:1"),
    ("/tpu:0", "/device:TPU:0"),
    ("/device:MY_DEVICE:0", "/device:MY_DEVICE:0"),
    ("/device:my_device:2", "/device:my_device:2"),
    ("/device:Gpu:0", "/device:Gpu:0"),
])
def test_normalize_device(name, expected):
    assert devices.normalize_device(name) == expected
    # TensorFlow's own parser agrees (it is lenient where parse_device is strict, not here)
    assert tf.DeviceSpec.from_string(name).to_string() == expected


def test_parse_device_fields():
    spec = devices.parse_device("/job:worker/replica:2/task:1/device:GPU:3")
    assert (spec.job, spec.replica, spec.task, spec.device_type, spec.device_index) == (
        "worker", 2, 1, "GPU", 3)
    assert isinstance(spec, tf.DeviceSpec)


@pytest.mark.parametrize("bad", ["/gpu:x", "/job:worker/task:-1", "/cpu:0/gpu:1",
                                 "/job:a/job:b", "/replica:-2", "/job:9bad", "/device:GPU",
                                 "/JOB:ps"])
def test_parse_device_rejects_bad_names(bad):
    with pytest.raises(ValueError) as err:
        devices.parse_device(bad)
    assert repr(bad) in str(err.value)


def test_parse_device_rejects_non_strings():
    with pytest.raises(ValueError, match="a device name must be a string, got 3"):
        devices.parse_device(3)


def test_merge_devices_inner_wins():
    merged = devices.merge_devices("/job:worker/task:1", "/gpu:0")
    assert merged == "/job:worker/task:1/device:GPU:0"
    assert devices.merge_devices("/job:worker/task:1/cpu:0", "/gpu:2") == (
        "/job:worker/task:1/device:GPU:2")
    assert devices.merge_devices("/job:ps/cpu:0", "/job:worker") == "/job:worker/device:CPU:0"
    with pytest.raises(ValueError, match="device name '/gpu:x': cannot parse 'gpu:x'"):
        devices.merge_devices("/job:ps", "/gpu:x")


# ----------------------------------------------------------------------------- table, report
def test_device_table_lists_physical_then_logical(four_devices):
    rows = devices.device_table()
    levels = [r.level for r in rows]
    assert levels == sorted(levels, key=["physical", "logical"].index)
    logical = [r.name for r in rows if r.level == "logical"]
    assert logical[:4] == four_devices
    cpu = next(r for r in rows if r.level == "physical" and r.device_type == "CPU")
    assert cpu.memory_mb is None or cpu.memory_mb > 0


def test_format_table_with_and_without_memory():
    rows = devices.device_table()
    with_mem = devices.format_table(rows).splitlines()
    without = devices.format_table(rows, memory=False).splitlines()
    assert with_mem[0].split() == ["name", "type", "level", "memory", "detail"]
    assert without[0].split() == ["name", "type", "level", "detail"]
    assert len(with_mem) == len(without) == len(rows) + 1
    assert "MiB" not in "\n".join(without)


def test_report_mentions_version_and_devices(four_devices):
    text = devices.report()
    assert tf.__version__ in text
    assert "CUDA_VISIBLE_DEVICES=" in text
    assert all(name in text for name in four_devices)


@pytest.mark.slow
def test_fresh_process_devices_sees_its_environment():
    seen = devices.fresh_process_devices(env={"CUDA_VISIBLE_DEVICES": "1"})
    assert seen["CUDA_VISIBLE_DEVICES"] == "1"
    assert "/physical_device:CPU:0" in seen["physical"]
    late = devices.fresh_process_devices(after_import='os.environ["CUDA_VISIBLE_DEVICES"] = "7"')
    assert late["CUDA_VISIBLE_DEVICES"] == "7"


@pytest.mark.slow
def test_fresh_process_devices_reports_a_failing_child():
    with pytest.raises(RuntimeError, match="exit 3"):
        devices.fresh_process_devices(before_import="raise SystemExit(3)")
