"""The serving protocol's outputs: serving.json (everything measured) and serving.md (one
row per server, the CPU named, the n-gram sweep beside it)."""

from __future__ import annotations

import json
from pathlib import Path

from quasar.bench.report import output_folder
from quasar.fileio import write_atomic

SERVING_JSON = "serving.json"
SERVING_MD = "serving.md"


def _f(v, fmt: str = "{:.1f}") -> str:
    return "–" if v is None else fmt.format(v)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _server_rows(results: dict) -> tuple[list[str], list[list[str]]]:
    cs = [str(c) for c in results["config"]["concurrency"]]
    header = ["server", "flags"]
    for c in cs:
        header += [f"decode tok/s, c={c} (median)", f"aggregate tok/s, c={c}", f"TTFT s, c={c} (median)",
                   f"tokens, c={c}"]
    rows = []
    for rec in results["servers"].values():
        flags = " ".join(rec.get("flags") or []) or "(defaults)"
        if rec["status"] != "ok":
            rows.append([rec["label"], f"{flags}: {rec['status']}", *["–"] * (4 * len(cs))])
            continue
        row = [rec["label"], flags]
        for c in cs:
            ph = rec["phases"][c]
            row += [_f(ph["median_decode_tokens_per_s"]), _f(ph["aggregate_tokens_per_s"]),
                    _f(ph["median_ttft_s"], "{:.3f}"), str(ph["completion_tokens"])]
        rows.append(row)
    return header, rows


def _sweep_lines(sweep: dict | None) -> list[str]:
    if not sweep:
        return []
    rows = [[("**" + g["label"] + "**") if g["label"] == sweep["best"] else g["label"], " ".join(g["flags"]),
             _f(g["pooled_decode_tokens_per_s"]), _f(g["median_decode_tokens_per_s"]),
             str(g["completion_tokens"]) if g["status"] == "ok" else g["status"]] for g in sweep["grid"]]
    return ["", f"n-gram sweep (concurrency 1, prompts {', '.join(sweep['prompts'])}; picked by "
                f"{sweep['metric']}): best **{sweep['best'] or 'none'}**", "",
            *_table(["configuration", "flags", "pooled decode tok/s", "median decode tok/s", "tokens"], rows)]


def render_markdown(results: dict) -> str:
    cfg, env = results["config"], results["environment"]
    band = env.get("bandwidth")
    lines = [
        "# Serving benchmark",
        "",
        f"- CPU: {env['cpu']}, {env['cpu_count']} cores, {cfg['threads']} threads per server"
        + (f", memory read bandwidth {band['gb_per_s']:.1f} GB/s" if band else ""),
        f"- Model: {cfg['model']}; llama-server's file: {cfg['gguf'] or '–'}"
        + (f"; llama-server {env['llama_server_version']}" if env.get("llama_server_version") else ""),
        f"- {cfg['prompts']} prompts ({', '.join(cfg['tasks'])}), max_tokens {cfg['max_tokens']}, greedy "
        f"(temperature 0), streamed through the OpenAI API; concurrency {', '.join(map(str, cfg['concurrency']))}, "
        "a fresh server and a warm-up request per phase, the servers' phases in turn"
        + (f", {cfg['rounds']} rounds (order reversed each round, requests pooled)" if cfg.get("rounds", 1) > 1 else ""),
        "- decode tok/s: per request, tokens after the first ÷ time after the first token; aggregate: all "
        "tokens ÷ wall time; TTFT: time to the first token",
        "",
        *_table(*_server_rows(results)),
        *_sweep_lines(results.get("sweep")),
        "",
        f"Command: `{results['command']}`" if results.get("command") else "",
    ]
    return "\n".join(lines).rstrip() + "\n"


def write_serving(results: dict, out_dir: str | Path) -> dict[str, Path]:
    out = output_folder(out_dir)
    paths = {"json": out / SERVING_JSON, "markdown": out / SERVING_MD}
    write_atomic(paths["json"], to_json(results) + "\n")
    write_atomic(paths["markdown"], render_markdown(results))
    return paths


def to_json(results: dict) -> str:
    return json.dumps(results, indent=2)
