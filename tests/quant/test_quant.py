"""W8A8 verifier: smoothing is exact, quantized logits stay close, checkpoints round-trip,
a token's logits do not depend on the tokens verified with it, exports load in transformers,
and bad `quasar quantize` inputs fail cleanly."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny_model
from quasar.cli import main
from quasar.errors import QuasarError
from quasar.models.llama import Transformer
from quasar.models.loader import load_model
from quasar.quant import smooth as sm
from quasar.quant.calibrate import CalibrationStats, StatsCollector, token_windows
from quasar.quant.checkpoint import prepare_quantized_modules, quantization_config, save_checkpoint
from quasar.eval.fidelity import compare_models
from quasar.runtime.w8a8 import Int8Linear, set_backend
from quasar.quant.options import QuantOptions
from quasar.quant.quantize import build_w8a8

CALIB = ("The committee met on Tuesday to review the annual budget and the new transit plan.\n"
         "def mean(xs):\n    return sum(xs) / len(xs)\n"
         "Photosynthesis converts light energy into chemical energy stored in glucose.\n") * 12
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
FAST = dict(calib_text=CALIB, samples=2, seq_len=48, progress=False)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("quant")
    return {arch: make_tiny_model(root / arch, arch, default_model_dir) for arch in ("llama", "qwen3")}


@pytest.fixture(scope="module")
def llama(model_dirs):
    return load_model(model_dirs["llama"])


@pytest.fixture(scope="module")
def w8a8(llama):
    return build_w8a8(llama.model, llama.tokenizer, alpha="auto", **FAST)


def logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    model.setup_cache(256)
    return model(torch.tensor([ids]))[0]


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# --------------------------------------------------------------------------- smoothing
# The package folds rotation and smoothing into one decoder layer at a time (sequential.py)
# and never holds a whole float model. These whole-model versions of the same pieces are
# the reference the exactness tests need: only a whole float model's logits show that a
# fold leaves the function unchanged, embeddings and lm_head included.


def bind_groups(model, smooth_o_down=True, lm_head=False):
    """The smoothing groups of a whole model, in order; `lm_head` adds model.norm -> lm_head."""
    groups = [bg for i, layer in enumerate(model.model.layers)
              for bg in sm.layer_groups(layer, model.config, i, smooth_o_down)]
    if lm_head:
        groups += sm.head_groups(model.model.norm, model.lm_head, model.config)
    return groups


@torch.inference_mode()
def calibrate(model, windows) -> CalibrationStats:
    """Input statistics of every decoder linear (lm_head included) over a whole float model."""
    collector = StatsCollector(len(windows))
    collector.hook({name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                    and (name.startswith("model.layers.") or name == "lm_head")})
    saved_cache = model.cache
    try:
        model.cache = None
        model.setup_cache(max(len(w) for w in windows))
        for ids in windows:
            collector.window(len(ids))
            model.cache.length = 0
            model(torch.tensor([ids]), logits="all")  # "all": lm_head sees every position
    finally:
        stats = collector.finish()
        model.cache = saved_cache
    return stats


@torch.no_grad()
def rotate_model(model) -> None:
    """Fold the sequential quantizer's rotations into a whole float model in place; lm_head
    is untied (it reads the rotated stream, the embeddings write it)."""
    cfg = model.config
    if model.lm_head.weight is model.model.embed_tokens.weight:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
    q, r = sm.rotations(cfg)
    emb = model.model.embed_tokens
    emb.weight.data = sm.rotate_rows(emb.weight.detach(), q)
    for layer in model.model.layers:
        sm.rotate_layer(layer, cfg, q, r)
    head, norm = model.lm_head, model.model.norm
    head.weight.data = sm.rotate_rows(head.weight.detach(), q, norm.weight)
    norm.weight.data = torch.ones_like(norm.weight)
    model.config = dataclasses.replace(cfg, tie_word_embeddings=False)


def float_and_copy(model_dir):
    """(the loaded float model, the prompt's ids, its logits, a deep copy to transform)."""
    loaded = load_model(model_dir)
    ids = loaded.tokenizer.encode(PROMPT)
    return loaded, ids, logits(loaded.model, ids), copy.deepcopy(loaded.model)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_rotation_leaves_float_logits_unchanged(arch, model_dirs):
    loaded, ids, ref, work = float_and_copy(model_dirs[arch])
    rotate_model(work)
    assert not work.config.tie_word_embeddings
    assert torch.equal(work.model.layers[0].input_layernorm.weight, torch.ones(64))
    assert rel_diff(logits(work, ids), ref) <= 1e-5
    assert torch.equal(logits(loaded.model, ids), ref)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_smoothing_leaves_float_logits_unchanged(arch, model_dirs):
    loaded, ids, ref, work = float_and_copy(model_dirs[arch])
    work.lm_head.weight = torch.nn.Parameter(work.lm_head.weight.detach().clone())  # untie
    groups = bind_groups(work, smooth_o_down=True, lm_head=True)
    assert {g.group.name for g in groups} == {"attn_in", "mlp_in", "attn_out", "mlp_out", "head_in"}
    stats = calibrate(work, token_windows(loaded.tokenizer, CALIB, 2, 48))
    chosen = sm.smooth_groups(groups, stats, 0.5)
    assert len(chosen) == len(groups)
    assert rel_diff(logits(work, ids), ref) <= 1e-5
    # arbitrary strong scales too: exactness must not rely on the scales being mild (a wrong
    # GQA mapping for v->o would show here: 4 query heads share 2 kv heads)
    gen = torch.Generator().manual_seed(0)
    for bg in bind_groups(work, smooth_o_down=True, lm_head=True):
        s_prod, _ = sm.group_scales(bg, stats.act_max[bg.sample_name], 0.5)
        s = torch.empty_like(s_prod).uniform_(0.25, 4.0, generator=gen)
        sm.fold(bg, s, sm._to_consumer(s, bg) if bg.group.kind == "heads" else s)
    assert rel_diff(logits(work, ids), ref) <= 1e-5
    assert torch.equal(logits(loaded.model, ids), ref)  # the float model was not touched


def test_w8a8_logits_close_to_float(llama, w8a8):
    ids = llama.tokenizer.encode(PROMPT + " " + CALIB[:200])
    ref, out = logits(llama.model, ids), logits(w8a8, ids)
    assert sum(isinstance(m, Int8Linear) for m in w8a8.modules()) == 2 * 7 + 1  # + lm_head
    assert w8a8.quant_info["rotate"] and w8a8.quant_info["gptq"] and w8a8.quant_info["alpha"] == "auto"
    assert rel_diff(out, ref) < 0.1
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    kl = F.kl_div(F.log_softmax(out, -1), F.log_softmax(ref, -1), log_target=True, reduction="batchmean")
    assert float(kl) < 0.05


def test_fixed_alpha_and_float_lm_head(llama):
    q = build_w8a8(llama.model, llama.tokenizer, alpha=0.5, lm_head="float", smooth_o_down=False, rotate=False,
                   **FAST)
    assert not isinstance(q.lm_head, Int8Linear) and isinstance(q.model.layers[0].mlp.down_proj, Int8Linear)
    assert q.quant_info["alphas"] == {"attn_in": [0.5, 0.5], "mlp_in": [0.5, 0.5]}
    ids = llama.tokenizer.encode(PROMPT)
    assert rel_diff(logits(q, ids), logits(llama.model, ids)) < 0.1


def test_gptq_rounding_beats_nearest_on_its_inputs():
    from quasar.runtime.w8a8_numerics import quantize_weight
    from quasar.quant.gptq import gptq_quantize

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 96, generator=gen) @ torch.randn(96, 96, generator=gen)  # correlated inputs
    w = torch.randn(40, 96, generator=gen)
    q, scale = gptq_quantize(w, (x.t() @ x).double())
    q0, scale0 = quantize_weight(w)
    assert q.dtype == torch.int8 and torch.equal(scale, scale0)
    err = (x @ (q.float() * scale).t() - x @ w.t()).pow(2).sum()
    err0 = (x @ (q0.float() * scale0).t() - x @ w.t()).pow(2).sum()
    assert err < 0.7 * err0


# --------------------------------------------------------------------------- checkpoint


@pytest.mark.parametrize("lm_head", ["int8", "float"])
def test_quantize_save_load_identical_logits(llama, w8a8, tmp_path, lm_head):
    q = w8a8 if lm_head == "int8" else build_w8a8(llama.model, llama.tokenizer, alpha=0.5, lm_head="float", **FAST)
    out = save_checkpoint(q, tmp_path / "ckpt", llama.model_dir)
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["format"] == "int-quantized" and qc["quasar"]["lm_head"] == lm_head
    assert qc["ignore"] == ([] if lm_head == "int8" else ["lm_head"])
    assert (out / "tokenizer.json").is_file()
    loaded = load_model(out)
    assert isinstance(loaded.model.lm_head, Int8Linear) == (lm_head == "int8")
    ids = llama.tokenizer.encode(PROMPT)
    assert torch.equal(logits(loaded.model, ids), logits(q, ids))
    assert not list(tmp_path.glob(".*tmp*"))


def test_prepare_rejects_unsupported_schemes(llama):
    with torch.device("meta"):
        model = Transformer(llama.model.config)
    qc = quantization_config(["lm_head"])
    qc["config_groups"]["group_0"]["weights"]["symmetric"] = False
    with pytest.raises(QuasarError, match="symmetric"):
        prepare_quantized_modules(model, qc, {})
    with pytest.raises(QuasarError, match="quantization method"):
        prepare_quantized_modules(model, {"quant_method": "gptq"}, {})
    with pytest.raises(QuasarError, match="lacks"):
        prepare_quantized_modules(model, quantization_config(["lm_head"]), {})


# --------------------------------------------------------------------------- batch invariance


def _rows_alone_and_together(model: Transformer, ids: list[int], k: int = 6):
    p = len(ids) - k
    model.setup_cache(256)
    model(torch.tensor([ids[:p]]), logits="none")
    together = model(torch.tensor([ids[p:]]))[0]
    model.cache.length = p
    alone = torch.cat([model(torch.tensor([[t]]))[0] for t in ids[p:]])
    return alone, together


@pytest.mark.parametrize("fused", [True, False], ids=["fused-step", "modules"])
def test_token_logits_do_not_depend_on_other_tokens_in_the_step(llama, w8a8, fused):
    """A token's logits are bitwise the same computed alone or with 5 other tokens: int8
    GEMMs are exact, activation scales per token, lm_head int8, attention row-invariant
    for verifier steps. This is what makes greedy speculative == greedy autoregressive.
    Both paths: the fused C++ step (where the CPU runs it) and the modules (elsewhere)."""
    set_backend(w8a8, "cpu")
    kernel = w8a8.step_kernel
    if not fused:
        w8a8.step_kernel = None
    try:
        alone, together = _rows_alone_and_together(w8a8, llama.tokenizer.encode(PROMPT))
    finally:
        set_backend(w8a8, "auto")
        w8a8.step_kernel = kernel
    assert torch.equal(alone, together)


# --------------------------------------------------------------------------- verifier, fidelity


def test_w8a8_verifier_is_cached(llama, tmp_path, monkeypatch):
    from quasar.engine import w8a8_verifier as verifier

    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path / "cache"))
    opts = QuantOptions(samples=2, seq_len=48, alpha=0.5)
    assert opts.cache_key(None) == {"alpha": 0.5, "lm_head": "int8", "smooth_o_down": True, "calib": None,
                                    "samples": 2, "seq_len": 48, "rotate": True, "gptq": True,
                                    "down_act_bits": 15, "pipeline": "sequential"}  # as the cache spelled it before
    first = verifier.w8a8_verifier(llama, opts)
    assert first is not llama.model and not isinstance(llama.model.lm_head, Int8Linear)
    entries = list((tmp_path / "cache" / "w8a8").iterdir())
    assert len(entries) == 1 and (entries[0] / "model.safetensors.index.json").is_file()

    def no_rebuild(*a, **k):
        raise AssertionError("recalibrated although the cache holds this model")

    from quasar.quant import quantize

    monkeypatch.setattr(quantize, "quantize_to_dir", no_rebuild)
    monkeypatch.setattr(quantize, "build_w8a8", no_rebuild)
    second = verifier.w8a8_verifier(llama, opts)
    ids = llama.tokenizer.encode(PROMPT)
    assert torch.equal(logits(second, ids), logits(first, ids))
    assert verifier.w8a8_verifier(load_model(entries[0])).lm_head is not None  # W8A8 in, as is
    with pytest.raises(QuasarError, match="alpha"):
        QuantOptions(alpha=2.0)
    with pytest.raises(QuasarError, match="unknown quantization option 'bogus'"):
        build_w8a8(llama.model, llama.tokenizer, bogus=1)


def test_run_fidelity(llama, w8a8):
    ids = llama.tokenizer.encode(CALIB[:600])
    r = compare_models(llama.model, w8a8, ids, window=40)
    assert {"top1_agreement", "kl_mean", "ppl_fp", "ppl_w8a8"} <= r.keys()
    assert r["tokens"] == len(ids) - 1 and 0.8 <= r["top1_agreement"] <= 1.0 and r["kl_mean"] >= 0
    same = compare_models(llama.model, llama.model, ids, window=40)
    assert same["top1_agreement"] == 1.0 and same["kl_mean"] < 1e-6 and same["ppl_fp"] == same["ppl_w8a8"]


# --------------------------------------------------------------------------- interop


def test_transformers_loads_export_and_agrees(tmp_path):
    """transformers + compressed-tensors loads the export and decodes the same greedy tokens.

    A 16-token vocabulary keeps near-ties rare: transformers' fake quantization divides by
    127.5 where vLLM and Quasar divide by 127, so its logits differ from ours by about the
    quantization noise; every decision with a clear margin must agree, and here all do."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")
    from transformers import AutoModelForCausalLM

    from quasar.quant.checkpoint import export_compressed_tensors

    src = load_model(make_tiny_model(tmp_path / "char", "llama"))
    ids = src.tokenizer.encode("abcabdacebadcfegahbicjdkelfmg")
    q_int8 = build_w8a8(src.model, src.tokenizer, calib_text="abcdefghijklm" * 40 + "fedcbaglkjih" * 40,
                        samples=2, seq_len=48, progress=False)
    ours_dir = save_checkpoint(q_int8, tmp_path / "ours", src.model_dir)
    assert main(["export", "--format", "compressed-tensors", "--model", str(ours_dir),
                 "--out", str(tmp_path / "vllm")]) == 0
    out = tmp_path / "vllm"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head"] and "quasar" not in qc
    # the float-lm_head path of the export (what `export --model FLOAT` writes)
    q_float = build_w8a8(src.model, src.tokenizer, lm_head="float", calib_text="abcdefghijklm" * 40,
                         samples=2, seq_len=48, progress=False)
    out2 = export_compressed_tensors(q_float, tmp_path / "vllm2", src.model_dir)
    for d in (out, out2):
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        ours = load_model(d).model
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
        ours.setup_cache(128)
        mine, x = [], torch.tensor([ids])
        for _ in range(16):
            mine.append(int(ours(x, logits="last")[0, -1].argmax()))
            x = torch.tensor([[mine[-1]]])
        seq = torch.tensor([ids + mine])
        with torch.no_grad():
            hf_logits = hf(seq).logits[0, len(ids) - 1:-1]
        ours.setup_cache(128)
        our_logits = ours(seq)[0, len(ids) - 1:-1]
        assert rel_diff(hf_logits, our_logits) < 0.05
        top2 = our_logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * (hf_logits - our_logits).abs().amax(-1)
        assert clear.sum() >= 8
        assert torch.equal(hf_logits.argmax(-1)[clear], our_logits.argmax(-1)[clear])
        assert theirs == mine


# --------------------------------------------------------------------------- CLI errors


def _no_leftovers(parent: Path) -> None:
    assert not [p.name for p in parent.iterdir() if ".tmp" in p.name]


def test_quantize_cli_writes_a_loadable_checkpoint(model_dirs, tmp_path, capsys):
    calib = tmp_path / "calib.txt"
    calib.write_text(CALIB)
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(model_dirs["qwen3"]), "--out", str(out), "--calib", str(calib),
                 "--samples", "2", "--seq-len", "32", "--alpha", "0.6", "--no-gptq", "--down-act-bits", "8",
                 "--no-progress"]) == 0
    assert re.search(r"\d+ s, peak RSS \d+\.\d\d GB", capsys.readouterr().err)
    info = json.loads((out / "config.json").read_text())["quantization_config"]["quasar"]
    assert info["alpha"] == 0.6 and info["calibration"]["seq_len"] == 32
    assert info["rotate"] is True and info["gptq"] is False and info["lm_head"] == "int8"
    assert info["down_act_bits"] == 8
    layer = load_model(out).model.model.layers[1]
    assert isinstance(layer.self_attn.o_proj, Int8Linear) and layer.mlp.down_proj.act_bits == 8
    assert main(["quantize", "--model", str(out), "--out", str(tmp_path / "again")]) == 2
    assert "already a W8A8" in capsys.readouterr().err
    _no_leftovers(tmp_path)


@pytest.mark.parametrize("case", ["out_exists", "missing_calib", "empty_calib", "bad_alpha", "bad_seq_len"])
def test_quantize_cli_bad_inputs(model_dirs, tmp_path, capsys, case):
    out = tmp_path / "out"
    args = ["quantize", "--model", str(model_dirs["llama"]), "--out", str(out), "--samples", "1",
            "--seq-len", "16", "--no-progress"]
    expect = {"out_exists": "already exists", "missing_calib": "not found", "empty_calib": "empty",
              "bad_alpha": "alpha", "bad_seq_len": "seq_len"}[case]
    if case == "out_exists":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    elif case == "missing_calib":
        args += ["--calib", str(tmp_path / "nope.txt")]
    elif case == "empty_calib":
        (tmp_path / "empty.txt").write_text("  \n")
        args += ["--calib", str(tmp_path / "empty.txt")]
    elif case == "bad_alpha":
        args += ["--alpha", "1.5"]
    else:
        args[args.index("--seq-len") + 1] = "1"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and expect in err and len(err.strip().splitlines()) == 1
    if case == "out_exists":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    else:
        assert not out.exists()
    _no_leftovers(tmp_path)
