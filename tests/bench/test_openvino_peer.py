"""The OpenVINO GenAI peers (`openvino`, `openvino-pld`): reported as unavailable without
OpenVINO, and run end to end when scripts/setup/install_openvino.sh has installed it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from quasar.bench.engine import Unavailable
from quasar.bench.openvino import (
    EXPORT_PYTHON_VAR,
    MANIFEST,
    OpenVINOPeer,
    export_dir,
    export_model,
    export_python,
    ir_weight_bytes,
)
from quasar.cli import main

FAST = ["--threads", "1", "--bandwidth-gb", "0.0625", "--no-progress", "--repeats", "1"]


def _openvino_missing() -> str | None:
    """Why the OpenVINO peers cannot run here, or None."""
    try:
        import openvino_genai  # noqa: F401
    except Exception as e:
        return f"openvino-genai not importable ({e}); run scripts/setup/install_openvino.sh"
    try:
        export_python()
    except Unavailable as e:
        return str(e)
    return None


_WHY_NOT = _openvino_missing()
needs_openvino = pytest.mark.skipif(_WHY_NOT is not None, reason=str(_WHY_NOT))


def _bench(capsys, argv: list[str]) -> dict:
    assert main(["bench", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# --------------------------------------------------------------------------- without OpenVINO


def test_missing_runtime_is_reported(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino_genai", None)  # import fails as if not installed
    peer = OpenVINOPeer("openvino", tiny_model("llama"), threads=1, eos_ids={2})
    with pytest.raises(Unavailable, match=r"openvino-genai is not importable.*install_openvino\.sh"):
        peer.prepare()
    # the benchmark goes on without them and says why
    res = _bench(capsys, ["--model", str(tiny_model("llama")), "--tasks", "code", "--n", "1",
                          "--max-new-tokens", "4", "--modes", "ar-fp", "--peers", "openvino,openvino-pld,hf",
                          "--out", str(tmp_path / "o"), *FAST])
    for name in ("openvino", "openvino-pld"):
        assert res["unavailable"][name].startswith("unavailable: openvino-genai is not importable")
        assert name not in res["peers"]
    assert res["peers"]["hf"]["tokens_per_s"] > 0


def test_missing_or_failing_exporter_is_reported(tiny_model, monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setenv(EXPORT_PYTHON_VAR, str(model / "no-such-python"))
    with pytest.raises(Unavailable, match="not an executable Python"):
        export_model(model)
    # an exporter that fails leaves no cache entry and no temporary directory behind
    monkeypatch.setenv(EXPORT_PYTHON_VAR, "/bin/false")
    with pytest.raises(Unavailable, match=r"optimum-intel could not export .* \(exit 1"):
        export_model(model)
    assert not export_dir(model).exists()
    assert not [p for p in export_dir(model).parent.iterdir() if p.name.startswith(".tmp-")]


def test_export_cache_key_follows_the_model(tiny_model):
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    assert export_dir(a) == export_dir(a)
    assert export_dir(a) != export_dir(b)
    before = export_dir(a)
    (a / "config.json").write_text((a / "config.json").read_text() + "\n")  # same content, new identity
    assert export_dir(a) != before


# --------------------------------------------------------------------------- with OpenVINO


def _check_run(r, max_new_tokens: int, eos: set[int]) -> None:
    assert 0 < r.new_tokens <= max_new_tokens and r.new_tokens == len(r.token_ids)
    assert not eos & set(r.token_ids)
    assert r.rate_tokens == r.new_tokens - 1
    assert r.prefill_s > 0 and r.decode_s > 0 and r.wall_s == pytest.approx(r.prefill_s + r.decode_s)
    # every step after prefill is in the histogram, and the tokens they emitted add up
    assert sum(r.hist.values()) == r.steps
    assert sum(k * v for k, v in r.hist.items()) == r.step_tokens


@needs_openvino
def test_openvino_peers_end_to_end(tiny_model, monkeypatch):
    from quasar.api import LLM

    model = tiny_model("llama")  # untied output head
    llm = LLM(str(model), threads=1)
    eos = set(llm.tokenizer.eos_ids)
    prompt = llm.encode([{"role": "user", "content": "abc abc abc abc abc abc abc abc abc abc"}])
    # float32 activations: on AMX CPUs OpenVINO's default is bf16, whose greedy tokens may
    # leave the float model's
    f32 = {"INFERENCE_PRECISION_HINT": "f32"}
    ar, pld = (OpenVINOPeer(n, model, threads=1, eos_ids=eos, properties=f32) for n in ("openvino", "openvino-pld"))
    ar.prepare()
    path = export_dir(model)
    assert (path / MANIFEST).is_file() and (path / "openvino_model.xml").is_file()
    assert json.loads((path / MANIFEST).read_text())["versions"]["optimum-intel"]
    # the second peer finds the export in the cache: the exporter is not run again
    monkeypatch.setenv(EXPORT_PYTHON_VAR, "/bin/false")
    pld.prepare()

    want = llm.generate(prompt_ids=prompt, max_new_tokens=16, temperature=0.0, drafter="none",
                        verifier="fp").token_ids
    a, p = ar.run(prompt, 16), pld.run(prompt, 16)
    for r in (a, p):
        _check_run(r, 16, eos)
    assert set(a.hist) == {1} and a.steps == a.step_tokens  # one token per forward
    assert max(p.hist) <= 6  # at most num_assistant_tokens drafts accepted, plus one
    # the same prompt ids, greedy: OpenVINO picks the float model's tokens on this model
    assert a.token_ids == p.token_ids == list(want)

    # bytes per step: every constant but the input embedding table (one row of it is read)
    cfg = json.loads((model / "config.json").read_text())
    table = cfg["vocab_size"] * cfg["hidden_size"]  # int8
    ir_bytes = (path / "openvino_model.bin").stat().st_size
    assert ir_bytes - table - 8 * cfg["vocab_size"] <= ar.bytes_per_step <= ir_bytes - table
    info = ar.info()
    assert info["threads"] == 1 and info["versions"]["openvino_genai"] and info["inference_precision"] == "f32"

    # fidelity: the IR's logits through OpenVINO's runtime, on the float model's ids
    from contextlib import ExitStack

    from quasar.eval.fidelity import compare_logits, model_logits

    assert ar.fidelity_source() == pld.fidelity_source()  # one IR, one figure
    ids = prompt + list(want)
    with ExitStack() as stack:
        ir = stack.enter_context(ar.fidelity_source().scorer(32))
        fp = stack.enter_context(model_logits(llm.model, 32))
        int8 = compare_logits(fp, {"int8": ir}, ids, window=32)["int8"]
        same = compare_logits(ir, {"self": ir}, ids, window=32)["self"]  # each window from an empty state
    assert same["top1_agreement"] == 1.0 and same["kl_mean"] < 1e-6
    assert 0.5 < int8["top1_agreement"] <= 1.0 and int8["kl_mean"] >= 0


@needs_openvino
@pytest.mark.slow
def test_openvino_bench_default_model(tmp_path, capsys):
    """Both peers in `quasar bench` on the default model; a short chat reply stops at EOS."""
    res = _bench(capsys, ["--model", "default", "--tasks", "code,chat", "--n", "1", "--max-new-tokens", "48",
                          "--modes", "ar-fp", "--peers", "openvino,openvino-pld", "--out", str(tmp_path / "o"),
                          *FAST])
    assert res["unavailable"] == {}
    ar, pld = res["peers"]["openvino"], res["peers"]["openvino-pld"]
    assert ar["tokens_per_s"] > 0 and pld["tokens_per_s"] > 0
    assert ar["mean_accepted"] == 1.0 and set(ar["accepted_hist"]) == {"1"}
    assert pld["mean_accepted"] > 1.0  # the code prompt repeats itself
    # the default model ties its output head to the embedding: all weights are read per step
    model_dir = Path(res["config"]["model_dir"])
    ir_bytes = (export_dir(model_dir) / "openvino_model.bin").stat().st_size
    assert ar["bytes_per_step"] == pytest.approx(ir_bytes, rel=1e-3)
    assert ir_weight_bytes(export_dir(model_dir) / "openvino_model.xml") == ar["bytes_per_step"]

    from quasar.api import LLM

    llm = LLM("default", threads=1)
    eos = set(llm.tokenizer.eos_ids)
    peer = OpenVINOPeer("openvino", llm.loaded.model_dir, threads=1, eos_ids=eos)
    peer.prepare()
    r = peer.run(llm.encode([{"role": "user", "content": "Say hi."}]), 64)
    _check_run(r, 64, eos)
    assert r.new_tokens < 64 and r.step_tokens == r.new_tokens  # stopped at EOS, which is counted, not returned
