"""The servers the serving protocol times, as subprocesses: what each one's command line is,
starting one on a free loopback port, waiting until it answers `/health`, and stopping it
(its whole process group) whatever happened in between.

Every server gets the same model file, the same threads, a context large enough for every
prompt and room for the protocol's highest concurrency. llama-server is the binary that
`scripts/setup/install_llamacpp.sh` builds next to the virtualenv's Python; a missing one makes
its servers unavailable (`engine.Unavailable`), as for the in-process peers.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from quasar.bench.engine import Unavailable

HOST = "127.0.0.1"
LOG_TAIL_CHARS = 2000
STOP_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1
try:
    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:
    _LIBC = None


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the bench dies, even by SIGKILL, which no
    finally in the bench could handle (Linux only; a server elsewhere relies on stop())."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM (e.g. `timeout`, a job scheduler) raises KeyboardInterrupt while inside, so the
    finally blocks that stop the servers run; Python's default would exit without them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@dataclass(frozen=True)
class ServerSpec:
    """One server configuration: `argv(port)` is its whole command line; `flags` are the
    options that make it this configuration (the report names them)."""
    name: str
    kind: str  # "quasar" or "llama-server"
    base: tuple[str, ...]  # the command up to, but without, the port
    flags: tuple[str, ...] = ()
    port_flag: str = "--port"

    def argv(self, port: int) -> list[str]:
        return [*self.base, self.port_flag, str(port), *self.flags]

    def command_line(self) -> str:
        """The command as the report shows it (the port is picked per start)."""
        return " ".join(shlex.quote(a) for a in self.argv(0)).replace(f"{self.port_flag} 0", f"{self.port_flag} PORT")


def default_llama_server() -> Path:
    """Where scripts/setup/install_llamacpp.sh installs llama-server: beside this Python (the
    virtualenv's bin folder; the link itself, not the interpreter it points to)."""
    return Path(sys.executable).parent / "llama-server"


def check_llama_server(path: str | Path | None) -> Path:
    """The llama-server binary to run, or Unavailable saying why not."""
    binary = Path(path).expanduser() if path else default_llama_server()
    if not binary.is_file():
        raise Unavailable(f"no llama-server at {binary} (bash scripts/setup/install_llamacpp.sh builds it)")
    if not os.access(binary, os.X_OK):
        raise Unavailable(f"{binary} is not executable")
    return binary


def llama_server_version(binary: Path) -> str | None:
    """`llama-server --version`'s line naming the build, or None if it says nothing usable."""
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip().startswith("version")]
    return lines[0] if lines else None


def quasar_spec(model: str, threads: int, extra: tuple[str, ...] = ()) -> ServerSpec:
    """`quasar serve` with its defaults (plus `extra`, for a user who asks), on this model."""
    base = (sys.executable, "-m", "quasar", "serve", "--model", model, "--host", HOST, "--threads", str(threads),
            "--log-level", "warning")
    return ServerSpec("quasar serve", "quasar", base, tuple(extra))


def llama_spec(name: str, binary: Path, gguf: Path, threads: int, slot_context: int, parallel: int,
               flags: tuple[str, ...] = ()) -> ServerSpec:
    """llama-server on the GGUF with `parallel` slots of `slot_context` tokens each (without a
    unified KV cache, `-c` is split evenly between the slots)."""
    base = (str(binary), "-m", str(gguf), "--host", HOST, "-t", str(threads), "-tb", str(threads),
            "-c", str(slot_context * parallel), "--parallel", str(parallel))
    return ServerSpec(name, "llama-server", base, tuple(flags))


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    """(status, body) of a GET; status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback, our own URL)
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {}
    except (OSError, ValueError):
        return 0, {}


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((HOST, port)) == 0


@dataclass
class RunningServer:
    """A started server: its process (leader of its own process group), port and log."""
    spec: ServerSpec
    proc: subprocess.Popen
    port: int
    log_path: Path
    startup_s: float = 0.0
    model_id: str = ""
    _log: object = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log_tail(self) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text[-LOG_TAIL_CHARS:].strip()

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL after a grace period; waits for the leader."""
        for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        if self._log is not None:
            self._log.close()
            self._log = None


def start_server(spec: ServerSpec, log_path: Path, ready_timeout_s: float) -> RunningServer:
    """Start `spec` on a free port and wait until `/health` says 200 and `/v1/models` names
    the model; the server is stopped again if it never gets there."""
    port = free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")  # noqa: SIM115 (closed by RunningServer.stop)
    log.write(f"$ {' '.join(spec.argv(port))}\n".encode())
    log.flush()
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(spec.argv(port), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_die_with_parent)
    except OSError as e:
        log.close()
        raise Unavailable(f"cannot start {spec.argv(port)[0]}: {e.strerror or e}") from None
    server = RunningServer(spec, proc, port, log_path, _log=log)
    try:
        server.model_id = _wait_ready(server, ready_timeout_s)
    except BaseException:
        server.stop()
        raise
    server.startup_s = time.perf_counter() - t0
    return server


def _wait_ready(server: RunningServer, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise Unavailable(f"{server.spec.name} exited with status {server.proc.returncode} before it was "
                              f"ready; its log ends: {server.log_tail()[-500:]}")
        status, _ = get_json(server.base_url + "/health", timeout=2.0)
        if status == 200:
            status, models = get_json(server.base_url + "/v1/models", timeout=10.0)
            ids = [m.get("id") for m in models.get("data", []) if m.get("id")]
            if status == 200 and ids:
                return ids[0]
        time.sleep(0.25)
    raise Unavailable(f"{server.spec.name} was not ready within {timeout_s:.0f} s (log: {server.log_path})")
