"""The bootstrap: imperfect demos encoded exactly as the agent loop builds contexts, a supervised
warm-up on policy tokens only, and a folder that loads back with its measured success recorded."""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import pytest
import torch

from treegrpo.models.loader import load_model, load_tokenizer, tiny_info
from treegrpo.models.tiny import build_model, train_tokenizer, wrap_tokenizer
from treegrpo.rollout.agent import AgentConfig, StepRunner
from treegrpo.tasks.world import bootstrap as world_bootstrap
from treegrpo.tasks.world.bootstrap import (
    BootstrapConfig,
    bootstrap,
    default_model_dir,
    ensure_bootstrapped,
    is_bootstrapped,
    load_setup,
)
from treegrpo.tasks.world.demos import aux_demo_tasks, aux_worlds, make_demos, make_env
from treegrpo.tasks.world.world import PRESETS, build_world
from treegrpo.training import warmup
from treegrpo.training.warmup import encode_demo

TINY = BootstrapConfig(
    preset="tiny",
    aux_worlds=1,
    vocab_size=600,
    hidden_size=32,
    layers=2,
    heads=2,
    kv_heads=1,
    intermediate_size=64,
    max_positions=512,
    max_context_tokens=512,
    epochs=1,
    batch_size=16,
    n_eval=8,
)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bootstrap(tmp_path_factory.mktemp("boot") / "model", TINY, progress=False)


@pytest.fixture(scope="module")
def parts():
    world = build_world(PRESETS["tiny"])
    env = make_env(world, topk=3)
    demos = make_demos(world, env, world.tasks("warmup"), TINY, random.Random(0))
    tok = wrap_tokenizer(train_tokenizer([*world.texts(), *warmup.demo_texts(demos, env)], vocab_size=600))
    return world, env, demos, tok


def test_bootstrap_end_to_end(tiny_folder: Path):
    assert is_bootstrapped(tiny_folder)
    assert not [p for p in tiny_folder.parent.iterdir() if p.name.startswith(".")]  # no temp folder left
    tok = load_tokenizer(tiny_folder)
    model = load_model(tiny_folder)
    assert sum(p.numel() for p in model.parameters()) > 0
    for tag in ("</search>", "</answer>", "<search>", "<answer>"):
        assert len(tok.encode(tag, add_special_tokens=False)) == 1
    info = tiny_info(tiny_folder)
    assert info["preset"] == "tiny" and info["seed"] == 0
    assert info["world"] == PRESETS["tiny"].to_dict()
    assert math.isfinite(info["sft"]["final_loss"])
    assert info["demos"]["n"] > len(build_world(PRESETS["tiny"]).tasks("warmup"))  # + the aux world's
    for mode in ("sampled", "greedy"):
        m = info["warmup_eval"][mode]
        assert m["n"] == TINY.n_eval
        for key in ("success", "answer_after_one_search", "early_answer", "no_search_answer"):
            assert 0.0 <= m[key] <= 1.0
        assert m["tool_calls"] >= 0.0
    setup = load_setup(tiny_folder)
    assert setup.env.topk == TINY.topk and setup.env.prompt_template == "minimal"
    assert setup.agent.max_obs_tokens == TINY.max_obs_tokens
    assert [t.question for t in setup.world.tasks("eval")] == [
        t.question for t in build_world(PRESETS["tiny"]).tasks("eval")
    ]


def test_encoded_demo_matches_the_agent_loop(parts):
    _world, env, demos, tok = parts
    cfg = AgentConfig(max_obs_tokens=40, use_chat_template=False)
    runner = StepRunner(None, env, tok, cfg)  # type: ignore[arg-type]
    demo = next(d for d in demos if sum(o is not None for _, o in d.steps) >= 2)
    enc = encode_demo(runner, demo)
    assert len(enc.ids) == len(enc.policy_mask)

    prompt = runner.prompt_ids(demo.task)
    assert enc.ids[: len(prompt)] == prompt and set(enc.policy_mask[: len(prompt)]) == {0}
    pos = len(prompt)
    stops = {tok.convert_tokens_to_ids("</search>"), tok.convert_tokens_to_ids("</answer>")}
    for step, obs in demo.steps:
        s = tok.encode(step, add_special_tokens=False)
        assert enc.ids[pos : pos + len(s)] == s and set(enc.policy_mask[pos : pos + len(s)]) == {1}
        assert s[-1] in stops  # a step ends with its single stop token
        pos += len(s)
        if obs is not None:
            (real,) = env.step([demo.task], [step], [True])  # the observation is the env's own
            assert obs == real.observation
            o = runner.observation_ids(obs)[1]  # kept as the loop keeps it: whole passages, closed tag
            assert len(o) <= cfg.max_obs_tokens and tok.decode(o).rstrip().endswith("</information>")
            assert enc.ids[pos : pos + len(o)] == o and set(enc.policy_mask[pos : pos + len(o)]) == {0}
            pos += len(o)
    # the final answer is followed by the end-of-turn token, trained on (the model learns to stop)
    assert pos + 1 == len(enc.ids) and enc.ids[-1] == tok.eos_token_id and enc.policy_mask[-2:] == [1, 1]


def test_loss_is_on_policy_tokens_only(parts):
    _world, env, demos, tok = parts
    runner = StepRunner(None, env, tok, AgentConfig(use_chat_template=False))  # type: ignore[arg-type]
    enc = [encode_demo(runner, d) for d in demos[:6]]
    assert any(sum(o is not None for _, o in d.steps) >= 2 for d in demos[:6])
    batch = warmup._collate(enc, tok.pad_token_id, decision_weight=3.0)
    decisions = 0
    for r, e in enumerate(enc):
        n = len(e.ids)
        labels = batch["labels"][r, :n].tolist()
        assert labels == [t if m else -100 for t, m in zip(e.ids, e.policy_mask, strict=True)]
        assert set(batch["labels"][r, n:].tolist()) <= {-100}
        w = batch["weights"][r, :n].tolist()
        first = e.policy_mask.index(1)
        for t in range(n):
            if not e.policy_mask[t]:
                assert w[t] == 0.0
            elif t > first and not e.policy_mask[t - 1]:  # search on / answer now, after an observation
                assert w[t] == 3.0 and tok.convert_ids_to_tokens(e.ids[t]) in ("<search>", "<answer>")
                decisions += 1
            else:
                assert w[t] == 1.0
    assert decisions > 0
    model = build_model(len(tok), hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate_size=64)
    loss = warmup.policy_token_loss(model, batch)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    terms, weights = [], []
    for r, e in enumerate(enc):
        for t in range(1, len(e.ids)):
            if e.policy_mask[t]:
                terms.append(-torch.log_softmax(logits[r, t - 1], -1)[e.ids[t]])
                weights.append(float(batch["weights"][r, t]))
    w = torch.tensor(weights)
    assert torch.allclose(loss, (torch.stack(terms) * w).sum() / w.sum(), atol=1e-5)
    plain = {k: v for k, v in batch.items() if k != "weights"}
    assert torch.allclose(warmup.policy_token_loss(model, plain), torch.stack(terms).mean(), atol=1e-5)


def test_packed_batch_equals_separate_rows(parts):
    _world, env, demos, tok = parts
    runner = StepRunner(None, env, tok, AgentConfig(use_chat_template=False))  # type: ignore[arg-type]
    enc = [encode_demo(runner, d) for d in demos[:12]]
    lengths = [len(e.ids) for e in enc]
    rows = warmup._pack(lengths, list(range(len(enc))), 160)
    assert sorted(i for r in rows for i in r) == list(range(len(enc)))
    assert all(sum(lengths[i] for i in r) <= max(160, *(lengths[i] for i in r)) for r in rows)
    assert len(rows) < len(enc)  # several demos share a row
    model = build_model(len(tok), hidden_size=32, layers=2, heads=2, kv_heads=1, intermediate_size=64)
    packed = warmup._collate_packed(enc, rows, tok.pad_token_id, 3.0)
    separate = warmup._collate(enc, tok.pad_token_id, 3.0)
    assert torch.allclose(
        warmup.policy_token_loss(model, packed), warmup.policy_token_loss(model, separate), atol=1e-5
    )
    assert int((packed["labels"] != -100).sum()) == int((separate["labels"] != -100).sum())


def test_batches_are_random_not_length_sorted():
    rng = random.Random(0)
    batches = warmup._batches(100, 10, rng)
    assert sorted(i for b in batches for i in b) == list(range(100))
    assert any(b != sorted(b) for b in batches) and batches[0] != list(range(10))


def test_demo_imperfections(parts):
    world, env, _, _ = parts
    tasks = world.tasks("warmup")
    perfect = dataclasses.replace(TINY, p_guess=0.0, p_shortcut=0.0, p_bad_query=0.0)
    demos = make_demos(world, env, tasks, perfect, random.Random(0))
    assert all(d.reward == 1.0 and d.kind == "correct" for d in demos)
    assert all(sum(o is not None for _, o in d.steps) == d.task.meta["hops"] for d in demos)

    hasty = dataclasses.replace(perfect, p_shortcut=1.0)
    for d in make_demos(world, env, tasks, hasty, random.Random(0)):
        assert sum(o is not None for _, o in d.steps) == 1
        if d.task.meta["hops"] > 1:  # answers with the bridge entity it just found
            assert d.kind == "shortcut" and d.reward == 0.0
            assert d.steps[-1][0] == f"<answer> {d.task.meta['bridges'][0]} </answer>"

    guess = dataclasses.replace(perfect, p_guess=1.0)
    assert all(
        len(d.steps) == 1 and d.kind == "guess"
        for d in make_demos(world, env, tasks, guess, random.Random(0))
    )


def test_aux_worlds_share_names_not_facts():
    (aux,) = aux_worlds(TINY)
    target = build_world(PRESETS["tiny"])
    assert set(aux.entities) == set(target.entities)
    assert [d.contents for d in aux.corpus] != [d.contents for d in target.corpus]
    held = {t.question for s in ("train", "eval") for t in target.tasks(s)}
    assert not held & {t.question for t in aux_demo_tasks(aux, target)}


def test_cache_dir_and_ensure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_folder: Path):
    monkeypatch.setenv("TREEGRPO_CACHE", str(tmp_path))
    folder = default_model_dir(TINY)
    assert folder.parent == tmp_path / "models" and folder.name.startswith("tiny-")
    assert default_model_dir(dataclasses.replace(TINY, seed=1)) != folder
    # A folder already there is reused, not rebuilt.
    import shutil

    shutil.copytree(tiny_folder, folder)
    monkeypatch.setattr(world_bootstrap, "bootstrap", lambda *a, **k: pytest.fail("rebuilt a cached model"))
    assert ensure_bootstrapped("tiny", cfg=TINY) == folder


def test_cli_prints_recorded_success(tiny_folder: Path):
    from typer.testing import CliRunner

    from treegrpo.cli import app

    res = CliRunner().invoke(app, ["bootstrap", "--out", str(tiny_folder), "--preset", "tiny"])
    assert res.exit_code == 0, res.output
    assert (
        "already bootstrapped" in res.output
        and "sampled: success" in res.output
        and "greedy: success" in res.output
    )
    bad = CliRunner().invoke(app, ["bootstrap", "--preset", "nope"])
    assert bad.exit_code == 2


def test_world_seed_variant_has_its_own_cached_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("TREEGRPO_CACHE", str(tmp_path))
    own = BootstrapConfig.for_preset("tiny")
    assert BootstrapConfig.for_preset("tiny", world_seed=PRESETS["tiny"].seed) == own  # the preset's own world
    other = BootstrapConfig.for_preset("tiny", world_seed=5)
    assert other.world_config() == dataclasses.replace(PRESETS["tiny"], seed=5)
    assert default_model_dir(other).name.startswith("tiny-w5-")
    assert default_model_dir(other) != default_model_dir(own)
    # the hash of the preset's own recipe does not depend on the new field
    assert "world_seed" not in own.to_dict()
    with pytest.raises(ValueError, match="unknown world preset"):
        BootstrapConfig.for_preset("nope")


def test_micro_batched_warmup_step_equals_the_whole_batch(tiny_model_dir: Path) -> None:
    """Accumulating over micro-batches of demos gives the whole batch's weighted-mean gradient,
    and the warm-up with micro-batches runs (the real-model recipe)."""
    from treegrpo.training import warmup as w

    rng = random.Random(0)
    encoded = [
        w.EncodedDemo([rng.randrange(5, 300) for _ in range(n)], [0] * 4 + [1] * (n - 4)) for n in (12, 20, 9, 15, 30, 11)
    ]
    grads = {}
    for micro in (0, 1, 4):
        model = load_model(tiny_model_dir)
        if micro == 0:
            w.policy_token_loss(model, w._collate(encoded, 1, 3.0)).backward()
        else:
            w._accumulated_step(model, [w._collate(encoded[i : i + micro], 1, 3.0) for i in range(0, 6, micro)])
        grads[micro] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert float(grads[0].abs().max()) > 1e-3
    for micro in (1, 4):
        assert torch.allclose(grads[micro], grads[0], atol=1e-6, rtol=1e-5), micro
    cfg = w.WarmupConfig(epochs=1, batch_size=6, pack_len=64, lr=1e-3, micro_batch_size=2)
    stats = w.supervised_warmup(load_model(tiny_model_dir), encoded, cfg, 1, random.Random(1))
    assert stats["steps"] == 1 and math.isfinite(stats["final_loss"])


def test_the_default_bootstrap_demonstrates_every_ruler_and_country() -> None:
    """Every ruler and country a train or held-out question of the default world asks for is the
    answer of some rewarded demo of that world. The tiny agent learns those names from its demos
    (it copies one-word cities and companies from a passage, but names a ruler or a country it was
    never shown answering with the bridge it searched instead), and RL only reinforces what the
    policy samples: with p_shortcut 0.7, 5 of the 12 rulers were in no demo, so about a tenth of
    the held-out questions were out of every run's reach and the runs' ends spread with which of
    the rest they happened to learn (issue 34)."""
    from treegrpo.tasks.world.bootstrap import PRESET_RECIPES, WORLD_RECIPE

    cfg = BootstrapConfig.for_preset("default")
    assert cfg == BootstrapConfig() and cfg.p_shortcut == 0.5
    assert BootstrapConfig.for_preset("rare3").p_shortcut == PRESET_RECIPES["rare3"]["p_shortcut"] == 0.7
    world = build_world(cfg.world_config())
    n_target = len(world.tasks("warmup"))  # the target world's demos come first, then the aux worlds'
    demos = WORLD_RECIPE.prepare(cfg, random.Random(f"{WORLD_RECIPE.seed_name}-{cfg.seed}")).demos[:n_target]
    assert {d.task.question for d in demos} == {t.question for t in world.tasks("warmup")}
    taught = {d.task.answers[0] for d in demos if d.reward}
    for relation in ("ruled_by", "in_country"):
        asked = {t.answers[0] for s in ("train", "eval") for t in world.tasks(s) if t.meta["relations"][-1] == relation}
        assert len(asked) >= 10 and asked <= taught, (relation, sorted(asked - taught))
