"""Test doubles: a scripted engine that follows the Engine contract exactly, token ids in and out."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from treegrpo.rollout.engine import Generation, SamplingParams


class ScriptedEngine:
    """Answers each context with ``policy(context_text, rng_draw)``, tokenized once.

    It honours ``max_new_tokens`` and stops right after the first stop id, like a real engine; each
    returned token gets log-prob -0.5. ``calls`` records the contexts of every call, so tests can
    check how often a prefix was run through the "model". With ``seeds`` (per-request streams) a
    request's draw comes from a generator seeded with its seed.
    """

    eos_token_id: int | None = None

    def __init__(self, tokenizer, policy: Callable[[str, float], str]) -> None:
        self.tok = tokenizer
        self.policy = policy
        self.calls: list[list[list[int]]] = []
        self.generated: list[list[int]] = []

    def generate(
        self,
        contexts: Sequence[Sequence[int]],
        params: SamplingParams,
        generator: torch.Generator | None = None,
        seeds: Sequence[int] | None = None,
    ) -> list[Generation]:
        self.calls.append([list(c) for c in contexts])
        out = []
        for k, ctx in enumerate(contexts):
            own = None if seeds is None else torch.Generator().manual_seed(int(seeds[k]))
            draw = float(torch.rand((), generator=generator if own is None else own))
            text = self.policy(self.tok.decode(list(ctx), skip_special_tokens=False), draw)
            ids = self.tok.encode(text, add_special_tokens=False)
            finish = "length"
            for k, t in enumerate(ids):
                if t in params.stop_token_ids:
                    ids, finish = ids[: k + 1], "stop"
                    break
            if len(ids) > params.max_new_tokens:
                ids, finish = ids[: params.max_new_tokens], "length"
            self.generated.append(list(ids))
            out.append(Generation(list(ids), [-0.5] * len(ids), finish, prefill_tokens=len(ctx)))
        return out

    def load_weights(self, model: torch.nn.Module) -> None:
        pass


class EOSEngine(ScriptedEngine):
    """The scripted engine, also stopping at EOS like a real one (EOS is the last token returned)."""

    def generate(
        self, contexts: Sequence[Sequence[int]], params: SamplingParams, generator: torch.Generator | None = None,
        seeds: Sequence[int] | None = None,
    ) -> list[Generation]:
        out = super().generate(contexts, params, generator, seeds)
        eos = self.tok.eos_token_id
        for g in out:
            if eos in g.tokens:
                k = g.tokens.index(eos) + 1
                g.tokens, g.logprobs, g.finish_reason = g.tokens[:k], g.logprobs[:k], "eos"
        return out
