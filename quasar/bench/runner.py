"""The benchmark protocol (ARCHITECTURE.md, "Benchmark protocol").

One process: load the model once, fix torch's threads (recorded), measure memory read
bandwidth, warm every engine up (this also builds verifiers, e.g. quantizes w8a8), then for
each prompt run every engine `repeats` times interleaved — A B C A B C … — so drift of the
machine hits all engines alike; the median of the repeats is kept per prompt and engine.
Bandwidth is measured again at the end; the figure used is the median of all samples.

Metrics of an engine over a set of prompts (a task, or all of them):
- tokens_per_s: decode rate = Σ rate tokens ÷ Σ median decode time (prefill excluded; see
  `engine` for how each engine's decode time is taken); e2e_tokens_per_s = Σ new tokens ÷
  Σ median wall time (prefill included).
- speedup_vs_ar_fp: tokens_per_s ÷ ar-fp's tokens_per_s over the same prompts.
- mean_accepted (acceptance length L): tokens emitted per verifier step, from the
  per-step histogram (EOS counted as emitted): exactly 1.0 for autoregressive decoding.
- step_ms: Σ decode time ÷ Σ steps. bytes_per_step: weights read by one forward (of a
  mixture-of-experts model, the experts one row reaches, top-k per layer; for a speculative
  mode, those a full draft's rows reach under uniform routing).
  kv_bytes_per_step: the KV cache a step reads, on average: each step reads its context's
  K and V in every layer (context ≈ prompt + half the output over a run, in the engine's
  cache precision; None for an engine whose precision is not known).
  floor_ms = (bytes_per_step + kv_bytes_per_step) ÷ bandwidth; floor_fraction = floor_ms ÷
  step_ms (1.0 would be reading weights and cache at full memory speed and doing nothing
  else); step_over_floor is its inverse. Activation traffic is not in the floor.
"""

from __future__ import annotations

import datetime as _dt
import gc
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch
from tqdm import tqdm

from quasar import __version__
from quasar.api import LLM
from quasar.bench import bandwidth as bw
from quasar.bench.engine import FLOAT_MODEL, Contender, FidelitySource, RunResult, Unavailable
from quasar.bench.fidelity import matched_quality, measure_fidelity
from quasar.bench.peers import PEERS, import_llama_cpp, make_peers
from quasar.bench.tasks import TASKS, task_prompts
from quasar.data.packages import packaged_model_path
from quasar.data.user_files import load_prompt_file
from quasar.defaults import (DEFAULT_DRAFT_BUDGET, DEFAULT_FIDELITY_TOKENS, DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN,
                             DEFAULT_NUM_DRAFT)
from quasar.engine.verifiers import model_bytes
from quasar.errors import QuasarError
from quasar.eval.fidelity import model_logits
from quasar.kernels import ext
from quasar.resources import peak_rss_gb
from quasar.speculative.tree_drafter import RecyclingTable

# 2: duration_s became resources.seconds, beside resources.peak_rss_gb; 3: "targets" (with
# the project's thresholds) became "ratios" (the measurements alone); 4: "fidelity" (each
# engine's model against the float model) and "matched_quality"
SCHEMA_VERSION = 4
BASELINE = "ar-fp"
# mode -> (drafter, verifier)
MODES: dict[str, tuple[str, str]] = {
    "ar-fp": ("none", "fp"),
    "ar-w8a8": ("none", "w8a8"),
    "ngram-fp": ("ngram", "fp"),
    "quasar": ("ngram", "w8a8"),
    "quasar-tree": ("tree", "w8a8"),
    "ngram-pruned": ("ngram", "pruned:0.5"),
    "ar-w4a8": ("none", "w4a8"),
    "quasar-w4a8": ("ngram", "w4a8"),
    "quasar-w4a8-tree": ("tree", "w4a8"),
    "ar-w4a8-small": ("none", "w4a8-small"),
    "quasar-w4a8-small": ("ngram", "w4a8-small"),
    "quasar-w4a8-small-tree": ("tree", "w4a8-small"),
}
DEFAULT_N = 5
DEFAULT_REPEATS = 3
DEFAULT_MAX_NEW_TOKENS = 128
WARMUP_TOKENS = 16
CUSTOM_TASK = "custom"


@dataclass
class BenchConfig:
    model: str = "default"
    gguf: str | None = None  # the llama.cpp peers' file (default: model, when it is a GGUF)
    dtype: str = "auto"
    threads: int | None = None
    tasks: list[str] = field(default_factory=lambda: ["code", "summarization", "qa", "math", "chat"])
    prompts_file: str | None = None
    n: int | None = None  # prompts per task (default DEFAULT_N for shipped tasks, all of a file)
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    modes: list[str] = field(default_factory=lambda: list(MODES))
    peers: list[str] = field(default_factory=lambda: list(PEERS))
    repeats: int = DEFAULT_REPEATS
    warmup: bool = True
    num_draft: int = DEFAULT_NUM_DRAFT
    ngram_min: int = DEFAULT_NGRAM_MIN
    ngram_max: int = DEFAULT_NGRAM_MAX
    draft_budget: int = DEFAULT_DRAFT_BUDGET
    bandwidth_bytes: int = bw.DEFAULT_BYTES
    bandwidth_repeats: int = bw.DEFAULT_REPEATS
    fidelity_tokens: int = DEFAULT_FIDELITY_TOKENS  # held-out tokens each engine's model is scored on; 0: none
    progress: bool = True
    command: str = ""

    def validate(self) -> "BenchConfig":
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise QuasarError(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
        unknown = [p for p in self.peers if p not in PEERS]
        if unknown:
            raise QuasarError(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(PEERS)} (or none/all)")
        if BASELINE not in self.modes:  # every speedup is relative to it
            self.modes = [BASELINE, *self.modes]
        self.modes = list(dict.fromkeys(self.modes))
        if self.gguf and not (Path(self.gguf).expanduser().is_file() and self.gguf.lower().endswith(".gguf")):
            raise QuasarError(f"--gguf {self.gguf}: not a .gguf file", param="gguf")
        self.peers = list(dict.fromkeys(self.peers))
        for name, value, low in (("--repeats", self.repeats, 1), ("--max-new-tokens", self.max_new_tokens, 1),
                                 ("--n", self.n if self.n is not None else 1, 1),
                                 ("--threads", self.threads if self.threads is not None else 1, 1),
                                 ("--fidelity-tokens", self.fidelity_tokens, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise QuasarError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.fidelity_tokens == 1:  # one token predicts nothing
            raise QuasarError("--fidelity-tokens must be 0 (skip) or at least 2, got 1")
        return self


# --------------------------------------------------------------------------- prompts


@dataclass
class BenchPrompt:
    task: str
    id: str
    ids: list[int]
    chat: bool


def load_prompts(cfg: BenchConfig, llm) -> tuple[list[BenchPrompt], list[str]]:
    """Prompts as token ids. Chat items go through the model's chat template; raw text items
    are fed as-is for the code task (completion of a function) and as one user turn otherwise."""
    warnings: list[str] = []
    if cfg.prompts_file:
        items = load_prompt_file(cfg.prompts_file)
        per_task: dict[str, int] = {}
        chosen = []
        for i, item in enumerate(items):
            task = item.category or CUSTOM_TASK
            if cfg.n is not None and per_task.get(task, 0) >= cfg.n:
                continue
            per_task[task] = per_task.get(task, 0) + 1
            chosen.append((task, item.id or f"{Path(cfg.prompts_file).name}:{i + 1}", item))
    else:
        bad = [t for t in cfg.tasks if t not in TASKS]
        if bad:
            raise QuasarError(f"unknown task(s) {', '.join(bad)}; choose from {', '.join(TASKS)}")
        chosen = []
        for task in cfg.tasks:
            for j, item in enumerate(task_prompts(task, cfg.n or DEFAULT_N)):
                chosen.append((task, item.id or f"{task}-{j}", item))
    prompts = []
    for task, pid, item in chosen:
        if item.is_chat:
            ids = llm.encode(item.messages)
        else:
            ids = llm.encode(item.text, raw=(task == "code"))
        if not ids:
            warnings.append(f"prompt {pid} ({task}) encodes to no tokens; skipped")
            continue
        if len(ids) + cfg.max_new_tokens + 1 > llm.max_context:
            warnings.append(f"prompt {pid} ({task}) has {len(ids)} tokens; with {cfg.max_new_tokens} new tokens "
                            f"it exceeds the {llm.max_context}-token context; skipped")
            continue
        prompts.append(BenchPrompt(task, pid, ids, item.is_chat))
    if not prompts:
        raise QuasarError("no prompt fits the model's context; " + "; ".join(warnings[-1:]))
    return prompts, warnings


# --------------------------------------------------------------------------- Quasar modes


class QuasarMode(Contender):
    kind = "mode"

    def __init__(self, name: str, llm, cfg: BenchConfig):
        self.name, self.llm, self.cfg = name, llm, cfg
        self.drafter, self.verifier = MODES[name]
        draft = {"ngram": f"n-gram drafts (k={cfg.num_draft}, n={cfg.ngram_min}..{cfg.ngram_max})",
                 "tree": f"draft trees of n-gram matches and recycled verifier candidates ({cfg.draft_budget} "
                         f"nodes, n={cfg.ngram_min}..{cfg.ngram_max}; the recycling table carries over from "
                         "the prompts before, never a prompt's own decode)"}.get(self.drafter, "autoregressive")
        self.description = f"Quasar: {draft}, verifier {self.verifier}"
        self._tables: dict[tuple[int, ...], RecyclingTable] = {}  # prompt -> the table before its first run

    def prepare(self) -> None:
        try:  # builds the verifier once (w8a8: quantizes or loads it); one that cannot be built is reported
            model = self.llm.verifier_model(self.verifier)
        except QuasarError as e:
            raise Unavailable(str(e)) from None
        # a mixture-of-experts step reads the experts its rows reach: priced at a full draft's rows
        rows = {"none": 1, "ngram": 1 + self.cfg.num_draft, "tree": 1 + self.cfg.draft_budget}[self.drafter]
        self.bytes_per_step = model_bytes(model, rows)
        self.kv_element_size = model.cache.k.element_size()
        self.kv_config = model.config  # a pruned verifier has fewer layers (and caches)
        dtype = str(self.llm.loaded.dtype).removeprefix("torch.")
        self.weights = f"{self.llm.loaded.model_dir} ({self.verifier}, {dtype})"

    def fidelity_source(self) -> FidelitySource:
        """Its verifier: the modes on one verifier share its figure (quasar, quasar-tree, ar-w8a8)."""
        if self.verifier == "fp":
            return FLOAT_MODEL
        model = self.llm.verifier_model(self.verifier)
        return FidelitySource(f"verifier {self.verifier}", lambda window: model_logits(model, window))

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunResult:
        if self.drafter == "tree":
            # Tree drafts share a recycling table across requests (LLM.recycling_table), as a
            # server's would across its requests; but a prompt's warm-up and repeats must not
            # draft from its own earlier decode: every run of a prompt starts from the table
            # as it was before that prompt's first run.
            table = self.llm.recycling_table(self.verifier)
            table.restore(self._tables.setdefault(tuple(prompt_ids), table.copy()))
        res = self.llm.generate(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, temperature=0.0,
                                drafter=self.drafter, verifier=self.verifier, num_draft=self.cfg.num_draft,
                                ngram_min=self.cfg.ngram_min, ngram_max=self.cfg.ngram_max,
                                draft_budget=self.cfg.draft_budget)
        s = res.stats
        hist = Counter({int(k): int(v) for k, v in s["accepted_hist"].items()})
        return RunResult(token_ids=list(res.token_ids), new_tokens=s["new_tokens"], rate_tokens=s["new_tokens"],
                         step_tokens=sum(k * v for k, v in hist.items()), steps=s["steps"],
                         prefill_s=s["prefill_s"], decode_s=s["decode_s"], wall_s=s["wall_s"], hist=hist)


# --------------------------------------------------------------------------- environment


# AMD's Zen generations by (family, first model, last model). VMs often show only "AMD EPYC"
# as the model name, so a Zen 4 host and a Zen 5 host would read alike in a report.
_AMD_ZEN = (
    (0x17, 0x00, 0x2F, "Zen/Zen+"),
    (0x17, 0x30, 0xFF, "Zen 2"),
    (0x19, 0x00, 0x0F, "Zen 3"),
    (0x19, 0x10, 0x1F, "Zen 4"),
    (0x19, 0x20, 0x5F, "Zen 3"),
    (0x19, 0x60, 0xAF, "Zen 4"),
    (0x1A, 0x00, 0x4F, "Zen 5"),
)


def describe_cpu(cpuinfo: str) -> str | None:
    """The CPU as a report names it: /proc/cpuinfo's model name, with the vendor's family and
    model numbers (and the Zen generation they mean on AMD), e.g. "AMD EPYC (AMD family 26
    model 2: Zen 5)"; None without a model name."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block is enough
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name")
    if not name:
        return None
    try:
        family, model = int(fields["cpu family"]), int(fields["model"])
    except (KeyError, ValueError):
        return name
    vendor = {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}.get(fields.get("vendor_id", ""), "")
    ident = f"{vendor} family {family} model {model}".strip()
    if vendor == "AMD":
        ident += "".join(f": {zen}" for fam, lo, hi, zen in _AMD_ZEN if fam == family and lo <= model <= hi)
    return f"{name} ({ident})"


def _cpu_model() -> str:
    try:
        described = describe_cpu(Path("/proc/cpuinfo").read_text())
    except OSError:
        described = None
    return described or platform.processor() or platform.machine()


def _version(module: str) -> str | None:
    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _kernel_path() -> str:
    """The int8 kernels' path this run's W8A8 engines decode on (amx ... portable, or pytorch)."""
    return ext.kernel_path()


def environment(threads: int) -> dict:
    return {
        "quasar": __version__,
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "kernel_path": _kernel_path(),
        "torch": torch.__version__,
        "torch_threads": threads,
        "transformers": _version("transformers"),
        "llama_cpp_python": _version("llama-cpp-python") or _version("llama_cpp_python"),
        "llama_cpp_isa": _llama_cpp_isa(),
        "openvino_genai": _version("openvino-genai"),
    }


def _llama_cpp_isa() -> str | None:
    """The x86 vector extensions the installed llama.cpp was built for (its system info), so a
    report says whether a forced-AVX2 Quasar run met an AVX2 llama.cpp or an AVX512 one; None
    without llama-cpp-python."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    try:
        info = import_llama_cpp().llama_print_system_info()
        info = info.decode() if isinstance(info, bytes) else str(info)
    except Exception:  # a build that cannot load here: the peer itself reports why
        return None
    flags = [part.split("=")[0].strip() for part in info.replace("CPU :", "").split("|") if part.strip().endswith("= 1")]
    return ", ".join(f for f in flags if f.startswith(("AVX", "AMX", "FMA", "F16C"))) or "no AVX"


# --------------------------------------------------------------------------- aggregation


def _median_run(runs: list[RunResult], prompt_tokens: int, kv_token_bytes: int | None) -> dict:
    """One record per prompt and engine: median times over repeats, counts of the first.
    `kv_token_bytes`: K and V of one token in all layers, in the engine's precision."""
    first = runs[0]
    # Step i reads a context growing from the prompt to prompt + output: half the output on average.
    kv = None if kv_token_bytes is None else int(first.steps * (prompt_tokens + first.new_tokens / 2) * kv_token_bytes)
    return {
        "kv_bytes": kv,
        "new_tokens": first.new_tokens,
        "rate_tokens": first.rate_tokens,
        "step_tokens": first.step_tokens,
        "steps": first.steps,
        "decode_s": statistics.median(r.decode_s for r in runs),
        "wall_s": statistics.median(r.wall_s for r in runs),
        "prefill_s": statistics.median(r.prefill_s for r in runs),
        "decode_s_samples": [round(r.decode_s, 5) for r in runs],
        "hist": {str(k): v for k, v in sorted(first.hist.items())},
        "deterministic": all(r.token_ids == first.token_ids for r in runs),
        "token_ids": first.token_ids,
    }


def kv_token_bytes(cfg, element_size: int | None) -> int | None:
    """K and V of one token over all layers of `cfg` (a ModelConfig), or None."""
    return None if element_size is None else cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * element_size


def aggregate(records: list[dict], bytes_per_step: int | None, bandwidth_gbps: float) -> dict:
    """Metrics of one engine over the given per-prompt records (see module doc)."""
    rate = sum(r["rate_tokens"] for r in records)
    new = sum(r["new_tokens"] for r in records)
    decode = sum(r["decode_s"] for r in records)
    wall = sum(r["wall_s"] for r in records)
    steps = sum(r["steps"] for r in records)
    step_tokens = sum(r["step_tokens"] for r in records)
    hist: Counter = Counter()
    for r in records:
        hist.update({int(k): v for k, v in r["hist"].items()})
    step_s = decode / steps if steps else None
    kv = [r.get("kv_bytes") for r in records]
    kv_per_step = sum(kv) / steps if steps and all(k is not None for k in kv) else None
    read = bytes_per_step + (kv_per_step or 0) if bytes_per_step else None
    floor_s = read / (bandwidth_gbps * 1e9) if read and bandwidth_gbps else None
    same = [r["same_as_ar_fp"] for r in records if r.get("same_as_ar_fp") is not None]
    exact = [r["same_as_own_ar"] for r in records if r.get("same_as_own_ar") is not None]
    return {
        "tokens_per_s": rate / decode if decode > 0 else 0.0,
        "e2e_tokens_per_s": new / wall if wall > 0 else 0.0,
        "mean_accepted": step_tokens / steps if steps else None,
        "step_ms": step_s * 1e3 if step_s else None,
        "bytes_per_step": bytes_per_step,
        "kv_bytes_per_step": round(kv_per_step) if kv_per_step is not None else None,
        "floor_ms": floor_s * 1e3 if floor_s else None,
        "floor_fraction": floor_s / step_s if floor_s and step_s else None,
        "step_over_floor": step_s / floor_s if floor_s and step_s else None,
        "new_tokens": new,
        "rate_tokens": rate,
        "decode_s": decode,
        "wall_s": wall,
        "steps": steps,
        "accepted_hist": {str(k): v for k, v in sorted(hist.items())},
        "prompts": len(records),
        "same_output_as_ar_fp": sum(same) / len(same) if same else None,
        "same_output_as_own_ar": sum(exact) / len(exact) if exact else None,
        "deterministic": all(r["deterministic"] for r in records),
    }


def _summaries(per_prompt: list[dict], engines: list[Contender], bandwidth_gbps: float) -> dict:
    """{"modes": {...}, "peers": {...}} for a set of prompts, speedups filled in."""
    out: dict = {"modes": {}, "peers": {}}
    for e in engines:
        recs = [p["engines"][e.name] for p in per_prompt]
        out["modes" if e.kind == "mode" else "peers"][e.name] = aggregate(recs, e.bytes_per_step, bandwidth_gbps)
    base = out["modes"].get(BASELINE, {}).get("tokens_per_s")
    for group in ("modes", "peers"):
        for row in out[group].values():
            row["speedup_vs_ar_fp"] = row["tokens_per_s"] / base if base else None
    return out


def ratios(overall: dict) -> list[dict]:
    """The ratios a reader compares Quasar by, on the overall numbers (None where an engine
    did not run). Only measurements: what counts as good enough is the project's call, kept
    with the results in BENCHMARKS.md, not the tool's."""
    modes, peers = overall["modes"], overall["peers"]
    chain, tree = modes.get("quasar", {}), modes.get("quasar-tree", {})
    q = chain.get("tokens_per_s")

    def ratio(a, b):
        return a / b if a and b else None

    best = [peers[p]["tokens_per_s"] for p in ("llamacpp", "llamacpp-pld") if p in peers]
    return [
        {"name": "quasar tokens/s ÷ hf tokens/s", "value": ratio(q, peers.get("hf", {}).get("tokens_per_s"))},
        {"name": "quasar tokens/s ÷ best of llamacpp, llamacpp-pld (model's own file)",
         "value": ratio(q, max(best) if best else None)},
        {"name": "quasar verifier step ÷ bandwidth floor", "value": chain.get("step_over_floor")},
        {"name": "quasar-tree acceptance length ÷ quasar's",
         "value": ratio(tree.get("mean_accepted"), chain.get("mean_accepted"))},
        {"name": "quasar-tree tokens/s ÷ quasar tokens/s", "value": ratio(tree.get("tokens_per_s"), q)},
    ]


# --------------------------------------------------------------------------- the run


def _progress(total: int, enabled: bool):
    return tqdm(total=total, desc="bench", unit="run", file=sys.stderr, disable=not enabled, dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}] {postfix}")


def gguf_source(cfg) -> tuple[Path | None, str]:
    """The GGUF file llama.cpp peers read for `cfg` (a BenchConfig or ServingConfig: its
    `gguf`, else its `model` when that is a GGUF file or "default"), or None and why not."""
    if cfg.gguf:
        return Path(cfg.gguf).expanduser(), ""
    packaged = packaged_model_path(cfg.model)
    if packaged is not None:
        return packaged, ""
    path = Path(cfg.model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path, ""
    return None, "the model is a Hugging Face directory, not a GGUF file (give one with --gguf)"


def _warm_up(cfg: BenchConfig, llm, candidates: list[Contender], prompts: list[BenchPrompt],
             bar) -> tuple[list[Contender], dict[str, str]]:
    """Prepare and warm up every candidate: (the engines that run, {name: why not} for the
    rest). An engine that cannot run is reported, not fatal, unless it is the baseline of a
    float model."""
    engines, unavailable = [], {}
    warm_prompt = min(prompts, key=lambda p: len(p.ids))
    warm_tokens = min(cfg.max_new_tokens, WARMUP_TOKENS)
    for e in candidates:
        bar.set_postfix_str(f"warm-up {e.name}")
        try:
            e.prepare()
            if cfg.warmup:
                e.run(warm_prompt.ids, warm_tokens)
        except Unavailable as exc:
            if e.name == BASELINE and not llm.loaded.quantized:  # a W8A8 checkpoint has no float model
                raise QuasarError(f"baseline {BASELINE} cannot run: {exc}") from None
            unavailable[e.name] = f"unavailable: {exc}"
            bar.total -= len(prompts) * cfg.repeats
            bar.refresh()
        else:
            engines.append(e)
        if cfg.warmup:
            bar.update(1)
    return engines, unavailable


def own_ar_mode(e: Contender, engines: list[Contender]) -> str | None:
    """The autoregressive mode of the run on drafting mode `e`'s verifier (quasar, quasar-tree:
    ar-w8a8; quasar-w4a8, quasar-w4a8-tree: ar-w4a8), whose greedy tokens `e` must reproduce; None if none ran."""
    if e.kind != "mode" or e.drafter == "none":
        return None
    return next((o.name for o in engines if o.kind == "mode" and o.drafter == "none" and o.verifier == e.verifier),
                None)


def _time_prompt(cfg: BenchConfig, llm, p: BenchPrompt, engines: list[Contender], bar,
                 warnings: list[str]) -> dict:
    """One prompt's record: every engine `repeats` times, interleaved, the median kept."""
    runs: dict[str, list[RunResult]] = {e.name: [] for e in engines}
    for _ in range(cfg.repeats):
        for e in engines:  # interleaved: A B C A B C …
            bar.set_postfix_str(f"{p.task} {p.id} {e.name}")
            gc.collect()
            runs[e.name].append(e.run(p.ids, cfg.max_new_tokens))
            bar.update(1)
    recs = {e.name: _median_run(runs[e.name], len(p.ids),
                                kv_token_bytes(getattr(e, "kv_config", llm.config), e.kv_element_size))
            for e in engines}
    base_ids = recs[BASELINE]["token_ids"] if BASELINE in recs else None
    for name, rec in recs.items():
        rec["same_as_ar_fp"] = None if base_ids is None else rec["token_ids"] == base_ids
        if not rec["deterministic"]:
            warnings.append(f"{name} gave different tokens across repeats on prompt {p.id}")
    for e in engines:  # exactness: greedy drafting must give its verifier's own tokens
        ar = own_ar_mode(e, engines)
        if ar is not None:
            same = recs[e.name]["same_as_own_ar"] = recs[e.name]["token_ids"] == recs[ar]["token_ids"]
            if not same:
                warnings.append(f"{e.name}'s greedy tokens differ from {ar}'s on prompt {p.id}: speculative "
                                "decoding must give its verifier's own tokens")
    return {"task": p.task, "id": p.id, "prompt_tokens": len(p.ids), "chat": p.chat, "engines": recs}


def _config_record(cfg: BenchConfig, llm, gguf_path: Path | None, threads: int, task_order: list[str],
                   n_prompts: int) -> dict:
    """The run's settings as results.json records them."""
    return {
        "model": cfg.model, "model_dir": str(llm.loaded.model_dir), "gguf": str(gguf_path) if gguf_path else None,
        "dtype": cfg.dtype, "threads": threads, "tasks": task_order, "prompts_file": cfg.prompts_file,
        "n": cfg.n, "prompts": n_prompts, "max_new_tokens": cfg.max_new_tokens, "repeats": cfg.repeats,
        "warmup": cfg.warmup, "modes": cfg.modes, "peers": cfg.peers, "num_draft": cfg.num_draft,
        "ngram_min": cfg.ngram_min, "ngram_max": cfg.ngram_max, "draft_budget": cfg.draft_budget,
        "fidelity_tokens": cfg.fidelity_tokens, "greedy": True, "batch": 1,
    }


def run_bench(cfg: BenchConfig) -> dict:
    """Run the whole protocol; returns the results dict (the content of results.json)."""
    cfg.validate()
    started = _dt.datetime.now(_dt.timezone.utc)
    threads = cfg.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    # no prompt cache: every prompt prefills from an empty cache, as the peers' (llama.cpp is reset)
    llm = LLM(cfg.model, dtype=cfg.dtype, threads=threads, prompt_cache_mib=0)
    prompts, warnings = load_prompts(cfg, llm)
    gguf_path, why_no_gguf = gguf_source(cfg)

    bandwidths = [bw.measure_read_bandwidth(cfg.bandwidth_bytes, cfg.bandwidth_repeats, threads)]

    n_ctx = max(len(p.ids) for p in prompts) + cfg.max_new_tokens + 64
    candidates: list[Contender] = [QuasarMode(m, llm, cfg) for m in cfg.modes]
    candidates += make_peers(cfg.peers, model_dir=llm.loaded.model_dir, dtype=llm.loaded.dtype,
                             gguf_path=gguf_path, why_no_gguf=why_no_gguf, threads=threads, n_ctx=n_ctx,
                             eos_ids=set(llm.tokenizer.eos_ids))
    n_runs = len(candidates) * (1 if cfg.warmup else 0) + len(prompts) * cfg.repeats * len(candidates)
    with _progress(n_runs, cfg.progress) as bar:
        engines, unavailable = _warm_up(cfg, llm, candidates, prompts, bar)
        per_prompt = [_time_prompt(cfg, llm, p, engines, bar, warnings) for p in prompts]

    bandwidths.append(bw.measure_read_bandwidth(cfg.bandwidth_bytes, cfg.bandwidth_repeats, threads))
    band = bw.combine(bandwidths)
    gbps = band["gb_per_s"]
    # after the timed runs, so loading more copies of a model cannot slow them
    fidelity = measure_fidelity(engines, llm, cfg.fidelity_tokens, cfg.progress)

    task_order = list(dict.fromkeys(p.task for p in prompts))
    tasks = {}
    for t in task_order:
        subset = [p for p in per_prompt if p["task"] == t]
        tasks[t] = {"prompts": len(subset), **_summaries(subset, engines, gbps)}
    overall = _summaries(per_prompt, engines, gbps)
    for p in per_prompt:  # keep results.json readable: token ids only as a count
        for rec in p["engines"].values():
            rec.pop("token_ids")
    finished = _dt.datetime.now(_dt.timezone.utc)
    return {
        "schema": SCHEMA_VERSION,
        "started": started.isoformat(timespec="seconds"),
        "finished": finished.isoformat(timespec="seconds"),
        # the whole run in one process: the model, every verifier and in-process peer included
        "resources": {"peak_rss_gb": round(peak_rss_gb(), 2),
                      "seconds": round((finished - started).total_seconds(), 1)},
        "command": cfg.command,
        "config": _config_record(cfg, llm, gguf_path, threads, task_order, len(prompts)),
        "environment": environment(threads),
        "bandwidth": band,
        "engines": {e.name: e.info() for e in engines},
        "unavailable": unavailable,
        "modes": overall["modes"],
        "peers": overall["peers"],
        "tasks": tasks,
        "ratios": ratios(overall),
        "fidelity": fidelity,
        "matched_quality": matched_quality(overall, fidelity, MODES),
        "prompts": per_prompt,
        "warnings": warnings,
    }
