"""The update dispatch: packed and per-path updates give the same parameters; ``packing``
auto/on/off; fallback (one log line) for models that reject or ignore custom 4D masks."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from test_packing import PAD, forests_for_tests

from treegrpo.algos.advantages import token_advantages
from treegrpo.algos.losses import AGG_MODES, LossConfig
from treegrpo.models.loader import load_model
from treegrpo.training.config import TrainConfig, make_config
from treegrpo.training.policy import Policy
from treegrpo.training.update import split_minibatches, update


def _cfgs(**kw: Any) -> tuple[TrainConfig, LossConfig]:
    base = {"micro_batch_tokens": 128, "kl_coef": 0.05, "entropy_coef": 0.01, "grad_clip": 1e6}
    cfg = make_config({**base, **kw})
    loss_cfg = LossConfig(
        kl_coef=cfg.kl_coef, entropy_coef=cfg.entropy_coef, agg_mode=cfg.agg_mode, dual_clip=cfg.dual_clip
    )
    return cfg, loss_cfg


def _run(
    model: torch.nn.Module, cfg: TrainConfig, loss_cfg: LossConfig, estimator: str = "tree_grpo", **kw: Any
):
    forests = forests_for_tests()
    advs = [token_advantages(f, estimator) for f in forests]
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    metrics = update(Policy(model, ref), opt, forests, advs, cfg, loss_cfg, PAD, **kw)
    return metrics, torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize(
    ("agg_mode", "mini_batches", "estimator"),
    [("token-mean", 1, "tree_grpo"), ("seq-mean-token-mean", 2, "treerl"), ("seq-mean-token-sum", 3, "grpo")],
)
def test_packed_update_equals_per_path_update(
    tiny_model_dir: Path, agg_mode: str, mini_batches: int, estimator: str
) -> None:
    """Same parameters after the update (SGD, so a parameter step is lr × gradient). With several
    mini-batches the later ones train off-policy on old log-probs computed before the first step."""
    results = {}
    for packing in ("on", "off"):
        cfg, loss_cfg = _cfgs(agg_mode=agg_mode, mini_batches=mini_batches, packing=packing)
        results[packing] = _run(load_model(tiny_model_dir), cfg, loss_cfg, estimator)
    (m_on, p_on), (m_off, p_off) = results["on"], results["off"]
    start = torch.cat([p.detach().flatten() for p in load_model(tiny_model_dir).parameters()])
    assert float((p_off - start).abs().max()) > 1e-3  # the update did something
    assert float((p_on - p_off).abs().max()) <= 1e-5
    assert m_on["update/packed"] == 1.0 and m_off["update/packed"] == 0.0
    assert m_on["update/tokens_packed"] < m_on["update/tokens_paths"]
    for key in ("loss/policy", "loss/kl", "loss/entropy", "loss/total", "actor/grad_norm", "actor/entropy"):
        assert m_on[key] == pytest.approx(m_off[key], abs=1e-4), key
    if mini_batches > 1:
        assert m_on["actor/clipfrac"] > 0 or m_on["actor/ratio_max"] != pytest.approx(1.0)


@pytest.mark.parametrize("packing", ["on", "off"])
@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_micro_batches_give_the_one_batch_gradient(tiny_model_dir: Path, agg_mode: str, packing: str) -> None:
    """One optimizer step (SGD, lr 1: the parameter change is the gradient) from one micro-batch
    and from several (token cap 64) agree to 1e-6: every micro-batch is aggregated with the
    mini-batch's normalisers, not its own counts and padded width."""
    params = {}
    for cap in (1 << 20, 64):
        cfg, loss_cfg = _cfgs(agg_mode=agg_mode, packing=packing, micro_batch_tokens=cap)
        model = load_model(tiny_model_dir)
        forests = forests_for_tests()
        advs = [token_advantages(f, "tree_grpo") for f in forests]
        ref = copy.deepcopy(model).eval()
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
        update(Policy(model, ref), torch.optim.SGD(model.parameters(), lr=1.0), forests, advs, cfg, loss_cfg, PAD)
        params[cap] = torch.cat([p.detach().flatten() for p in model.parameters()])
    start = torch.cat([p.detach().flatten() for p in load_model(tiny_model_dir).parameters()])
    assert float((params[64] - start).abs().max()) > 1e-3
    assert float((params[64] - params[1 << 20]).abs().max()) <= 1e-6


def test_auto_packs_every_sampler_and_off_trains_per_path(tiny_model_dir: Path) -> None:
    for sampler in ("tree", "chain"):
        cfg, loss_cfg = _cfgs(sampler=sampler)
        assert _run(load_model(tiny_model_dir), cfg, loss_cfg)[0]["update/packed"] == 1.0, sampler
    cfg, loss_cfg = _cfgs(sampler="chain", packing="off")
    assert _run(load_model(tiny_model_dir), cfg, loss_cfg)[0]["update/packed"] == 0.0


class RejectsMasks(torch.nn.Module):
    """A model that raises on a 4D attention mask (as some attention kernels do)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):  # type: ignore[no-untyped-def]
        if attention_mask is not None and attention_mask.dim() == 4:
            raise ValueError("custom 4D attention masks are not supported\nsecond line")
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)


class IgnoresMasks(RejectsMasks):
    """A model that silently drops the custom mask and the position ids: plain causal attention."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):  # type: ignore[no-untyped-def]
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = None
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)


@pytest.mark.parametrize("wrapper", [RejectsMasks, IgnoresMasks])
def test_auto_falls_back_to_per_path_with_one_log_line(tiny_model_dir: Path, wrapper: type) -> None:
    cfg, loss_cfg = _cfgs(packing="auto")
    lines: list[str] = []
    model = wrapper(load_model(tiny_model_dir))
    m, params = _run(model, cfg, loss_cfg, log=lines.append)
    assert m["update/packed"] == 0.0
    assert len(lines) == 1 and "training per path" in lines[0] and "\n" not in lines[0]
    m2, _ = _run(model, cfg, loss_cfg, log=lines.append)  # decided once per model
    assert m2["update/packed"] == 0.0 and len(lines) == 1
    off_cfg, _ = _cfgs(packing="off")
    _, params_off = _run(wrapper(load_model(tiny_model_dir)), off_cfg, loss_cfg)
    assert torch.equal(params, params_off)


def test_packing_on_raises_when_the_model_cannot(tiny_model_dir: Path) -> None:
    cfg, loss_cfg = _cfgs(packing="on")
    with pytest.raises(RuntimeError, match=r"cannot train packed.*4D attention masks"):
        _run(RejectsMasks(load_model(tiny_model_dir)), cfg, loss_cfg)
    with pytest.raises(ValueError, match="token-wise"):
        _run(load_model(tiny_model_dir), cfg, LossConfig(policy_loss="gspo"))


def test_split_minibatches_is_contiguous_and_balanced() -> None:
    assert split_minibatches(7, 3) == [[0, 1], [2, 3, 4], [5, 6]]
    assert split_minibatches(2, 4) == [[0], [1]]
    assert split_minibatches(0, 2) == []
    assert split_minibatches(5, 1) == [list(range(5))]


def test_an_empty_batch_trains_nothing_and_decides_nothing(tiny_model_dir: Path) -> None:
    from treegrpo.training.update import _PACKING_CHECKED

    cfg, loss_cfg = _cfgs()
    model = load_model(tiny_model_dir)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    metrics = update(Policy(model), opt, [], [], cfg, loss_cfg, PAD)
    assert metrics["update/packed"] == 1.0 and model not in _PACKING_CHECKED


@pytest.mark.parametrize("packing", ["on", "off"])
def test_entropy_bonus_reaches_the_gradient(tiny_model_dir: Path, packing: str) -> None:
    """The entropy is a metric (no autograd) only without an entropy term: with ``entropy_coef > 0``,
    zero advantages and no KL, the entropy bonus alone moves the weights; with 0 nothing does."""
    forests = forests_for_tests()
    zero = [[[0.0] * len(path) for path in token_advantages(f, "tree_grpo")] for f in forests]
    moved = {}
    for coef in (0.0, 0.1):
        cfg, loss_cfg = _cfgs(packing=packing, kl_coef=0.0, entropy_coef=coef)
        model = load_model(tiny_model_dir)
        start = torch.cat([p.detach().flatten() for p in model.parameters()])
        m = update(Policy(model), torch.optim.SGD(model.parameters(), lr=0.5), forests, zero, cfg, loss_cfg, PAD)
        assert m["actor/entropy"] > 0
        moved[coef] = float((torch.cat([p.detach().flatten() for p in model.parameters()]) - start).abs().max())
    assert moved[0.0] == 0.0 and moved[0.1] > 1e-4


def test_packing_probe_reads_log_probs_as_training_does(tiny_model_dir: Path) -> None:
    """With ``chunk_tokens`` the packing probe reads its log-probs from the decoder's hidden states
    (chunked, as the update does), never from the model's full ``[paths, T, vocab]`` logits: with
    the model's own forward made to fail, the probe still passes."""
    from treegrpo.training.logprobs import split_head
    from treegrpo.training.update import packing_supported

    model = load_model(tiny_model_dir)
    assert split_head(model) is not None  # probed (and cached) before the full forward is broken

    def no_full_logits(*a: Any, **k: Any) -> Any:
        raise RuntimeError("the full logits were computed")

    model.forward = no_full_logits  # type: ignore[method-assign]
    assert packing_supported(model, forests_for_tests(), PAD, strict=True, chunk_tokens=16)
    model2 = load_model(tiny_model_dir)
    model2.forward = no_full_logits  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="full logits"):  # unchunked: the probe needs them
        packing_supported(model2, forests_for_tests(), PAD, strict=True)
