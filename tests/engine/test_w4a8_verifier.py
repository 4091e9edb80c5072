"""The W4A8 verifier (quasar.engine.w4a8_verifier): a 4-bit GGUF's own groups as W4A8 layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quasar.kernels import ext
from quasar.errors import QuasarError
from quasar.models.loader import load_model
from quasar.runtime.w8a8 import Int8Linear
from quasar.runtime.w4a8 import W4A8Linear
from quasar.runtime.exact_head import ExactTopHead
from quasar.runtime.refined_head import RefinedHead, kth_largest
from quasar.quant.w4a8_layouts import FAITHFUL, SMALL, keeps_wider
from quasar.runtime.w4a8_numerics import (dequantize_w4, fit_weight_w4_affine, quantize_weight_w4,
                                        reference_linear_w4a8, symmetric_as_affine)


@pytest.fixture(scope="module")
def default_w4a8():
    from quasar.engine.w4a8_verifier import w4a8_verifier

    loaded = load_model("default")
    return loaded, w4a8_verifier(loaded)


@pytest.fixture(scope="module")
def default_w4a8_small(default_w4a8):
    from quasar.engine.w4a8_verifier import w4a8_verifier

    loaded = default_w4a8[0]
    return loaded, w4a8_verifier(loaded, layout=SMALL)


def _check_4bit_layers(loaded, model) -> None:
    layers = [m for m in model.model.modules() if isinstance(m, W4A8Linear)]
    assert len(layers) == 7 * loaded.config.num_layers
    for i in (0, loaded.config.num_layers - 1):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj"):
            got = model.model.layers[i].get_submodule(name).dequantized_weight()
            want = loaded.model.model.layers[i].get_submodule(name).weight.float()
            assert torch.equal(got, want), (i, name)


def test_the_faithful_head_keeps_the_files_precision(default_w4a8) -> None:
    """SmolLM2's Q4_1 file: every decoder linear is 4-bit, and dequantized it is the float
    model's weight bit for bit (Q and K rows put back in Hugging Face order); the output head,
    Q8_0 in the file, is never refitted to 4 bits: int8 per channel with 15-bit activations,
    its top logits recomputed from the float rows, which are the embedding table itself (tied:
    not stored twice)."""
    loaded, model = default_w4a8
    _check_4bit_layers(loaded, model)
    head = model.lm_head
    assert isinstance(head, ExactTopHead) and head.tied and head.approx.act_bits == 15
    assert torch.equal(head.approx.weight, Int8Linear.from_float(loaded.model.lm_head).weight)
    assert head.exact.weight is model.model.embed_tokens.weight
    assert torch.equal(head.exact.weight, loaded.model.lm_head.weight.float())


def test_the_small_layout_fits_the_head_to_4_bits(default_w4a8_small) -> None:
    """``w4a8-small``: the same 4-bit layers; the head a RefinedHead, 4-bit groups fitted to
    it and its int8 rounding."""
    loaded, model = default_w4a8_small
    _check_4bit_layers(loaded, model)
    assert isinstance(model.lm_head, RefinedHead)
    head = loaded.model.lm_head.weight
    assert torch.equal(model.lm_head.exact.weight, Int8Linear.from_float(loaded.model.lm_head).weight)
    q, s, o = fit_weight_w4_affine(head[:4096], 32)
    assert torch.equal(model.lm_head.approx.dequantized_weight()[:4096], dequantize_w4(q, s, 32, o))


def test_w4a8_logits_follow_the_float_model(default_w4a8, default_w4a8_small) -> None:
    """The faithful layout is close to the float model, and closer than the small one."""
    from quasar.eval.fidelity import compare_models, fidelity_text

    loaded, model = default_w4a8
    ids = loaded.tokenizer.encode(fidelity_text())
    scores = {name: compare_models(loaded.model, m, ids, window=256, limit=2, name="w4a8")
              for name, (_, m) in (("faithful", default_w4a8), ("small", default_w4a8_small))}
    assert scores["faithful"]["top1_agreement"] > 0.95 and scores["faithful"]["kl_mean"] < 0.005, scores
    assert scores["faithful"]["kl_mean"] < 0.5 * scores["small"]["kl_mean"], scores
    assert scores["faithful"]["top1_agreement"] >= scores["small"]["top1_agreement"], scores


def test_the_exact_head_recomputes_its_top_logits_from_the_float_rows() -> None:
    """ExactTopHead: each row's logits are the int8 head's, except those at least its top_k-th
    largest (ties included), which are dot products with the float rows summed in float64; a row alone
    gives the same bits as in a batch; stored rows and tied rows; a bad top_k is a clear error."""
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(300, 64, generator=gen)
    head = ExactTopHead.from_float(weight, top_k=8)
    x = torch.randn(2, 5, 64, generator=gen)
    y = head(x).view(10, 300)
    approx = head.approx(x.view(10, 64))
    exact = (x.view(10, 64).double() @ weight.double().T).float()
    for r in range(10):
        refined = approx[r] >= approx[r].topk(8).values[-1]
        assert int(refined.sum()) >= 8
        assert torch.allclose(y[r][refined], exact[r][refined], rtol=1e-6, atol=1e-6)
        assert torch.equal(y[r][~refined], approx[r][~refined])
        assert torch.equal(head(x.view(10, 64)[r:r + 1])[0], y[r])
        assert not torch.equal(y[r][refined], approx[r][refined])
    many = torch.randn(400, 64, generator=gen)  # 3200 refined pairs: recomputed in more than one chunk
    rows = head(many)
    assert all(torch.equal(head(many[r:r + 1])[0], rows[r]) for r in (0, 255, 256, 399))
    embedding = nn.Embedding(300, 64)
    tied = ExactTopHead.from_float(embedding.weight.detach(), top_k=8, tied=embedding)
    assert "exact.weight" not in tied.state_dict() and tied.exact.weight is embedding.weight
    with torch.no_grad():
        assert torch.equal(tied(x), ExactTopHead.from_float(embedding.weight.detach(), top_k=8)(x))
    with pytest.raises(QuasarError, match="top_k must be an integer in \\[1, 300\\]"):
        ExactTopHead(64, 300, top_k=0)
    with pytest.raises(QuasarError, match="needs float32 rows"):
        ExactTopHead.from_float(weight, top_k=8, tied=True)(x)


def test_layer_forward_is_the_reference_and_rows_are_independent() -> None:
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(96, 40)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=gen))
    layer = W4A8Linear.from_float(linear, 32)
    x = torch.randn(2, 3, 96, generator=gen)
    y = layer(x)
    q, s, o = symmetric_as_affine(*quantize_weight_w4(linear.weight, 32))
    assert torch.equal(y.view(6, 40), reference_linear_w4a8(x.view(6, 96), q, s, o, linear.bias, 32))
    for r in range(6):
        assert torch.equal(layer(x.view(6, 96)[r:r + 1]), y.view(6, 40)[r:r + 1])


def test_the_refined_head_is_the_int8_heads_logits_where_the_4bit_ones_are_largest() -> None:
    """RefinedHead: each row's logits are the 4-bit head's, except those at least its top_k-th
    largest (ties included), which are the int8 head's bit for bit; a row alone gives the same
    bits as in a batch; a bad top_k is a clear error."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(300, 64, generator=gen)
    head = RefinedHead.from_float(weight, top_k=8)
    x = torch.randn(2, 5, 64, generator=gen)
    y = head(x).view(10, 300)
    approx, exact = head.approx(x.view(10, 64)), head.exact(x.view(10, 64))
    for r in range(10):
        refined = approx[r] >= approx[r].topk(8).values[-1]
        assert int(refined.sum()) >= 8
        assert torch.equal(y[r][refined], exact[r][refined]) and torch.equal(y[r][~refined], approx[r][~refined])
        assert torch.equal(head(x.view(10, 64)[r:r + 1])[0], y[r])
    many = torch.randn(1100, 64, generator=gen)  # 8800+ refined pairs: recomputed in more than one chunk
    approx, exact = head.approx(many), head.exact(many)
    refined = approx >= approx.topk(8, dim=1).values[:, -1:]
    assert int(refined.sum()) > 8192
    assert torch.equal(head(many), torch.where(refined, exact, approx))
    tied = RefinedHead.from_float(torch.zeros(300, 64), top_k=8)(x.view(10, 64))  # every logit equal: all refined
    assert torch.equal(tied, torch.zeros(10, 300))
    with pytest.raises(QuasarError, match="top_k must be an integer in \\[1, 300\\]"):
        RefinedHead(64, 300, top_k=0)


def refine_trials(gen: torch.Generator, hidden: int, trials: int = 40):
    """(trial, inputs [rows, hidden], logits [rows, 1000]) for the refine ops: one row and many,
    random logits, many ties at the threshold (with -0.0), rows with fewer and more NaNs than
    a top_k of 16."""
    for trial in range(trials):
        rows = 1 if trial % 4 == 0 else int(torch.randint(2, 12, (1,), generator=gen))
        x2 = torch.randn(rows, hidden, generator=gen)
        y = torch.randn(rows, 1000, generator=gen)
        if trial % 3 == 0:
            y = torch.randint(-4, 5, (rows, 1000), generator=gen).float()  # ties at the threshold
            y[y == 0] = -0.0
        if trial % 5 == 0:
            y[0, torch.randint(0, 1000, (3,), generator=gen)] = float("nan")  # fewer NaNs than top_k
            y[-1, torch.randint(0, 1000, (40,), generator=gen)] = float("nan")  # more: nothing refined
        yield trial, x2, y


@pytest.mark.parametrize("path", ["avx512-vnni", "portable"])
def test_the_refine_op_gives_the_torch_paths_bits(path) -> None:
    """The C++ refinement (csrc/head/refine_rows.cpp) against RefinedHead's torch path, bit for bit:
    random logits, many ties, -0.0, rows holding fewer and more NaNs than top_k, one row and
    many; on the AVX512 scan and the plain one."""
    from quasar.kernels import ext

    if ext.refine_head_rows_op() is None:
        pytest.skip("no C++ op (QUASAR_NO_EXT or no toolchain)")
    if not ext.cpu_runs(path):
        pytest.skip(f"this CPU does not run the {path} kernel path")
    gen = torch.Generator().manual_seed(5)
    head = RefinedHead.from_float(torch.randn(1000, 64, generator=gen), top_k=16)
    with ext.forced_kernel_path(path):
        for trial, x2, y in refine_trials(gen, 64):
            rows = len(y)
            want = head.refine(y.clone(), x2, use_op=False)
            got = head.refine(y.clone(), x2)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (path, trial)
            if rows > 1 or trial % 5:  # (a lone row of 43 NaNs refines nothing)
                assert not torch.equal(got.view(torch.int32), y.view(torch.int32))
    with pytest.raises(RuntimeError, match="top_k must be"):
        ext.refine_head_rows_op()(torch.zeros(1, 10), torch.zeros(1, 64, dtype=torch.int8), torch.ones(1, 1),
                                  torch.zeros(10, 64, dtype=torch.int8), torch.ones(10, 1), 11)


@pytest.mark.parametrize("path", ["avx512-vnni", "portable"])
def test_the_exact_refine_op_agrees_with_torch_and_keeps_rows_independent(path) -> None:
    """ExactTopHead's C++ refinement (csrc/head/refine_rows.cpp) against its torch path: the same
    logits refined (random logits, ties, -0.0, rows with fewer and more NaNs than top_k), each
    refined logit the float64 dot product rounded to float32 (the two sum in different orders:
    equal to an ulp), the rest untouched; a row gives the same bits alone as beside others."""
    if ext.refine_exact_rows_op() is None:
        pytest.skip("no C++ op (QUASAR_NO_EXT or no toolchain)")
    if not ext.cpu_runs(path):
        pytest.skip(f"this CPU does not run the {path} kernel path")
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(1000, 68, generator=gen)  # a hidden size that is not a multiple of 8
    head = ExactTopHead.from_float(weight, top_k=16)
    with ext.forced_kernel_path(path):
        for trial, x2, y in refine_trials(gen, 68):
            rows = len(y)
            want = head.refine(y.clone(), x2, use_op=False)
            got = head.refine(y.clone(), x2)
            refined = y >= kth_largest(y, 16)
            assert torch.equal(got[~refined].view(torch.int32), y[~refined].view(torch.int32)), (path, trial)
            exact = (weight.double() @ x2.double().T).T.float()  # the dot products, rounded once
            torch.testing.assert_close(got[refined], exact[refined], rtol=3e-7, atol=1e-6)
            torch.testing.assert_close(got, want, rtol=1.2e-7, atol=0.0, equal_nan=True)
            for r in range(rows):
                alone = head.refine(y[r:r + 1].clone(), x2[r:r + 1])
                assert torch.equal(alone[0].view(torch.int32), got[r].view(torch.int32)), (path, trial, r)
    with pytest.raises(RuntimeError, match="top_k must be"):
        ext.refine_exact_rows_op()(torch.zeros(1, 10), torch.zeros(1, 64), torch.zeros(10, 64), 11)
    with pytest.raises(RuntimeError, match="weight must be float32"):
        ext.refine_exact_rows_op()(torch.zeros(1, 10), torch.zeros(1, 64), torch.zeros(10, 64, dtype=torch.int8), 4)


def test_bad_groups_are_clear_errors() -> None:
    with pytest.raises(QuasarError, match="group size"):
        W4A8Linear(64, 8, group=48)
    with pytest.raises(QuasarError, match="do not fit"):
        W4A8Linear.from_groups(torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 3), torch.zeros(8, 3), 32)
    with pytest.raises(QuasarError, match="input features"):
        W4A8Linear(64, 8, group=32)(torch.zeros(1, 32))


def test_a_float_model_is_calibrated_and_gptq_rounded_closer_than_to_nearest() -> None:
    """A float directory (the default model's, dequantized) goes through the sequential
    pipeline with 4-bit layers: rotated and GPTQ-rounded against its calibrated inputs, it
    is much closer to the float model than the same int4 groups rounded to nearest
    (measured KL 0.19 vs 0.39, top-1 85% vs 78%, 4 samples of 256 tokens)."""
    from quasar.eval.fidelity import compare_models, fidelity_text
    from quasar.models.tensors import SafetensorsSource
    from quasar.quant.options import QuantOptions
    from quasar.quant.quantize import build_w8a8

    loaded = load_model("default")
    source = SafetensorsSource(loaded.model_dir)
    ids = loaded.tokenizer.encode(fidelity_text())
    scores = {}
    for name, extra in (("nearest", dict(gptq=False, rotate=False)), ("gptq", {})):
        opts = QuantOptions(weight_bits=4, samples=4, seq_len=256, **extra)
        model = build_w8a8(source, loaded.tokenizer, cfg=loaded.config, options=opts, progress=False)
        _check_faithful_layers(model, loaded.config.num_layers)
        assert isinstance(model.lm_head, Int8Linear) and model.quant_kind == "w4a8"
        assert model.quant_info["weight_bits"] == 4
        scores[name] = compare_models(loaded.model, model, ids, window=256, limit=2, name="w4a8")
    assert scores["gptq"]["kl_mean"] < 0.7 * scores["nearest"]["kl_mean"], scores
    assert scores["gptq"]["top1_agreement"] > scores["nearest"]["top1_agreement"], scores


def test_quantize_bits_4_of_a_float_model_takes_calibration_flags(tmp_path) -> None:
    import json
    import subprocess
    import sys

    float_dir = str(load_model("default").model_dir)
    cmd = [sys.executable, "-m", "quasar", "quantize", "--model", float_dir, "--bits", "4", "--no-progress"]
    bad = subprocess.run([*cmd, "--out", str(tmp_path / "bad"), "--alpha", "0.5"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--alpha do not apply to --bits 4 (4-bit layers are not smoothed" in bad.stderr
    assert "Traceback" not in bad.stderr
    out = tmp_path / "w4"
    done = subprocess.run([*cmd, "--out", str(out), "--samples", "2", "--seq-len", "64", "--no-rotate"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "quasar-w4a8" and qc["quasar"]["gptq"] and not qc["quasar"]["rotate"]
    assert qc["quasar"]["calibration"]["samples"] == 2
    loaded = load_model(str(out))
    assert loaded.quant_kind == "w4a8"
    _check_faithful_layers(loaded.model, loaded.config.num_layers)


def _check_faithful_layers(model, n_layers: int) -> None:
    """A float model's faithful W4A8: the value and down projections llama.cpp's Q4_K_M keeps
    in 6 bits are int8 with 15-bit activations, every other decoder linear 4-bit."""
    wide = 0
    for i, layer in enumerate(model.model.layers):
        for name, m in layer.named_modules():
            if isinstance(m, (W4A8Linear, Int8Linear)):
                assert isinstance(m, Int8Linear) == keeps_wider(name, i, n_layers), (i, name)
                if isinstance(m, Int8Linear):
                    wide += 1
                    assert m.act_bits == 15, (i, name)
    assert wide == 28  # SmolLM2's 30 layers: 14 of them, v and down


def test_keeps_wider_is_llama_cpps_q4_k_m_rule() -> None:
    """llama.cpp's use_more_bits for 28 layers (Qwen2.5-1.5B): layers 0-2, 24-27 and every third
    between, from 5; only the value and down projections."""
    assert [i for i in range(28) if keeps_wider("mlp.down_proj", i, 28)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23,
                                                                             24, 25, 26, 27]
    assert keeps_wider("self_attn.v_proj", 5, 28) and not keeps_wider("self_attn.q_proj", 0, 28)
    assert FAITHFUL != SMALL
