"""The trainer loop end to end on a tiny random model: metrics, checkpoints, resume, masking."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from treegrpo.algos.losses import LossConfig
from treegrpo.envs.base import Task
from treegrpo.envs.search import SearchEnv
from treegrpo.models.loader import MARKER_FILE, load_model, load_tokenizer
from treegrpo.retrieval.base import Doc
from treegrpo.retrieval.bm25 import BM25Retriever
from treegrpo.rollout.agent import AgentConfig
from treegrpo.training.batching import TrainSequence
from treegrpo.training.config import ConfigError, TrainConfig, make_config
from treegrpo.training.config_files import load_config
from treegrpo.training.policy import Policy
from treegrpo.training.setup import RunParts
from treegrpo.training.trainer import train
from treegrpo.training.update import update_paths

DOCS = [Doc(str(i), f"city{i}\ncity{i} is in country{i % 3}.") for i in range(6)]
TASKS = [Task(f"q{i}", f"where is city{i}?", [f"country{i % 3}"]) for i in range(6)]


def parts_for(model_dir: Path) -> RunParts:
    return RunParts(
        model_dir=model_dir,
        model=load_model(model_dir),
        tokenizer=load_tokenizer(model_dir),
        env=SearchEnv(BM25Retriever(DOCS), topk=1, prompt_template="minimal"),
        train_tasks=TASKS[:4],
        eval_tasks=TASKS[4:],
        agent_cfg=AgentConfig(max_turns=2, max_step_tokens=12, max_obs_tokens=24, max_context_tokens=256),
        extra_files={MARKER_FILE: (model_dir / MARKER_FILE).read_text()},
        info={},
    )


def small_cfg(out: Path, **kw) -> TrainConfig:
    base = dict(steps=2, prompts_per_step=2, m=2, n=1, l=1, eval_every=0, save_every=1, out_dir=str(out), tensorboard=False)
    return make_config({**base, **kw})


def test_train_two_steps_logs_and_checkpoints(tiny_model_dir: Path, tmp_path: Path) -> None:
    s = train(small_cfg(tmp_path / "run"), parts=parts_for(tiny_model_dir))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("reward/mean", "loss/policy", "loss/kl", "budget/generated_tokens", "rollout/trajectories"):
        assert key in rows[1]
    assert rows[1]["rollout/trajectories"] == 2 * 2 * (1 + 1)  # prompts x M x (1 + N·L)
    assert "eval/success_greedy" in rows[0] and "eval/success_sampled" in rows[-1]
    assert s.trajectories == 16 and s.generated_tokens == rows[1]["budget/generated_tokens"] + rows[2]["budget/generated_tokens"]
    ck = tmp_path / "run" / "checkpoint"
    assert (ck / "trainer_state.pt").exists() and (ck / MARKER_FILE).exists()
    load_model(ck)  # a from_pretrained folder
    assert not list((tmp_path / "run").glob(".checkpoint*"))  # no temp folders left
    assert list((tmp_path / "run" / "rollouts").glob("*.jsonl"))


def test_resume_continues_where_it_stopped(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    full = train(small_cfg(tmp_path / "full", steps=3, kl_coef=0.0), parts=parts_for(tiny_model_dir))
    train(small_cfg(out, steps=2, kl_coef=0.0), parts=parts_for(tiny_model_dir))
    resumed = train(small_cfg(out, steps=3, resume=True, kl_coef=0.0), parts=parts_for(tiny_model_dir))
    rows = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == [0, 1, 2, 3]
    # same seed, same RNG state restored: the resumed run spends exactly what the straight run did
    assert resumed.generated_tokens == full.generated_tokens
    assert resumed.trajectories == full.trajectories


def test_observation_tokens_carry_no_loss(tiny_model_dir: Path) -> None:
    """Changing advantages or sampling log-probs on mask-0 (prompt/observation) tokens changes
    nothing in the update."""
    cfg = make_config({"mini_batches": 2, "kl_coef": 0.01, "entropy_coef": 0.01})
    loss_cfg = LossConfig(kl_coef=0.01, entropy_coef=0.01)
    tok = load_tokenizer(tiny_model_dir)
    ids = tok.encode("Question: where is city1? <search> city1 </search><information>x</information>", add_special_tokens=False)
    mask = [0] * 6 + [1] * 4 + [0] * (len(ids) - 10)
    grads = []
    for obs_adv in (0.0, 5.0):
        model = load_model(tiny_model_dir)
        ref = load_model(tiny_model_dir)
        seqs = [
            TrainSequence(ids, mask, [1.0 if m else obs_adv for m in mask], [0.0] * len(ids)),
            TrainSequence(ids[:12], mask[:12], [-1.0 if m else obs_adv for m in mask[:12]], [0.0] * 12),
        ]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        update_paths(Policy(model, ref), opt, seqs, cfg, loss_cfg, tok.pad_token_id)
        grads.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(grads[0], grads[1])


def test_config_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="m: Input should be greater than or equal to 1"):
        make_config({"m": 0})
    with pytest.raises(ConfigError, match="--data needs a retriever"):
        make_config({"data": "x.jsonl"})
    (tmp_path / "c.yaml").write_text("ts_m: 3\nts_n: 4\nts_l: 2\n")
    cfg = load_config(tmp_path / "c.yaml", {"lr": 1e-3})
    assert (cfg.m, cfg.n, cfg.l, cfg.lr) == (3, 4, 2, 1e-3)
    assert cfg.out_dir == "runs/tree" and cfg.estimator == "tree_grpo"
    assert make_config({"sampler": "chain"}).estimator == "grpo"
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_eval_due_at_steps_and_token_checkpoints() -> None:
    from treegrpo.training.trainer import eval_due

    cfg = make_config({"steps": 10, "eval_every": 4, "eval_every_tokens": 100})
    assert eval_due(cfg, 4, 10, 20) == eval_due(cfg, 10, 10, 20) == "full"  # every 4 steps, the last step
    assert eval_due(cfg, 4, 150, 250) == "full"  # a step due both ways: the full evaluation
    assert eval_due(cfg, 3, 150, 199) is None  # no multiple of 100 passed
    assert eval_due(cfg, 3, 199, 200) == eval_due(cfg, 3, 150, 420) == "tokens"  # reached / passed (several: one)
    assert eval_due(make_config({"steps": 10, "eval_every": 0}), 3, 0, 10**6) is None  # off


def test_budget_tokens_config() -> None:
    assert make_config({"budget_tokens": "chain:2"}).budget_tokens == "chain:2"
    assert make_config({"budget_tokens": 64}).budget_tokens == 64
    with pytest.raises(ConfigError, match=r"budget_tokens 'chain:x'.*chain:G"):
        make_config({"budget_tokens": "chain:x"})
    with pytest.raises(ConfigError, match="budget_tokens needs --sampler tree"):
        make_config({"budget_tokens": "chain:2", "sampler": "chain"})
    with pytest.raises(ConfigError, match="N >= 1"):
        make_config({"budget_tokens": 64, "n": 0})


def test_token_matched_run_and_dense_curve(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A token-matched run books what it spends, and its curve has a point per token checkpoint
    passed (tokens, EM, tool calls), each at the run's totals after that step."""
    s = train(small_cfg(tmp_path / "run", steps=4, m=1, n=2, budget_tokens="chain:2", eval_every_tokens=200),
              parts=parts_for(tiny_model_dir))  # fmt: skip
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    tokens = [0]
    for r in rows[1:]:
        tokens.append(tokens[-1] + r["budget/generated_tokens"])
    due = [i for i in range(1, 5) if tokens[i] // 200 > tokens[i - 1] // 200 or i == 4]
    assert 1 < len(due) < 4, tokens  # some steps pass a checkpoint, some do not
    assert [p[0] for p in s.em_curve] == [0] + [tokens[i] for i in due]
    assert [p[2] for p in s.em_curve][-1] == s.tool_calls and all(len(p) == 3 for p in s.em_curve)
    assert all("eval/success_sampled" in rows[i] for i in due)
    # a token checkpoint alone is evaluated sampled only; the last step greedy too
    assert ["eval/success_greedy" in rows[i] for i in due] == [i == 4 for i in due]
    assert s.generated_tokens == tokens[-1]
    forest = json.loads((tmp_path / "run" / "rollouts" / "step_00004.jsonl").read_text().splitlines()[0])
    assert forest["token_limit"] > 0


def test_work_counters_in_metrics(tiny_model_dir: Path, tmp_path: Path) -> None:
    """One tree step logs the engine's and the update's model work; prefix reuse off runs more
    prefill positions (every context in full), packing off more update positions (every path
    padded to the longest). Same seed: both runs sample the same forests."""
    keys = ("engine/prefill_positions", "engine/decode_steps", "engine/decode_positions", "update/positions")
    rows = {}
    for name, kw in (("on", {}), ("off", {"engine_options": {"prefix_reuse": False}, "packing": "off"})):
        out = tmp_path / name
        train(small_cfg(out, steps=1, save_every=0, **kw), parts=parts_for(tiny_model_dir), eval_start={"eval/success_greedy": 0.0})
        rows[name] = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
        for key in keys:
            assert rows[name][key] > 0, key
        r = rows[name]
        assert r["engine/prefill_positions"] >= r["budget/prefill_tokens"]  # padding included
        assert r["engine/decode_steps"] <= r["engine/decode_positions"] < r["budget/generated_tokens"]
    on, off = rows["on"], rows["off"]
    assert on["budget/generated_tokens"] == off["budget/generated_tokens"]  # the same rollouts
    assert off["engine/prefill_positions"] > on["engine/prefill_positions"]
    assert off["budget/prefill_tokens"] > on["budget/prefill_tokens"]
    assert on["update/packed"] == 1.0 and off["update/packed"] == 0.0
    assert off["update/positions"] > on["update/positions"] >= on["update/tokens_packed"]
