"""The padded head layout served to vLLM on CPU (checked end to end against real vLLM in
tests/test_vllm.py): where each weight goes, by hand, and the served folder's config."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from treegrpo.rollout.vllm_weights import chunks, pad_heads, serve_folder


def test_pad_heads_by_hand() -> None:
    heads, kv, d, big, hidden = 2, 1, 3, 4, 5
    q = torch.arange(heads * d * hidden, dtype=torch.float32).reshape(heads * d, hidden)
    qb = torch.arange(heads * d, dtype=torch.float32)
    k = torch.ones(kv * d, hidden)
    o = torch.arange(hidden * heads * d, dtype=torch.float32).reshape(hidden, heads * d)
    norm = torch.ones(hidden)
    out = dict(pad_heads(
        [("l.self_attn.q_proj.weight", q), ("l.self_attn.q_proj.bias", qb), ("l.self_attn.k_proj.weight", k),
         ("l.self_attn.o_proj.weight", o), ("l.input_layernorm.weight", norm)], heads, kv, d, big,
    ))  # fmt: skip
    s = math.sqrt(big / d)
    assert out["l.self_attn.q_proj.weight"].shape == (heads * big, hidden)
    for h in range(heads):
        torch.testing.assert_close(out["l.self_attn.q_proj.weight"][h * big : h * big + d], q[h * d : (h + 1) * d] * s)
        assert not out["l.self_attn.q_proj.weight"][h * big + d : (h + 1) * big].any()
        torch.testing.assert_close(out["l.self_attn.q_proj.bias"][h * big : h * big + d], qb[h * d : (h + 1) * d] * s)
        torch.testing.assert_close(out["l.self_attn.o_proj.weight"][:, h * big : h * big + d], o[:, h * d : (h + 1) * d])
        assert not out["l.self_attn.o_proj.weight"][:, h * big + d : (h + 1) * big].any()
    assert out["l.self_attn.k_proj.weight"].shape == (kv * big, hidden)
    assert out["l.self_attn.k_proj.weight"][:d].eq(1).all() and not out["l.self_attn.k_proj.weight"][d:].any()
    assert out["l.input_layernorm.weight"] is norm
    # scores and outputs are unchanged: q·k over the padded head = s · q·k over the model's head
    x = torch.randn(hidden)
    qh, kh = (out["l.self_attn.q_proj.weight"] @ x)[:big], (out["l.self_attn.k_proj.weight"] @ x)[:big]
    torch.testing.assert_close(qh @ kh / math.sqrt(big), (q @ x)[:d] @ (k @ x)[:d] / math.sqrt(d))


def test_serve_folder(tiny_model_dir: Path) -> None:
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    d = cfg["hidden_size"] // cfg["num_attention_heads"]  # 16: no CPU kernel
    served, transform = serve_folder(tiny_model_dir)
    assert served != tiny_model_dir and transform is not None
    new = json.loads((served / "config.json").read_text())
    assert new["architectures"] == ["LlamaForCausalLM"] and new["head_dim"] == 32 and new["qkv_bias"] is True
    assert new["rope_parameters"]["partial_rotary_factor"] == d / 32
    assert (served / "tokenizer.json").is_file() and (served / "model.safetensors").is_file()
    ok = tiny_model_dir.parent / "ok"
    ok.mkdir(exist_ok=True)
    (ok / "config.json").write_text(json.dumps(cfg | {"hidden_size": 256, "num_attention_heads": 4}))
    assert serve_folder(ok) == (ok, None)


def test_chunks_keep_layers_whole() -> None:
    t = torch.zeros(256)  # 1 KiB
    items = [("model.embed_tokens.weight", t)] + [
        (f"model.layers.{i}.{p}", t) for i in range(3) for p in ("q.weight", "k.weight", "o.weight")
    ]
    got = [[n for n, _ in c] for c in chunks(items, 1500)]
    assert got[0] == ["model.embed_tokens.weight"]
    assert got[1:] == [[f"model.layers.{i}.{p}" for p in ("q.weight", "k.weight", "o.weight")] for i in range(3)]
