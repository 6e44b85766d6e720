"""Every Python block of the README runs as written, in a fresh interpreter, in order."""

import re
from pathlib import Path

import pytest

from accel.procs import run_python

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    out = run_python("\n\n".join(blocks), timeout=300)
    assert "/device:GPU:1" in out and "['CPU:0', 'CPU:0', 'CPU:1', 'CPU:1']" in out
