"""``accel.course.run_folder``: one folder per name, user and process, emptied at every call;
the folders of ended processes removed."""

import os
import subprocess
import sys
import tempfile

import pytest

import accel.course


def test_run_folder_is_made_empty_and_ended_processes_folders_go(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = accel.course.run_folder("test-dump")
    parent = tmp_path / f"accel-test-dump-{os.getuid()}"
    assert path == str(parent / str(os.getpid())) and os.listdir(path) == []
    with open(os.path.join(path, "left.txt"), "w") as f:
        f.write("from the last run")
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True).stdout.strip()
    (parent / ended).mkdir()
    (parent / ended / "old.txt").write_text("an ended process's dump")
    (parent / "1").mkdir()  # init, always alive: another process's folder stays
    (parent / "stray.txt").write_text("left by an older layout")
    assert accel.course.run_folder("test-dump") == path and os.listdir(path) == []
    assert sorted(os.listdir(parent)) == sorted(["1", str(os.getpid())])


def test_run_folder_refuses_a_linked_parent(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / f"accel-linked-{os.getuid()}")
    with pytest.raises(ValueError, match="is a link or belongs to another user"):
        accel.course.run_folder("linked")


@pytest.mark.parametrize("name", ["", "a/b"])
def test_run_folder_refuses_a_name_that_is_not_one_folder(name):
    with pytest.raises(ValueError, match="give a non-empty folder name"):
        accel.course.run_folder(name)
