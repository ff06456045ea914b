"""Checkpoints and resume: two verified generations, plain-data state, refused config changes.

Layout inside a run's ``out_dir``::

    checkpoint/        the latest generation: a from_pretrained folder (weights, tokenizer, extra
                       files) + trainer_state.pt + checksums.json (size and sha256 of every file);
                       a LoRA run saves the merged weights there (still a plain --model) and
                       its adapter in lora_adapter/, which resume loads back exactly
    checkpoint.prev/   the generation before it

A save writes everything to a temp folder ``.checkpoint.XXXX`` beside them (``checksums.json``
last, everything fsynced), then rotates: the old ``checkpoint.prev`` goes, ``checkpoint`` becomes
``checkpoint.prev``, the temp folder becomes ``checkpoint``. A kill at any point leaves at least
one complete generation; temp folders a killed save left behind are removed by the next save and
at the start of every run. (Keeping two generations costs twice the checkpoint's disk space.)

Resume verifies the latest generation against its checksums and falls back to the previous one
with a message; when neither is valid it refuses with one line (:class:`ConfigError`) rather than
silently starting over. ``trainer_state.pt`` is read with ``torch.load(weights_only=True)``: only
tensors and plain containers load, so a crafted file cannot run code — all state is stored in that
form (:meth:`RunState.to_state`).

A resumed run is the run it continues: it takes the checkpoint's recorded config, with the fields
the resume sets explicitly on top; an explicit field that differs from the recorded one is refused
unless named in ``resume_override`` (then applied and recorded in ``config.json`` and the next
checkpoint). ``RESUME_FREE_FIELDS`` may differ freely: where the run lives, how often it is
evaluated, logged and saved, the device and thread count, and ``steps`` upwards (that is how a run
is extended).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from pydantic import ValidationError

from treegrpo.io import atomic_write_json, fsync_path, sha256_file
from treegrpo.models.lora import save_model_folder
from treegrpo.training.config import ConfigError, TrainConfig

T = TypeVar("T")

CHECKPOINT_DIR = "checkpoint"
STATE_FILE = "trainer_state.pt"
MANIFEST = "checksums.json"
STATE_FORMAT = 2  # 2: plain-data state (weights_only-safe) with checksums; 1 (no field): pickled RNG tuples
USER_CODE = "user_code"  # the resume_override name accepting changed user modules (training/usercode.py)
RUN_FILES = ("config.json", "summary.json", "metrics.jsonl")  # written atomically, via temp files

#: Fields a resume may change without ``resume_override``: none of them changes what is trained.
RESUME_FREE_FIELDS = frozenset(
    {
        "out_dir",
        "resume",
        "resume_override",
        "steps",  # upwards only: the checkpoint's step is a floor
        "device",
        "parallel",  # and the number of processes: the update is the same (training/distributed.py)
        "threads",
        "tensorboard",
        "eval_every",
        "eval_every_tokens",
        "save_every",
        "dump_rollouts_every",
    }
)


class CheckpointError(ValueError):
    """A checkpoint generation that cannot be used; the message says why."""


# -- the run's state besides weights and optimizer ----------------------------------------------


@dataclass
class RunState:
    """Everything a run carries from step to step besides weights and optimizer: the last finished
    step, budget totals, summed phase times, evaluations and the three RNG streams."""

    step: int
    rng: random.Random  # prompt order: the same for every sampler at one seed (paired runs)
    pick_rng: random.Random  # tree picks, apart so they cannot shift the prompts
    gen: torch.Generator  # rollout sampling
    totals: dict[str, int] = field(
        default_factory=lambda: {
            "trajectories": 0,
            "generated_tokens": 0,
            "prefill_tokens": 0,
            "tool_calls": 0,
        }
    )
    times: dict[str, float] = field(default_factory=lambda: {"rollout_s": 0.0, "update_s": 0.0})
    eval_start: dict[str, float] = field(default_factory=dict)
    last_eval: dict[str, float] = field(default_factory=dict)
    em_curve: list[list[float]] = field(default_factory=list)  # [generated tokens, held-out success, tool calls]
    wall_s: float = 0.0  # wall seconds of the run up to ``step`` (all sessions)
    rank_streams: list[dict[str, Any]] = field(default_factory=list)  # data parallel: every rank's picks/gen

    @classmethod
    def fresh(cls, seed: int, eval_start: dict[str, float] | None = None) -> RunState:
        return cls(
            step=0,
            rng=random.Random(seed),
            pick_rng=random.Random(f"picks-{seed}"),
            gen=torch.Generator().manual_seed(seed),
            eval_start=dict(eval_start or {}),
        )

    def draw_prompts(self, tasks: Sequence[T], k: int) -> list[T]:
        """One step's prompts: ``k`` of ``tasks`` from the prompt-order stream (replaying
        :meth:`fresh` ``(seed)`` gives any run's order without running it)."""
        return self.rng.sample(tasks, min(k, len(tasks)))

    def reseed(self, seed: int) -> None:
        """Restart the three streams as a new run at ``seed`` would (a resume overriding ``seed``)."""
        new = RunState.fresh(seed)
        self.rng, self.pick_rng, self.gen = new.rng, new.pick_rng, new.gen

    def stream_state(self) -> dict[str, Any]:
        """This process's tree-pick and sampling streams, as plain data."""
        return {"pick_rng": _random_state(self.pick_rng), "gen": self.gen.get_state()}

    def load_streams(self, d: dict[str, Any]) -> None:
        """Continue the streams of a :meth:`stream_state`."""
        self.pick_rng = _random_from(d["pick_rng"])
        self.gen = torch.Generator()
        self.gen.set_state(d["gen"])

    def account(
        self, n_traj: int, generated: int, prefill: int, tool_calls: int, rollout_s: float, update_s: float
    ) -> None:
        """Add one step's budget and phase times to the run's totals."""
        self.totals["trajectories"] += n_traj
        self.totals["generated_tokens"] += generated
        self.totals["prefill_tokens"] += prefill
        self.totals["tool_calls"] += tool_calls
        self.times["rollout_s"] += rollout_s
        self.times["update_s"] += update_s

    def to_state(self) -> dict[str, Any]:
        """Tensors and plain containers only, so ``torch.load(weights_only=True)`` reads it."""
        return {
            "step": self.step,
            "rng": _random_state(self.rng),
            "pick_rng": _random_state(self.pick_rng),
            "gen": self.gen.get_state(),
            "totals": dict(self.totals),
            "times": dict(self.times),
            "eval_start": dict(self.eval_start),
            "last_eval": dict(self.last_eval),
            "em_curve": [list(p) for p in self.em_curve],
            "wall_s": self.wall_s,
            **({"rank_streams": list(self.rank_streams)} if self.rank_streams else {}),
        }

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> RunState:
        gen = torch.Generator()
        gen.set_state(d["gen"])
        return cls(
            step=int(d["step"]),
            rng=_random_from(d["rng"]),
            pick_rng=_random_from(d["pick_rng"]),
            gen=gen,
            totals=dict(d["totals"]),
            times=dict(d["times"]),
            eval_start=dict(d["eval_start"]),
            last_eval=dict(d["last_eval"]),
            em_curve=[list(p) for p in d["em_curve"]],
            wall_s=float(d["wall_s"]),
            rank_streams=list(d.get("rank_streams", [])),
        )


def _random_state(r: random.Random) -> dict[str, Any]:
    version, internal, gauss_next = r.getstate()
    return {
        "version": version,
        "internal": torch.tensor(internal, dtype=torch.int64),
        "gauss_next": gauss_next,
    }


def _random_from(d: dict[str, Any]) -> random.Random:
    r = random.Random()
    r.setstate((int(d["version"]), tuple(int(x) for x in d["internal"].tolist()), d["gauss_next"]))
    return r


# -- writing ---------------------------------------------------------------------------------------


def previous(folder: Path) -> Path:
    return folder.with_name(folder.name + ".prev")


def save_run(
    folder: Path,
    run: RunState,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    cfg: TrainConfig,
    extra_files: dict[str, str] | None = None,
    optimizer_state: dict[str, Any] | None = None,
) -> None:
    """Checkpoint a run: weights, tokenizer, optimizer, :class:`RunState` and the config it ran with.
    ``optimizer_state``: the optimizer's full state when it is not ``optimizer.state_dict()``
    (sharded, :meth:`~treegrpo.training.policy.Policy.optimizer_state`)."""
    state = {
        "format": STATE_FORMAT,
        "run": run.to_state(),
        "optimizer": optimizer.state_dict() if optimizer_state is None else optimizer_state,
        "config": cfg.model_dump(),
        "config_set": sorted(cfg.model_fields_set),  # what the user gave, for agent limits on resume
    }
    save_checkpoint(folder, model, tokenizer, state, extra_files)


def save_checkpoint(
    folder: Path,
    model: torch.nn.Module,
    tokenizer: Any,
    state: dict[str, Any],
    extra_files: dict[str, str] | None = None,
) -> None:
    """Write model, tokenizer, ``state`` and their checksums to a temp folder beside ``folder``,
    then rotate it in (the module docstring); an interrupted save leaves a complete generation."""
    folder = Path(folder)
    try:
        _save(folder, model, tokenizer, state, extra_files)
    except (OSError, RuntimeError) as e:  # a full disk: torch.save says "inline_container.cc:672 unexpected pos"
        raise ConfigError(write_failure(f"cannot save the checkpoint to {folder}", folder.parent, e)) from None


def write_failure(what: str, where: Path, err: BaseException) -> str:
    """One line for a failed write under ``where``: ``no space left`` (with the free space) when
    the disk is full, else the error's first line."""
    try:
        free = shutil.disk_usage(next(p for p in (where, *where.parents) if p.exists())).free / 1e9
    except (OSError, StopIteration):
        free = float("nan")
    full = getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or any(
        s in str(err) for s in ("unexpected pos", "No space left", "file write failed")
    )
    if full:
        return f"{what}: no space left on {where} ({free:.1f} GB free); free some space or choose another --out-dir"
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    return f"{what}: {type(err).__name__}: {first}"


def _save(
    folder: Path, model: torch.nn.Module, tokenizer: Any, state: dict[str, Any], extra_files: dict[str, str] | None
) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_temp_folders(folder)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        save_model_folder(model, tmp)  # a LoRA model: merged weights + its adapter in lora_adapter/
        tokenizer.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        torch.save(state, tmp / STATE_FILE)
        _write_manifest(tmp)
        prev = previous(folder)
        if folder.exists():
            if _check(folder, hashes=False) is None:  # keep a sound previous generation over a broken latest
                if prev.exists():
                    shutil.rmtree(prev)
                folder.rename(prev)
            else:
                shutil.rmtree(folder)
        tmp.rename(folder)
        fsync_path(folder.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def drop_previous(folder: Path) -> bool:
    """Delete ``folder``'s previous generation once the latest one verifies (every file against its
    checksum): what a finished run keeps is its last checkpoint. A latest generation that does
    not verify keeps the previous one. True when one was deleted."""
    prev = previous(Path(folder))
    if not prev.exists() or _check(Path(folder)) is not None:
        return False
    shutil.rmtree(prev)
    return True


def _write_manifest(folder: Path) -> None:
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            fsync_path(p)
            files[p.relative_to(folder).as_posix()] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    atomic_write_json(folder / MANIFEST, {"files": files})
    fsync_path(folder)


def _remove_temp_folders(folder: Path) -> None:
    for p in folder.parent.glob(f".{folder.name}.*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def check_writable(out: Path) -> None:
    """Make the run folder ``out``, and refuse in one line (:class:`ConfigError`) when it cannot
    be written (read-only, not a folder, a full disk) — before anything runs."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            write_failure(f"cannot write to the run folder {out}", out, e) + " (choose a writable --out-dir)"
        ) from None


def remove_stale_temps(out: Path) -> None:
    """Remove what a killed run left half-written in ``out``: checkpoint temp folders and the
    temp files of the atomic config/summary/metrics writes."""
    out = Path(out)
    _remove_temp_folders(out / CHECKPOINT_DIR)
    for name in RUN_FILES:
        for p in out.glob(f".{name}.*.tmp"):
            if p.is_file():
                p.unlink(missing_ok=True)


# -- reading ---------------------------------------------------------------------------------------


@dataclass
class Checkpoint:
    """One verified checkpoint generation, its state parsed."""

    folder: Path
    run: RunState
    optimizer: dict[str, Any]
    config: dict[str, Any]
    config_set: list[str]

    @property
    def step(self) -> int:
        return self.run.step


def _check(folder: Path, hashes: bool = True) -> str | None:
    """Why ``folder`` is not a complete checkpoint (sizes, and with ``hashes`` the sha256 of every
    file against ``checksums.json``), or None."""
    if not (folder / MANIFEST).is_file():
        return f"no {MANIFEST} (an interrupted save, or a checkpoint written before checksums)"
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        items = [(str(name), int(v["bytes"]), str(v["sha256"])) for name, v in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST} is unreadable"
    if STATE_FILE not in files:
        return f"{MANIFEST} does not list {STATE_FILE}"
    for name, size, digest in items:
        p = folder / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != size:
            return f"{name} has {p.stat().st_size} bytes, not the {size} it was written with (truncated?)"
        if hashes and sha256_file(p) != digest:
            return f"{name} does not match its checksum"
    return None


def read_checkpoint(folder: Path) -> Checkpoint:
    """Verify and read one generation; :class:`CheckpointError` says why it cannot be used."""
    folder = Path(folder)
    problem = _check(folder)
    if problem:
        raise CheckpointError(problem)
    try:
        state = torch.load(folder / STATE_FILE, weights_only=True)
    except Exception as e:  # weights_only refuses anything but tensors and plain data
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{STATE_FILE} refused: it holds more than tensors and plain data, and loading it could run code ({first[:160]})"
        ) from None
    try:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise CheckpointError(f"{STATE_FILE} is not a format-{STATE_FORMAT} trainer state")
        return Checkpoint(
            folder,
            RunState.from_state(state["run"]),
            dict(state["optimizer"]),
            dict(state["config"]),
            [str(k) for k in state["config_set"]],
        )
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{STATE_FILE} lacks a valid trainer state ({type(e).__name__}: {e})") from None


def open_checkpoint(out: Path, say: Callable[[str], Any] = print) -> Checkpoint | None:
    """The newest valid generation in ``out`` (falling back to the previous one with a message),
    None for a run that has not started (nothing to resume: a new run begins), and
    :class:`ConfigError` when a run was started there but no valid checkpoint is left."""
    out = Path(out)
    folder = out / CHECKPOINT_DIR
    problems = []
    for cand in (folder, previous(folder)):
        if not cand.exists():
            continue
        try:
            ck = read_checkpoint(cand)
        except CheckpointError as e:
            problems.append(f"{cand.name}/: {e}")
            say(f"checkpoint {cand} is unusable: {e}")
            continue
        if problems:
            say(f"falling back to the previous checkpoint {cand} (step {ck.step})")
        return ck
    metrics = out / "metrics.jsonl"
    if not problems and not (metrics.is_file() and metrics.stat().st_size > 0):
        say(f"--resume: nothing to resume in {out} yet; starting a new run")
        return None
    why = "; ".join(problems) or f"no {CHECKPOINT_DIR}/ folder, but {metrics.name} holds an earlier run"
    raise ConfigError(
        f"cannot resume {out}: no valid checkpoint left ({why}); run without --resume to start over "
        "(this replaces metrics.jsonl) or choose another --out-dir"
    )


def resume_config(ck: Checkpoint, cfg: TrainConfig) -> tuple[TrainConfig, dict[str, tuple[Any, Any]]]:
    """The config of the resumed run: ``ck``'s recorded config with the fields ``cfg`` sets
    explicitly on top (and ``out_dir`` where the checkpoint was found), and what that changes as
    ``{field: (old, new)}``. A change outside ``RESUME_FREE_FIELDS`` must be named in
    ``cfg.resume_override``, else :class:`ConfigError`; ``steps`` may only grow."""
    unknown = [f for f in cfg.resume_override if f not in TrainConfig.model_fields and f != USER_CODE]
    if unknown:
        raise ConfigError(f"resume_override: unknown config field(s) {', '.join(unknown)}")
    recorded_set = set(ck.config_set) & set(TrainConfig.model_fields)
    per_call = {"resume", "resume_override"}  # an override holds for the resume that names it, not later ones
    base = {k: v for k, v in ck.config.items() if k in recorded_set - per_call}
    explicit = cfg.model_dump(include=cfg.model_fields_set | {"out_dir"})
    try:
        merged = TrainConfig.model_validate({**base, **explicit})
    except ValidationError as e:
        first = e.errors()[0]
        raise ConfigError(
            f"cannot resume {cfg.out_dir}: its recorded config does not validate any more "
            f"({'.'.join(map(str, first['loc']))}: {first['msg']})"
        ) from None
    if merged.steps < ck.step:
        raise ConfigError(
            f"--steps {merged.steps}: the checkpoint in {cfg.out_dir} is at step {ck.step} already; "
            f"give --steps {ck.step} or more"
        )
    now = merged.model_dump()
    changed = {
        k: (ck.config[k], v)
        for k, v in now.items()
        if k in ck.config and k not in RESUME_FREE_FIELDS and ck.config[k] != v
    }
    refused = [k for k in changed if k not in merged.resume_override]
    if refused:
        was = ", ".join(f"{k}={changed[k][0]!r}" for k in refused)
        new = ", ".join(f"{k}={changed[k][1]!r}" for k in refused)
        raise ConfigError(
            f"--resume: the run in {cfg.out_dir} was run with {was}, this one asks for {new}; "
            f"keep the run's values, or pass --resume-override {','.join(refused)} to apply the new ones"
        )
    return merged, changed


def resumed_run(
    ck: Checkpoint, optimizer: torch.optim.Optimizer, cfg: TrainConfig, changed: dict[str, tuple[Any, Any]]
) -> RunState:
    """``ck``'s run state, with the overridden fields of ``changed`` applied (its weights and
    optimizer state are loaded by :meth:`~treegrpo.training.policy.Policy.restore`): the optimizer
    takes ``cfg``'s lr and weight decay, a changed seed restarts the RNG streams (everything else
    is read from ``cfg`` each step)."""
    for group in optimizer.param_groups:
        group["lr"], group["weight_decay"] = cfg.lr, cfg.weight_decay
    run = ck.run
    if "seed" in changed:
        run.reseed(cfg.seed)
        run.rank_streams = []  # every rank restarts from the new seed
    return run
