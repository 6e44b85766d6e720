"""``accel.course.run_folder``: one folder per name and user, emptied at every call."""

import os
import tempfile

import pytest

import accel.course


def test_run_folder_is_made_empty_under_the_temporary_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = accel.course.run_folder("test-dump")
    assert path == str(tmp_path / f"accel-test-dump-{os.getuid()}") and os.listdir(path) == []
    with open(os.path.join(path, "left.txt"), "w") as f:
        f.write("from the last run")
    assert accel.course.run_folder("test-dump") == path and os.listdir(path) == []
    assert os.listdir(tmp_path) == [os.path.basename(path)]


@pytest.mark.parametrize("name", ["", "a/b"])
def test_run_folder_refuses_a_name_that_is_not_one_folder(name):
    with pytest.raises(ValueError, match="give a non-empty folder name"):
        accel.course.run_folder(name)
