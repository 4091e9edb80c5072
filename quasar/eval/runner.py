"""Run evaluation tasks for each verifier side by side and report the difference.

Every task sees the same items for both verifiers (the float model first, then the one
under test). After each task, `results.json`, `report.md` and `samples.jsonl` (per-item
records) are rewritten atomically in the output folder, so a long run that is stopped keeps
the tasks it finished.
"""

from __future__ import annotations

import json
import math
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from tqdm import tqdm

from quasar.engine.spec import VerifierSpec
from quasar.errors import QuasarError
from quasar.eval.fidelity import DEFAULT_WINDOW, fidelity_text, run_fidelity
from quasar.fileio import write_atomic
from quasar.eval.tasks import FIDELITY, TASKS, EvalConfig, ppl_window


def parse_verifiers(spec: str) -> list[str]:
    """'fp,w8a8' -> ['fp', 'w8a8']: one verifier, or two to compare (the first is the baseline)."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not 1 <= len(names) <= 2 or len(set(names)) != len(names):
        raise QuasarError(f"--verifiers takes one or two different verifiers, e.g. fp,w8a8; got {spec!r}")
    for name in names:
        VerifierSpec.parse(name)
    return names


# --------------------------------------------------------------------------- runner


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def compare(task: str, metric: str, higher_is_better: bool, verifiers: Sequence[str],
            metrics: dict[str, dict], records: dict[str, list[dict]] | None = None) -> dict:
    """The task's entry in results.json: headline per verifier, delta (second - first)."""
    entry: dict[str, Any] = {"status": "ok", "metric": metric, "higher_is_better": higher_is_better}
    for v in verifiers:
        entry[v] = _number(metrics[v].get(metric))
    entry["delta"] = entry["delta_rel"] = None
    if len(verifiers) == 2:
        a, b = entry[verifiers[0]], entry[verifiers[1]]
        if a is not None and b is not None:
            entry["delta"] = b - a
            entry["delta_rel"] = (b - a) / abs(a) if a else None
        if records:
            ra, rb = records[verifiers[0]], records[verifiers[1]]
            if ra and "pred" in ra[0] and len(ra) == len(rb):
                entry["agreement"] = sum(x["pred"] == y["pred"] for x, y in zip(ra, rb)) / len(ra)
    entry["details"] = metrics
    return entry


def unavailable(task: str, metric: str, higher_is_better: bool, verifiers: Sequence[str], reason: str) -> dict:
    entry: dict[str, Any] = {"status": "unavailable", "reason": reason, "metric": metric,
                             "higher_is_better": higher_is_better}
    entry.update({v: None for v in verifiers})
    entry.update(delta=None, delta_rel=None)
    return entry


def fidelity_entry(llm, cfg: EvalConfig, verifiers: Sequence[str], progress: bool) -> dict:
    if list(verifiers) not in (["fp", "w8a8"], ["fp", "w4a8"]):
        return unavailable("fidelity", FIDELITY.metric, False, verifiers,
                           "fidelity compares fp with a quantized verifier (--verifiers fp,w8a8 or fp,w4a8)")
    quantized = verifiers[1]
    raw = run_fidelity(llm, fidelity_text(cfg.text_file), window=cfg.window or DEFAULT_WINDOW, stride=cfg.stride,
                       limit=cfg.limit if cfg.limit is not None and cfg.limit >= 0 else None, progress=progress,
                       verifier=quantized)
    metrics = {"fp": {"perplexity": raw.get("ppl_fp")}, quantized: {"perplexity": raw.get(f"ppl_{quantized}")}}
    entry = compare("fidelity", FIDELITY.metric, False, verifiers, metrics)
    for key in ("top1_agreement", "kl_mean"):
        entry[key] = raw.get(key)
    entry["details"] = raw
    return entry


class Runner:
    def __init__(self, llm, tasks: Sequence[str], verifiers: Sequence[str], cfg: EvalConfig,
                 out: str | Path | None, progress: bool | None = None, log=sys.stderr, model_name: str | None = None):
        self.llm, self.tasks, self.verifiers, self.cfg = llm, list(tasks), list(verifiers), cfg
        self.out = Path(out) if out else None
        self.progress = log.isatty() if progress is None else progress
        self.log = log
        self.samples: dict[str, dict[str, list[dict]]] = {}
        self.results: dict[str, Any] = {
            "model": model_name, "verifiers": self.verifiers, "drafter": "ngram",
            "settings": self._settings(), "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "elapsed_s": 0.0, "tasks": {}}

    def _settings(self) -> dict:
        c = self.cfg
        s = {"limit": c.limit, "shots": c.shots, "check_spec": c.check_spec, "max_new_tokens": c.max_new_tokens,
             "text_file": c.text_file, "timeout_s": c.timeout_s, "memory_mb": c.memory_mb}
        if "perplexity" in self.tasks:
            s["window"], s["stride"] = ppl_window(self.llm, c)
        return s

    def say(self, msg: str) -> None:
        tqdm.write(msg, file=self.log)

    def run(self) -> dict:
        t0 = time.perf_counter()
        for v in self.verifiers:  # build (quantize) up front: fail before hours of work
            self.llm.verifier_model(v)
        if self.out:
            self._prepare_out()
        for name in self.tasks:
            start = time.perf_counter()
            if name == "fidelity":
                entry = fidelity_entry(self.llm, self.cfg, self.verifiers, self.progress)
            else:
                entry = self._run_task(name)
            entry["elapsed_s"] = round(time.perf_counter() - start, 2)
            self.results["tasks"][name] = entry
            self.results["elapsed_s"] = round(time.perf_counter() - t0, 2)
            self.say(_summary_line(name, entry, self.verifiers))
            if self.out:
                self.write()
        return self.results

    def _run_task(self, name: str) -> dict:
        task = TASKS[name]
        items = task.load(self.llm, self.cfg)
        metrics, records = {}, {}
        for v in self.verifiers:
            recs = []
            with tqdm(items, desc=f"{name} [{v}]", unit="item", file=self.log, disable=not self.progress,
                      leave=False, dynamic_ncols=True) as bar:
                for item in bar:
                    recs.append(task.run(self.llm, v, item, self.cfg))
            records[v], metrics[v] = recs, task.summarize(recs)
        self.samples[name] = records
        entry = compare(name, task.metric, task.higher_is_better, self.verifiers, metrics, records)
        entry["n"] = len(items)
        return entry

    # ------------------------------------------------------------------ output

    def _prepare_out(self) -> None:
        if self.out.exists() and not self.out.is_dir():
            raise QuasarError(f"--out {self.out} exists and is not a directory")
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise QuasarError(f"cannot create --out {self.out}: {e.strerror}") from None

    def write(self) -> None:
        samples = "".join(json.dumps({"task": t, "verifier": v, "index": i, **r}, ensure_ascii=False) + "\n"
                          for t, per_v in self.samples.items() for v, recs in per_v.items()
                          for i, r in enumerate(recs))
        write_atomic(self.out / "samples.jsonl", samples)
        write_atomic(self.out / "results.json", json.dumps(self.results, indent=2, ensure_ascii=False) + "\n")
        write_atomic(self.out / "report.md", render_report(self.results))


# --------------------------------------------------------------------------- report


def _fmt(x: Any, metric: str = "") -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        if metric in ("accuracy", "pass@1", "exact_match", "accuracy_text", "spec_identical", "agreement",
                      "top1_agreement"):
            return f"{100 * x:.1f}%"
        return f"{x:.4g}"
    return str(x)


def _signed(x: float | None, metric: str) -> str:
    if x is None:
        return "–"
    if metric in ("accuracy", "pass@1", "exact_match"):
        return f"{100 * x:+.1f} pt"
    return f"{x:+.4g}"


def _summary_line(name: str, entry: dict, verifiers: Sequence[str]) -> str:
    if entry["status"] != "ok":
        return f"{name}: {entry['status']} ({entry.get('reason', '')})"
    metric = entry["metric"]
    parts = [f"{v} {_fmt(entry[v], metric)}" for v in verifiers]
    if entry.get("delta") is not None:
        parts.append(f"delta {_signed(entry['delta'], metric)}")
    return f"{name} {metric}: " + ", ".join(parts) + f"  [{entry.get('elapsed_s', 0):.0f} s]"


def render_report(results: dict) -> str:
    vs = results["verifiers"]
    s = results["settings"]
    lines = ["# Quasar eval", "",
             f"Model: `{results.get('model') or '?'}` · verifiers: {', '.join(f'`{v}`' for v in vs)}"
             f" · generation: n-gram drafter (k=5, n 1..3), greedy · started {results['started']}"
             f" · {results['elapsed_s']:.0f} s", "",
             f"Settings: limit {s['limit'] if s['limit'] is not None else 'default'}, shots {s['shots']}, "
             f"check-spec {'on' if s['check_spec'] else 'off'}"
             + (f", perplexity window {s['window']} / stride {s['stride']}" if "window" in s else ""), ""]
    head = ["task", "metric", "n", *vs] + (["delta", "agreement"] if len(vs) == 2 else [])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for name, e in results["tasks"].items():
        metric = e["metric"]
        if e["status"] != "ok":
            row = [name, metric, "–", *["–"] * len(vs)] + (["–", "–"] if len(vs) == 2 else [])
            notes.append(f"- {name}: {e['status']}: {e.get('reason', '')}")
        else:
            agree = e.get("agreement", e.get("top1_agreement"))
            delta = _signed(e["delta"], metric)
            if e.get("delta_rel") is not None and metric == "perplexity":
                delta += f" ({100 * e['delta_rel']:+.2f}%)"
            row = [name, metric, _fmt(e.get("n")), *[_fmt(e[v], metric) for v in vs]]
            if len(vs) == 2:
                row += [delta, _fmt(agree, "agreement")]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Delta is the second verifier minus the first. Agreement: share of items where both "
              "verifiers chose the same option or wrote the same completion (fidelity: top-1 token agreement).", ""]
    lines += ["What each task measures:", ""]
    lines += [f"- {name}: {(FIDELITY if name == 'fidelity' else TASKS[name]).describe}" for name in results["tasks"]]
    lines.append("")
    details = _details(results)
    if details:
        lines += ["## Details", ""] + details
    if notes:
        lines += ["## Not run", ""] + notes + [""]
    return "\n".join(lines)


def _details(results: dict) -> list[str]:
    vs, out = results["verifiers"], []
    for name, e in results["tasks"].items():
        if e["status"] != "ok":
            continue
        if name == "fidelity":
            out.append(f"- fidelity: top-1 agreement {_fmt(e.get('top1_agreement'), 'top1_agreement')}, "
                       f"mean KL {_fmt(e.get('kl_mean'))}")
            continue
        for v in vs:
            d = e["details"][v]
            bits = []
            if "accuracy_text" in d:
                bits.append(f"accuracy scoring the option text {_fmt(d['accuracy_text'], 'accuracy_text')}")
            if "by_source" in d:
                bits.append(", ".join(f"{k} {_fmt(x)}" for k, x in d["by_source"].items()) + f" ({d['tokens']} tokens)")
            if "status" in d:
                bits.append("outcomes " + ", ".join(f"{k} {n}" for k, n in sorted(d["status"].items())))
            if "unparsed" in d:
                bits.append(f"{d['unparsed']} answers without a number")
            if d.get("mean_accepted") is not None:
                bits.append(f"mean acceptance length {d['mean_accepted']:.2f}, {d['tokens_per_s']:.1f} tokens/s")
            if "spec_identical" in d:
                bits.append(f"n-gram output identical to autoregressive in {_fmt(d['spec_identical'], 'spec_identical')}"
                            f" of {d['spec_checked']}")
            if bits:
                out.append(f"- {name} [{v}]: " + "; ".join(bits))
    return out + ([""] if out else [])
