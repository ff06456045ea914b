"""The trainer on 2 gloo ranks: rank 0 writes every file, the rollouts of all ranks are in the
metrics and the written forests, checkpoints hold every rank's streams, and a run resumes with a
different world size (2 → 1 → 2, DDP → FSDP2 → 1) holding, at every checkpoint, the parameter and
optimizer-state values of one uninterrupted process trained on the same forests. Plus real
launches: ``treegrpo train --nproc 2`` through torchrun, and two torchrun "nodes" (c10d
rendezvous) of which only global rank 0 prints the summary."""

from __future__ import annotations

import copy
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_trainer import DOCS, TASKS, parts_for, small_cfg

from treegrpo.algos.advantages import token_advantages
from treegrpo.models.loader import load_model
from treegrpo.training.checkpoint import read_checkpoint
from treegrpo.training.config import TrainConfig
from treegrpo.training.policy import Policy
from treegrpo.training.schedule import lr_at, set_lr
from treegrpo.training.trainer import advantage_config, loss_config, train
from treegrpo.training.update import update
from treegrpo.tree import read_forests


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, model_dir: str, kw: dict[str, Any]) -> None:
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    torch.set_num_threads(1)
    cfg = small_cfg(Path(kw.pop("out")), **kw)
    train(cfg, parts=parts_for(Path(model_dir)))


def _spawn(model_dir: Path, **kw: Any) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(2, _free_port(), str(model_dir), kw), nprocs=2, join=True)


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


RUN = {"prompts_per_step": 3, "m": 2, "n": 1, "l": 1, "kl_coef": 0.01}
# every step's forests (what the replay trains on); an entropy bonus, so the steps move every
# parameter (the random tiny model earns no reward: no policy gradient, and KL 0 at the start)
RESUME = {**RUN, "dump_rollouts_every": 1, "entropy_coef": 0.01}


# -- training state, compared by value --------------------------------------------------------------

State = tuple[dict[str, torch.Tensor], dict[str, Any]]  # (parameters by name, optimizer.state_dict())
HYPER = ("lr", "betas", "eps", "weight_decay", "params")


def assert_same_training_state(got: State, want: State, *, param_atol: float = 1e-5, opt_rtol: float = 1e-4) -> None:
    """``got`` holds the values of ``want``: every parameter within ``param_atol``; the optimizer's
    hyper-parameters and per-parameter step counts equal, and each moment tensor (``exp_avg``,
    ``exp_avg_sq``) within ``opt_rtol`` of its own largest magnitude. The optimizer state is
    matched by parameter index, the parameters by name, so a mapping that swaps two tensors of the
    same shape fails (their values differ)."""
    (gp, go), (wp, wo) = got, want
    assert gp.keys() == wp.keys()
    for name, w in wp.items():
        assert gp[name].shape == w.shape, name
        d = float((gp[name].double() - w.double()).abs().max())
        assert d <= param_atol, f"parameter {name} differs by {d:.3g} (> {param_atol})"
    def hyper(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:  # a reloaded state has lists for tuples
        return [{k: list(g[k]) if isinstance(g[k], tuple) else g[k] for k in HYPER} for g in groups]

    assert hyper(go["param_groups"]) == hyper(wo["param_groups"])
    assert go["state"].keys() == wo["state"].keys()
    for i, w in wo["state"].items():
        g = go["state"][i]
        assert g.keys() == w.keys() and float(g["step"]) == float(w["step"]), i
        for k in ("exp_avg", "exp_avg_sq"):
            assert g[k].shape == w[k].shape, (i, k)
            d, scale = float((g[k].double() - w[k].double()).abs().max()), float(w[k].abs().max())
            assert d <= opt_rtol * scale + 1e-30, f"optimizer state {i}.{k} differs by {d:.3g} (scale {scale:.3g})"


def _saved(out: Path) -> State:
    """The parameters and optimizer state of the run's latest checkpoint."""
    ck = read_checkpoint(out / "checkpoint")
    return load_model(ck.folder).state_dict(), ck.optimizer


def _replay(model_dir: Path, out: Path, steps: int) -> dict[int, State]:
    """The uninterrupted run: one process, one model and optimizer never saved nor loaded, trained
    step by step on the forests the resumed run wrote (``rollouts/step_k.jsonl``: all ranks'
    forests, in task order) with the run's recorded config. (A separately sampled run would not
    do: each rank samples its own stream, so the rollouts depend on the world size.)"""
    cfg = TrainConfig.model_validate(json.loads((out / "config.json").read_text()))
    parts = parts_for(model_dir)
    policy = Policy.build(parts.model, cfg)
    model = policy.model
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=float(cfg.lr), weight_decay=cfg.weight_decay)
    states = {}
    for step in range(1, steps + 1):
        forests = read_forests(out / "rollouts" / f"step_{step:05d}.jsonl")
        advs = [token_advantages(f, cfg.estimator, advantage_config(cfg)) for f in forests]
        set_lr(opt, lr_at(step, float(cfg.lr), cfg.steps, cfg.lr_warmup_steps, cfg.lr_schedule, cfg.min_lr_ratio))
        update(policy, opt, forests, advs, cfg, loss_config(cfg), parts.tokenizer.pad_token_id)
        states[step] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, copy.deepcopy(opt.state_dict()))
    return states


def test_the_state_comparison_catches_a_swapped_mapping(tiny_model_dir: Path) -> None:
    """Two same-shape tensors swapped — parameters by name, or optimizer state by index — fail the
    comparison; the unswapped copy and float noise pass."""
    model = load_model(tiny_model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for seed in range(2):
        ids = torch.randint(3, 400, (2, 16), generator=torch.Generator().manual_seed(seed))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    state: State = ({k: v.detach().clone() for k, v in model.state_dict().items()}, copy.deepcopy(opt.state_dict()))
    assert_same_training_state(copy.deepcopy(state), state)
    noisy = copy.deepcopy(state)
    for v in noisy[0].values():
        v.add_(1e-7)
    assert_same_training_state(noisy, state)

    a, b = "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"
    swapped = copy.deepcopy(state)
    swapped[0][a], swapped[0][b] = swapped[0][b], swapped[0][a]
    with pytest.raises(AssertionError, match=r"parameter model\.layers\.0\.mlp\.up_proj\.weight differs"):
        assert_same_training_state(swapped, state)

    names = [n for n, _ in model.named_parameters()]
    i, j = names.index(a), names.index(b)
    swapped = copy.deepcopy(state)
    st = swapped[1]["state"]
    st[i], st[j] = st[j], st[i]
    with pytest.raises(AssertionError, match="optimizer state"):
        assert_same_training_state(swapped, state)


def test_two_ranks_train_write_once_and_resume_with_other_world_sizes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    saved: dict[int, State] = {}
    _spawn(tiny_model_dir, out=str(out), steps=2, **RESUME)
    saved[2] = _saved(out)
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["rollout/trajectories"] == 3 * 2 * 2  # all ranks' forests: 3 prompts (2 + 1)
    forests = (out / "rollouts" / "step_00002.jsonl").read_text().splitlines()
    assert len(forests) == 3
    ck = read_checkpoint(out / "checkpoint")
    assert len(ck.run.rank_streams) == 2 and ck.run.rank_streams[0]["gen"].equal(ck.run.gen.get_state())
    assert not ck.run.rank_streams[1]["gen"].equal(ck.run.gen.get_state())  # rank 1 samples its own stream
    # 2 ranks → 1 process
    s = train(small_cfg(out, steps=3, resume=True, **RESUME), parts=parts_for(tiny_model_dir))
    assert s.steps == 3 and [r["step"] for r in _rows(out)] == [0, 1, 2, 3]
    saved[3] = _saved(out)
    # 1 process → 2 ranks, DDP → FSDP2 (parallel may change on resume)
    _spawn(tiny_model_dir, out=str(out), steps=4, resume=True, parallel="fsdp2", **RESUME)
    saved[4] = _saved(out)
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[4]["rollout/trajectories"] == 12 and "eval/success_greedy" in rows[4]
    ck = read_checkpoint(out / "checkpoint")
    assert ck.step == 4 and len(ck.run.rank_streams) == 2
    assert set(ck.optimizer["state"]) == set(range(len(list(parts_for(tiny_model_dir).model.parameters()))))
    # and back to one process from the FSDP2 checkpoint: weights and the gathered optimizer state load
    s = train(small_cfg(out, steps=5, resume=True, **RESUME), parts=parts_for(tiny_model_dir))
    assert s.steps == 5
    saved[5] = _saved(out)
    # the values: every checkpoint holds what one uninterrupted process trained on the same forests
    replay = _replay(tiny_model_dir, out, 5)
    start = load_model(tiny_model_dir).state_dict()
    assert max(float((replay[5][0][k] - start[k]).abs().max()) for k in start) > 1e-3  # the steps did something
    for step, state in saved.items():
        assert_same_training_state(state, replay[step])


def test_a_rank_without_prompts_still_takes_part(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "one"
    _spawn(tiny_model_dir, out=str(out), steps=1, **{**RUN, "prompts_per_step": 1})
    rows = _rows(out)
    assert rows[1]["rollout/trajectories"] == 4 and rows[1]["update/packed"] == 1.0
    # the model work, summed over the ranks (rank 1 sampled nothing and adds zeros)
    assert rows[1]["engine/prefill_positions"] >= rows[1]["budget/prefill_tokens"] > 0
    assert 0 < rows[1]["engine/decode_positions"] < rows[1]["budget/generated_tokens"]
    assert rows[1]["update/positions"] >= rows[1]["update/tokens_packed"] > 0


def test_nproc_launches_torchrun(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``treegrpo train --nproc 2`` relaunches itself under ``torch.distributed.run``."""
    data, corpus = tmp_path / "q.jsonl", tmp_path / "docs.jsonl"
    data.write_text(
        "".join(json.dumps({"id": t.id, "question": t.question, "answers": t.answers}) + "\n" for t in TASKS)
    )
    corpus.write_text("".join(json.dumps({"id": d.id, "contents": d.contents}) + "\n" for d in DOCS))
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "treegrpo", "train", "--nproc", "2", "--model", str(tiny_model_dir)]
    cmd += ["--data", str(data), "--eval-data", str(data), "--corpus", str(corpus), "--steps", "1"]
    cmd += ["--prompts-per-step", "3", "--m", "2", "--n", "1", "--l", "1", "--out-dir", str(out)]
    cmd += ["--set", "eval_prompts=2", "--set", "max_turns=2", "--set", "tensorboard=false"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"), *sys.path])}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["rollout/trajectories"] == 12
    assert json.loads((out / "summary.json").read_text())["steps"] == 1
    assert proc.stdout.count("outputs in") == 1 and proc.stdout.count("treegrpo run summary") == 1  # rank 0's


def _cli_files(tmp_path: Path) -> list[str]:
    """The command line of a 1-step run on the test world: data, corpus, tree shape, out dir."""
    data, corpus = tmp_path / "q.jsonl", tmp_path / "docs.jsonl"
    data.write_text(
        "".join(json.dumps({"id": t.id, "question": t.question, "answers": t.answers}) + "\n" for t in TASKS)
    )
    corpus.write_text("".join(json.dumps({"id": d.id, "contents": d.contents}) + "\n" for d in DOCS))
    cmd = ["--data", str(data), "--eval-data", str(data), "--corpus", str(corpus), "--steps", "1"]
    cmd += ["--prompts-per-step", "3", "--ts-m", "2", "--ts-n", "1", "--ts-l", "1", "--out-dir", str(tmp_path / "cli")]
    return [*cmd, "--set", "eval_prompts=2", "--set", "max_turns=2", "--set", "tensorboard=false"]


def test_only_global_rank_0_prints_the_summary(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second node's process has LOCAL_RANK 0 but RANK 1: it wrote nothing, so it prints no
    summary and no "outputs in"."""
    from rich.console import Console

    from treegrpo.training import run as run_mod
    from treegrpo.training.trainer import TrainSummary

    done = TrainSummary(
        out_dir=str(tmp_path), steps=1, eval_start={"eval/success_greedy": 0.25}, eval_end={"eval/success_greedy": 0.5},
        trajectories=12, generated_tokens=100, prefill_tokens=300, tool_calls=4, wall_s=2.0, rollout_s=1.0,
        update_s=1.0, em_curve=[],
    )  # fmt: skip
    monkeypatch.setattr(run_mod, "train", lambda cfg, console, **kw: done)
    printed = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "2")
        console = Console(file=io.StringIO(), width=200)
        assert run_mod.run_training(small_cfg(tmp_path), console) is done  # every rank gets the summary
        printed[rank] = console.file.getvalue()  # type: ignore[attr-defined]
    assert "outputs in" in printed["0"] and "treegrpo run summary" in printed["0"]
    assert printed["1"] == ""


def test_two_torchrun_nodes_print_one_summary(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two torchrun "nodes" on this machine (c10d rendezvous, one process each): they train as one
    job, and only the node that got global rank 0 prints the summary and "outputs in"."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"), *sys.path])}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
    cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "two-nodes", "--max_restarts", "0"]
    cmd += ["-m", "treegrpo", "train", "--model", str(tiny_model_dir), *_cli_files(tmp_path)]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in nodes]
    for p, (o, e) in zip(nodes, outs, strict=True):
        assert p.returncode == 0, o[-2000:] + e[-3000:]
    rows = _rows(tmp_path / "cli")
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["rollout/trajectories"] == 12  # one job of 2 ranks
    printed = sorted(o.count("outputs in") + o.count("treegrpo run summary") for o, _ in outs)
    assert printed == [0, 2], [o[-1500:] for o, _ in outs]  # one node prints both, the other neither


# -- the model's own tool protocol (ToolEnv protocol="tools") on 2 ranks ---------------------------


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


class NativeEngine:
    """Writes the model's turns in the chatml-tools template: two add calls in one turn while the
    context has no tool result yet, then an answer, right and wrong in turn (rewards that differ)."""

    def __init__(self, tok: Any, schemas: list[dict[str, Any]]) -> None:
        from treegrpo.rollout.toolcall import ToolCall, assistant_message, assistant_turn_text

        def ids(msg: dict[str, Any]) -> list[int]:
            return tok.encode(assistant_turn_text(tok, msg, schemas), add_special_tokens=False)

        self.tok = tok
        self.call = ids(assistant_message("I add.", [ToolCall("add", {"a": 2, "b": 3}), ToolCall("add", {"a": 4, "b": 5})]))
        self.answers = [ids({"role": "assistant", "content": a}) for a in ("5, 9", "7")]
        self.n = 0

    def generate(self, contexts: Any, params: Any, generator: Any = None) -> list[Any]:
        from treegrpo.rollout.engine import Generation

        out = []
        for c in contexts:
            if "<|im_start|>tool" in self.tok.decode(c):
                ids, self.n = self.answers[self.n % 2], self.n + 1
            else:
                ids = self.call
            out.append(Generation(tokens=list(ids), logprobs=[0.0] * len(ids), finish_reason="stop", prefill_tokens=len(c)))
        return out

    def load_weights(self, module: Any) -> None:
        pass


def native_parts(model_dir: Path) -> tuple[Any, NativeEngine]:
    """The run's pieces for the native protocol on the 2-layer SmolLM2, and its scripted engine."""
    from templating import templated
    from treegrpo.envs.base import Task
    from treegrpo.envs.tool_env import ToolEnv
    from treegrpo.models.loader import load_tokenizer
    from treegrpo.rollout.agent import AgentConfig
    from treegrpo.training.setup import RunParts

    tok = templated(load_tokenizer(model_dir), "chatml-tools")
    env = ToolEnv([add], rewards=["em"], protocol="tools", tokenizer=tok)
    tasks = [Task(f"q{i}", f"What is 2 + 3, and 4 + 5? ({i})", ["5, 9"], meta={"answer": "5, 9"}) for i in range(5)]
    parts = RunParts(
        model_dir=model_dir, model=load_model(model_dir), tokenizer=tok, env=env, train_tasks=tasks[:4],
        eval_tasks=tasks[4:], agent_cfg=AgentConfig(max_turns=3, max_step_tokens=96, max_context_tokens=1024),
        extra_files={}, info={},
    )  # fmt: skip
    return parts, NativeEngine(tok, env.tool_schemas)


def _native_rank(rank: int, world: int, port: int, model_dir: str, kw: dict[str, Any]) -> None:
    from treegrpo.training import trainer as trainer_module

    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    torch.set_num_threads(1)
    parts, engine = native_parts(Path(model_dir))
    trainer_module.make_engine = lambda *a, **k: engine  # this rank's process only
    train(small_cfg(Path(kw.pop("out")), **kw), parts=parts)


def test_two_ranks_train_on_native_forests(smollm2_2layer_dir: Path, tmp_path: Path) -> None:
    """Data-parallel training on forests of the model's own tool protocol: rank 0 writes the
    files, all ranks' forests (native tool turns: two calls, their results as tool turns) are in
    the metrics and the written rollouts, the checkpoint holds both ranks' streams, and its
    weights and optimizer state are what one process trained on the same forests."""
    import torch.multiprocessing as mp

    out = tmp_path / "native"
    kw = {**RESUME, "out": str(out), "steps": 1, "entropy_coef": 0.01}
    mp.spawn(_native_rank, args=(2, _free_port(), str(smollm2_2layer_dir), kw), nprocs=2, join=True)
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["rollout/trajectories"] == 3 * 2 * 2  # all ranks' forests: 3 prompts (2 + 1)
    forests = read_forests(out / "rollouts" / "step_00001.jsonl")
    assert len(forests) == 3
    calls = [n for f in forests for t in f.trees for n in t.nodes if n.parent == t.root.id]  # every first turn
    for step in calls:
        assert step.extra["kind"] == "tool" and [m["content"] for m in step.extra["messages"][1:]] == ["5", "9"]
        assert step.observation == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>tool\n9<|im_end|>\n<|im_start|>assistant\n"
    assert rows[1]["budget/tool_calls"] == 2 * len(calls) >= 2 * 3 * 2  # all ranks' calls: two a turn, 2+ turns a tree
    assert sorted({leaf.reward for f in forests for _, leaf in f.leaves()}) == [0.0, 1.0]
    ck = read_checkpoint(out / "checkpoint")
    assert len(ck.run.rank_streams) == 2 and not ck.run.rank_streams[1]["gen"].equal(ck.run.gen.get_state())
    # the values: one uninterrupted process trained on the same forests
    cfg = TrainConfig.model_validate(json.loads((out / "config.json").read_text()))
    parts, _ = native_parts(smollm2_2layer_dir)
    start = {k: v.detach().clone() for k, v in parts.model.state_dict().items()}
    policy = Policy.build(parts.model, cfg)
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=float(cfg.lr), weight_decay=cfg.weight_decay)
    advs = [token_advantages(f, cfg.estimator, advantage_config(cfg)) for f in forests]
    set_lr(opt, lr_at(1, float(cfg.lr), cfg.steps, cfg.lr_warmup_steps, cfg.lr_schedule, cfg.min_lr_ratio))
    update(policy, opt, forests, advs, cfg, loss_config(cfg), parts.tokenizer.pad_token_id)
    want = ({k: v.detach().clone() for k, v in policy.model.state_dict().items()}, copy.deepcopy(opt.state_dict()))
    assert max(float((want[0][k] - start[k]).abs().max()) for k in start) > 0.0  # the step did something
    assert_same_training_state(_saved(out), want)
