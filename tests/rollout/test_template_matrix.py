"""The template matrix: every tool-calling chat template TRL 1.16 ships, on SmolLM2's tokenizer (the
2-layer fixture) with the family's special tokens added. Per family, an agent conversation (one
user turn, two tool rounds — two calls in the first where the template allows it —, a final
answer), with and without thinking:

- renders: the start-up checks pass (``prepare_tool_template``: TRL's training variant swapped in
  where the family's own template fails), or refuse it in one line;
- exact ids: the ids the loop builds turn by turn (prompt + each generated turn + each tool turn)
  are the template's rendering of the whole conversation, token for token;
- parses: the family's calls parse back with its parser (chosen from the template);
- trains a step: the real loop (a scripted engine writing the family's turns, ``ToolEnv`` running
  the calls) builds the same ids, and one update through the library runs on them;
- thinking: earlier turns' thinking is kept, exactly (``keep``), where the template renders it.

:data:`MATRIX` is the table of docs/tools.md (:func:`markdown`; a test keeps them equal).
"""

from __future__ import annotations

import copy
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from _optional import needs_package
from templating import LLAMA3_SPLIT, with_llama_tokens
from treegrpo.envs.base import Task
from treegrpo.envs.tool_env import ToolEnv
from treegrpo.errors import ConfigError
from treegrpo.models.loader import load_model, load_tokenizer
from treegrpo.rollout.agent import AgentConfig, StepRunner
from treegrpo.rollout.chat import encode_observation
from treegrpo.rollout.engine import Generation
from treegrpo.rollout.samplers import SamplerConfig, get_sampler
from treegrpo.rollout.templates import prepare_tool_template
from treegrpo.rollout.templates.loop import agent_conversation, loop_pieces, render
from treegrpo.rollout.toolcall import end_of_turn_tokens, parse_tool_calls, tool_call_format, tool_turn_parts

ROOT = Path(__file__).resolve().parents[2]
SPECIAL = re.compile(r"<\|[^<>|\s]+\|>|<\uff5c[^\uff5c]+\uff5c>|<\|[a-z_]+>|<[a-z_]+\|>")
QUESTION = "Add the two pairs, then the two sums."
TASK = Task("q0", QUESTION, ["55, 97 and 152."], meta={"answer": "55, 97 and 152."})


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


#: A thinking template's prompt ends ``<think>\n``: a turn with no thought writes ``\n</think>``, and
#: the whole conversation's ``<think>\n\n</think>`` tokenizes ``\n\n`` as one token.
EMPTY_THOUGHT = "with a thought (an empty one: the loop's `\\n` `\\n` is the whole's `\\n\\n`)"


#: family -> (renders, exact ids, parses, trains a step, thinking): the docs' table. "yes" cells
#: are asserted as such; any other text is what the test finds instead (asserted too).
MATRIX: dict[str, tuple[str, str, str, str, str]] = {
    "qwen2_5": ("yes", "yes", "hermes", "yes", "no thinking in the template"),
    "qwen3": ("yes, as qwen3_training (swapped in)", "yes", "hermes", "yes", "keep"),
    "qwen3_instruct_2507": ("yes", "yes", "hermes", "yes", "no thinking in the template"),
    "qwen3_vl": ("yes", "yes", "hermes", "yes", "keep"),
    "qwen3_5_think": ("yes", "yes, " + EMPTY_THOUGHT, "qwen3_xml", "yes", "keep"),
    "qwen3_5_nothink": ("yes", "yes", "qwen3_xml", "yes", "no thinking (its prompt closes the think block)"),
    "qwen3_6": ("yes", "yes, " + EMPTY_THOUGHT, "qwen3_xml", "yes", "keep"),
    "qwen3_8": ("yes", "yes, " + EMPTY_THOUGHT, "qwen3_xml", "yes", "keep"),
    "nemotron_3_nano": ("yes", "yes", "qwen3_xml", "yes", "keep"),
    "nemotron_3_super": ("yes", "yes", "qwen3_xml", "yes", "keep"),
    "glm4moe": ("yes", "yes", "glm45", "yes", "keep"),
    "gptoss": ("yes", "one call per turn, no text before it", "harmony", "yes", "kept in the ids; the template drops it once the answer is final"),
    "llama3_1": ("yes", "one call per turn", "llama3_json", "yes", "no thinking in the template"),
    "llama3_2": ("yes", "one call per turn", "llama3_json", "yes", "no thinking in the template"),
    "nemotron_3_ultra": ("yes", "yes", "qwen3_xml", "yes", "keep"),
    "nemotron_3_5_lightning": ("yes", "yes", "qwen3_xml", "yes", "keep"),
    "lfm2_v2": ("yes", "yes", "pythonic", "yes", "no thinking in the template"),
    "lfm2_2_5": ("yes", "yes", "pythonic", "yes", "keep"),
    "lfm2_2_5_v2": ("yes", "yes", "pythonic", "yes", "keep"),
    "lfm2_2_5_vl": ("yes", "yes", "pythonic", "yes", "keep"),
    "deepseekv3": ("refused at start-up", "-", "deepseek_v3", "-", "-"),
    "lfm2": ("refused at start-up", "-", "-", "-", "-"),
    "gemma4": ("refused at start-up", "-", "-", "-", "-"),
    "gemma4_v2": ("refused at start-up", "-", "-", "-", "-"),
    "gemma4_v3": ("refused at start-up", "-", "-", "-", "-"),
    "gemma4_v4": ("refused at start-up", "-", "-", "-", "-"),
    "gemma4_v5": ("refused at start-up", "-", "-", "-", "-"),
    "muse_glimmer": ("refused at start-up", "-", "-", "-", "-"),
    "diffusion_gemma": ("refused at start-up", "-", "-", "-", "-"),
}


def markdown() -> str:
    """:data:`MATRIX` as the markdown table of docs/tools.md."""
    head = "| TRL template | renders | exact ids | parses (parser) | trains a step | thinking |\n|---|---|---|---|---|---|\n"
    return head + "".join(f"| `{name}` | {' | '.join(row)} |\n" for name, row in MATRIX.items())


@pytest.fixture(scope="module")
def smollm2(smollm2_2layer_dir: Path) -> Any:
    return load_tokenizer(smollm2_2layer_dir)


def family_tokenizer(smollm2: Any, name: str) -> Any:
    """SmolLM2's tokenizer with TRL's ``name`` template and the template's special tokens, and Llama
    3's pre-tokenizer: every family's own tokenizer keeps a run of newlines one piece
    (``\\s*[\\r\\n]+``, Qwen's, GLM's, gpt-oss's and Llama's alike); SmolLM2's GPT-2 rule splits
    ``"\\n\\nLet"`` otherwise than ``"\\n\\n"`` + ``"Let"``, which no family's tokenizer does."""
    import trl
    from tokenizers import Regex, pre_tokenizers
    from transformers import AddedToken

    text = (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text(encoding="utf-8")
    tok = with_llama_tokens(smollm2) if name.startswith("llama") else copy.deepcopy(smollm2)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in sorted(set(SPECIAL.findall(text)))], special_tokens=True)
    tok.chat_template = text
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return tok


def ids(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def conversation(tok: Any, schemas: list[dict[str, Any]], thinking: bool) -> tuple[list[dict[str, Any]], list[tuple[str, str]]] | None:
    """The agent conversation the template can carry (two calls in the first turn, else one; text
    before them, else none) and the loop's pieces of it; ``None`` when the template renders no
    such turn after its prompt."""
    for first, text in ((2, True), (1, True), (2, False), (1, False)):
        conv = agent_conversation("add", thinking, first, text=text)
        try:
            if first == 2 and "57" not in render(tok, conv[:2], schemas):
                continue  # gpt-oss writes one call per turn
            pieces = loop_pieces(tok, conv, schemas)
        except Exception:  # Meta's Llama 3.1 refuses two calls in one turn
            continue
        if not isinstance(pieces, str):
            return conv, pieces
    return None


def loop_ids(tok: Any, pieces: list[tuple[str, str]], results: list[list[dict[str, Any]]], schemas: list[dict[str, Any]]) -> list[int]:
    """What the loop holds: the prompt's ids, each turn's, each tool turn's (plain-text results)."""
    out: list[int] = []
    rounds = iter(results)
    for kind, text in pieces:
        if kind == "tool":
            parts = tool_turn_parts(tok, next(rounds), schemas)
            assert "".join(t for t, _ in parts) == text
            out += encode_observation(tok, text, parts)
        else:
            out += ids(tok, text)
    return out


class TurnEngine:
    """Writes the family's turns: the k-th turn after the k-th context length."""

    def __init__(self, turns: dict[int, list[int]]) -> None:
        self.turns = turns
        self.offset = 0  # the prompt's length

    def generate(self, contexts: Any, params: Any, generator: Any = None) -> list[Generation]:
        out = []
        for c in contexts:
            t = self.turns[len(c) - self.offset]
            out.append(Generation(tokens=list(t), logprobs=[-1.0] * len(t), finish_reason="stop", prefill_tokens=len(c)))
        return out


@needs_package("trl")
@pytest.mark.parametrize("name", list(MATRIX))
def test_the_template_matrix(smollm2: Any, smollm2_2layer_dir: Path, name: str) -> None:
    renders, exact, parser, trains, thinking = MATRIX[name]
    tok = family_tokenizer(smollm2, name)
    env = ToolEnv([add], rewards=["em"], protocol="tools", tokenizer=tok)
    schemas = env.tool_schemas
    assert tool_call_format(tok) == (None if parser == "-" else parser)  # the parser is chosen from the template
    if renders == "refused at start-up":
        with pytest.raises(ConfigError) as e:
            prepare_tool_template(tok, schemas)
        assert "\n" not in str(e.value)
        return
    notes = prepare_tool_template(tok, schemas)
    swapped = re.search(r"as (\w+) \(swapped in\)", renders)
    assert (swapped is not None) == any("training template instead" in n for n in notes)
    if swapped:
        assert tok.chat_template.startswith("{#- Training variant") and f"using TRL's prefix-preserving {swapped.group(1)}" in notes[0]
    found = {}
    for think in (False, True):
        got = conversation(tok, schemas, think)
        if got is None:
            continue
        conv, pieces = got
        results = [[]]  # each tool round's results
        for m in conv[1:]:
            if m["role"] == "tool":
                results[-1].append(m)
            elif results[-1]:
                results.append([])
        results = [r for r in results if r]
        held = "".join(t for _, t in pieces)
        whole = render(tok, conv, schemas)
        found[think] = (whole.startswith(held) and not whole[len(held) :].strip(), conv, pieces, results)
        if found[think][0]:  # exact: the ids, token for token
            same = loop_ids(tok, pieces, results, schemas) == ids(tok, held)
            empty = not think and pieces[0][1].endswith("<think>\n")  # an empty thought after a prompt opening one
            assert same or (empty and EMPTY_THOUGHT in exact), (name, think)
    if thinking == "keep":
        assert found[True][0]
    elif thinking == "no thinking in the template":  # a thought given to it is not rendered
        assert "Two sums." not in render(tok, agent_conversation("add", True, 1), schemas)
    elif thinking.startswith("no thinking"):
        assert True not in found
    elif thinking.startswith("kept in the ids"):  # a thinking conversation is not a prefix of its final rendering
        assert not found.get(True, (False,))[0] and found[False][0]
    assert any(v[0] for v in found.values())
    # parses: the first turn's calls come back, typed by the schema
    _, conv, pieces, results = next(v for v in found.values() if v[0])
    assert len(conv[1]["tool_calls"]) == (2 if exact.startswith("yes") else 1)
    assert bool(conv[1]["content"]) == ("no text" not in exact and not conv[1].get("thinking"))
    _, calls = parse_tool_calls(pieces[1][1], tok, schemas=schemas)
    assert [(c.name, c.arguments) for c in calls] == [("add", m["function"]["arguments"]) for m in conv[1]["tool_calls"]]
    assert trains == "yes"
    train_one_step(tok, env, smollm2_2layer_dir, pieces, results)


def train_one_step(tok: Any, env: ToolEnv, model_dir: Path, pieces: list[tuple[str, str]], results: list[Any]) -> None:
    """The real loop on the family's turns gives the pieces' ids; one update runs on its forest."""
    from treegrpo.algos.advantages import token_advantages
    from treegrpo.algos.losses import LossConfig
    from treegrpo.training.config import make_config
    from treegrpo.training.policy import Policy
    from treegrpo.training.update import update

    ends = end_of_turn_tokens(tok)
    last = pieces[-1][1]
    if not any(last.endswith(e) for e in ends):  # the template writes no end after the answer (GLM): the model does
        pieces = [*pieces[:-1], ("turn", last + ("<|user|>" if "<|user|>" in ends else tok.eos_token))]
    turns, at, rounds = {}, 0, iter(results)
    for kind, text in pieces[1:]:
        if kind == "turn":
            turns[at] = ids(tok, text)
        at += len(encode_observation(tok, text, tool_turn_parts(tok, next(rounds), env.tool_schemas)) if kind == "tool" else ids(tok, text))
    runner = StepRunner(TurnEngine(turns), env, tok, AgentConfig(max_turns=4, max_step_tokens=256, max_context_tokens=8192))  # type: ignore[arg-type]
    prompt = runner.prompt_ids(TASK)  # today's date where the template writes it (Llama 3.2)
    runner.engine.offset = len(prompt)  # type: ignore[attr-defined]
    result = get_sampler("chain")(runner, [TASK], SamplerConfig("chain", group_size=2), random.Random(0), torch.Generator().manual_seed(0))
    (forest,) = result.forests
    want = prompt + loop_ids(tok, pieces, results, env.tool_schemas)[len(ids(tok, pieces[0][1])) :]
    for ti, leaf in forest.leaves():
        path = forest.trees[ti].path(leaf.id)
        got = [t for n in path for t in n.tokens]
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        assert got == want, (tok.decode(got[at - 30 : at + 10]), tok.decode(want[at - 30 : at + 10]))
        assert leaf.extra["kind"] == "answer" and leaf.reward == 1.0
    model = load_model(model_dir)
    model.resize_token_embeddings(len(tok))
    cfg = make_config({})
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    advantages = [[1.0] * len(row) for row in token_advantages(forest, "grpo")]  # the two chains are equal: a signal
    metrics = update(Policy(model, None), opt, [forest], [advantages], cfg, LossConfig(), tok.pad_token_id)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values() if isinstance(v, float))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_the_docs_table_is_the_matrix() -> None:
    assert markdown() in (ROOT / "docs" / "tools.md").read_text(encoding="utf-8")
