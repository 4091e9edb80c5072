"""The engine layer: one parser of verifier names (`VerifierSpec`), an `Engine` that builds
each verifier once and keeps it, and no lower layer reaching back up into quasar.api."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import quasar
from quasar.api import LLM
from quasar.engine.engine import Engine
from quasar.engine.plan import DecodePlan
from quasar.engine.spec import VerifierSpec
from quasar.errors import QuasarError
from quasar.quant.options import QuantOptions
from tests.conftest import make_tiny_model

CHEAP_QUANT = QuantOptions(samples=2, seq_len=32)


# --------------------------------------------------------------------------- VerifierSpec


@pytest.mark.parametrize("name, spec", [
    ("fp", VerifierSpec("fp")),
    ("w8a8", VerifierSpec("w8a8")),
    ("w4a8", VerifierSpec("w4a8", layout="faithful")),
    ("w4a8-small", VerifierSpec("w4a8", layout="small")),
    ("pruned:0.5", VerifierSpec("pruned", fraction=0.5)),
    ("pruned:1", VerifierSpec("pruned", fraction=1.0)),
])
def test_a_name_parses_to_its_spec_and_back(name, spec):
    parsed = VerifierSpec.parse(name)
    assert parsed == spec and hash(parsed) == hash(spec)
    assert str(parsed) == name and parsed.name == name
    assert VerifierSpec.parse(parsed) is parsed  # a spec passes through unparsed
    assert parsed.quantized == (name in ("w8a8", "w4a8", "w4a8-small"))


def test_two_spellings_of_one_verifier_are_one_spec():
    specs = {VerifierSpec.parse(n) for n in ("pruned:0.5", "pruned:0.50", "pruned:5e-1", "pruned:.5")}
    assert len(specs) == 1 and str(specs.pop()) == "pruned:0.5"
    assert VerifierSpec("w4a8") == VerifierSpec.parse("w4a8")  # the faithful layout by default
    # fractions equal to the digits their names show are one spec, as their names are one
    a, b = VerifierSpec.parse("pruned:0.12345678901234567"), VerifierSpec.parse("pruned:0.1234567890123457")
    assert a == b and str(a) == str(b)


@pytest.mark.parametrize("name, message", [
    ("bogus", "unknown verifier 'bogus'; choose one of fp, w8a8, w4a8, w4a8-small, pruned:F"),
    ("W8A8", "unknown verifier 'W8A8'"),
    ("pruned", "unknown verifier 'pruned'"),
    ("pruned:0", r"pruned verifier needs a fraction in \(0, 1\], e.g. pruned:0.5; got 'pruned:0'"),
    ("pruned:1.5", "needs a fraction in"),
    ("pruned:x", "needs a fraction in"),
    ("pruned:nan", "needs a fraction in"),
    ("", "unknown verifier ''"),
    (None, "verifier must be a name"),
    (8, "verifier must be a name"),
])
def test_a_bad_name_is_an_error_naming_the_verifier(name, message):
    with pytest.raises(QuasarError, match=message) as err:
        VerifierSpec.parse(name)
    assert err.value.param == "verifier"


@pytest.mark.parametrize("kwargs", [dict(kind="int4"), dict(kind="w4a8", layout="tiny"),
                                    dict(kind="w8a8", layout="small"), dict(kind="pruned"),
                                    dict(kind="pruned", fraction=2.0), dict(kind="fp", fraction=0.5)])
def test_a_spec_built_directly_is_checked_too(kwargs):
    with pytest.raises(QuasarError) as err:
        VerifierSpec(**kwargs)
    assert err.value.param == "verifier"


def test_a_plan_carries_a_spec_and_names_it():
    from quasar.speculative.options import DecodeOptions

    plan = DecodePlan(VerifierSpec.parse("w4a8-small"), DecodeOptions())
    assert plan.verifier == "w4a8-small" and plan.verifier_spec.layout == "small"
    with pytest.raises(QuasarError):
        DecodePlan("w8a8", DecodeOptions())  # parsed where the request entered, never here


# --------------------------------------------------------------------------- Engine


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp("m") / "char", "llama", None, seed=3)
    return LLM(str(d), drafter="ngram", verifier="fp", max_context=64, max_batch=2, quant=CHEAP_QUANT)


def test_the_engine_builds_each_verifier_once_and_reuses_it(llm, monkeypatch):
    engine = llm.engine
    assert isinstance(engine, Engine) and engine.quant is CHEAP_QUANT and engine.max_batch == llm.max_batch == 2
    built = []
    real = engine._build
    monkeypatch.setattr(engine, "_build", lambda spec: built.append(spec) or real(spec))
    names = ("fp", "pruned:0.5", "pruned:0.50", "w8a8", "w4a8", "w4a8-small")
    first = {n: llm.verifier_model(n) for n in names}
    again = {n: engine.model(VerifierSpec.parse(n)) for n in names}
    assert all(first[n] is again[n] for n in names)
    assert first["pruned:0.5"] is first["pruned:0.50"]
    assert [str(s) for s in built] == [n for n in names if n != "pruned:0.50"]  # one build a verifier
    assert llm.resident_verifiers == [str(s) for s in built]
    for n in names:  # each has its KV cache of max_batch slots, empty after the warm-up step
        cache = first[n].cache
        assert cache.n_slots == 2 and cache.max_seq_len == 64 and cache.lengths == [0, 0]
    # a released verifier goes, with its recycling table; a later use builds it again
    table = llm.recycling_table("pruned:0.5")
    assert engine.recycling_table(VerifierSpec.parse("pruned:0.50")) is table
    llm.release_verifier("pruned:0.50")
    assert "pruned:0.5" not in llm.resident_verifiers
    assert llm.recycling_table("pruned:0.5") is not table
    assert llm.verifier_model("pruned:0.5") is not first["pruned:0.5"] and len(built) == len(names)


def test_the_engine_prices_and_names_each_verifier(llm):
    from quasar.kernels import ext

    engine = llm.engine
    fp, w8, w4 = (VerifierSpec.parse(n) for n in ("fp", "w8a8", "w4a8-small"))
    assert engine.prefers_trees(fp) is False and engine.resolve_drafter("auto", fp) == "ngram"
    assert engine.kernel_path(fp) == llm.kernel_path() == llm.kernel_path("pruned:0.5") == ext.PYTORCH_PATH
    assert engine.kernel_path(w8) == ext.kernel_path() and engine.kernel_path(w4) == ext.w4a8_kernel_path()
    costs = engine.step_costs(w8)
    assert engine.prefers_trees(w8) == (costs is not None and costs.prefers_trees)
    assert llm.resolve_drafter("auto", "w8a8") == engine.resolve_drafter("auto", w8)
    assert engine.resolve_drafter("tree", fp) == "tree" and llm.resolve_drafter(None, fp) == "ngram"


def test_llm_takes_a_name_or_a_spec_and_reports_names(llm):
    spec = VerifierSpec("pruned", fraction=0.5)
    by_spec = llm.generate("abcabcabc", raw=True, max_new_tokens=8, verifier=spec)
    by_name = llm.generate("abcabcabc", raw=True, max_new_tokens=8, verifier="pruned:0.50")
    assert by_spec.token_ids == by_name.token_ids
    assert by_spec.verifier == by_name.verifier == "pruned:0.5"
    json.dumps(by_spec.as_dict())  # results stay plain data
    plan = llm.check_options(verifier="w4a8-small", drafter="tree")
    assert plan.verifier_spec == VerifierSpec("w4a8", layout="small") and plan.verifier == "w4a8-small"
    assert llm.plan(plan.options).verifier == llm.verifier == "fp"
    with pytest.raises(QuasarError, match="unknown verifier 'fp16'") as err:
        llm.check_options(verifier="fp16")
    assert err.value.param == "verifier"


def test_a_bad_verifier_fails_before_the_model_loads():
    with pytest.raises(QuasarError, match="needs a fraction") as err:
        LLM("/no/such/model", verifier="pruned:2")
    assert err.value.param == "verifier"


# --------------------------------------------------------------------------- layering

BELOW_THE_API = ("engine", "speculative", "runtime")


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return found


def test_nothing_below_the_api_imports_it():
    root = Path(quasar.__file__).parent
    files = [f for layer in BELOW_THE_API for f in sorted((root / layer).rglob("*.py"))]
    assert len(files) > 10
    upward = {str(f.relative_to(root)): sorted(m for m in _imports(f) if m == "quasar.api" or m.startswith(
        ("quasar.api.", "quasar.server", "quasar.cli", "quasar.bench", "quasar.eval"))) for f in files}
    assert not {f: m for f, m in upward.items() if m}
