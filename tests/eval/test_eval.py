"""`quasar eval`: scoring helpers are exact, every task runs end to end through the CLI,
results.json / report.md are written, and bad options fail with one clear line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from quasar.cli import main
from quasar.errors import QuasarError
from quasar.eval.windows import sliding_windows
from quasar.eval import runner, tasks
from quasar.eval.tasks import EvalConfig

ALL_TASKS = ["fidelity", "perplexity", "humaneval", "mmlu", "boolq", "asdiv"]


# --------------------------------------------------------------------------- pure helpers


def test_parse_last_number() -> None:
    assert tasks.parse_last_number("So 3 + 4 = 7. The answer is 1,200.") == 1200.0
    assert tasks.parse_last_number("half: 5/2") == 2.5
    assert tasks.parse_last_number("It costs $3.50.") == 3.5
    assert tasks.parse_last_number("-4 degrees") == -4.0
    assert tasks.parse_last_number("no digits here") is None


def test_windows_score_every_token_once() -> None:
    for n, window, stride in [(1000, 128, 64), (1000, 128, 128), (130, 128, 64), (5, 128, 64), (2, 2, 1)]:
        scored = []
        for begin, end, first in sliding_windows(n, window, stride):
            assert end - begin <= window and begin < first <= end
            # every scored token sees at least window - stride tokens of its window before it
            assert begin == 0 or first - begin >= window - max(1, min(stride, window - 1))
            scored += range(first, end)
        assert scored == list(range(1, n))


def test_parse_tasks_and_verifiers() -> None:
    assert tasks.parse_tasks("mmlu, boolq,mmlu") == ["mmlu", "boolq"]
    with pytest.raises(QuasarError, match="unknown task 'gsm8k'"):
        tasks.parse_tasks("mmlu,gsm8k")
    assert runner.parse_verifiers("fp,pruned:0.5") == ["fp", "pruned:0.5"]
    for bad in ("fp,fp", "fp,w8a8,pruned:0.5", "fp,int4", ""):
        with pytest.raises(QuasarError):
            runner.parse_verifiers(bad)


def test_compare_delta_and_agreement() -> None:
    metrics = {"fp": {"accuracy": 0.5}, "w8a8": {"accuracy": 0.25}}
    records = {"fp": [{"pred": 0}, {"pred": 1}], "w8a8": [{"pred": 0}, {"pred": 2}]}
    entry = runner.compare("mmlu", "accuracy", True, ["fp", "w8a8"], metrics, records)
    assert entry["fp"] == 0.5 and entry["w8a8"] == 0.25
    assert entry["delta"] == -0.25 and entry["delta_rel"] == -0.5 and entry["agreement"] == 0.5


def test_few_shot_prompts_use_held_back_examples() -> None:
    cfg = EvalConfig(limit=3, shots=2)
    items = tasks.load_mmlu(None, cfg)
    assert len(items) == 3
    prompt = items[0].prompt
    assert prompt.count("Question:") == 3 and prompt.count("\nAnswer: ") == 2 and prompt.endswith("Answer:")
    assert [c.strip() for c in items[0].choices][:2] == ["A", "B"]
    boolq = tasks.load_boolq(None, EvalConfig(limit=2, shots=1))
    assert boolq[0].prompt.count("\nAnswer:") == 2 and boolq[0].choices == [" yes", " no"]
    zero = tasks.load_boolq(None, EvalConfig(limit=2, shots=0))
    assert zero[0].prompt.count("\nAnswer:") == 1
    with pytest.raises(QuasarError, match="--shots"):
        tasks.load_mmlu(None, EvalConfig(limit=1, shots=99))


# --------------------------------------------------------------------------- scoring on a model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, default_model_dir):
    from conftest import make_tiny_model

    # 4 layers so that pruned:0.5 (2 layers) really differs from fp
    return make_tiny_model(tmp_path_factory.mktemp("eval") / "tiny", "llama", default_model_dir, 0,
                           num_hidden_layers=4)


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    from quasar.api import LLM

    return LLM(str(tiny_dir))


def _reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    model.cache.length = 0
    logits = model(torch.tensor([ids]))[0].double()
    return torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_sequence_logprob_matches_one_forward(tiny_llm) -> None:
    model = tiny_llm.verifier_model("fp")
    ids = tiny_llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
    ref = _reference_logprobs(model, ids)
    for chunk in (7, 16, 1000):
        total, n = tasks.sequence_logprob(model, ids, score_from=10, chunk=chunk)
        assert n == len(ids) - 10
        assert math.isclose(total, float(ref[9:].sum()), rel_tol=1e-4)


def test_score_options_matches_full_sequence(tiny_llm) -> None:
    model, tok = tiny_llm.verifier_model("fp"), tiny_llm.tokenizer
    context = tok.encode("Question: what colour is the sky?\nAnswer:")
    options = [tok.encode(" blue", add_special_tokens=False), tok.encode(" a shade of green", add_special_tokens=False)]
    scores = tasks.score_options(model, context, options)
    for opt, score in zip(options, scores):
        ref = _reference_logprobs(model, context + opt)[len(context) - 1:].sum()
        assert math.isclose(score, float(ref), rel_tol=1e-4)


# --------------------------------------------------------------------------- the CLI end to end


def _eval(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["eval", "--no-progress", *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_eval_cli_all_tasks(tiny_dir, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    rc, stdout, stderr = _eval(capsys, "--model", str(tiny_dir), "--tasks", ",".join(ALL_TASKS),
                               "--verifiers", "fp,pruned:0.5", "--limit", "2", "--check-spec",
                               "--max-new-tokens", "8", "--window", "48", "--json", "--out", str(out))
    assert rc == 0, stderr
    result = json.loads(stdout)
    assert list(result["tasks"]) == ALL_TASKS
    for name, entry in result["tasks"].items():
        assert {"fp", "pruned:0.5", "delta", "metric", "status"} <= set(entry), name
        if name == "fidelity":
            assert entry["status"] == "unavailable"  # fidelity compares fp with w8a8 or w4a8 only
            continue
        assert entry["status"] == "ok"
        assert entry["fp"] is not None and entry["pruned:0.5"] is not None
        assert entry["delta"] == pytest.approx(entry["pruned:0.5"] - entry["fp"])
    t = result["tasks"]
    assert t["perplexity"]["fp"] > 1 and t["perplexity"]["fp"] != t["perplexity"]["pruned:0.5"]
    for name in ("humaneval", "mmlu", "boolq", "asdiv"):
        assert t[name]["n"] == 2 and 0 <= t[name]["fp"] <= 1 and 0 <= t[name]["agreement"] <= 1
    for name in ("humaneval", "asdiv"):  # greedy speculative decoding == autoregressive
        for v in ("fp", "pruned:0.5"):
            assert t[name]["details"][v]["spec_identical"] == 1.0
            assert t[name]["details"][v]["spec_checked"] == 2
    assert "accuracy_text" in t["mmlu"]["details"]["fp"]
    # files: the same results, a readable report and per-item samples
    assert json.loads((out / "results.json").read_text())["tasks"].keys() == result["tasks"].keys()
    report = (out / "report.md").read_text()
    assert "| humaneval | pass@1 | 2 |" in report and "pruned:0.5" in report
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    he = [s for s in samples if s["task"] == "humaneval"]
    assert len(he) == 4 and all("completion" in s and "status" in s for s in he)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_eval_cli_bad_options(tiny_dir, capsys) -> None:
    rc, _, err = _eval(capsys, "--model", str(tiny_dir), "--tasks", "mmlu,nope", "--json")
    assert rc == 2 and "unknown task 'nope'" in err and "choose from" in err and len(err.strip().splitlines()) == 1
    rc, _, err = _eval(capsys, "--model", str(tiny_dir), "--verifiers", "fp,int3")
    assert rc == 2 and "unknown verifier 'int3'" in err
    rc, _, err = _eval(capsys, "--model", str(tiny_dir), "--tasks", "mmlu", "--shots", "40")
    assert rc == 2 and "--shots" in err


def test_eval_cli_w8a8(tiny_dir, tmp_path, capsys) -> None:
    rc, stdout, stderr = _eval(capsys, "--model", str(tiny_dir), "--tasks", "fidelity,perplexity,mmlu,humaneval",
                               "--limit", "1", "--max-new-tokens", "8", "--window", "48", "--check-spec",
                               "--json", "--out", str(tmp_path / "out"))
    assert rc == 0, stderr
    t = json.loads(stdout)["tasks"]
    for name in ("perplexity", "mmlu", "humaneval"):
        assert t[name]["status"] == "ok" and t[name]["fp"] is not None and t[name]["w8a8"] is not None
        assert t[name]["delta"] is not None
    assert t["humaneval"]["details"]["w8a8"]["spec_identical"] == 1.0
    assert t["fidelity"]["status"] == "ok"
    rc, stdout, stderr = _eval(capsys, "fidelity", "--model", str(tiny_dir), "--limit", "1", "--json")
    assert rc == 0, stderr
    # the keys `quasar eval fidelity` has always printed, in their order
    assert list(json.loads(stdout)) == ["top1_agreement", "kl_mean", "kl_median", "kl_p99", "kl_max", "ppl_fp",
                                        "ppl_w8a8", "ppl_increase",
                                        "tokens", "windows", "window", "seconds_fp", "seconds_w8a8"]
