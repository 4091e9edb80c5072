"""The bandwidth floor of a mixture-of-experts step: a token reads its top-k experts, not
all of them, in Quasar's verifier (model_bytes with rows) and in llama.cpp's file
(gguf_weight_bytes: the stacked expert tensors scaled by used / count)."""

from __future__ import annotations

import numpy as np
from gguf import GGUFWriter

from quasar.bench.peers import gguf_weight_bytes
from quasar.engine.verifiers import model_bytes
from quasar.models.hf import load_hf_dir
from quasar.models.moe import sparse_blocks
from quasar.runtime.step_cost import expected_experts
from tests.family_models import make_family_model


def _state_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def test_a_row_reads_its_top_k_experts(tmp_path):
    model = load_hf_dir(make_family_model(tmp_path / "m", "qwen2_moe"))  # 6 experts, top 2, a shared one
    every = model_bytes(model)
    assert model_bytes(model, None) == every
    unread_one_row = unread_four_rows = 0
    for block in sparse_blocks(model):
        n, expert = len(block.experts), _state_bytes(block.experts[0])
        unread_one_row += (n - block.top_k) * expert
        unread_four_rows += round(expert * (n - expected_experts(n, block.top_k, 4)))
    assert model_bytes(model, 1) == every - unread_one_row
    assert model_bytes(model, 4) == every - unread_four_rows
    assert model_bytes(model, 1) < model_bytes(model, 4) < every


def test_llamacpp_floor_counts_the_experts_a_token_uses(tmp_path):
    path = tmp_path / "m.gguf"
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_expert_count(8)
    w.add_expert_used_count(2)
    tensors = {"token_embd.weight": np.zeros((32, 16), np.float32), "output.weight": np.zeros((32, 16), np.float32),
               "blk.0.ffn_gate_exps.weight": np.zeros((8, 4, 16), np.float32),
               "blk.0.ffn_gate_inp.weight": np.zeros((8, 16), np.float32)}
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert gguf_weight_bytes(path) == 4 * (32 * 16 + 8 * 16 + 2 * 4 * 16)
