"""`quasar bench` on a tiny model: runs end to end, JSON and report agree, bad inputs fail
clearly. One torch thread, a small bandwidth buffer and a short fidelity text keep it quick
on a busy 2-core box."""

from __future__ import annotations

import importlib.util
import json
import math
import re

import pytest

from quasar.cli import main
from quasar.defaults import DEFAULT_DRAFT_BUDGET
from quasar.data.packages import default_model_path

FIDELITY_TOKENS = 128
FAST = ["--threads", "1", "--max-new-tokens", "8", "--bandwidth-gb", "0.0625", "--no-progress",
        "--fidelity-tokens", str(FIDELITY_TOKENS)]


def _run_json(capsys, argv: list[str]) -> dict:
    assert main(["bench", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out)


def _report_rows(md: str, heading: str) -> dict[str, dict[str, str]]:
    """The engine table under `## heading` as {engine: {column: cell}}."""
    section = md.split(f"## {heading}", 1)[1].splitlines()
    start = next(i for i, ln in enumerate(section) if ln.startswith("|"))
    lines = []
    for ln in section[start:]:  # the first table only
        if not ln.startswith("|"):
            break
        lines.append(ln)
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def _check_consistent(section: dict, rows: dict[str, dict[str, str]]) -> None:
    base = section["modes"]["ar-fp"]["tokens_per_s"]
    for group in ("modes", "peers"):
        for name, m in section[group].items():
            # JSON: the speedup is exactly the ratio of tokens/s
            assert m["speedup_vs_ar_fp"] == pytest.approx(m["tokens_per_s"] / base, rel=1e-4)
            # report: the speedup column is the ratio of the tokens/s column, up to rounding
            row = rows[name]
            tps, base_tps = float(row["tokens/s"]), float(rows["ar-fp"]["tokens/s"])
            shown = float(row["speedup vs ar-fp"].rstrip("x"))
            assert shown == pytest.approx(tps / base_tps, rel=0.01, abs=0.011)
            assert float(row["acceptance length"]) == pytest.approx(m["mean_accepted"], abs=0.006)


def _check_fidelity(res: dict, md: str) -> None:
    """Every engine that ran has a fidelity record, measured ones on the same tokens, and the
    report's Overall table shows them."""
    fid = res["fidelity"]
    assert set(fid["engines"]) == set(res["modes"]) | set(res["peers"])
    assert fid["tokens_requested"] == FIDELITY_TOKENS
    rows = _report_rows(md, "Overall")
    for name, rec in fid["engines"].items():
        if rec.get("reference"):
            assert rows[name]["top-1 vs fp"] == rows[name]["KL vs fp: mean"] == rows[name]["p99"] == "reference"
        elif "top1_agreement" in rec:
            assert rec["tokens"] == fid["tokens"] == FIDELITY_TOKENS - 1  # predictions; the text is far longer
            assert 0.0 <= rec["top1_agreement"] <= 1.0 and math.isfinite(rec["kl_mean"]) and rec["kl_mean"] >= 0
            # (results.json rounds to 6 decimals, the report formats the unrounded figure)
            assert float(rows[name]["top-1 vs fp"].rstrip("%")) == pytest.approx(100 * rec["top1_agreement"], abs=0.051)
            for column, key in (("KL vs fp: mean", "kl_mean"), ("median", "kl_median"), ("p99", "kl_p99")):
                assert float(rows[name][column]) == pytest.approx(rec[key], rel=0.01, abs=1e-6)
            assert rec["kl_median"] <= rec["kl_p99"] <= rec["kl_max"]
        else:
            assert rows[name]["top-1 vs fp"] == "–" and rec["unavailable"]


def test_bench_end_to_end(tiny_model, tmp_path, capsys):
    model = tiny_model("llama")
    out = tmp_path / "out"
    res = _run_json(capsys, ["--model", str(model), "--tasks", "code,chat", "--n", "1", "--repeats", "2",
                             "--modes", "ar-fp,ngram-fp,ngram-pruned", "--peers", "hf,hf-pld,llamacpp",
                             "--out", str(out), *FAST])
    # --json prints what results.json holds
    assert json.loads((out / "results.json").read_text()) == res
    assert set(res["modes"]) == {"ar-fp", "ngram-fp", "ngram-pruned"}
    for name, m in res["modes"].items():
        assert m["tokens_per_s"] > 0 and m["new_tokens"] > 0 and m["prompts"] == 2
        assert m["step_ms"] > 0 and m["bytes_per_step"] > 0 and 0 < m["floor_fraction"]
        assert m["kv_bytes_per_step"] > 0  # our float32 cache, counted in the floor
    assert res["modes"]["ar-fp"]["speedup_vs_ar_fp"] == 1.0
    assert res["modes"]["ar-fp"]["mean_accepted"] == 1.0  # exactly: one token per step
    assert set(res["modes"]["ar-fp"]["accepted_hist"]) == {"1"}
    assert res["modes"]["ngram-fp"]["mean_accepted"] >= 1.0
    # peer hf ran on the same model and prompt ids
    hf = res["peers"]["hf"]
    assert hf["tokens_per_s"] > 0 and hf["mean_accepted"] == 1.0 and hf["bytes_per_step"] > 0
    assert res["peers"]["hf-pld"]["mean_accepted"] >= 1.0
    # llama.cpp cannot run on a Hugging Face directory (or is not installed): reported, skipped
    assert res["unavailable"]["llamacpp"].startswith("unavailable: ")
    assert "llamacpp" not in res["peers"]
    # per task, same keys
    assert set(res["tasks"]) == {"code", "chat"}
    for task in res["tasks"].values():
        assert task["modes"]["ar-fp"]["mean_accepted"] == 1.0
        assert {"tokens_per_s", "mean_accepted", "speedup_vs_ar_fp"} <= set(task["modes"]["ngram-fp"])
    # protocol is recorded
    assert res["config"]["threads"] == 1 and res["config"]["repeats"] == 2
    assert res["bandwidth"]["gb_per_s"] > 0 and len(res["bandwidth"]["samples_gb_per_s"]) >= 2
    assert res["resources"]["peak_rss_gb"] > 0 and res["resources"]["seconds"] > 0
    assert all(len(p["engines"]["ar-fp"]["decode_s_samples"]) == 2 for p in res["prompts"])
    # which vector extensions the llama.cpp peer was built for (a forced-AVX2 run is fair
    # only against an AVX2 llama.cpp), when llama-cpp-python is installed
    isa = res["environment"]["llama_cpp_isa"]
    assert (isa is None) == (importlib.util.find_spec("llama_cpp") is None)
    if isa is not None:
        assert "AVX2" in isa.split(", ") or isa == "no AVX"

    md = (out / "report.md").read_text()
    assert f"peak RSS {res['resources']['peak_rss_gb']:.2f} GB" in md
    assert (f"(built for {isa})" in md) == (isa is not None)
    _check_consistent(res, _report_rows(md, "Overall"))
    for task, section in res["tasks"].items():
        _check_consistent(section, _report_rows(md, f"Task: {task}"))
    assert _report_rows(md, "Overall")["ar-fp"]["acceptance length"] == "1.00"
    assert "llamacpp" in md.split("## Not measured", 1)[1]
    _check_fidelity(res, md)
    fid = res["fidelity"]["engines"]
    for name in ("ar-fp", "ngram-fp", "hf", "hf-pld"):  # the float model itself
        assert fid[name] == {"reference": True}
    # the negative control's verifier is scored like any other model; of two layers it keeps both
    # (first and last), so here it is the float model itself through the same code path
    pruned = fid["ngram-pruned"]
    assert pruned["model"] == "verifier pruned:0.5" and pruned["top1_agreement"] == 1.0 and pruned["kl_mean"] < 1e-9
    assert "llamacpp" not in fid  # it did not run
    assert res["matched_quality"] == []  # no W8A8 mode, no peer of its precision
    if importlib.util.find_spec("matplotlib"):
        for png in ("speedup.png", "acceptance.png"):
            assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert f"]({png})" in md


def test_bench_prompt_file_categories(tiny_model, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(o) for o in [
        {"prompt": "def add(a, b):\n    ", "category": "code"},
        {"messages": [{"role": "user", "content": "Say hello."}], "category": "greet"},
        {"turns": ["Count to three.", "Now to four."]},
    ]) + "\n")
    res = _run_json(capsys, ["--model", str(tiny_model("qwen2")), "--prompts", str(prompts), "--repeats", "1",
                             "--modes", "ngram-fp", "--peers", "none", "--out", str(tmp_path / "o"), *FAST,
                             "--fidelity-tokens", "0"])
    assert res["fidelity"]["skipped"] == "--fidelity-tokens 0" and res["fidelity"]["engines"] == {}
    assert "Fidelity vs the float model: not measured (--fidelity-tokens 0)" in (tmp_path / "o" / "report.md").read_text()
    assert set(res["tasks"]) == {"code", "greet", "custom"}
    assert set(res["modes"]) == {"ar-fp", "ngram-fp"}  # the baseline is always run
    assert res["peers"] == {}


def test_bench_w8a8_modes(tiny_model, tmp_path, capsys):
    res = _run_json(capsys, ["--model", str(tiny_model("llama")), "--tasks", "code", "--n", "1", "--repeats", "1",
                             "--modes", "ar-fp,ar-w8a8,quasar,quasar-tree", "--peers", "none", "--out",
                             str(tmp_path / "o"), *FAST])
    assert res["unavailable"] == {}
    assert res["modes"]["ar-w8a8"]["mean_accepted"] == 1.0
    assert res["modes"]["quasar"]["mean_accepted"] >= 1.0 and res["modes"]["quasar-tree"]["mean_accepted"] >= 1.0
    assert res["config"]["draft_budget"] == DEFAULT_DRAFT_BUDGET
    tree_l = next(r for r in res["ratios"] if r["name"].startswith("quasar-tree acceptance"))
    assert tree_l["value"] == pytest.approx(res["modes"]["quasar-tree"]["mean_accepted"]
                                            / res["modes"]["quasar"]["mean_accepted"])
    # exactness: both drafting modes give ar-w8a8's greedy tokens, and the report says so
    assert res["modes"]["quasar"]["same_output_as_own_ar"] == res["modes"]["quasar-tree"]["same_output_as_own_ar"] == 1
    assert res["modes"]["ar-w8a8"]["same_output_as_own_ar"] is None and not res["warnings"]
    assert "Exactness (greedy drafting gives its verifier's autoregressive tokens): quasar 100% of prompts, " \
           "quasar-tree 100% of prompts" in (tmp_path / "o" / "report.md").read_text()
    # int8 weights: fewer bytes per step than the float model
    assert res["modes"]["ar-w8a8"]["bytes_per_step"] < res["modes"]["ar-fp"]["bytes_per_step"]
    base = res["modes"]["ar-fp"]["tokens_per_s"]
    assert res["modes"]["quasar"]["speedup_vs_ar_fp"] == pytest.approx(res["modes"]["quasar"]["tokens_per_s"] / base,
                                                                       rel=1e-4)
    # one verifier, one figure: the three W8A8 modes share it
    fid = res["fidelity"]["engines"]
    assert fid["ar-w8a8"] == fid["quasar"] == fid["quasar-tree"] and fid["quasar"]["model"] == "verifier w8a8"
    assert 0.5 < fid["quasar"]["top1_agreement"] <= 1.0
    _check_fidelity(res, (tmp_path / "o" / "report.md").read_text())


def test_bench_w4a8_modes(tiny_model, tmp_path, capsys):
    """The W4A8 verifier's modes: the chain and the tree both give ar-w4a8's greedy tokens and
    share its fidelity figure."""
    res = _run_json(capsys, ["--model", str(tiny_model("llama")), "--tasks", "code", "--n", "1", "--repeats", "1",
                             "--modes", "ar-w4a8,quasar-w4a8,quasar-w4a8-tree", "--peers", "none", "--out",
                             str(tmp_path / "o"), *FAST])
    modes = res["modes"]
    assert res["unavailable"] == {} and not res["warnings"]
    assert modes["ar-w4a8"]["mean_accepted"] == 1.0 and modes["quasar-w4a8-tree"]["mean_accepted"] >= 1.0
    assert modes["quasar-w4a8"]["same_output_as_own_ar"] == modes["quasar-w4a8-tree"]["same_output_as_own_ar"] == 1
    fid = res["fidelity"]["engines"]
    assert fid["ar-w4a8"] == fid["quasar-w4a8"] == fid["quasar-w4a8-tree"]
    assert fid["quasar-w4a8-tree"]["model"] == "verifier w4a8"


@pytest.mark.parametrize("content, match", [
    (None, r"file not found"),
    ("", r"file is empty"),
    ('{"prompt": "ok"}\n{"prompt": "oops"\n', r"p\.jsonl:2: invalid JSON"),
    ('{"prompt": "ok"}\n\n{"text": "no prompt key"}\n', r"p\.jsonl:3: need exactly one of 'prompt', 'messages', 'turns'"),
    ('{"messages": [{"role": "robot", "content": "x"}]}\n', r"p\.jsonl:1: messages\[0\]\.role"),
])
def test_bad_prompt_files(tmp_path, capsys, content, match):
    path = tmp_path / "p.jsonl"
    if content is not None:
        path.write_text(content)
    # fails before any model is loaded: the model path does not even exist
    assert main(["bench", "--model", str(tmp_path / "no-model"), "--prompts", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(match, err), err


def test_bad_mode_and_peer_names(capsys):
    for argv in (["--modes", "turbo"], ["--peers", "vllm"], ["--tasks", "poetry"]):
        with pytest.raises(SystemExit) as e:
            main(["bench", *argv])
        assert e.value.code == 2
        assert "choose from" in capsys.readouterr().err


def _cpuinfo(vendor: str, family: int, model: int, name: str) -> str:
    block = f"processor\t: {{}}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\nmodel name\t: {name}\n"
    return block.format(0) + "\n" + block.format(1).replace(name, "other")


def test_reports_name_the_cpu_beyond_a_masked_model_name():
    from quasar.bench.runner import describe_cpu

    # VMs show "AMD EPYC" for every generation; the family and model tell Zen 4 from Zen 5.
    assert describe_cpu(_cpuinfo("AuthenticAMD", 25, 17, "AMD EPYC")) == "AMD EPYC (AMD family 25 model 17: Zen 4)"
    assert describe_cpu(_cpuinfo("AuthenticAMD", 26, 2, "AMD EPYC")) == "AMD EPYC (AMD family 26 model 2: Zen 5)"
    assert describe_cpu(_cpuinfo("AuthenticAMD", 25, 1, "AMD EPYC 7763")) == "AMD EPYC 7763 (AMD family 25 model 1: Zen 3)"
    intel = describe_cpu(_cpuinfo("GenuineIntel", 6, 143, "Intel(R) Xeon(R) Platinum 8480+"))
    assert intel == "Intel(R) Xeon(R) Platinum 8480+ (Intel family 6 model 143)"
    assert describe_cpu("processor\t: 0\n") is None
    assert describe_cpu("model name\t: Some CPU\n") == "Some CPU"


def test_bandwidth_measurement():
    from quasar.bench.bandwidth import combine, measure_read_bandwidth
    from quasar.errors import QuasarError

    m = measure_read_bandwidth(16 << 20, repeats=3, threads=1)
    assert m["gb_per_s"] > 0 and len(m["samples_gb_per_s"]) == 3 and m["bytes"] == 16 << 20
    both = combine([m, m])
    assert len(both["samples_gb_per_s"]) == 6 and both["gb_per_s"] == pytest.approx(m["gb_per_s"])
    with pytest.raises(QuasarError, match="at least 4 MiB"):
        measure_read_bandwidth(1024)


def test_aggregate_definitions():
    from quasar.bench.runner import aggregate

    recs = [
        {"new_tokens": 10, "rate_tokens": 10, "step_tokens": 10, "steps": 5, "decode_s": 1.0, "wall_s": 1.5,
         "hist": {"1": 3, "2": 1, "5": 1}, "deterministic": True, "same_as_ar_fp": True},
        {"new_tokens": 6, "rate_tokens": 6, "step_tokens": 7, "steps": 7, "decode_s": 1.0, "wall_s": 1.0,
         "hist": {"1": 7}, "deterministic": True, "same_as_ar_fp": False},
    ]
    m = aggregate(recs, bytes_per_step=10**8, bandwidth_gbps=10.0)
    assert m["tokens_per_s"] == pytest.approx(16 / 2.0)  # total tokens / total decode time
    assert m["e2e_tokens_per_s"] == pytest.approx(16 / 2.5)
    assert m["mean_accepted"] == pytest.approx(17 / 12)
    assert m["step_ms"] == pytest.approx(2000 / 12)
    assert m["floor_ms"] == pytest.approx(10.0)
    assert m["floor_fraction"] == pytest.approx(10.0 / (2000 / 12))
    assert m["accepted_hist"] == {"1": 10, "2": 1, "5": 1}
    assert m["same_output_as_ar_fp"] == 0.5
    assert m["same_output_as_own_ar"] is None  # no record compared with its verifier's AR mode
    assert m["kv_bytes_per_step"] is None  # records without a KV estimate: weights alone


def test_the_floor_counts_the_kv_cache_a_step_reads():
    """Each step reads its context's K and V in every layer: prompt + half the output on
    average, in the engine's precision; the floor adds it to the weights."""
    from quasar.bench.engine import RunResult
    from quasar.bench.runner import _median_run, aggregate, kv_token_bytes
    from quasar.models.config import ModelConfig

    cfg = ModelConfig(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    per_token = kv_token_bytes(cfg, 4)
    assert per_token == 3 * 2 * 2 * 16 * 4
    assert kv_token_bytes(cfg, None) is None
    run = RunResult(token_ids=list(range(20)), new_tokens=20, rate_tokens=20, step_tokens=20, steps=10,
                    prefill_s=0.1, decode_s=1.0, wall_s=1.1)
    rec = _median_run([run], prompt_tokens=100, kv_token_bytes=per_token)
    assert rec["kv_bytes"] == 10 * (100 + 10) * per_token
    m = aggregate([rec], bytes_per_step=10**6, bandwidth_gbps=1.0)
    assert m["kv_bytes_per_step"] == 110 * per_token
    assert m["floor_ms"] == pytest.approx((10**6 + 110 * per_token) / 1e9 * 1e3)
    unknown = aggregate([_median_run([run], 100, None)], bytes_per_step=10**6, bandwidth_gbps=1.0)
    assert unknown["kv_bytes_per_step"] is None and unknown["floor_ms"] == pytest.approx(1.0)


class _FakeLlama:
    """Mimics llama_cpp.Llama.generate: eval the prompt, then per step eval the last token
    plus drafts and yield the accepted ones; the script says how many per step."""

    def __init__(self, per_step: list[int], eos: int = 2):
        self.per_step, self.eos, self.evals = per_step, eos, []

    def token_eos(self):
        return self.eos

    def reset(self):
        pass

    def eval(self, tokens):
        self.evals.append(list(tokens))

    def generate(self, tokens, **kw):
        self.eval(tokens)
        tok = 100
        yield tok  # from the prompt forward
        for n in self.per_step:
            self.eval([tok])
            for _ in range(n):
                tok += 1
                yield tok


def test_llamacpp_peer_counts_steps_without_llama_cpp():
    from quasar.bench.peers import LlamaCppPeer

    peer = LlamaCppPeer("llamacpp-pld", None, threads=1, n_ctx=64, eos_ids={2})
    fake = _FakeLlama([1, 3, 2, 1, 3])
    peer.attach(fake)
    r = peer.run([1, 5, 6], max_new_tokens=6)  # stops at the 6th token: steps emit 1, 3, 1
    assert r.token_ids == [100, 101, 102, 103, 104, 105] and r.new_tokens == 6
    assert r.steps == 3 and r.step_tokens == 5 and r.rate_tokens == 5
    assert dict(r.hist) == {1: 2, 3: 1}
    assert r.decode_s >= 0 and r.wall_s >= r.decode_s
    # EOS ends the run: counted as emitted by its step, not output
    peer2 = LlamaCppPeer("llamacpp", None, threads=1, n_ctx=64, eos_ids={103})
    peer2.attach(_FakeLlama([1, 1, 1, 1]))
    r = peer2.run([1], max_new_tokens=50)
    assert r.token_ids == [100, 101, 102] and r.steps == 3 and r.step_tokens == 3 and dict(r.hist) == {1: 3}


def test_tree_mode_runs_of_a_prompt_never_draft_from_their_own_decode(tiny_model):
    """The bench's tree mode shares the recycling table across prompts, but each run of a
    prompt (warm-up, repeats) starts from the table as it was before that prompt's first run:
    the same drafts, the same steps, every time."""
    from quasar.api import LLM
    from quasar.bench.runner import BenchConfig, QuasarMode

    llm = LLM(str(tiny_model("llama")), verifier="fp", max_context=128)
    mode = QuasarMode("quasar-tree", llm, BenchConfig(num_draft=5, draft_budget=8))
    mode.verifier = "fp"  # the float verifier: no quantization in this test
    table = llm.recycling_table("fp")
    ids = llm.encode("def add(a, b):\n    return a + b\n\ndef add(a, b):", raw=True)
    other = llm.encode("Once upon a time there was a", raw=True)
    first = mode.run(ids, 12)
    assert len(table) > 0  # the prompt's decode taught the shared table ...
    mode.run(other, 12)
    again = mode.run(ids, 12)  # ... but not its own later runs
    assert (again.steps, again.hist, again.token_ids) == (first.steps, first.hist, first.token_ids)
    assert mode.run(other, 12).steps == mode.run(other, 12).steps


def test_bench_on_a_w8a8_checkpoint(tiny_char_model, tmp_path, capsys):
    """A W8A8 checkpoint has no float weights: ar-fp is reported unavailable (not run on the
    int8 model under its name), the int8 modes run, nothing is relative to a missing baseline;
    --gguf gives the llama.cpp peers their file."""
    ckpt = tmp_path / "w8a8"
    assert main(["quantize", "--model", str(tiny_char_model("llama")), "--out", str(ckpt), "--samples", "2",
                 "--seq-len", "32", "--no-progress"]) == 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "abcabcabc"}) + "\n")
    gguf = default_model_path()
    res = _run_json(capsys, ["--model", str(ckpt), "--prompts", str(prompts), "--repeats", "1",
                             "--modes", "ar-w8a8,quasar", "--peers", "llamacpp", "--gguf", str(gguf),
                             "--out", str(tmp_path / "o"), *FAST])
    assert set(res["modes"]) == {"ar-w8a8", "quasar"}
    assert "no float weights" in res["unavailable"]["ar-fp"]
    assert res["config"]["gguf"] == str(gguf)
    if "llamacpp" in res["unavailable"]:  # llama-cpp-python is optional; the file was found
        assert "GGUF" not in res["unavailable"]["llamacpp"]
    for row in [*res["modes"].values(), *res["peers"].values()]:
        assert row["speedup_vs_ar_fp"] is None and row["same_output_as_ar_fp"] is None
    assert res["modes"]["quasar"]["tokens_per_s"] > 0
    md = (tmp_path / "o" / "report.md").read_text()
    assert "speedup.png" not in md
    assert "no float model" in res["fidelity"]["skipped"] and res["fidelity"]["engines"] == {}


def test_bench_gguf_must_be_a_gguf_file(tmp_path, capsys):
    assert main(["bench", "--gguf", str(tmp_path / "missing.gguf"), "--peers", "none", *FAST]) == 2
    assert "--gguf" in capsys.readouterr().err


def test_bench_fidelity_tokens_must_be_0_or_at_least_2(capsys):
    for bad, message in (("-1", "must be an integer >= 0"), ("1", "must be 0 (skip) or at least 2")):
        assert main(["bench", "--peers", "none", *FAST, "--fidelity-tokens", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --fidelity-tokens {message}") and "Traceback" not in err


# --------------------------------------------------------------------------- fidelity


def test_matched_quality_pairs_each_verifier_with_the_peers_of_its_precision():
    from quasar.bench.fidelity import matched_quality
    from quasar.bench.runner import MODES

    overall = {"modes": {"ar-fp": {"tokens_per_s": 10.0}, "ar-w8a8": {"tokens_per_s": 40.0},
                         "quasar": {"tokens_per_s": 60.0}, "quasar-tree": {"tokens_per_s": 80.0}},
               "peers": {"llamacpp": {"tokens_per_s": 50.0}, "llamacpp-q8": {"tokens_per_s": 20.0},
                         "llamacpp-pld-q8": {"tokens_per_s": 25.0}}}
    w8a8 = {"model": "verifier w8a8", "top1_agreement": 0.97, "kl_mean": 0.01, "kl_median": 0.004, "kl_p99": 0.1}
    fidelity = {"engines": {"ar-fp": {"reference": True}, "ar-w8a8": w8a8, "quasar": w8a8, "quasar-tree": w8a8,
                            "llamacpp": {"model": "gguf a", "top1_agreement": 0.9, "kl_mean": 0.1},
                            "llamacpp-q8": {"model": "gguf b", "unavailable": "ValueError: no"},
                            "llamacpp-pld-q8": {"model": "gguf b", "unavailable": "ValueError: no"}}}
    rows = matched_quality(overall, fidelity, MODES)
    # W8A8's fastest drafting mode against the fastest engine on the Q8_0 copy; no OpenVINO ran,
    # and no mode decodes with a 4-bit verifier, so nothing pairs with the model's own Q4 file
    assert rows == [{"verifier": "w8a8", "mode": "quasar-tree", "peer": "llamacpp-pld-q8",
                     "peer_model": "llama.cpp Q8_0 copy", "tokens_per_s_ratio": 80.0 / 25.0,
                     "mode_fidelity": {"top1_agreement": 0.97, "kl_mean": 0.01, "kl_median": 0.004, "kl_p99": 0.1},
                     "peer_fidelity": None, "matched": None}]


def test_a_pair_is_matched_only_where_quasar_is_at_least_as_faithful():
    """The fidelity rule: a W4A8 mode pairs with llama.cpp on the same file as a like-for-like
    comparison only if its top-1 is no lower and its KL mean and median no higher."""
    from quasar.bench.fidelity import at_least_as_faithful, matched_quality
    from quasar.bench.runner import MODES

    peer = {"top1_agreement": 0.97, "kl_mean": 0.0025, "kl_median": 0.0017, "kl_p99": 0.014}
    better = {"top1_agreement": 0.973, "kl_mean": 0.0020, "kl_median": 0.0015, "kl_p99": 0.02}
    assert at_least_as_faithful(better, peer) and at_least_as_faithful(peer, peer)
    assert not at_least_as_faithful({**better, "kl_median": 0.0018}, peer)  # a lower mean is not enough
    assert not at_least_as_faithful({**better, "top1_agreement": 0.96}, peer)
    assert at_least_as_faithful(better, None) is None and at_least_as_faithful({**better, "kl_median": None}, peer) is None
    overall = {"modes": {"quasar-w4a8-tree": {"tokens_per_s": 50.0}, "quasar-w4a8-small-tree": {"tokens_per_s": 60.0}},
               "peers": {"llamacpp": {"tokens_per_s": 30.0}}}
    small = {**better, "top1_agreement": 0.95, "kl_mean": 0.008}
    fidelity = {"engines": {"quasar-w4a8-tree": better, "quasar-w4a8-small-tree": small, "llamacpp": peer}}
    rows = {r["verifier"]: r for r in matched_quality(overall, fidelity, MODES)}
    assert rows["w4a8"]["matched"] is True and rows["w4a8"]["tokens_per_s_ratio"] == pytest.approx(50 / 30)
    assert rows["w4a8-small"]["matched"] is False  # faster, less faithful: reported, never the headline


def test_llamacpp_logits_compared_with_themselves():
    """The default GGUF's llama.cpp logits against themselves, through the bench's code path:
    full agreement, no divergence; each window starts from an empty cache (a second call on
    the same window would otherwise see the first one's tokens as context)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is optional (scripts/setup/install_llamacpp.sh)")
    from quasar.bench.peers import llamacpp_logits
    from quasar.eval.fidelity import compare_logits

    ids = list(range(300, 500, 2))  # 100 ids: four windows of up to 48
    with llamacpp_logits(default_model_path(), 48, threads=1) as logits:
        assert tuple(logits(ids[:5]).shape) == (5, 49152)
        same = compare_logits(logits, {"self": logits}, ids, window=48)["self"]
    assert same["top1_agreement"] == 1.0 and same["kl_mean"] < 1e-6 and same["tokens"] == 99
    assert same["windows"] == 4 and same["ppl"] == same["ppl_fp"]


@pytest.mark.slow
def test_bench_fidelity_of_llamacpp_on_the_default_model(tmp_path, capsys):
    """The default model's own GGUF and its Q8_0 copy, scored from llama.cpp's logits against
    the float model on the same held-out ids; the -pld peer shares its file's figure."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is optional (scripts/setup/install_llamacpp.sh)")
    res = _run_json(capsys, ["--model", "default", "--tasks", "code", "--n", "1", "--repeats", "1", "--modes", "ar-fp",
                             "--peers", "llamacpp,llamacpp-pld,llamacpp-q8", "--out", str(tmp_path / "o"), *FAST])
    assert res["unavailable"] == {}
    _check_fidelity(res, (tmp_path / "o" / "report.md").read_text())
    fid = res["fidelity"]["engines"]
    own, q8 = fid["llamacpp"], fid["llamacpp-q8"]
    assert fid["llamacpp-pld"] == own and own["model"] == f"gguf {default_model_path()}"
    assert q8["model"] != own["model"] and q8["model"].endswith(".Q8_0.gguf")
    for rec in (own, q8):
        assert 0.5 < rec["top1_agreement"] <= 1.0 and math.isfinite(rec["kl_mean"]) and rec["kl_mean"] >= 0
