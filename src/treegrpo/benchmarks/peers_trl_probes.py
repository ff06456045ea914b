"""What the TRL rows of ``bench peers`` probe on the installed versions, so the results state TRL's
limits as measured, not assumed: stop strings in its ``generate`` path, how its LM head scores
the update's positions on this device, and whether ``GRPOTrainer`` accepts ``tools=`` with a
model's chat template."""

from __future__ import annotations

from typing import Any

import torch

from treegrpo.tasks.datafile import search_tool


def probe_stop_strings(model: Any) -> dict[str, Any]:
    """Whether ``generate`` as TRL 1.16 calls it (a ``GenerationConfig``, no ``tokenizer=``)
    accepts stop strings: ``{"error": None}`` or the error it raised."""
    from transformers import GenerationConfig

    try:
        with torch.no_grad():
            ids = torch.tensor([[int(model.config.bos_token_id or 0)]])
            model.generate(
                input_ids=ids,
                generation_config=GenerationConfig(max_new_tokens=1, stop_strings=["</answer>"]),
            )
        return {"error": None}
    except (ValueError, TypeError) as e:
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}


def probe_lm_head(device: str) -> dict[str, Any]:
    """How TRL's fused LM head scores the update's positions on ``device``: only the completion
    positions (``compact``: where Triton runs, CUDA/XPU) or every prompt and completion position,
    in chunks of ``chunk_positions`` (trl/trainer/utils.py ``add_fused_lm_head``)."""
    from trl.kernels.chunked_logprob import _use_triton
    from trl.trainer import utils

    return {
        "compact": bool(_use_triton(torch.device(device))),
        "chunk_positions": utils._CHUNKED_LOGPROB_CHUNK_SIZE,
    }


def probe_tools(model: Any, tok: Any, args: Any, dataset: Any, retriever: Any, topk: int) -> dict[str, Any]:
    """Whether ``GRPOTrainer`` accepts ``tools=[search]`` (treegrpo's search tool over our
    retriever) with this model's chat template: ``{"error": None | str, "supports_tool_calling": bool}``."""
    from trl import GRPOTrainer
    from trl.chat_template_utils import supports_tool_calling

    try:
        GRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args,
                    train_dataset=dataset, processing_class=tok, tools=[search_tool(retriever, topk)])  # fmt: skip
        error = None
    except (ValueError, TypeError, ImportError) as e:
        error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return {"error": error, "supports_tool_calling": bool(supports_tool_calling(tok))}


__all__ = ["probe_lm_head", "probe_stop_strings", "probe_tools"]
