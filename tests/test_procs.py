"""accel.procs.start_python: background children in their own process group, their output,
a bounded wait, and a stop that ends grandchildren too (checked through /proc and signals)."""

import json
import os
import time
from pathlib import Path

import pytest

from accel import procs

ROOT = Path(__file__).resolve().parents[1]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("warm", [True, False])
def test_output_exit_code_and_env(warm):
    with procs.start_python(["-c", "import os, sys; print(os.environ['X']); "
                             "print('e', file=sys.stderr); sys.exit(4)"], env={"X": "hi"},
                            warm=warm) as c:
        assert c.wait(60) == 4
        assert c.output() == ("hi\n", "e\n")
        assert not c.alive()


def test_reading_the_output_while_the_child_writes_loses_nothing():
    """The caller polls ``output()`` while the child prints (chapter 12's coordinator is read
    that way); every line must come back intact and in order."""
    code = "import time\nfor i in range(300):\n    print(f'line {i}', flush=True)\n" \
           "    time.sleep(0.001)"
    with procs.start_python(["-c", code]) as c:
        while c.alive():
            c.output()
        assert c.wait(60) == 0
        assert c.output()[0] == "".join(f"line {i}\n" for i in range(300))


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
def test_stop_ends_the_child_and_its_own_children_and_timeouts_stop_it():
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(300)']); print(p.pid, flush=True); time.sleep(300)")
    child = procs.start_python(["-c", code], name="sleeper")
    try:
        end = time.monotonic() + 60
        while not child.output()[0] and time.monotonic() < end:
            time.sleep(0.05)
        grandchild = int(child.output()[0])
        assert alive(child.pid) and alive(grandchild)
        with pytest.raises(procs.ChildFailed, match=r"sleeper \(pid \d+\) ran past its 0.2 s"):
            child.wait(0.2)
        time.sleep(0.2)
        assert not child.alive() and not alive(grandchild)
    finally:
        child.stop()
    child.stop()  # a second stop is harmless


def test_bad_args():
    with pytest.raises(ValueError, match="list of strings"):
        procs.start_python("-c print(1)")
    with pytest.raises(ValueError, match="'-m', MODULE or '-c', CODE"):
        procs.start_python(["script.py"])


# ------------------------------------------------------------------------------ warm starts
SHOW = ("import json, os, sys\n"
        "print(json.dumps({'ppid': os.getppid(), 'argv': sys.argv, 'cwd': os.getcwd(),\n"
        "                  'config': os.environ.get('TF_CONFIG'), 'main': __name__}))")


def shown(child: procs.Child) -> dict:
    assert child.wait(60) == 0, child.output()[1]
    return json.loads(child.output()[0])


@pytest.mark.skipif(not procs.warm_available(), reason="warm starts are Linux-only")
def test_a_warm_child_is_what_a_fresh_python_would_be(tmp_path):
    """Same argv, cwd, environment and ``__main__`` as ``python -c`` / ``python -m`` (checked
    against a fresh interpreter), but its parent is the template, shared by children whose
    environments differ only in variables read after import (TF_CONFIG)."""
    (tmp_path / "show_me.py").write_text(SHOW)
    os.chdir(tmp_path)
    try:
        runs = {}
        for warm in (True, False):
            for args, cfg in ((["-c", SHOW, "a", "b"], "1"), (["-m", "show_me", "x"], "2")):
                env = {"TF_CONFIG": cfg, "PYTHONPATH": str(tmp_path)}
                with procs.start_python(args, env=env, warm=warm) as c:
                    runs[warm, args[0]] = shown(c)
    finally:
        os.chdir(ROOT)
    for flag in ("-c", "-m"):
        warm, fresh = runs[True, flag], runs[False, flag]
        assert {k: v for k, v in warm.items() if k != "ppid"} == \
            {k: v for k, v in fresh.items() if k != "ppid"}
        assert fresh["ppid"] == os.getpid() and warm["ppid"] != os.getpid()
    assert runs[True, "-c"]["ppid"] == runs[True, "-m"]["ppid"]  # one template for both
    assert runs[True, "-c"]["argv"] == ["-c", "a", "b"]
    assert runs[True, "-m"]["argv"][1:] == ["x"] and runs[True, "-m"]["main"] == "__main__"


@pytest.mark.skipif(not procs.warm_available(), reason="warm starts are Linux-only")
def test_a_warm_child_starts_tensorflow_fresh_and_import_time_settings_get_their_own_template():
    """The template imported TensorFlow and ran nothing: a child can still split its CPU into
    logical devices, which TensorFlow refuses once its runtime has started (it says so in the
    second half of the child). A child asking for another C++ log level (read at import) gets
    a template of its own."""
    code = ("import os, tensorflow as tf\n"
            "cpu = tf.config.list_physical_devices('CPU')[0]\n"
            "one = tf.config.LogicalDeviceConfiguration()\n"
            "tf.config.set_logical_device_configuration(cpu, [one] * 3)\n"
            "print(len(tf.config.list_logical_devices('CPU')))\n"
            "try:\n"
            "    tf.config.set_logical_device_configuration(cpu, [one])\n"
            "except RuntimeError as e:\n"
            "    print('RuntimeError', e)\n"
            "print(os.getppid())")
    lines = procs.run_python(code, warm=True).splitlines()
    assert lines[0] == "3"
    assert lines[1].startswith("RuntimeError") and "cannot be modified" in lines[1]
    other = procs.run_python("import os; print(os.getppid())", warm=True,
                             env={"TF_CPP_MIN_LOG_LEVEL": "1"}).split()[-1]
    assert other != lines[2] and int(other) != os.getpid()


@pytest.mark.skipif(not procs.warm_available(), reason="warm starts are Linux-only")
def test_warm_children_fail_time_out_and_can_be_switched_off(monkeypatch):
    with pytest.raises(procs.ChildFailed, match=r"(?s)exit 1.*ValueError: boom"):
        procs.run_python("raise ValueError('boom')", warm=True)
    with pytest.raises(procs.ChildFailed, match=r"(?s)exit 1.*no way"):
        procs.run_python("import sys; sys.exit('no way')", warm=True)
    with pytest.raises(procs.ChildFailed, match="ran past its 0.5 s timeout"):
        procs.run_python("import time; time.sleep(30)", timeout=0.5, warm=True)
    monkeypatch.setenv(procs.WARM_ENV, "0")
    assert not procs.warm_available()
    assert procs.run_python("import os; print(os.getppid())", warm=True).strip() == \
        str(os.getpid())


def test_a_group_reports_then_is_stopped_together():
    """``report_and_linger`` keeps a worker alive after its report (its peers may still be
    pulling its last collective chunk); ``wait_for_reports`` returns once all have reported."""
    code = ("import sys, time; from accel.procs import report_and_linger; "
            "time.sleep(float(sys.argv[1])); print('noise'); "
            "report_and_linger({'rank': int(sys.argv[2]), 'xs': [1.5, 2]})")
    children = [procs.start_python(["-c", code, delay, str(rank)], name=f"w{rank}")
                for rank, delay in enumerate(("0.0", "0.5"))]
    try:
        reports = procs.wait_for_reports(children, timeout=60)
        assert reports == [{"rank": 0, "xs": [1.5, 2]}, {"rank": 1, "xs": [1.5, 2]}]
        assert all(c.alive() for c in children)  # lingering until stopped
    finally:
        for c in children:
            c.stop(grace=1.0)
    assert not any(c.alive() for c in children)


def test_waiting_for_reports_fails_clearly():
    silent = procs.start_python(["-c", "import sys; print('oops', file=sys.stderr)"],
                                name="silent")
    slow = procs.start_python(["-c", "import time; time.sleep(60)"], name="slow")
    try:
        with pytest.raises(procs.ChildFailed, match="silent exited .code 0. without a report"
                                                    "(.|\n)*oops"):
            procs.wait_for_reports([silent], timeout=60)
        with pytest.raises(procs.ChildFailed, match="no report from slow within 0.5 s"):
            procs.wait_for_reports([slow], timeout=0.5)
    finally:
        slow.stop(grace=0.0)


def _local():
    return None


def test_a_function_travels_by_its_import_path():
    from accel.models import mlp_apply

    assert procs.function_path(mlp_apply) == "accel.models:mlp_apply"
    assert procs.load_function("accel.models:mlp_apply") is mlp_apply
    assert procs.load_function(procs.function_path(os.path.join)) is os.path.join
    for bad in (lambda x: x, _local.__call__, None, 3):
        with pytest.raises(ValueError, match="model_fn must be a function defined at the top"):
            procs.function_path(bad, "model_fn")


@pytest.mark.skipif(not procs.warm_available(), reason="warm starts are Linux-only")
def test_a_launcher_that_dies_without_its_exit_handlers_leaves_no_folder_behind():
    """A killed kernel or test worker runs no atexit handler: the template sees its stdin close
    and removes the folder of its children's output files itself."""
    launcher = ("import os\n"
                "from accel import procs\n"
                "procs.run_python('print(1)', warm=True)\n"
                "print(next(iter(procs._TEMPLATES.values())).dir, flush=True)\n"
                "os._exit(0)  # as a killed process: no exit handler runs\n")
    folder = Path(procs.run_python(launcher, warm=False).split()[-1])
    end = time.monotonic() + 30
    while folder.exists() and time.monotonic() < end:
        time.sleep(0.05)
    assert not folder.exists()
