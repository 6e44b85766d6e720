"""The one way the package starts a fresh Python: some things (visible GPUs, thread pools, the
CPU allocator, logical devices) are fixed once TensorFlow has started, so showing them needs a
new process. Every child gets a timeout and is killed if it outlives it.

``run_python`` runs code to completion; ``start_python`` starts a long-lived child (a cluster's
server, a client) in its own process group, which ``Child.stop()`` always ends.

**Warm starts.** Importing TensorFlow costs a process about five seconds of CPU, and a cluster
of three tasks on a two-core laptop pays it three times before it can answer. Yet a task does
not need a fresh *import*: what it needs fresh is TensorFlow's *runtime* (devices, thread pools,
the allocator, ``TF_CONFIG``, ``cuInit``), which starts at the first op or device listing, not
at import. So a child started ``warm`` is forked from a *template*: a Python that has imported
TensorFlow and run nothing (``python -m accel.procs template``). The fork gets its own session,
its environment and arguments, and runs ``-m module`` or ``-c code`` exactly as a fresh
interpreter would, in milliseconds. ``start_python`` starts warm by default (every caller in
the package runs a cluster task or a client); ``run_python`` only when asked (``warm=True``),
since some children exist to show what happens *at* import. A template is started on first
use, one per import-time environment (variables such as ``TF_CPP_MIN_LOG_LEVEL`` or
``PYTHONHASHSEED`` that Python or TensorFlow read while importing; a child whose environment
differs only in variables read later, such as ``TF_CONFIG`` or ``CUDA_VISIBLE_DEVICES``,
shares the template). It lives until this process exits. ``ACCEL_WARM_START=0`` in the
environment (or a platform other than Linux) starts every child as a fresh ``python``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ["run_python", "ChildFailed", "Child", "start_python", "prewarm", "WARM_ENV",
           "RUNTIME_ENV", "warm_available", "template_main", "report_and_linger",
           "wait_for_reports", "REPORT_PREFIX", "function_path", "load_function"]

WARM_ENV = "ACCEL_WARM_START"
# read only after import (at the first op, device listing or cluster use): a child may differ
# from its template in these; any other variable of these prefixes may be read at import
RUNTIME_ENV = frozenset({"TF_CONFIG", "CUDA_VISIBLE_DEVICES", "TF_CPU_ALLOCATOR_USE_BFC",
                         "TF_FORCE_GPU_ALLOW_GROWTH", "ACCEL_PORT_RANGE", "ACCEL_RUN_ID",
                         "ACCEL_SAVE_FIGURES"})
_IMPORT_TIME_PREFIXES = ("PYTHON", "TF_", "KERAS", "LD_", "OMP_", "OPENBLAS", "MKL", "MPL",
                         "CUDA", "XLA", "NVIDIA", "ACCEL", "HOME", "PATH", "TMPDIR", "LANG",
                         "LC_", "VIRTUAL_ENV")


class ChildFailed(RuntimeError):
    """A child Python exited with an error or ran past its timeout."""


def _full_env(env: dict[str, str] | None, quiet_tensorflow: bool) -> dict[str, str]:
    return {**os.environ, **({"TF_CPP_MIN_LOG_LEVEL": "3"} if quiet_tensorflow else {}),
            **(env or {})}


def warm_available() -> bool:
    """Whether children can start warm here (Linux, ``ACCEL_WARM_START`` not ``0``)."""
    return sys.platform.startswith("linux") and os.environ.get(WARM_ENV, "1") != "0"


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 120,
               quiet_tensorflow: bool = True, warm: bool = False) -> str:
    """Run ``code`` in a fresh interpreter and return its standard output.

    ``env`` is added to this process's environment (like a shell prefix); with
    ``quiet_tensorflow`` the child starts with ``TF_CPP_MIN_LOG_LEVEL=3`` unless ``env`` says
    otherwise. ``warm=True`` forks the child from a template that has already imported
    TensorFlow (see the module's doc): use it when the child needs a fresh runtime, not a fresh
    import. Raises ``ChildFailed`` with the end of the child's stderr if it exits non-zero,
    and after ``timeout`` seconds (the child is killed).
    """
    if not isinstance(code, str):
        raise ValueError(f"code must be a string of Python source, got {type(code).__name__}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    full_env = _full_env(env, quiet_tensorflow)
    if warm and warm_available():
        with Child(["-c", code], full_env, "the child Python", warm=True) as child:
            try:
                returncode = child.wait(timeout)
            except ChildFailed as exc:
                raise ChildFailed(f"the child Python ran past its {timeout:g} s timeout and "
                                  "was killed") from exc
            out, err = child.output()
        if returncode != 0:
            raise ChildFailed(f"the child Python failed (exit {returncode}):\n{err[-3000:]}")
        return out
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


class _Forked:
    """The part of ``subprocess.Popen`` that ``Child`` uses, for a child forked by a template
    (not this process's own child: the template reaps it and writes its exit code to a file)."""

    def __init__(self, pid: int, status_path: str, template: _Template) -> None:
        self.pid, self._status, self._template = pid, status_path, template
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(FileNotFoundError, ValueError):
                with open(self._status) as f:
                    self.returncode = int(f.read())
            if self.returncode is None and not self._template.alive():
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:
                    self.returncode = -signal.SIGKILL  # gone, and nobody left to say how
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode


class _Template:
    """A ``python -m accel.procs template`` that has imported TensorFlow and forks children on
    request (one JSON line each way over its stdin / stdout)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.dir = tempfile.mkdtemp(prefix="accel-warm-")
        self._lock = threading.Lock()
        self._count = itertools.count()
        self.popen = subprocess.Popen([sys.executable, "-m", "accel.procs", "template", self.dir],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, env=env, text=True,
                                      start_new_session=True)
        said = []
        while True:  # anything an import printed on stdout comes before "ready"
            line = self.popen.stdout.readline()
            if line.strip() == "ready":
                break
            said.append(line)
            if not line or len(said) > 100:
                self.close()
                raise ChildFailed(f"the warm-start template did not start: {''.join(said)!r}")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def spawn(self, args: list[str], env: dict[str, str]) -> tuple[_Forked, str, str]:
        with self._lock:
            base = os.path.join(self.dir, str(next(self._count)))
            paths = {k: f"{base}.{k}" for k in ("out", "err", "rc")}
            for k in ("out", "err"):
                open(paths[k], "wb").close()
            self.popen.stdin.write(json.dumps({"args": args, "env": env, "cwd": os.getcwd(),
                                               **paths}) + "\n")
            self.popen.stdin.flush()
            reply = json.loads(self.popen.stdout.readline() or "{}")
        if "pid" not in reply:
            raise ChildFailed(f"the warm-start template could not fork: {reply!r}")
        return _Forked(reply["pid"], paths["rc"], self), paths["out"], paths["err"]

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.popen.stdin.close()
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_TEMPLATES: dict[tuple, _Template] = {}
_TEMPLATES_LOCK = threading.Lock()


def _import_key(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items()
                        if k.startswith(_IMPORT_TIME_PREFIXES) and k not in RUNTIME_ENV))


def _template_for(env: dict[str, str]) -> _Template:
    key = _import_key(env)
    with _TEMPLATES_LOCK:
        template = _TEMPLATES.get(key)
        if template is None or not template.alive():
            template = _TEMPLATES[key] = _Template(env)
        return template


def prewarm(env: dict[str, str] | None = None, quiet_tensorflow: bool = True) -> bool:
    """Start, in the background, the template that warm children with this ``env`` will fork
    from (``start_python``'s and ``run_python``'s defaults), so that the first one does not wait
    for its import. Call it early (a chapter's set-up cell, while this process imports
    TensorFlow itself): the two imports then share the machine's cores instead of following
    each other. Returns whether warm starts are available; a template that fails to start is
    reported by the first child that needs it."""
    if not warm_available():
        return False
    full_env = _full_env(env, quiet_tensorflow)

    def start() -> None:
        with contextlib.suppress(ChildFailed):
            _template_for(full_env)

    threading.Thread(target=start, name="accel-prewarm", daemon=True).start()
    return True


@atexit.register
def _close_templates() -> None:
    for template in _TEMPLATES.values():
        template.close()
    _TEMPLATES.clear()


class Child:
    """A Python started in the background by ``start_python``, in its own process group.

    Its standard output and error go to files (a pipe nobody reads can fill up and block the
    child); ``output()`` reads them. ``stop()`` ends the whole group (the child and anything it
    started): SIGTERM, then SIGKILL after ``grace`` seconds. Use it as a context manager, or
    call ``stop()`` in a ``finally``: it is safe to call twice. ``warm``: forked from a
    template that has imported TensorFlow (the module's doc), else a fresh ``python``.
    """

    def __init__(self, args: list[str], env: dict[str, str], name: str,
                 warm: bool = False) -> None:
        self.name = name
        self.args = list(args)
        self.warm = warm and warm_available()
        if self.warm:
            self.popen, self._out, self._err = _template_for(env).spawn(self.args, env)
        else:
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
            if isinstance(f, str):  # a warm child's files, written by the forked process
                with open(f, "rb") as g:
                    texts.append(g.read().decode(errors="replace"))
                continue
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
                 quiet_tensorflow: bool = True, warm: bool = True) -> Child:
    """Start ``python ARGS...`` (e.g. ``["-m", "accel.distributed.cluster", "serve"]``) in the
    background and return its ``Child``; the caller must ``stop()`` it (a ``with`` block does).
    ``env`` and ``quiet_tensorflow`` work as in ``run_python``; ``name`` appears in errors.
    ``warm`` (the default): forked from a template that has already imported TensorFlow, which
    saves the child the import (the module's doc); ``warm=False``: a fresh ``python``."""
    if isinstance(args, str) or not all(isinstance(a, str) for a in args):
        raise ValueError(f"args must be a list of strings, got {args!r}")
    if not args or args[0] not in ("-m", "-c") or len(args) < 2:
        raise ValueError(f"args must start with '-m', MODULE or '-c', CODE, got {args!r}")
    return Child(args, _full_env(env, quiet_tensorflow), name, warm=warm)


# ------------------------------------------------------------- a function sent to a child by name
def function_path(fn, what: str = "function") -> str:
    """``"module:qualname"`` of ``fn``, by which a child process imports it
    (``load_function``): ``ValueError`` naming ``fn`` unless it is a module-level function of a
    module a fresh Python can import (not ``__main__``, a notebook, a lambda or a closure)."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not callable(fn) or not module or not name or module == "__main__" or "<" in name:
        raise ValueError(f"{what} must be a function defined at the top level of an importable "
                         f"module (a child process imports it by name), got {fn!r}")
    try:
        found = load_function(f"{module}:{name}")
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} {fn!r} cannot be imported as {module}:{name}: {exc}") from exc
    if found is not fn:
        raise ValueError(f"{what} {fn!r}: {module}:{name} names another object")
    return f"{module}:{name}"


def load_function(path: str):
    """The function that ``function_path`` named ``path`` (``"module:qualname"``)."""
    module, _, name = path.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


# ------------------------------------------------------------- ending a collective group together
REPORT_PREFIX = "accel-report: "


def report_and_linger(result, limit: float = 600.0) -> None:
    """In a worker of a collective group (``MultiWorkerMirroredStrategy``, a ring): print
    ``result`` as one JSON line marked ``REPORT_PREFIX``, then wait to be stopped.

    A worker must not exit on its own once its last collective returns: collectives are pulled
    over gRPC, so a peer may still be fetching this worker's last chunk, and would fail with
    "Connection reset by peer" (seen when a fast worker exits first). The parent stops the
    whole group once every worker has reported (``wait_for_reports``). ``limit`` seconds, or
    the parent's exit, end the wait anyway."""
    print(REPORT_PREFIX + json.dumps(result), flush=True)
    parent, end = os.getppid(), time.monotonic() + limit
    while time.monotonic() < end and os.getppid() == parent:
        time.sleep(0.2)
    os._exit(0)


def wait_for_reports(children: list[Child], timeout: float) -> list:
    """Wait until every child has printed its report (``report_and_linger``); return them in
    order. ``ChildFailed`` if one exits without a report or ``timeout`` seconds pass. The
    caller stops the children (``Child.stop``) afterwards, whatever happens."""
    end = time.monotonic() + timeout
    reports: list = [None] * len(children)
    while True:
        for i, c in enumerate(children):
            if reports[i] is not None:
                continue
            alive = c.alive()  # read before the output: a report written just before exiting
            out, err = c.output()
            lines = [ln for ln in out.splitlines() if ln.startswith(REPORT_PREFIX)]
            if lines:
                reports[i] = json.loads(lines[-1][len(REPORT_PREFIX):])
            elif not alive:
                raise ChildFailed(f"{c.name} exited (code {c.popen.returncode}) without a "
                                  f"report:\n{err[-1500:]}")
        if all(r is not None for r in reports):
            return reports
        if time.monotonic() > end:
            missing = [c.name for c, r in zip(children, reports, strict=True) if r is None]
            raise ChildFailed(f"no report from {', '.join(missing)} within {timeout:g} s")
        time.sleep(0.05)


# ------------------------------------------------------------------------ the template itself
def _run_forked(request: dict) -> None:
    """In the forked child: become the program a fresh ``python ARGS`` would be, then exit."""
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, key in ((1, "out"), (2, "err")):
            target = os.open(request[key], os.O_WRONLY | os.O_APPEND)
            os.dup2(target, fd)
        sys.stdin = open(0, closefd=False)  # the child's own stdin
        sys.stdout = open(1, "w", closefd=False, buffering=1)
        sys.stderr = open(2, "w", closefd=False, buffering=1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        flag, target, *rest = request["args"]
        if flag == "-m":
            import runpy

            sys.argv = [target, *rest]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *rest]
            sys.path.insert(0, "")
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:  # reported as the interpreter would, then exit 1
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def template_main(work_dir: str) -> None:
    """``python -m accel.procs template WORK_DIR``: import TensorFlow, say ``ready``, then fork
    one child per request line until stdin closes; write each child's exit code when it ends.
    When stdin closes (the launcher closed it, or died without running its exit handlers, as a
    killed Jupyter kernel or test worker does) the template removes ``WORK_DIR``, the launcher's
    folder of the children's output files, so that no run leaves one behind in the temporary
    folder. Nothing here may run a TensorFlow op: a forked runtime would be shared, not fresh."""
    import tensorflow  # noqa: F401  (the import every child saves)

    print("ready", flush=True)
    status_paths: dict[int, str] = {}
    stdin = sys.stdin
    while True:
        while status_paths:  # reap whatever ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            path = status_paths.pop(pid, None)
            if path:
                with open(path + ".tmp", "w") as f:
                    f.write(str(os.waitstatus_to_exitcode(status)))
                os.replace(path + ".tmp", path)
        ready, _, _ = select.select([stdin], [], [], 0.02)
        if not ready:
            continue
        line = stdin.readline()
        if not line:  # the launcher closed the pipe (or died): children keep their sessions
            shutil.rmtree(work_dir, ignore_errors=True)
            return
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run_forked(request)
        status_paths[pid] = request["rc"]
        print(json.dumps({"pid": pid}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "template":
        template_main(sys.argv[2])
    else:
        raise SystemExit("usage: python -m accel.procs template WORK_DIR")
