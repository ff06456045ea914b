"""Load a model reference into ``(model, tokenizer)``: the one place the transformers 5.x
pitfalls are handled (DESIGN.md §7).

- A folder written by :func:`treegrpo.models.tiny.save_tiny` (it has ``treegrpo_tiny.json``) holds
  a locally trained tokenizer: ``AutoTokenizer`` would swap in Qwen2's pre-tokenizer for a
  ``qwen2`` folder (other ids than the saved ``tokenizer.json``), so it is loaded with
  ``PreTrainedTokenizerFast`` from the file itself.
- ``padding_side`` is not saved: every tokenizer is set to left padding (the engines batch
  prompts left-padded), and gets a pad token (EOS when it has none).
- Models load through ``AutoModelForCausalLM.from_pretrained`` with an explicit ``dtype`` and
  ``attn_implementation`` (``sdpa``: a custom 4D mask is accepted as bool or float).

A model reference is a local folder, a ``.gguf`` file, a built-in name (``smollm2-135m``) or a hub
id; :mod:`treegrpo.models.refs` resolves it to a local folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from treegrpo.models import refs
from treegrpo.models.refs import ModelLoadError

# Loading/saving a 1M-parameter model needs no progress bars between our own progress lines.
hf_logging.disable_progress_bar()

EOS = "<|endoftext|>"
PAD = "<|pad|>"
MARKER_FILE = "treegrpo_tiny.json"
#: The tokenizer attribute holding the model's ``generation_config.eos_token_id`` as a list of ids
#: (Llama 3's ``<|end_of_text|>`` and ``<|eot_id|>``, Qwen's ``<|endoftext|>`` and ``<|im_end|>``):
#: every one of them ends a turn (:func:`treegrpo.rollout.toolcall.end_of_turn_ids`).
GENERATION_EOS_ATTR = "generation_eos_token_ids"


def generation_eos_ids(source: Any) -> list[int]:
    """The ``eos_token_id`` ids of a model folder's ``generation_config.json`` or of a model's
    ``generation_config`` (an int or a list), ``[]`` when there is none or it is unreadable."""
    if isinstance(source, Path):
        try:
            eos = json.loads((source / "generation_config.json").read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            return []
    else:
        eos = getattr(getattr(source, "generation_config", None), "eos_token_id", None)
    items = eos if isinstance(eos, list) else [eos]
    return [int(i) for i in items if isinstance(i, int) and not isinstance(i, bool)]


@dataclass
class LoadedModel:
    """A loaded model reference.

    Attributes:
        folder: the local folder it was loaded from.
        model: the causal LM (``eval()`` mode is the caller's business).
        tokenizer: left-padding tokenizer with a pad token.
        info: the bootstrap record of a tiny folder (``treegrpo_tiny.json``), ``{}`` otherwise.
    """

    folder: Path
    model: torch.nn.Module
    tokenizer: Any
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def is_tiny(self) -> bool:
        """A folder built by :mod:`treegrpo.models.tiny` (a bootstrapped tiny agent)."""
        return (self.folder / MARKER_FILE).exists()


def resolve_model_ref(ref: str | Path) -> Path:
    """The local folder of a model reference (a folder, a ``.gguf`` file, a built-in name or a hub
    id: :mod:`treegrpo.models.refs`), checked so that a broken folder is one clear error instead
    of a traceback from deep inside transformers."""
    folder = refs.resolve_model_ref(ref)
    check_model_folder(folder)
    return folder


_WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")
_TOKENIZER = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "spiece.model")


def check_model_folder(folder: Path) -> None:
    """Raise :class:`ModelLoadError` naming what a causal-LM folder lacks: ``config.json`` (valid
    JSON with a ``model_type``), weights, or tokenizer files."""
    where = f"--model {folder}"
    if not folder.is_dir():
        raise ModelLoadError(f"{where}: no such folder; give a local causal-LM folder (config.json, weights, tokenizer)")
    cfg = folder / "config.json"
    if not cfg.is_file():
        raise ModelLoadError(f"{where}: not a model folder (no config.json); give a local causal-LM folder")
    try:
        doc = json.loads(cfg.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{where}: config.json is not valid JSON ({e}); restore it from the model's source") from None
    if not isinstance(doc, dict) or "model_type" not in doc:
        raise ModelLoadError(f"{where}: config.json has no 'model_type'; it is not a transformers model config")
    if not any(any(folder.glob(pat)) for pat in _WEIGHTS):
        raise ModelLoadError(
            f"{where}: no weights (model.safetensors or pytorch_model.bin); save the model with save_pretrained"
        )
    if not any((folder / name).is_file() for name in _TOKENIZER):
        raise ModelLoadError(
            f"{where}: no tokenizer files (tokenizer.json / tokenizer_config.json); save the tokenizer into the "
            "model folder with tokenizer.save_pretrained"
        )


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerFast:
    """Load a model folder's tokenizer, left padding, with a pad token.

    A folder written by :func:`save_tiny` is loaded with ``PreTrainedTokenizerFast`` (its saved
    ``tokenizer.json`` exactly); any other folder through ``AutoTokenizer``.
    """
    folder = Path(folder)
    if (folder / MARKER_FILE).exists():
        tok = PreTrainedTokenizerFast(
            tokenizer_file=str(folder / "tokenizer.json"), eos_token=EOS, pad_token=PAD
        )
    else:
        tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    setattr(tok, GENERATION_EOS_ATTR, generation_eos_ids(folder))
    return tok


def load_model(
    folder: str | Path, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"
) -> torch.nn.Module:
    """Load any local causal LM folder through ``from_pretrained``."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)


def tiny_info(folder: str | Path) -> dict[str, Any]:
    """The bootstrap's recorded facts (warm-up success rates…), or ``{}`` for other folders."""
    p = Path(folder) / MARKER_FILE
    return json.loads(p.read_text()) if p.exists() else {}


def load_pretrained(
    ref: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> LoadedModel:
    """Load model + tokenizer of ``ref`` (:func:`resolve_model_ref`) onto ``device``."""
    folder = resolve_model_ref(ref)
    try:
        tokenizer = load_tokenizer(folder)
    except Exception as e:  # any failure inside transformers/tokenizers: one line, not a traceback
        raise ModelLoadError(f"--model {folder}: cannot load its tokenizer ({_first_line(e)})") from None
    try:
        model = load_model(folder, dtype=dtype).to(device)
    except Exception as e:  # truncated or foreign weight files raise many types
        raise ModelLoadError(f"--model {folder}: cannot load its weights ({_first_line(e)})") from None
    return LoadedModel(folder, model, tokenizer, tiny_info(folder))


def loaded_objects(model: torch.nn.Module, tokenizer: Any, device: str | torch.device = "cpu") -> LoadedModel:
    """A model and tokenizer a caller already holds, set up as :func:`load_pretrained` sets up its
    own: left padding, a pad token, on ``device``. Its folder is the model's ``name_or_path``."""
    if tokenizer is None:
        raise ModelLoadError("a model object needs its tokenizer: pass tokenizer= (the model's own)")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not getattr(tokenizer, GENERATION_EOS_ATTR, None):
        setattr(tokenizer, GENERATION_EOS_ATTR, generation_eos_ids(model))
    folder = Path(getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "") or ".")
    return LoadedModel(folder, model.to(device), tokenizer, tiny_info(folder) if folder.is_dir() else {})


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


__all__ = [
    "EOS",
    "GENERATION_EOS_ATTR",
    "MARKER_FILE",
    "PAD",
    "LoadedModel",
    "ModelLoadError",
    "generation_eos_ids",
    "load_model",
    "load_pretrained",
    "load_tokenizer",
    "loaded_objects",
    "resolve_model_ref",
    "tiny_info",
]
