"""Shared plumbing: accel.checks, procs, timing, data, models, training, viz;
and the CLI."""

import json
import subprocess
import sys

import matplotlib
import numpy as np
import pytest
import tensorflow as tf

from accel import checks, datasets, models, procs, timing, training, viz

matplotlib.use("Agg")


def test_time_fn_and_format_ratios():
    calls = []
    t = timing.time_fn(lambda: calls.append(1), repeat=3, warmup=2)
    assert len(calls) == 5 and t >= 0
    text = timing.format_ratios({"base": 0.002, "other": 0.004}, "base")
    assert "2.00x base" in text and "1.00x base" in text
    with pytest.raises(ValueError, match="repeat must be >= 1"):
        timing.time_fn(lambda: None, repeat=0)
    with pytest.raises(ValueError, match="baseline 'nope'"):
        timing.format_ratios({"a": 1.0}, "nope")
    with pytest.raises(ValueError, match="unit must be one of"):
        timing.format_ratios({"a": 1.0}, "a", unit="h")


def test_interleaved_medians_call_order_and_counts():
    """Every function warmed up first, then the rounds interleave them (a, b, a, b, ...); each
    round calls each ``repeat`` times; one median per key (a hand count of the calls)."""
    calls = []
    t = timing.interleaved_medians({"a": lambda: calls.append("a"),
                                    "b": lambda: calls.append("b")}, rounds=2, repeat=3,
                                   warmup=1)
    assert calls == ["a", "b"] + (["a"] * 3 + ["b"] * 3) * 2
    assert set(t) == {"a", "b"} and all(v >= 0 for v in t.values())
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        timing.interleaved_medians({"a": lambda: None}, rounds=0)


def test_require_quiet_decides_from_both_figures():
    """Literal measurements: a low ratio, or other processes using a core, is a busy machine."""
    ok = timing.Ceiling(1.83, 0.04)
    assert timing.require_quiet(measured=ok) == ok
    assert timing.require_quiet(measured=timing.Ceiling(1.83, None)).value == 1.83
    with pytest.raises(RuntimeError, match=r"busy: ceiling 1\.12 .*needs >= 1\.3\..*re-run"):
        timing.require_quiet(measured=timing.Ceiling(1.12, 0.0))
    with pytest.raises(RuntimeError, match=r"other processes used 0\.97 cores meanwhile, "
                                           r"needs <= 0\.35"):
        timing.require_quiet(measured=timing.Ceiling(1.52, 0.97))  # one busy core beside
    assert timing.ceiling_line(ok) == ("ceiling: 1.83 (1-thread / 2-thread matmul time; 2 = two "
                                       "free cores); other processes: 0.04 cores")


def test_lockstep_idle_counts_rounds_and_bounds_a_lone_worker():
    """Each work runs warmup + rounds times, in lock-step; a work that does nothing beside one
    that sleeps idles about half the clock whatever the machine's speed: the sleeper's time is
    at most each round's span, so 1 - (0 + sleep) / (2 span) >= 1/2, less the empty work's
    share (microseconds, unless a loaded machine preempts it: hence the margin)."""
    import time

    calls = {"nothing": 0, "sleep": 0}

    def nothing():
        calls["nothing"] += 1

    def sleep():
        calls["sleep"] += 1
        time.sleep(0.005)

    idle = timing.lockstep_idle([nothing, sleep], rounds=4, warmup=2)
    assert calls == {"nothing": 6, "sleep": 6}
    assert 0.3 <= idle < 1.0
    with pytest.raises(ValueError, match="at least 2 works, got 1"):
        timing.lockstep_idle([nothing])

    def fails():
        raise KeyError("the third work")
    with pytest.raises(KeyError, match="the third work"):  # raised here, no thread left waiting
        timing.lockstep_idle([nothing, sleep, fails], rounds=2)


def test_ceiling_is_measured_here_and_the_command_refuses_a_busy_verdict():
    measured = timing.measure_ceiling(n=64, repeat=1)
    assert measured.value > 0 and (measured.others is None or measured.others >= 0)
    with pytest.raises(ValueError, match="n must be"):
        timing.measure_ceiling(n=0)
    # no machine reaches a ratio of 100: the command must say busy and exit 1
    proc = subprocess.run([sys.executable, "-m", "accel", "ceiling", "--require", "100",
                           "--attempts", "1"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.startswith("ceiling: ") and "this machine is busy" in proc.stderr


def test_regression_is_reproducible_and_learnable():
    x, y, w = datasets.regression(n=256, features=4, noise=0.0, seed=1)
    x2, _, _ = datasets.regression(n=256, features=4, noise=0.0, seed=1)
    assert x.dtype == np.float32 and x.shape == (256, 4) and y.shape == (256, 1)
    np.testing.assert_array_equal(x, x2)
    w_fit = np.linalg.lstsq(x, y, rcond=None)[0]
    np.testing.assert_allclose(w_fit, w, atol=1e-4)


def test_classification_shapes_and_errors():
    x, labels = datasets.classification(n=100, features=3, classes=5)
    assert x.shape == (100, 3) and labels.dtype == np.int32 and set(labels) <= set(range(5))
    with pytest.raises(ValueError, match="classes must be >= 2"):
        datasets.classification(classes=1)
    with pytest.raises(ValueError, match="n and features"):
        datasets.regression(n=0)


def test_mlp_and_keras_mlp_agree_forward_and_gradient():
    sizes = [4, 8, 3]
    params = [tf.Variable(p) for p in models.mlp_init(sizes, seed=2)]
    model = models.keras_mlp(sizes, seed=2)
    x = tf.constant(np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32))
    with tf.GradientTape(persistent=True) as tape:
        ours = tf.reduce_sum(models.mlp_apply(params, x) ** 2)
        theirs = tf.reduce_sum(model(x) ** 2)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5)
    for g1, g2 in zip(tape.gradient(ours, params), tape.gradient(theirs, model.trainable_variables),
                      strict=True):
        np.testing.assert_allclose(g1.numpy(), g2.numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="sizes must list"):
        models.mlp_init([4])
    with pytest.raises(ValueError, match="alternate weight, bias"):
        models.mlp_apply(params[:1], x)


def test_viz_helpers():
    fig = viz.bars({"a": 2.0, "b": 4.0}, "time", baseline="a")
    assert [round(p.get_height(), 2) for p in fig.axes[0].patches] == [1.0, 2.0]
    fig = viz.curves({"loss": [3, 2, 1]}, "step", "loss", logy=True)
    assert fig.axes[0].get_yscale() == "log"
    fig = viz.timeline([("dev0", 0, 1, "F0"), ("dev1", 1, 2, "F0")])
    assert len(fig.axes[0].patches) == 2
    with pytest.raises(ValueError, match="end 0 < start 1"):
        viz.timeline([("dev0", 1, 0, "F0")])
    with pytest.raises(ValueError, match="baseline 'z'"):
        viz.bars({"a": 1.0}, "x", baseline="z")


def test_max_difference():
    a = [np.zeros((2, 2)), np.array([1.0, 2.0])]
    assert models.max_difference(a, [np.zeros((2, 2)), np.array([1.0, 2.5])]) == 0.5
    assert models.max_difference([tf.Variable([3.0])], [np.array([3.0])]) == 0.0
    assert models.max_difference([], []) == 0.0
    with pytest.raises(ValueError, match="length: 2 vs 1"):
        models.max_difference(a, a[:1])
    with pytest.raises(ValueError, match=r"weight 0: shapes differ, \(2, 2\) vs \(4,\)"):
        models.max_difference(a, [np.zeros(4), a[1]])


def test_import_accel_course_turns_onednn_off_unless_set():
    run_python = procs.run_python
    show = "import accel.course; import os; print(os.environ['TF_ENABLE_ONEDNN_OPTS'])"
    unset = "import os; os.environ.pop('TF_ENABLE_ONEDNN_OPTS', None); "
    assert run_python(unset + show).split()[-1] == "0"
    assert run_python(show, env={"TF_ENABLE_ONEDNN_OPTS": "1"}).split()[-1] == "1"


@pytest.mark.slow  # a fresh interpreter importing every module
def test_the_library_changes_nothing_global():
    """Importing every library module (all but accel.course) leaves the environment and the
    device configuration as they were, and prints nothing."""
    code = (
        "import os, sys, io, contextlib, importlib, json, pathlib\n"
        "for k in ('TF_CPP_MIN_LOG_LEVEL', 'TF_ENABLE_ONEDNN_OPTS'): os.environ.pop(k, None)\n"
        "before = dict(os.environ)\n"
        "import accel\n"
        "root = pathlib.Path(accel.__file__).parent\n"  # walk_packages would import packages
        "names = sorted('.'.join(('accel',) + p.relative_to(root).with_suffix('').parts)\n"
        "               .removesuffix('.__init__') for p in root.rglob('*.py')\n"
        "               if p.relative_to(root).parts[0] not in ('course', '__main__.py'))\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    for name in names: importlib.import_module(name)\n"
        "import tensorflow as tf\n"
        "changed = sorted(k for k in set(before) | set(os.environ)\n"
        "                 if before.get(k) != os.environ.get(k))\n"
        "print(json.dumps({'n': len(names), 'changed': changed, 'printed': out.getvalue(),\n"
        "    'logical': len(tf.config.list_logical_devices('CPU')),\n"
        "    'course': 'accel.course' in sys.modules}))\n")
    got = json.loads(procs.run_python(code, quiet_tensorflow=False).strip().splitlines()[-1])
    assert got["n"] > 40 and not got["course"]
    assert got["changed"] == [] and got["printed"] == ""
    assert got["logical"] == 1  # no setup(): the CPU is not split


def test_checks_name_the_value():
    assert checks.positive_int("steps", 3) == 3
    for bad in (0, -1, 2.5, True, "3"):
        with pytest.raises(ValueError, match=rf"steps must be an int >= 1, got {bad!r}"):
            checks.positive_int("steps", bad)
    assert checks.non_negative_int("k", 0) == 0
    assert checks.positive_number("lr", np.float32(0.5)) == 0.5
    with pytest.raises(ValueError, match="lr must be a number > 0, got 0"):
        checks.positive_number("lr", 0)
    with pytest.raises(ValueError, match=r"mode must be one of \['a', 'b'\], got 'c'"):
        checks.one_of("mode", "c", ("b", "a"))
    assert checks.learning_rate(np.float32(0.1)) == pytest.approx(0.1)
    assert checks.learning_rate(tf.keras.optimizers.SGD(0.1)) is None
    for bad in (True, 0.0, -1):
        with pytest.raises(ValueError, match="a learning rate must be a number > 0"):
            checks.learning_rate(bad)


def test_make_update_accepts_numpy_rates_and_refuses_the_rest():
    v = tf.Variable([1.0, 2.0])
    training.make_update(np.float32(0.5), [v])([(tf.constant([2.0, 2.0]), v)])
    np.testing.assert_allclose(v.numpy(), [0.0, 1.0])  # 1 - 0.5*2, 2 - 0.5*2
    training.make_update(1, [v])([(None, v)])  # a None gradient is skipped
    np.testing.assert_allclose(v.numpy(), [0.0, 1.0])
    with pytest.raises(ValueError, match="a learning rate must be a number > 0, got True"):
        training.make_update(True, [v])
    with pytest.raises(ValueError, match="must be a learning rate .* got str"):
        training.make_update("fast", [v])
    np.testing.assert_allclose(training.squared_error(tf.constant([[1.0, 2.0], [0.0, 0.0]]),
                                                      tf.constant([[0.0, 0.0], [0.0, 3.0]])),
                               [2.5, 4.5])  # (1 + 4) / 2, 9 / 2


def test_run_python_returns_stdout_and_reports_failures_and_timeouts():
    assert procs.run_python("print(6 * 7)").strip() == "42"
    assert procs.run_python("import os; print(os.environ['X'])", env={"X": "y"}).strip() == "y"
    with pytest.raises(procs.ChildFailed, match=r"exit 3"):
        procs.run_python("import sys; sys.exit(3)")
    with pytest.raises(procs.ChildFailed, match="ran past its 0.5 s timeout"):
        procs.run_python("import time; time.sleep(30)", timeout=0.5)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        procs.run_python("pass", timeout=0)




def test_lockstep_floor_runs_each_work_on_its_device(four_devices):
    """The TensorFlow works of measure_lockstep_floor run on the device each was made for: the
    result of a work's call lands on it (a function traced without the device scope ran on the
    default device, CPU:0, for both)."""
    x, w = np.ones((4, 8), np.float32), np.eye(8, dtype=np.float32)
    for device in four_devices[:2]:
        out = timing._tf_chain(device, x, w, layers=2)()
        assert tf.DeviceSpec.from_string(out.device) == tf.DeviceSpec.from_string(
            device).replace(job="localhost", replica=0, task=0)
        np.testing.assert_array_equal(out.numpy(), x)  # ReLU(x I) twice: x
    floor = timing.measure_lockstep_floor(four_devices[:2], rows=4, width=8, layers=2, rounds=2)
    assert set(floor) == {"tensorflow", "numpy"} and all(0 <= v < 1 for v in floor.values())
