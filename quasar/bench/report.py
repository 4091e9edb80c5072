"""Write a benchmark's results: results.json (atomically), report.md, PNG plots.

The report's tables are formatted from the same numbers as the JSON, so "speedup" is the
ratio of the tokens/s column to ar-fp's, up to rounding.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from quasar.errors import QuasarError
from quasar.fileio import write_atomic

RESULTS_JSON = "results.json"
REPORT_MD = "report.md"
SPEEDUP_PNG = "speedup.png"
ACCEPTANCE_PNG = "acceptance.png"

COLUMNS = ("engine", "tokens/s", "speedup vs ar-fp", "acceptance length", "step ms", "MB/step", "KV MB/step",
           "floor ms", "floor achieved", "e2e tokens/s", "same output as ar-fp")
# the overall table's, once per engine's model: a mean KL one token can decide, so its median
# and 99th percentile beside it
FIDELITY_COLUMNS = ("top-1 vs fp", "KL vs fp: mean", "median", "p99")

COLUMN_HELP = [
    ("tokens/s", "decode rate: new tokens ÷ decode time, prefill excluded; sums over the prompts of the "
                 "median of repeats (peers: tokens after the first ÷ time after the first)"),
    ("speedup vs ar-fp", "tokens/s ÷ tokens/s of ar-fp (Quasar, autoregressive, float) on the same prompts"),
    ("acceptance length", "tokens emitted per verifier step (L); 1.00 for autoregressive decoding"),
    ("step ms", "decode time ÷ verifier steps (one forward each)"),
    ("MB/step", "bytes of weights one forward reads (embedding table excluded, tied lm_head once), 10^6 bytes"),
    ("KV MB/step", "KV cache one step reads on average (its context's K and V in every layer, in the engine's "
                   "cache precision; – when not known), 10^6 bytes"),
    ("floor ms", "(MB/step + KV MB/step) ÷ measured memory read bandwidth: the fastest a step can be"),
    ("floor achieved", "floor ms ÷ step ms (100% = weights and cache streamed at full memory speed, nothing else)"),
    ("e2e tokens/s", "new tokens ÷ wall time including prefill"),
    ("same output as ar-fp", "fraction of prompts whose greedy tokens equal ar-fp's"),
    ("top-1 vs fp", "how often the engine's model and the float model agree on the most likely next token, "
                    "on the same held-out token ids (once per model: modes on one verifier, and a peer's -pld "
                    "variant, share it)"),
    ("KL vs fp: mean, median, p99", "KL(float ‖ engine's model) of the next-token distributions there, in nats: "
                                    "the mean, the median and the 99th percentile over the predictions (one token "
                                    "can decide a mean)"),
]


# --------------------------------------------------------------------------- JSON


def to_json(results: dict) -> str:
    return json.dumps(_clean(results), indent=2, ensure_ascii=False)


def _clean(obj):
    """Round floats for readability; NaN/inf become null so the file is strict JSON."""
    if isinstance(obj, float):
        if not math.isfinite(obj):
            return None
        return round(obj, 6)
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def output_folder(out_dir: str | Path) -> Path:
    """`out_dir`, created if need be; a one-line QuasarError where it cannot be."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise QuasarError(f"cannot create output folder {out}: {e.strerror}") from None
    if not out.is_dir():
        raise QuasarError(f"{out} is not a folder")
    return out


def write_outputs(results: dict, out_dir: str | Path) -> dict[str, Path]:
    """results.json, the plots and report.md in `out_dir`; returns their paths."""
    out = output_folder(out_dir)
    paths = {"results": out / RESULTS_JSON, "report": out / REPORT_MD}
    write_atomic(paths["results"], to_json(results) + "\n")
    plots, why = make_plots(results, out)
    paths.update(plots)
    write_atomic(paths["report"], render_report(results, plots, why))
    return paths


# --------------------------------------------------------------------------- formatting


def _f(v, fmt: str = "{:.2f}", none: str = "–") -> str:
    return none if v is None else fmt.format(v)


def _row(name: str, m: dict) -> list[str]:
    mb = None if m.get("bytes_per_step") is None else m["bytes_per_step"] / 1e6
    kv = None if m.get("kv_bytes_per_step") is None else m["kv_bytes_per_step"] / 1e6
    return [
        name,
        _f(m["tokens_per_s"]),
        _f(m.get("speedup_vs_ar_fp"), "{:.2f}x"),
        _f(m.get("mean_accepted")),
        _f(m.get("step_ms")),
        _f(mb, "{:.1f}"),
        _f(kv, "{:.1f}"),
        _f(m.get("floor_ms")),
        _f(None if m.get("floor_fraction") is None else 100 * m["floor_fraction"], "{:.0f}%"),
        _f(m.get("e2e_tokens_per_s")),
        _f(None if m.get("same_output_as_ar_fp") is None else 100 * m["same_output_as_ar_fp"], "{:.0f}%"),
    ]


def _fidelity_cells(rec: dict | None) -> list[str]:
    if not rec or "top1_agreement" not in rec:
        return ["reference"] * 4 if rec and rec.get("reference") else ["–"] * 4
    kls = (_f(rec.get(k), "{:.3g}") for k in ("kl_mean", "kl_median", "kl_p99"))
    return [f"{100 * rec['top1_agreement']:.1f}%", *kls]


def _table(header, rows) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def engine_table(section: dict, fidelity: dict | None = None) -> list[str]:
    """Markdown table of modes then peers (`section` has "modes" and "peers"); with
    `fidelity` (results' "fidelity"), its two columns at the end."""
    engines = [*section["modes"].items(), *section["peers"].items()]
    if fidelity is None:
        return _table(COLUMNS, [_row(name, m) for name, m in engines])
    rows = [_row(name, m) + _fidelity_cells(fidelity["engines"].get(name)) for name, m in engines]
    return _table(COLUMNS + FIDELITY_COLUMNS, rows)


def matched_quality_lines(results: dict) -> list[str]:
    """The matched-quality section: each Quasar verifier beside the peers of its precision."""
    rows = []
    for m in results.get("matched_quality", []):
        q, p = m["mode_fidelity"] or {}, m["peer_fidelity"] or {}
        top1 = [_f(None if f.get("top1_agreement") is None else 100 * f["top1_agreement"], "{:.1f}%") for f in (q, p)]
        kl = [f"{_f(q.get(k), '{:.3g}')} / {_f(p.get(k), '{:.3g}')}" for k in ("kl_mean", "kl_median")]
        matched = {True: "yes", False: "no: less faithful", None: "fidelity not measured"}[m.get("matched")]
        rows.append([f"{m['mode']} ({m['verifier']})", f"{m['peer']} ({m['peer_model']})", " / ".join(top1), *kl,
                     matched, _f(m["tokens_per_s_ratio"], "{:.2f}x")])
    if not rows:
        return []
    return ["", "## Matched quality", "", "The fastest Quasar mode on each verifier against the fastest peer "
            "of the same precision; fidelity vs the float model (Quasar / peer). A ratio is a like-for-like "
            "speed comparison only where Quasar is at least as faithful (top-1, KL mean and median).", "",
            *_table(("Quasar (verifier)", "peer (model)", "top-1 vs fp", "KL mean", "KL median",
                     "at least as faithful", "tokens/s ÷ peer's"), rows)]


def _fidelity_setup(fid: dict) -> str:
    if "skipped" in fid or "tokens" not in fid:
        return f"- Fidelity vs the float model: not measured ({fid.get('skipped', 'no model to score')})"
    return (f"- Fidelity vs the float model: {fid['tokens']} next-token predictions in {fid['windows']} windows of "
            f"{fid['window']} tokens of the {fid['text']}; float perplexity {fid['ppl_fp']:.2f}; {fid['seconds']:.0f} s")


def _resources(results: dict) -> str:
    r = results["resources"]
    return f"{r['seconds']:.0f} s, peak RSS {r['peak_rss_gb']:.2f} GB"


def render_report(results: dict, plots: dict[str, Path] | None = None, plots_note: str = "") -> str:
    cfg, env, band = results["config"], results["environment"], results["bandwidth"]
    L = ["# Quasar benchmark", ""]
    L.append(f"Run {results['started']} → {results['finished']} ({_resources(results)}).  ")
    if results.get("command"):
        L.append(f"Command: `{results['command']}`")
    L += ["", "## Setup", ""]
    L.append(f"- Model: `{cfg['model']}` (weights from `{cfg['model_dir']}`, {cfg['dtype']})"
             + (f"; GGUF `{cfg['gguf']}`" if cfg.get("gguf") else ""))
    L.append(f"- Prompts: {cfg['prompts']} over tasks {', '.join(cfg['tasks'])}"
             + (f" from `{cfg['prompts_file']}`" if cfg.get("prompts_file") else "")
             + f"; up to {cfg['max_new_tokens']} new tokens, greedy, batch 1")
    L.append(f"- Protocol: one process, warm-up {'on' if cfg['warmup'] else 'off'}, engines interleaved per prompt, "
             f"median of {cfg['repeats']} repeats, {cfg['threads']} torch threads")
    L.append(f"- Drafts: k={cfg['num_draft']}, n-gram {cfg['ngram_min']}..{cfg['ngram_max']}"
             + (f"; trees of {cfg['draft_budget']} nodes" if "draft_budget" in cfg else ""))
    L.append(f"- Memory read bandwidth: **{band['gb_per_s']:.2f} GB/s** ({band['method']}; "
             f"{band['bytes'] / 2**30:.1f} GiB buffer; start/end "
             + ", ".join(f"{x:.2f}" for x in band.get("per_measurement_gb_per_s", [band["gb_per_s"]])) + " GB/s)")
    L.append(f"- Environment: {env['cpu']}, {env['cpu_count']} cores, int8 kernel path "
             f"**{env.get('kernel_path', 'unknown')}**; Python {env['python']}, torch {env['torch']}, "
             f"transformers {env.get('transformers') or 'absent'}, llama-cpp-python "
             f"{env.get('llama_cpp_python') or 'absent'}"
             + (f" (built for {env['llama_cpp_isa']})" if env.get("llama_cpp_isa") else "")
             + f"; quasar {env['quasar']}"
             + (f" ({env['git_commit']})" if env.get("git_commit") else ""))
    fidelity = results.get("fidelity")
    if fidelity is not None:
        L.append(_fidelity_setup(fidelity))
    exact = {name: m["same_output_as_own_ar"] for name, m in results.get("modes", {}).items()
             if m.get("same_output_as_own_ar") is not None}
    if exact:
        L.append("- Exactness (greedy drafting gives its verifier's autoregressive tokens): "
                 + ", ".join(f"{name} {v:.0%} of prompts" for name, v in exact.items()))
    L += ["", "## Overall", ""]
    L += engine_table(results, fidelity)
    L += ["", "## Ratios", ""]
    L += _table(("ratio", "measured"), [[r["name"], _f(r["value"])] for r in results.get("ratios", [])])
    L += matched_quality_lines(results)
    if plots:
        L += ["", "## Plots", ""]
        if "speedup" in plots:
            L.append(f"![speedup per task]({plots['speedup'].name})")
        if "acceptance" in plots:
            L.append(f"![acceptance length distribution]({plots['acceptance'].name})")
    elif plots_note:
        L += ["", f"Plots not written: {plots_note}."]
    for task, section in results["tasks"].items():
        L += ["", f"## Task: {task} ({section['prompts']} prompts)", ""]
        L += engine_table(section)
    no_fidelity = {n: r["unavailable"] for n, r in (fidelity or {}).get("engines", {}).items() if "unavailable" in r}
    if results.get("unavailable") or no_fidelity:
        L += ["", "## Not measured", ""]
        L += [f"- `{name}`: {why}" for name, why in results["unavailable"].items()]
        L += [f"- fidelity of `{name}`: {why}" for name, why in no_fidelity.items()]
    L += ["", "## Engines", ""]
    for name, info in results["engines"].items():
        L.append(f"- `{name}` ({info['kind']}): {info['description']}; weights {info.get('weights') or '?'}")
    L += ["", "## Per prompt (tokens/s)", ""]
    names = list(results["engines"])
    prow = []
    for p in results["prompts"]:
        cells = []
        for n in names:
            r = p["engines"][n]
            cells.append(_f(r["rate_tokens"] / r["decode_s"] if r["decode_s"] > 0 else None))
        prow.append([p["task"], str(p["id"]), str(p["prompt_tokens"]), *cells])
    L += _table(("task", "prompt", "prompt tokens", *names), prow)
    if results.get("warnings"):
        L += ["", "## Warnings", ""]
        L += [f"- {w}" for w in results["warnings"]]
    L += ["", "## Columns", ""]
    L += [f"- **{name}**: {text}" for name, text in COLUMN_HELP]
    L.append("")
    return "\n".join(L)


def summary_text(results: dict, paths: dict[str, Path] | None = None) -> str:
    """What `quasar bench` prints without --json: the overall table and where files went."""
    lines = [f"{_resources(results)}; memory read bandwidth {results['bandwidth']['gb_per_s']:.2f} GB/s, "
             f"{results['config']['threads']} threads, {results['config']['prompts']} prompts, "
             f"median of {results['config']['repeats']}", ""]
    lines += engine_table(results, results.get("fidelity"))
    for name, why in results.get("unavailable", {}).items():
        lines.append(f"{name}: {why}")
    if paths:
        lines.append("")
        lines += [f"{k}: {v}" for k, v in paths.items()]
    return "\n".join(lines)


# --------------------------------------------------------------------------- plots


def make_plots(results: dict, out: Path) -> tuple[dict[str, Path], str]:
    """speedup.png and acceptance.png; ({}, reason) when matplotlib is missing."""
    try:  # the object API: no pyplot, so no GUI backend and no global state
        from matplotlib.figure import Figure  # lazy: plots only; matplotlib is slow to import, may be missing
    except ImportError:
        return {}, "matplotlib is not installed (pip install matplotlib)"
    paths = {}
    groups = [*results["tasks"], "overall"]
    sections = [*results["tasks"].values(), results]
    engines = [n for n in [*results["modes"], *results["peers"]] if n != "ar-fp"]
    if "ar-fp" in results["modes"]:  # not on a W8A8 checkpoint, which has no float model
        fig = Figure(figsize=(min(16.0, max(6.5, 2.0 + 0.25 * len(groups) * max(1, len(engines)))), 4.5))
        ax = fig.subplots()
        width = 0.8 / max(1, len(engines))
        for i, name in enumerate(engines):
            vals = []
            for s in sections:
                row = s["modes"].get(name) or s["peers"].get(name) or {}
                vals.append(row.get("speedup_vs_ar_fp") or 0.0)
            xs = [g + (i - (len(engines) - 1) / 2) * width for g in range(len(groups))]
            ax.bar(xs, vals, width, label=name)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="ar-fp")
        ax.set_xticks(range(len(groups)), groups)
        ax.set_ylabel("speedup vs ar-fp (decode tokens/s)")
        ax.set_title("Speedup per task")
        ax.legend(fontsize=8, ncol=2)
        fig.tight_layout()
        paths["speedup"] = out / SPEEDUP_PNG
        _save(fig, paths["speedup"])

    hists = {n: m["accepted_hist"] for n, m in [*results["modes"].items(), *results["peers"].items()]
             if m.get("accepted_hist")}
    if hists:
        kmax = max(int(k) for h in hists.values() for k in h)
        fig = Figure(figsize=(min(16.0, max(6.5, 2.0 + 0.15 * kmax * len(hists))), 4.5))
        ax = fig.subplots()
        width = 0.8 / len(hists)
        for i, (name, h) in enumerate(hists.items()):
            total = sum(h.values())
            vals = [h.get(str(k), 0) / total for k in range(1, kmax + 1)]
            xs = [k + (i - (len(hists) - 1) / 2) * width for k in range(1, kmax + 1)]
            L = results["modes"].get(name, results["peers"].get(name, {})).get("mean_accepted")
            ax.bar(xs, vals, width, label=f"{name} (L={L:.2f})" if L is not None else name)
        ax.set_xticks(range(1, kmax + 1))
        ax.set_xlabel("tokens emitted per verifier step")
        ax.set_ylabel("fraction of steps")
        ax.set_title("Acceptance length distribution (all prompts)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths["acceptance"] = out / ACCEPTANCE_PNG
        _save(fig, paths["acceptance"])
    return paths, ""


def _save(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    write_atomic(path, buf.getvalue())
