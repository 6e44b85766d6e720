"""The one way the package starts a fresh Python: some things (visible GPUs, thread pools, the
CPU allocator, logical devices) are fixed once TensorFlow has started, so showing them needs a
new process. Every child gets a timeout and is killed if it outlives it.

``run_python`` runs code to completion; ``start_python`` starts a long-lived child (a cluster's
server, a client) in its own process group, which ``Child.stop()`` always ends."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile

__all__ = ["run_python", "ChildFailed", "Child", "start_python"]


class ChildFailed(RuntimeError):
    """A child Python exited with an error or ran past its timeout."""


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 120,
               quiet_tensorflow: bool = True) -> str:
    """Run ``code`` in a fresh interpreter and return its standard output.

    ``env`` is added to this process's environment (like a shell prefix); with
    ``quiet_tensorflow`` the child starts with ``TF_CPP_MIN_LOG_LEVEL=3`` unless ``env`` says
    otherwise. Raises ``ChildFailed`` with the end of the child's stderr if it exits non-zero,
    and after ``timeout`` seconds (the child is killed).
    """
    if not isinstance(code, str):
        raise ValueError(f"code must be a string of Python source, got {type(code).__name__}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    full_env = {**os.environ, **({"TF_CPP_MIN_LOG_LEVEL": "3"} if quiet_tensorflow else {}),
                **(env or {})}
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=full_env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ChildFailed(f"the child Python ran past its {timeout:g} s timeout and was "
                          "killed") from exc
    if proc.returncode != 0:
        raise ChildFailed(f"the child Python failed (exit {proc.returncode}):\n"
                          f"{proc.stderr[-3000:]}")
    return proc.stdout


class Child:
    """A Python started in the background by ``start_python``, in its own process group.

    Its standard output and error go to temporary files (a pipe nobody reads can fill up and
    block the child); ``output()`` reads them. ``stop()`` ends the whole group (the child and
    anything it started): SIGTERM, then SIGKILL after ``grace`` seconds. Use it as a context
    manager, or call ``stop()`` in a ``finally``: it is safe to call twice.
    """

    def __init__(self, args: list[str], env: dict[str, str], name: str) -> None:
        self.name = name
        self.args = list(args)
        self._out = tempfile.TemporaryFile(mode="w+b")
        self._err = tempfile.TemporaryFile(mode="w+b")
        self.popen = subprocess.Popen([sys.executable, *args], stdout=self._out,
                                      stderr=self._err, stdin=subprocess.DEVNULL, env=env,
                                      start_new_session=True)

    @property
    def pid(self) -> int:
        """The child's process id (also its process group id)."""
        return self.popen.pid

    def alive(self) -> bool:
        """True while the child runs."""
        return self.popen.poll() is None

    def output(self) -> tuple[str, str]:
        """``(stdout, stderr)`` written so far."""
        texts = []
        for f in (self._out, self._err):
            # pread, not seek + read: the child writes through the same open file, so moving
            # its offset back to 0 would make the child overwrite what it wrote before
            fd = f.fileno()
            texts.append(os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace"))
        return texts[0], texts[1]

    def wait(self, timeout: float) -> int:
        """The exit code; ``ChildFailed`` (and the child stopped) if it runs past ``timeout``."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            self.stop()
            raise ChildFailed(f"{self.name} (pid {self.pid}) ran past its {timeout:g} s "
                              f"timeout and was stopped") from exc

    def stop(self, grace: float = 3.0) -> None:
        """End the child's process group: SIGTERM, then SIGKILL after ``grace`` seconds."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            if self.popen.poll() is not None:
                break
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.popen.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # whatever the child left in its group

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_python(args: list[str], env: dict[str, str] | None = None, name: str = "child",
                 quiet_tensorflow: bool = True) -> Child:
    """Start ``python ARGS...`` (e.g. ``["-m", "accel.distributed.cluster", "serve"]``) in the
    background and return its ``Child``; the caller must ``stop()`` it (a ``with`` block does).
    ``env`` and ``quiet_tensorflow`` work as in ``run_python``; ``name`` appears in errors."""
    if isinstance(args, str) or not all(isinstance(a, str) for a in args):
        raise ValueError(f"args must be a list of strings, got {args!r}")
    full_env = {**os.environ, **({"TF_CPP_MIN_LOG_LEVEL": "3"} if quiet_tensorflow else {}),
                **(env or {})}
    return Child(args, full_env, name)
