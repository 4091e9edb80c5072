"""The bench's fidelity column: how close the model each engine decodes is to the float model.

Every engine names its model (`Contender.fidelity_source`): a Quasar mode its verifier
(quasar, quasar-tree and ar-w8a8 share W8A8's figure), a llama.cpp peer its GGUF file (the
-pld peers share the plain ones'), OpenVINO its int8 IR; ar-fp, ngram-fp and transformers
decode the float model itself, the reference. Each distinct model is scored once, not per
prompt, by eval.fidelity.compare_logits against the float model: top-1 agreement and
KL(float || model) over the first `tokens` tokens of the held-out text, in the windows
`quasar eval fidelity` uses. Every model is given the same token ids, so tokenization
cannot differ. A model that cannot be scored is reported with the reason, never fatal.
"""

from __future__ import annotations

from contextlib import ExitStack

from quasar.bench.engine import Contender, FidelitySource
from quasar.defaults import DEFAULT_FIDELITY_TOKENS
from quasar.eval.fidelity import DEFAULT_WINDOW, compare_logits, fidelity_text, model_logits
TEXT = "held-out calibration text (quasar.eval.fidelity.fidelity_text)"
METRICS = ("top1_agreement", "kl_mean", "kl_median", "kl_p99", "kl_max", "ppl", "tokens")
# what "at least as faithful" compares: higher top-1, lower KL mean and median
FAITHFULNESS = ("top1_agreement", "kl_mean", "kl_median")


def _sources(engines: list[Contender]) -> tuple[dict[str, FidelitySource | None], dict[str, str]]:
    """{engine: its model, None where it has none}, {engine: why its model is not known}."""
    sources, why = {}, {}
    for e in engines:
        try:
            src = e.fidelity_source()
        except Exception as exc:  # a verifier or file that cannot be had: report, do not stop the bench
            src, why[e.name] = None, f"{type(exc).__name__}: {exc}"
        else:
            if src is None:
                why[e.name] = "this engine gives no logits to measure"
        sources[e.name] = src
    return sources, why


def _open_scorers(stack: ExitStack, models: dict[str, FidelitySource], window: int, probe: list[int],
                  vocab: int) -> tuple[dict, dict[str, str]]:
    """{model key: its LogitsFn} for the models that load and give one row of `vocab`
    logits per id (tried on `probe`), {model key: why not} for the rest."""
    scorers, failed = {}, {}
    for key, src in models.items():
        try:
            fn = stack.enter_context(src.scorer(window))
            shape = tuple(fn(probe).shape)
            if shape != (len(probe), vocab):
                raise ValueError(f"logits of shape {shape} for {len(probe)} ids, the float model's {vocab} wide "
                                 "(a different vocabulary)")
        except Exception as exc:  # third-party runtimes raise anything; the message says what
            failed[key] = f"{type(exc).__name__}: {exc}"
        else:
            scorers[key] = fn
    return scorers, failed


def _score(models: dict[str, FidelitySource], llm, tokens: int, progress: bool) -> tuple[dict, dict, dict]:
    """Every model against the float one: ({key: metrics}, {key: why not}, the run's figures)."""
    ids = llm.tokenizer.encode(fidelity_text())[:tokens]
    window = min(DEFAULT_WINDOW, llm.max_context, llm.config.max_position_embeddings)
    with ExitStack() as stack:
        reference = stack.enter_context(model_logits(llm.model, window))
        vocab = reference(ids[:2]).shape[-1]
        scorers, failed = _open_scorers(stack, models, window, ids[:2], vocab)
        scores = compare_logits(reference, scorers, ids, window, progress=progress) if scorers else {}
    if not scores:
        return scores, failed, {"skipped": "no model could be scored"}
    some = next(iter(scores.values()))
    run = {k: some[k] for k in ("tokens", "window", "windows", "ppl_fp")}
    run["seconds"] = round(some["seconds_fp"] + sum(s["seconds"] for s in scores.values()), 2)
    return scores, failed, run


def _engine_record(src: FidelitySource | None, why: str | None, scores: dict, failed: dict) -> dict:
    if why is not None:
        return {"unavailable": why}
    if src.scorer is None:
        return {"reference": True}
    if src.key in failed:
        return {"model": src.key, "unavailable": failed[src.key]}
    return {"model": src.key, **{k: scores[src.key][k] for k in METRICS}}


def measure_fidelity(engines: list[Contender], llm, tokens: int = DEFAULT_FIDELITY_TOKENS,
                     progress: bool = False) -> dict:
    """results.json's "fidelity": the run's figures and, per engine, its model's
    ({"reference": true} for the float model, {"unavailable": why} where not measured)."""
    out: dict = {"text": TEXT, "tokens_requested": tokens, "engines": {}}
    if tokens == 0:
        return {**out, "skipped": "--fidelity-tokens 0"}
    if llm.loaded.quantized:
        return {**out, "skipped": "a W8A8 checkpoint has no float model to compare with"}
    sources, why = _sources(engines)
    models = {s.key: s for s in sources.values() if s is not None and s.scorer is not None}
    scores, failed = {}, {}
    if models:
        scores, failed, run = _score(models, llm, tokens, progress)
        out.update(run)
    else:
        out["skipped"] = "every engine decodes the float model"
    out["engines"] = {name: _engine_record(src, why.get(name), scores, failed) for name, src in sources.items()}
    return out


# --------------------------------------------------------------------------- matched quality

# The peers nearest in quality to each Quasar verifier (the same bits a weight), for the
# report's "matched quality" rows: (label, the peer engines of that model).
MATCHED_PEERS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "w8a8": (("llama.cpp Q8_0 copy", ("llamacpp-q8", "llamacpp-pld-q8")),
             ("OpenVINO int8", ("openvino", "openvino-pld"))),
    "w4a8": (("llama.cpp, the model's own file", ("llamacpp", "llamacpp-pld")),),
    "w4a8-small": (("llama.cpp, the model's own file", ("llamacpp", "llamacpp-pld")),),
}


def _figures(fidelity: dict, name: str) -> dict | None:
    rec = fidelity.get("engines", {}).get(name, {})
    if rec.get("reference"):
        return {"top1_agreement": 1.0, "kl_mean": 0.0, "kl_median": 0.0, "kl_p99": 0.0}
    return {k: rec.get(k) for k in ("top1_agreement", "kl_mean", "kl_median", "kl_p99")} \
        if "top1_agreement" in rec else None


def at_least_as_faithful(mode: dict | None, peer: dict | None) -> bool | None:
    """Whether a model with fidelity `mode` is at least as close to the float model as `peer`'s
    on every FAITHFULNESS figure (None: not both measured)."""
    if not mode or not peer or any(mode.get(k) is None or peer.get(k) is None for k in FAITHFULNESS):
        return None
    return mode["top1_agreement"] >= peer["top1_agreement"] and \
        all(mode[k] <= peer[k] for k in FAITHFULNESS[1:])


def matched_quality(overall: dict, fidelity: dict, modes: dict[str, tuple[str, str]]) -> list[dict]:
    """Per Quasar verifier and matched peer model: the fastest Quasar mode drafting on that
    verifier against the fastest peer on that model, tokens/s ratio and both fidelities.
    `modes`: mode -> (drafter, verifier). Peers that did not run give no row. ``matched`` says
    whether the mode is at least as faithful as the peer (the fidelity rule: only then is the
    ratio a like-for-like speed comparison; None where fidelity was not measured)."""
    def fastest(names, group):
        ran = [n for n in names if n in overall[group]]
        return max(ran, key=lambda n: overall[group][n]["tokens_per_s"], default=None)

    rows = []
    for verifier, pairs in MATCHED_PEERS.items():
        mode = fastest([m for m, (drafter, v) in modes.items() if v == verifier and drafter != "none"], "modes")
        for label, peers in pairs:
            peer = fastest(peers, "peers")
            if mode is None or peer is None:
                continue
            q, p = overall["modes"][mode]["tokens_per_s"], overall["peers"][peer]["tokens_per_s"]
            mode_fid, peer_fid = _figures(fidelity, mode), _figures(fidelity, peer)
            rows.append({"verifier": verifier, "mode": mode, "peer": peer, "peer_model": label,
                         "tokens_per_s_ratio": q / p if q and p else None, "mode_fidelity": mode_fid,
                         "peer_fidelity": peer_fid, "matched": at_least_as_faithful(mode_fid, peer_fid)})
    return rows
