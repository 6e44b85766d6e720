"""accel.procs.start_python: background children in their own process group, their output,
a bounded wait, and a stop that ends grandchildren too (checked through /proc and signals)."""

import os
import time

import pytest

from accel import procs


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_output_exit_code_and_env():
    with procs.start_python(["-c", "import os, sys; print(os.environ['X']); "
                             "print('e', file=sys.stderr); sys.exit(4)"], env={"X": "hi"}) as c:
        assert c.wait(60) == 4
        assert c.output() == ("hi\n", "e\n")
        assert not c.alive()


def test_reading_the_output_while_the_child_writes_loses_nothing():
    """The caller polls ``output()`` while the child prints (chapter 10's coordinator is read
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
