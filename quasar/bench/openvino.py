"""OpenVINO GenAI peers for `quasar bench`: `openvino` and `openvino-pld`.

The model is the same float Hugging Face directory Quasar decodes (for a GGUF source, its
float conversion), exported once by optimum-intel to OpenVINO IR with int8 weights
(`--weight-format int8`, OpenVINO's default for CPU) and cached under
``$QUASAR_CACHE/openvino/``, keyed by the directory's identity like the W8A8 cache.
optimum-intel caps transformers below what Quasar uses and pulls torchvision, so it lives
in an environment of its own (``.venv-openvino-export``, made by
scripts/setup/install_openvino.sh) and runs as a subprocess; the runtime, openvino-genai, needs
no torch and sits in Quasar's environment. Both are optional: without them these peers are
reported as unavailable.

Decoding: `openvino_genai.LLMPipeline` on CPU with INFERENCE_NUM_THREADS = the bench's
threads and OpenVINO's other CPU defaults (bf16 activations where the CPU has bf16, u8 KV
cache). The prompt token ids go in as a tensor, so OpenVINO's tokenizer and chat template
play no part. Greedy; stops at the model's EOS ids, which are left out of the tokens.
`openvino-pld` adds GenAI's prompt lookup (num_assistant_tokens=5, max_ngram_size=3).
The scheduler config is GenAI's latency-oriented default for CPU with prefix caching off:
with it on, a repeated prompt reuses the KV blocks of the previous run and skips prefill,
while every other engine prefills each run.

Timing comes from GenAI's perf metrics, by the rule of the other peers (the prefill forward
yields the first token): prefill = time to first token, decode = generate duration − time
to first token, rate tokens = new tokens − 1. `raw_metrics.m_batch_sizes` holds the tokens
each forward of the model emitted, the first entry being prefill's, so the steps and the
acceptance histogram are read from it.

Fidelity: GenAI's pipeline returns no logits, so the bench scores the same IR with
OpenVINO's runtime (`openvino_logits`: a compiled stateful model, the same threads and CPU
properties, its state reset before each window).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from quasar.bench.engine import Contender, FidelitySource, RunResult, Unavailable
from quasar.engine.w8a8_verifier import model_identity
from quasar.paths import cache_dir

OPENVINO_PEERS = ("openvino", "openvino-pld")

PLD_ASSISTANT_TOKENS = 5
PLD_MAX_NGRAM = 3
EXPORT_TASK = "text-generation-with-past"
EXPORT_WEIGHT_FORMAT = "int8"
EXPORT_FORMAT = 1  # bump when the layout of a cache entry changes
MANIFEST = "quasar-export.json"
EXPORT_ENV_DIR = ".venv-openvino-export"
EXPORT_PYTHON_VAR = "QUASAR_OPENVINO_EXPORT_PYTHON"  # overrides where the exporter lives
EXPORT_PACKAGES = ("optimum-intel", "optimum", "nncf", "openvino", "openvino-tokenizers", "transformers", "torch")
INSTALL_HINT = "install it with scripts/setup/install_openvino.sh"

# Ops between a compressed weight and its use (int8 -> float: convert, zero point, scale).
_DECOMPRESSION_OPS = {"Convert", "Subtract", "Multiply", "Reshape"}


# --------------------------------------------------------------------------- export


def export_python() -> Path:
    """The Python interpreter that has optimum-intel: $QUASAR_OPENVINO_EXPORT_PYTHON, the
    repository's export environment, or the running one if it has optimum-intel itself."""
    given = os.environ.get(EXPORT_PYTHON_VAR)
    if given:
        path = Path(given).expanduser()
        if not os.access(path, os.X_OK):
            raise Unavailable(f"{EXPORT_PYTHON_VAR}={given} is not an executable Python")
        return path
    repo_env = Path(__file__).resolve().parents[2] / EXPORT_ENV_DIR / "bin" / "python"
    if os.access(repo_env, os.X_OK):
        return repo_env
    try:
        here = importlib.util.find_spec("optimum.intel") is not None
    except ImportError:
        here = False
    if here:
        return Path(sys.executable)
    raise Unavailable(f"no optimum-intel to export the model with (looked for {repo_env}); {INSTALL_HINT}")


def export_dir(model_dir: Path) -> Path:
    """Cache entry of the int8 IR export of `model_dir`."""
    blob = json.dumps({"model": model_identity(model_dir), "task": EXPORT_TASK,
                       "weight_format": EXPORT_WEIGHT_FORMAT, "format": EXPORT_FORMAT}, sort_keys=True)
    key = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return cache_dir("openvino") / f"{Path(model_dir).resolve().name}-{EXPORT_WEIGHT_FORMAT}-{key}"


def _tail(text: str, lines: int = 3) -> str:
    kept = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(kept[-lines:]) or "no output"


def _export_versions(python: Path) -> dict:
    code = ("import json, importlib.metadata as m\n"
            "def v(p):\n"
            "    try:\n        return m.version(p)\n"
            "    except m.PackageNotFoundError:\n        return None\n"
            f"print(json.dumps({{p: v(p) for p in {list(EXPORT_PACKAGES)!r}}}))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def export_model(model_dir: Path) -> Path:
    """The cached int8 OpenVINO IR of `model_dir`, exporting it on first use."""
    model_dir = Path(model_dir).resolve()
    target = export_dir(model_dir)
    if (target / MANIFEST).is_file():
        return target
    python = export_python()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    cmd = [str(python), "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model", str(model_dir),
           "--task", EXPORT_TASK, "--weight-format", EXPORT_WEIGHT_FORMAT, str(tmp)]
    print(f"exporting {model_dir.name} to OpenVINO IR with int8 weights (optimum-intel; once, cached in "
          f"{target.parent})...", file=sys.stderr)
    try:
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # a local directory: never ask the hub
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        except OSError as e:
            raise Unavailable(f"cannot run the exporter {python} ({e})") from None
        if proc.returncode != 0 or not (tmp / "openvino_model.xml").is_file():
            raise Unavailable(f"optimum-intel could not export {model_dir} (exit {proc.returncode}: "
                              f"{_tail(proc.stderr or proc.stdout)})")
        manifest = {"source": str(model_dir), "command": cmd[1:-1] + ["OUT"], "python": str(python),
                    "versions": _export_versions(python)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            if not (target / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def ir_weight_bytes(xml_path: Path) -> int:
    """Bytes of constants one forward reads: all of them but a table that is only gathered
    from (the input embedding when the output head is a separate matrix; one row of it is
    read). A weight is followed through its decompression ops to the ops that use it."""
    model = _import_openvino().Core().read_model(str(xml_path))
    total = 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Constant":
            continue
        users, front, seen = set(), [op], set()
        while front:
            node = front.pop()
            for target in node.output(0).get_target_inputs():
                user = target.get_node()
                if user.get_type_name() in _DECOMPRESSION_OPS:
                    if user.get_friendly_name() not in seen:
                        seen.add(user.get_friendly_name())
                        front.append(user)
                else:
                    users.add(user.get_type_name())
        if users != {"Gather"}:
            total += op.get_byte_size()
    return total


# --------------------------------------------------------------------------- decoding


def _cpu_precision() -> str:
    """The CPU plugin's default activation precision here (bf16 on AMX CPUs, else f32)."""
    try:
        return str(_import_openvino().Core().get_property("CPU", "INFERENCE_PRECISION_HINT"))
    except Exception:
        return "unknown"


def _import_openvino():
    """The OpenVINO runtime (installed with openvino-genai, which _import_genai checks first)."""
    import openvino  # lazy: optional dependency

    return openvino


def _import_genai():
    try:
        import openvino_genai  # lazy: optional dependency
    except Exception as e:  # ImportError, or a shared library that does not load
        raise Unavailable(f"openvino-genai is not importable ({type(e).__name__}: {e}); {INSTALL_HINT}") from None
    return openvino_genai


@contextmanager
def openvino_logits(xml_path: Path, threads: int, properties: dict):
    """The IR's logits for token ids (an eval.fidelity LogitsFn; see the module doc)."""
    ov = _import_openvino()
    try:
        compiled = ov.Core().compile_model(str(xml_path), "CPU", {"INFERENCE_NUM_THREADS": threads, **properties})
    except Exception as e:
        raise Unavailable(f"OpenVINO cannot compile {xml_path} ({type(e).__name__}: {e})") from None
    request = compiled.create_infer_request()
    inputs = {name for port in compiled.inputs for name in port.get_names()}

    def logits(ids: list[int]) -> torch.Tensor:
        n = len(ids)
        feed = {"input_ids": np.asarray([ids], dtype=np.int64), "attention_mask": np.ones((1, n), dtype=np.int64)}
        if "position_ids" in inputs:
            feed["position_ids"] = np.arange(n, dtype=np.int64)[None]
        if "beam_idx" in inputs:  # the stateful export's KV cache reorder for beams: one beam
            feed["beam_idx"] = np.zeros(1, dtype=np.int32)
        request.reset_state()  # each window from an empty cache
        request.infer(feed)
        return torch.from_numpy(np.array(request.get_tensor("logits").data[0], dtype=np.float32))

    yield logits


class OpenVINOPeer(Contender):
    """`properties`: extra CPU plugin properties (tests pin INFERENCE_PRECISION_HINT to f32;
    the bench keeps OpenVINO's defaults, bf16 activations on AMX CPUs, as users get them)."""

    def __init__(self, name: str, model_dir: Path, threads: int, eos_ids: set[int],
                 properties: dict | None = None):
        if name not in OPENVINO_PEERS:
            raise ValueError(name)
        self.properties = dict(properties or {})
        self.name, self.model_dir, self.threads = name, Path(model_dir), threads
        self.eos_ids = sorted(eos_ids)
        self.pld = name == "openvino-pld"
        self.description = ("OpenVINO GenAI LLMPipeline, CPU, greedy, int8 weights (optimum-intel)"
                            + (f", prompt_lookup (num_assistant_tokens={PLD_ASSISTANT_TOKENS}, "
                               f"max_ngram_size={PLD_MAX_NGRAM})" if self.pld else ""))
        self.pipe = None
        self.ir: Path | None = None  # the exported IR folder, once prepared
        self.versions: dict = {}
        self.precision: str | None = None  # the activation precision it runs at (after prepare)

    def prepare(self) -> None:
        ov_genai = _import_genai()
        path = export_model(self.model_dir)
        sched = ov_genai.SchedulerConfig()
        sched.enable_prefix_caching = False  # see the module doc
        sched.max_num_batched_tokens = sys.maxsize  # the prompt in one forward, as GenAI's latency default
        props = {"INFERENCE_NUM_THREADS": self.threads, "scheduler_config": sched, **self.properties}
        if self.pld:
            props["prompt_lookup"] = True
        try:
            self.pipe = ov_genai.LLMPipeline(str(path), "CPU", **props)
        except Exception as e:
            raise Unavailable(f"OpenVINO GenAI cannot load {path} ({type(e).__name__}: {e})") from None
        self.ir = path
        self.weights = f"{path} (OpenVINO IR, int8 weights)"
        self.bytes_per_step = ir_weight_bytes(path / "openvino_model.xml")
        exported = json.loads((path / MANIFEST).read_text()).get("versions", {})
        self.versions = {"openvino_genai": ov_genai.get_version(), "export": exported}
        self.precision = self.properties.get("INFERENCE_PRECISION_HINT") or _cpu_precision()

    def fidelity_source(self) -> FidelitySource:
        """Its int8 IR (openvino-pld shares openvino's), scored by OpenVINO's runtime."""
        xml, threads, props = self.ir / "openvino_model.xml", self.threads, self.properties
        return FidelitySource(f"openvino {self.ir}", lambda window: openvino_logits(xml, threads, props))

    def info(self) -> dict:
        return {**super().info(), "threads": self.threads, "versions": self.versions,
                "inference_precision": self.precision}

    def _config(self, max_new_tokens: int):
        ov_genai = _import_genai()
        cfg = ov_genai.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False)
        if self.eos_ids:
            cfg.eos_token_id = self.eos_ids[0]
            cfg.stop_token_ids = set(self.eos_ids)
        if self.pld:
            cfg.num_assistant_tokens = PLD_ASSISTANT_TOKENS
            cfg.max_ngram_size = PLD_MAX_NGRAM
        return cfg

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunResult:
        ids = _import_openvino().Tensor(np.asarray([prompt_ids], dtype=np.int64))
        res = self.pipe.generate(ids, self._config(max_new_tokens))
        tokens = [int(t) for t in res.tokens[0]]
        new, emitted = tokens, len(tokens)
        for i, tok in enumerate(tokens):
            if tok in self.eos_ids:
                new, emitted = tokens[:i], i + 1
                break
        raw = res.perf_metrics.raw_metrics
        wall = sum(raw.generate_durations) * 1e-6  # microseconds
        ttft = min(sum(raw.m_times_to_first_token) * 1e-6, wall)
        per_forward = [int(b) for b in raw.m_batch_sizes]  # [prefill's token, then each step's]
        return RunResult(token_ids=new, new_tokens=len(new), rate_tokens=max(len(new) - 1, 0),
                         step_tokens=max(emitted - 1, 0), steps=max(len(per_forward) - 1, 0),
                         prefill_s=ttft, decode_s=wall - ttft, wall_s=wall, hist=Counter(per_forward[1:]))
