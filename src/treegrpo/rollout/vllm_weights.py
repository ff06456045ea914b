"""What :class:`~treegrpo.rollout.vllm_engine.VLLMEngine` sends into vLLM's workers: the
functions run there, weight chunks, and a zero-padded layout for head sizes vLLM's CPU attention
kernels lack; plus one start-up workaround (:func:`scannable_modules`).

**Head padding.** vLLM's CPU attention exists for head sizes :data:`CPU_HEAD_SIZES` only; the
tiny agents have 24. :func:`serve_folder` writes a copy of such a Qwen2 / Llama folder that vLLM
serves as a Llama with head size ``D`` (the next supported size) computing exactly the same
function:

* every query / key / value head gets ``D - d`` zero rows (weights and biases), and the output
  projection ``D - d`` zero input columns per head — the padded coordinates add 0 to every score
  and every output;
* rotary embeddings act on the first ``d`` coordinates only (``partial_rotary_factor = d / D``:
  the same frequencies ``θ^(-2i/d)`` and neox pairing ``(i, i + d/2)`` as the model's own);
* the queries are scaled by ``sqrt(D / d)``, so vLLM's softmax scale ``1/sqrt(D)`` acts as the
  model's ``1/sqrt(d)``;
* Qwen2's query/key/value biases stay (``qkv_bias``), its output projection has none.

:func:`pad_heads` is the same map on ``(name, tensor)`` pairs; the engine applies it to every
weight push. Names are Hugging Face's (``model.layers.N.self_attn.q_proj.weight``), as vLLM loads
them.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import re
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

__all__ = [
    "CPU_HEAD_SIZES",
    "chunks",
    "has_reload_weights",
    "load_into_worker",
    "pad_heads",
    "scannable_modules",
    "serve_folder",
]

#: Head sizes vLLM 0.32's CPU attention backend supports (``CPUAttentionBackend``).
CPU_HEAD_SIZES: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

WeightPairs = Iterable[tuple[str, torch.Tensor]]


# -- run inside the workers (LLM.collective_rpc) ---------------------------------------------------


def _worker_model(worker: Any) -> Any:
    runner = getattr(worker, "model_runner", None)
    if runner is None:  # a wrapper around the real worker
        runner = worker.worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


def load_into_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Load HF-named tensors with the worker model's ``load_weights`` (vLLM without ``reload_weights``)."""
    _worker_model(worker).load_weights(weights=weights)
    return len(weights)


def has_reload_weights(worker: Any) -> bool:
    """Whether the worker has the in-place ``reload_weights`` (vLLM >= 0.1x)."""
    inner = getattr(worker, "worker", worker)
    return callable(getattr(inner, "reload_weights", None))


_LAYER = re.compile(r"^(.*?layers\.\d+)\.")


def chunks(items: WeightPairs, max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs into lists of about ``max_bytes``, never splitting a decoder
    layer (``...layers.N.*``) across two lists (vLLM finishes a layer's reload when all its
    weights came; a layer bigger than ``max_bytes`` goes alone)."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size, last = 0, None
    for name, t in items:
        m = _LAYER.match(name)
        layer = m.group(1) if m else None
        nb = t.numel() * t.element_size()
        if chunk and size + nb > max_bytes and (layer is None or layer != last):
            yield chunk
            chunk, size = [], 0
        chunk.append((name, t))
        size += nb
        last = layer
    if chunk:
        yield chunk


# -- start-up ---------------------------------------------------------------------------------


@contextlib.contextmanager
def scannable_modules() -> Iterator[None]:
    """Hide, while vLLM starts, module attributes that break its start-up scan of ``sys.modules``
    (vLLM 0.32's ``triton_utils.dispatcher._rebind_kernels`` calls ``vars(value).get`` on every
    module attribute; llvmlite's ``binding.ffi.lib``, imported with numba, answers ``vars()`` with a
    function wrapper). They are put back afterwards."""
    hidden: list[tuple[ModuleType, str, Any]] = []
    with warnings.catch_warnings():  # attribute probes of deprecated aliases warn
        warnings.simplefilter("ignore")
        _hide(hidden)
    try:
        yield
    finally:
        for module, attr, value in hidden:
            setattr(module, attr, value)


def _hide(hidden: list[tuple[ModuleType, str, Any]]) -> None:
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            try:
                ok = not hasattr(value, "__dict__") or hasattr(vars(value), "get")
            except Exception:
                ok = True
            if not ok:
                hidden.append((module, attr, value))
                del namespace[attr]


# -- head padding --------------------------------------------------------------------------------


def _pad_rows(t: torch.Tensor, heads: int, d: int, big: int, scale: float = 1.0) -> torch.Tensor:
    """``(heads·d, ...)`` → ``(heads·big, ...)``: each head's ``d`` rows, then zeros."""
    rest = t.shape[1:]
    out = t.new_zeros((heads, big, *rest))
    out[:, :d] = t.reshape(heads, d, *rest) * scale if scale != 1.0 else t.reshape(heads, d, *rest)
    return out.reshape(heads * big, *rest)


def pad_heads(items: WeightPairs, heads: int, kv_heads: int, d: int, big: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The padded layout of the module docstring, pair by pair (other weights pass through)."""
    scale = math.sqrt(big / d)
    for name, t in items:
        if ".self_attn.q_proj." in name:
            t = _pad_rows(t, heads, d, big, scale)
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            t = _pad_rows(t, kv_heads, d, big)
        elif name.endswith(".self_attn.o_proj.weight"):
            t = _pad_rows(t.t(), heads, d, big).t().contiguous()
        yield name, t


def _head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def serve_folder(folder: Path) -> tuple[Path, Callable[[WeightPairs], WeightPairs] | None]:
    """The folder vLLM-on-CPU should load for ``folder``, and the weight transform of every push:
    ``(folder, None)`` when its head size is supported, else a padded copy (module docstring) in a
    new temporary folder and :func:`pad_heads` bound to the model's shape.

    Raises:
        ValueError: an unsupported head size in an architecture other than Qwen2 / Llama.
    """
    if not (folder / "config.json").is_file():  # a hub id: vLLM resolves it (no padding)
        return folder, None
    cfg = json.loads((folder / "config.json").read_text())
    d = _head_dim(cfg)
    if d in CPU_HEAD_SIZES:
        return folder, None
    if cfg.get("model_type") not in ("qwen2", "llama") or d > CPU_HEAD_SIZES[-1]:
        raise ValueError(
            f"{folder}: head size {d} has no vLLM CPU attention kernel (supported: "
            f"{', '.join(map(str, CPU_HEAD_SIZES))}); only Qwen2 / Llama models are padded: use the hf engine"
        )
    big = next(s for s in CPU_HEAD_SIZES if s > d)
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    qwen = cfg["model_type"] == "qwen2"
    rope = dict(cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)})
    rope["partial_rotary_factor"] = d / big * float(rope.get("partial_rotary_factor", 1.0))
    served = {
        k: v for k, v in cfg.items() if k not in ("max_window_layers", "use_sliding_window", "sliding_window", "layer_types")
    }
    served.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        head_dim=big,
        rope_parameters=rope,
        attention_bias=bool(cfg.get("attention_bias", False)),
        qkv_bias=True if qwen else bool(cfg.get("attention_bias", False)),
        mlp_bias=False,
    )

    def transform(items: WeightPairs) -> WeightPairs:
        return pad_heads(items, heads, kv_heads, d, big)

    from safetensors.torch import load_file, save_file

    out = Path(tempfile.mkdtemp(prefix=f"treegrpo-vllm-{folder.name}-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    for f in folder.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json" and not f.name.endswith(".index.json"):
            shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps(served, indent=1))
    state: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(f))
    save_file(dict(transform(state.items())), out / "model.safetensors")
    return out, transform
