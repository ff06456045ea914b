"""Stand-ins of vLLM's interface for the vLLM engine's CPU tests (no vLLM needed): the request
types, ``RequestOutput`` / ``CompletionOutput``, and the slice of ``vllm.LLM`` the engine uses."""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch


class FakeSamplingParams:
    """Records the keyword arguments vLLM's ``SamplingParams`` would get."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def __getattr__(self, name: str) -> Any:
        try:
            return self.kwargs[name]
        except KeyError:
            raise AttributeError(name) from None


def fake_vllm() -> types.ModuleType:
    mod = types.ModuleType("fake_vllm")
    mod.SamplingParams = FakeSamplingParams
    mod.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    return mod


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    index: int = 0
    text: str = ""


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int | None = None
    finished: bool = True


def completion(tokens: list[int], finish: str, stop_reason=None, lp: float = -0.25) -> CompletionOutput:
    # like vLLM with logprobs=0: one dict per position holding (at least) the sampled token
    return CompletionOutput(
        tokens, [{t: Logprob(lp * (i + 1), 1)} for i, t in enumerate(tokens)], finish, stop_reason
    )


class FakeModel:
    """A worker's model: records what ``load_weights`` receives (vLLM's signature)."""

    def __init__(self) -> None:
        self.loaded: list[list[tuple[str, torch.Tensor]]] = []

    def load_weights(self, weights):
        batch = list(weights)
        self.loaded.append(batch)
        return {n for n, _ in batch}


@dataclass
class FakeLLM:
    """The slice of ``vllm.LLM`` the engine uses, answering with a scripted policy."""

    stop_id: int = 7
    eos_id: int = 2
    max_model_len: int = 64
    logprobs_mode: str | None = "processed_logprobs"  # None: a vLLM too old to record one
    generation_config: dict[str, Any] = field(default_factory=dict)  # as try_get_generation_config gives it
    resets: list[bool] = field(default_factory=list)  # what reset_prefix_cache answers (then True)
    model: FakeModel = field(default_factory=FakeModel)
    calls: list[tuple[list[Any], list[Any]]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        cfg = types.SimpleNamespace(
            max_model_len=self.max_model_len, try_get_generation_config=lambda: dict(self.generation_config)
        )
        if self.logprobs_mode is not None:
            cfg.logprobs_mode = self.logprobs_mode
        self.llm_engine = types.SimpleNamespace(model_config=cfg)
        self.worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=self.model))

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        assert use_tqdm is False
        self.calls.append((prompts, sampling_params))
        outs = []
        for i, (p, sp) in enumerate(zip(prompts, sampling_params, strict=True)):
            ids = p["prompt_token_ids"]
            if ids[-1] % 3 == 0:  # ends with the stop id
                comp = completion([11, 12, self.stop_id], "stop", self.stop_id)
            elif ids[-1] % 3 == 1:  # ends with EOS
                comp = completion([13, self.eos_id], "stop", None)
            else:  # runs to the cap
                comp = completion(list(range(20, 20 + sp.max_tokens)), "length")
            outs.append(RequestOutput(str(i), ids, [comp], num_cached_tokens=(len(ids) // 16) * 16))
        return outs

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.events.append("rpc")
        return [method(self.worker, *args, **(kwargs or {}))]

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.events.append("reset!" if reset_running_requests else "reset")
        return self.resets.pop(0) if self.resets else True
