"""`quasar bench --protocol serving`: the servers users run, timed through the OpenAI API.

Each server is started by the bench as a subprocess on a loopback port (serving_servers),
sent the bench's own prompts, streamed and greedy (temperature 0) with a fixed max_tokens,
at each concurrency (serving_client), and stopped. Each phase gets a freshly started server
with one warm-up request first (a prompt outside the timed set): a server must not find the
timed prompts, or what it generated for them, in its caches from an earlier phase (both
servers keep prompt caches, and llama-server's ngram-mod draft table is shared by all requests
of a process).

The servers take turns: for each concurrency, each server's phase, one after the other, so a
host whose speed drifts over minutes moves them alike; with `rounds` > 1 the order reverses
every other round and each server's requests of a concurrency are pooled over the rounds.

Servers: `quasar serve` with its defaults; llama-server plain, with `--spec-default`, and
with the n-gram configuration that decoded fastest in a short sweep (NGRAM_GRID at
concurrency 1 on a few of the prompts; the pick is by pooled decode rate, and named).
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quasar import __version__
from quasar.bench.bandwidth import measure_read_bandwidth
from quasar.bench.engine import Unavailable
from quasar.bench.runner import describe_cpu, gguf_source
from quasar.bench.serving_client import ServingPrompt, make_client, pool_phases, run_phase, stream_request
from quasar.bench.serving_servers import (check_llama_server, llama_server_version, llama_spec, quasar_spec,
                                          sigterm_as_interrupt, start_server)
from quasar.bench.tasks import task_prompts
from quasar.data.user_files import load_prompt_file
from quasar.errors import QuasarError

SCHEMA_VERSION = 1
SERVER_NAMES = ("quasar", "llama-server", "llama-server-spec-default", "llama-server-ngram")
DEFAULT_N = 5  # prompts per shipped task, as in the engine protocol
DEFAULT_CONCURRENCY = (1, 4)
LOGS_DIR = "serving-logs"
WARMUP = ServingPrompt("warm-up", "warm-up",
                       messages=({"role": "user", "content": "Write one sentence about the sea."},))
# The n-gram sweep: each llama.cpp draft-free mode with a short and a longer lookup / draft.
# ngram-simple and ngram-map-k: n = the n-gram looked up, m = the tokens drafted after it;
# ngram-mod: n-match = the n-gram looked up, n-min / n-max = the shortest draft it proposes
# and the longest (`--spec-default` is ngram-mod 24 / 48 / 64).
NGRAM_GRID: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ngram-simple n3 m8", ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                            "--spec-ngram-simple-size-m", "8")),
    ("ngram-simple n4 m16", ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
                             "--spec-ngram-simple-size-m", "16")),
    ("ngram-map-k n3 m8", ("--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "3",
                           "--spec-ngram-map-k-size-m", "8")),
    ("ngram-map-k n4 m16", ("--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "4",
                            "--spec-ngram-map-k-size-m", "16")),
    ("ngram-mod n8 min2 max16", ("--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "8",
                                 "--spec-ngram-mod-n-min", "2", "--spec-ngram-mod-n-max", "16")),
    ("ngram-mod n16 min4 max32", ("--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "16",
                                  "--spec-ngram-mod-n-min", "4", "--spec-ngram-mod-n-max", "32")),
)


@dataclass
class ServingConfig:
    model: str = "default"
    gguf: str | None = None  # llama-server's file (default: model, when it is a GGUF)
    threads: int | None = None  # every server's threads (default: torch's, i.e. the physical cores)
    tasks: list[str] = field(default_factory=lambda: ["code", "summarization", "qa", "math", "chat"])
    prompts_file: str | None = None
    n: int | None = None
    max_tokens: int = 128
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    servers: tuple[str, ...] = SERVER_NAMES
    rounds: int = 1  # phases per server and concurrency, taken in turns (see the module doc)
    sweep_prompts: int = 3
    sweep_grid: tuple[tuple[str, tuple[str, ...]], ...] = NGRAM_GRID
    llama_server: str | None = None  # default: serving_servers.default_llama_server()
    quasar_args: tuple[str, ...] = ()  # added to `quasar serve`'s command line
    slot_context: int = 4096  # llama-server's context per slot (it gets max(concurrency) slots)
    warmup: bool = True
    warmup_tokens: int = 16
    ready_timeout_s: float = 900.0  # a first `quasar serve` of a model builds its verifier
    bandwidth_bytes: int = 0  # 0: not measured
    out: str = "bench-results"
    command: str = ""

    def validate(self) -> "ServingConfig":
        bad = [s for s in self.servers if s not in SERVER_NAMES]
        if bad or not self.servers:
            raise QuasarError(f"unknown server(s) {', '.join(bad) or '(none)'}; choose from {', '.join(SERVER_NAMES)}")
        if not self.concurrency or any(isinstance(c, bool) or not isinstance(c, int) or c < 1
                                       for c in self.concurrency):
            raise QuasarError(f"--concurrency must be integers >= 1, got {self.concurrency!r}")
        for name, value in (("--max-new-tokens", self.max_tokens), ("sweep prompts", self.sweep_prompts),
                            ("--rounds", self.rounds),
                            ("--threads", self.threads or 1), ("--n", self.n or 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise QuasarError(f"{name} must be an integer >= 1, got {value!r}")
        if self.gguf and not (Path(self.gguf).expanduser().is_file() and self.gguf.lower().endswith(".gguf")):
            raise QuasarError(f"--gguf {self.gguf}: not a .gguf file", param="gguf")
        self.servers = tuple(dict.fromkeys(self.servers))
        self.concurrency = tuple(dict.fromkeys(self.concurrency))
        return self


def serving_prompts(cfg: ServingConfig) -> list[ServingPrompt]:
    """The engine protocol's prompts as requests: chat items as chat, the code task's raw
    text as a completion (a function to complete), other raw text as one user turn."""
    chosen = []
    if cfg.prompts_file:
        per_task: dict[str, int] = {}
        for i, item in enumerate(load_prompt_file(cfg.prompts_file)):
            task = item.category or "custom"
            if cfg.n is None or per_task.get(task, 0) < cfg.n:
                per_task[task] = per_task.get(task, 0) + 1
                chosen.append((task, item.id or f"{Path(cfg.prompts_file).name}:{i + 1}", item))
    else:
        for task in cfg.tasks:
            items = task_prompts(task, cfg.n or DEFAULT_N)
            chosen += [(task, item.id or f"{task}-{j}", item) for j, item in enumerate(items)]
    out = []
    for task, pid, item in chosen:
        if item.is_chat:
            out.append(ServingPrompt(str(pid), task, messages=tuple(item.messages)))
        elif task == "code":
            out.append(ServingPrompt(str(pid), task, text=item.text))
        else:
            out.append(ServingPrompt(str(pid), task, messages=({"role": "user", "content": item.text},)))
    return out


def new_record(spec) -> dict:
    """A server's record before its phases."""
    return {"label": spec.name, "kind": spec.kind, "flags": list(spec.flags), "status": "ok",
            "command": spec.command_line(), "processes": [], "phases": {}}


def time_phase(spec, record: dict, prompts: list[ServingPrompt], cfg: ServingConfig, log_path: Path,
               concurrency: int) -> dict | None:
    """One phase: a fresh server, a warm-up request, the prompts at `concurrency`, the server
    stopped (also on errors and Ctrl-C). Returns the phase, or None with `record`'s status
    saying why the server could not run it."""
    try:
        server = start_server(spec, log_path, cfg.ready_timeout_s)
    except Unavailable as e:
        record["status"] = f"unavailable: {e}"
        return None
    record["processes"].append({"concurrency": concurrency, "pid": server.proc.pid, "port": server.port,
                                "startup_s": round(server.startup_s, 2)})
    try:
        if cfg.warmup:
            stream_request(make_client(server.base_url), server.model_id, WARMUP,
                           min(cfg.warmup_tokens, cfg.max_tokens), time.perf_counter())
        phase = run_phase(server.base_url, server.model_id, prompts, cfg.max_tokens, concurrency)
        record["model_id"] = server.model_id
        return phase
    except QuasarError:
        raise
    except Exception as e:  # a peer's failure is its row's result, not the end of the bench
        record["status"] = f"failed at concurrency {concurrency}: {type(e).__name__}: {e} (log: {server.log_path})"
        return None
    finally:
        server.stop()


def time_server(spec, prompts: list[ServingPrompt], cfg: ServingConfig, log_dir: Path,
                concurrency: tuple[int, ...]) -> dict:
    """A server through every concurrency, one phase each (`time_phase`)."""
    record = new_record(spec)
    for c in concurrency:
        phase = time_phase(spec, record, prompts, cfg, log_dir / f"{_slug(spec.name)}-c{c}.log", c)
        if phase is None:
            break
        record["phases"][str(c)] = phase
    return record


def turns(names: list[str], concurrency: tuple[int, ...], rounds: int) -> list[tuple[int, int, str]]:
    """(round, concurrency, server) in the order the phases run: each concurrency's phases
    one server after the other, the servers' order reversed every other round."""
    out = []
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        out += [(r, c, name) for c in concurrency for name in order]
    return out


def sweep_ngram(cfg: ServingConfig, prompts: list[ServingPrompt], make_spec, log_dir: Path) -> dict:
    """Each NGRAM_GRID configuration at concurrency 1 on `cfg.sweep_prompts` of the prompts
    (spread over the set); the fastest by pooled decode rate is `best`."""
    k = min(cfg.sweep_prompts, len(prompts))
    subset = [prompts[i * len(prompts) // k] for i in range(k)]
    grid = []
    for label, flags in cfg.sweep_grid:
        rec = time_server(make_spec(f"llama-server {label}", flags), subset, cfg, log_dir / "sweep", (1,))
        phase = rec["phases"].get("1", {})
        grid.append({"label": label, "flags": list(flags), "status": rec["status"],
                     "pooled_decode_tokens_per_s": phase.get("pooled_decode_tokens_per_s"),
                     "median_decode_tokens_per_s": phase.get("median_decode_tokens_per_s"),
                     "completion_tokens": phase.get("completion_tokens")})
    ranked = [g for g in grid if g["pooled_decode_tokens_per_s"] is not None]
    best = max(ranked, key=lambda g: g["pooled_decode_tokens_per_s"]) if ranked else None
    return {"concurrency": 1, "prompts": [p.id for p in subset], "metric": "pooled decode tokens/s",
            "grid": grid, "best": best["label"] if best else None}


def _slug(name: str) -> str:
    """A label as a file name: "llama-server --spec-default" -> "llama-server-spec-default"."""
    return "-".join(part for part in re.split(r"[^A-Za-z0-9.]+", name) if part)


def _environment(cfg: ServingConfig, threads: int, binary: Path | None) -> dict:
    try:
        cpu = describe_cpu(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = None
    env = {"quasar": __version__, "cpu": cpu or platform.processor() or platform.machine(),
           "cpu_count": os.cpu_count(), "threads": threads, "python": platform.python_version(),
           "llama_server": str(binary) if binary else None,
           "llama_server_version": llama_server_version(binary) if binary else None}
    if cfg.bandwidth_bytes:
        env["bandwidth"] = measure_read_bandwidth(cfg.bandwidth_bytes, threads=threads)
    return env


def _llama_maker(cfg: ServingConfig, threads: int, gguf: Path | None, binary: Path | None):
    """(label, flags) -> the llama-server spec: the one GGUF, threads and context, one slot
    per request of the highest concurrency."""
    parallel = max(cfg.concurrency)
    return lambda label, flags: llama_spec(label, binary, gguf, threads, cfg.slot_context, parallel, flags)


def _run_servers(cfg: ServingConfig, prompts: list[ServingPrompt], threads: int, make_llama, why_not: str,
                 log_dir: Path) -> tuple[dict, dict | None]:
    """Every asked-for server through every phase, taking turns (`turns`; the n-gram sweep
    first): ({name: record}, the sweep)."""
    specs, servers, sweep = {}, {}, None
    for name in cfg.servers:
        if name == "quasar":
            spec = quasar_spec(cfg.model, threads, cfg.quasar_args)
        elif why_not:
            servers[name] = {"label": name, "kind": "llama-server", "status": f"unavailable: {why_not}"}
            continue
        elif name == "llama-server-ngram":
            sweep = sweep_ngram(cfg, prompts, make_llama, log_dir)
            if sweep["best"] is None:
                servers[name] = {"label": name, "kind": "llama-server",
                                 "status": "unavailable: no n-gram configuration of the sweep ran"}
                continue
            spec = make_llama(f"llama-server {sweep['best']}", dict(cfg.sweep_grid)[sweep["best"]])
        else:
            spec = make_llama("llama-server" + (" --spec-default" if name.endswith("spec-default") else ""),
                              ("--spec-default",) if name.endswith("spec-default") else ())
        specs[name], servers[name] = spec, new_record(spec)
    rounds: dict[str, dict[str, list]] = {name: {} for name in specs}
    for r, c, name in turns(list(specs), cfg.concurrency, cfg.rounds):
        record = servers[name]
        if record["status"] != "ok":
            continue
        log = log_dir / f"{_slug(record['label'])}-c{c}{f'-r{r + 1}' if r else ''}.log"
        phase = time_phase(specs[name], record, prompts, cfg, log, c)
        if phase is not None:
            rounds[name].setdefault(str(c), []).append(phase)
    for name, phases in rounds.items():
        servers[name]["phases"] = {c: pool_phases(ps) for c, ps in phases.items()}
        if cfg.rounds > 1:
            servers[name]["rounds"] = phases
    return {name: servers[name] for name in cfg.servers}, sweep


def run_serving(cfg: ServingConfig) -> dict:
    """Run the serving protocol; returns the content of serving.json."""
    cfg.validate()
    started = _dt.datetime.now(_dt.timezone.utc)
    prompts = serving_prompts(cfg)
    if not prompts:
        raise QuasarError("no prompts to send")
    threads = cfg.threads or torch.get_num_threads()
    gguf, why_no_gguf = gguf_source(cfg)
    binary, why_no_binary = None, ""
    if any(s != "quasar" for s in cfg.servers):
        try:
            binary = check_llama_server(cfg.llama_server)
        except Unavailable as e:
            why_no_binary = str(e)
    log_dir = Path(cfg.out) / LOGS_DIR
    make_llama = _llama_maker(cfg, threads, gguf, binary)
    with sigterm_as_interrupt():
        servers, sweep = _run_servers(cfg, prompts, threads, make_llama, why_no_gguf or why_no_binary, log_dir)
    finished = _dt.datetime.now(_dt.timezone.utc)
    return {
        "schema": SCHEMA_VERSION, "protocol": "serving", "command": cfg.command,
        "started": started.isoformat(timespec="seconds"), "finished": finished.isoformat(timespec="seconds"),
        "seconds": round((finished - started).total_seconds(), 1),
        "config": {"model": cfg.model, "gguf": str(gguf) if gguf else None, "threads": threads,
                   "prompts": len(prompts), "tasks": list(dict.fromkeys(p.task for p in prompts)),
                   "prompts_file": cfg.prompts_file, "max_tokens": cfg.max_tokens,
                   "concurrency": list(cfg.concurrency), "rounds": cfg.rounds, "temperature": 0, "stream": True,
                   "warmup": cfg.warmup,
                   "slot_context": cfg.slot_context, "quasar_args": list(cfg.quasar_args)},
        "environment": _environment(cfg, threads, binary),
        "servers": servers,
        "sweep": sweep,
    }
