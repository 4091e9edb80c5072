"""scripts/tools/compare_drafters.py: its config syntax, and on the default model that every config
decodes the same greedy tokens and that each round of a prompt starts from the same
recycling table (the bench's protocol), so rounds repeat step for step."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from quasar.errors import QuasarError

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tools" / "compare_drafters.py"
_spec = importlib.util.spec_from_file_location("compare_drafters", SCRIPT)
cd = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cd  # its dataclasses look their module up
_spec.loader.exec_module(cd)


def test_parse_config():
    assert cd.parse_config("chain") == cd.Config("chain", "ngram", None, None)
    assert cd.parse_config(" chain:3 ") == cd.Config("chain:3", "ngram", 3, None)
    assert cd.parse_config("tree:8@0.04") == cd.Config("tree:8@0.04", "tree", 8, 0.04)
    assert cd.parse_config("tree@0.5") == cd.Config("tree@0.5", "tree", None, 0.5)
    for bad in ("beam", "tree:x", "tree:0", "chain@-1", "tree:4@cheap", ""):
        with pytest.raises(QuasarError):
            cd.parse_config(bad)


def test_main_rejects_bad_options(capsys):
    assert cd.main(["--configs", "chain;chain"]) == 2
    assert "twice" in capsys.readouterr().err
    assert cd.main(["--configs", "tree", "--rounds", "0"]) == 2
    assert "--rounds" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("verifier", ["w8a8", "w4a8"])
def test_configs_agree_and_rounds_repeat(verifier):
    from quasar.api import LLM

    llm = LLM("default", max_context=2048, max_batch=1)
    configs = [cd.parse_config(c) for c in ("chain", "tree:6", "tree:6@0.5")]
    out = cd.compare(llm, configs, ["code", "summarization"], n=1, rounds=2, max_new_tokens=24, verifier=verifier)
    assert out.same_output
    assert set(out.overall) == {"chain", "tree:6", "tree:6@0.5"}
    tokens = {t.tokens for t in out.overall.values()}
    assert len(tokens) == 1 and tokens.pop() > 0
    for tally in out.overall.values():
        assert tally.mean_accepted >= 1.0 and tally.rate > 0
    # every round of a prompt starts from the table as it was before its first run
    for key, steps in out.round_steps.items():
        assert len(steps) == 2 and steps[0] == steps[1], key
    text = cd.report(out)
    assert "same output for every config: yes" in text and "| tree:6 |" in text
