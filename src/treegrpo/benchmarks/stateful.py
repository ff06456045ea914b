"""``treegrpo bench stateful``: branching a stateful tool — cost, exactness, and learning (what
each part runs and the figures: benchmarks/README.md). ``cost``: a node's SQL database state by
restore vs by replay per depth, and whole random-action rollouts in each mode
(:func:`~treegrpo.benchmarks.stateful_exact.expansion_cost`); ``exactness``: random trees in every
state mode against a replay of each node's path
(:func:`~treegrpo.benchmarks.stateful_exact.check_exactness`); ``rows`` / ``summary`` /
``compare``: chain GRPO vs Tree-GRPO on ``--task sql`` at budgets 2 and 4, paired as in ``bench
learn`` (:func:`~treegrpo.benchmarks.learn.plan_runs`). ``--quick`` shrinks every part.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

from treegrpo.benchmarks.learn import train_one
from treegrpo.benchmarks.learn_report import compare, summarize
from treegrpo.benchmarks.learn_spec import ROW_KEYS as LEARN_ROW_KEYS
from treegrpo.benchmarks.learn_spec import Regime, plan_runs
from treegrpo.benchmarks.provenance import source_commit
from treegrpo.benchmarks.runner import write_result
from treegrpo.benchmarks.stateful_exact import check_exactness, expansion_cost, grow, random_sql_action
from treegrpo.tasks.kv.env import KVEnv, kv_tasks, random_kv_action
from treegrpo.tasks.sql.env import SqlEnv
from treegrpo.tasks.sql.problems import SqlConfig, build_problems, read_balance, update
from treegrpo.tasks.sql.tool import SqlLimits

DEPTHS = (1, 3, 5, 8)
#: The exactness check's statement limit: smaller than the default so runaway statements (stopped
#: and rolled back) stay cheap to replay thousands of times; the behaviour checked is the same.
CHECK_LIMITS = SqlLimits(vm_steps=20_000)
#: Spare-connection pools of the whole-rollout timing: the env's default, and one large enough to
#: hold every snapshot of a rollout (then no snapshot or restore opens a new connection).
POOL_SIZES = (SqlEnv.pool_size, 2048)


def cost_part(repeats: int, rollout_prompts: int, rollout_repeats: int = 5) -> dict[str, Any]:
    """Restore vs replay per expansion at every depth of :data:`DEPTHS`, and whole rollouts
    (``ms_per_expansion_amortized``: a whole rollout's wall time — generation, tokenization, tool
    calls, snapshots or replays — per expansion, the median of ``rollout_repeats`` interleaved runs
    on a warm env, for each pool size of :data:`POOL_SIZES`)."""
    task = build_problems(SqlConfig(n_warmup=1, n_train=1, n_eval=1)).tasks("train")[0]
    a, b = task.meta["rows"][0][0], task.meta["rows"][1][0]
    cycle = [update(a, -3), update(b, 3), read_balance(b), "SELECT name, balance FROM accounts ORDER BY name"]
    actions = [f"<sql>{cycle[i % len(cycle)]}</sql>" for i in range(max(DEPTHS))]
    depths = [expansion_cost(lambda m: SqlEnv(m), task, actions[:d], repeats) for d in DEPTHS]
    tasks = build_problems(SqlConfig(n_warmup=1, n_train=64, n_eval=1)).tasks("train")[:rollout_prompts]
    rollout: dict[str, Any] = {"prompts": len(tasks), "shape": [2, 2, 2], "max_turns": 4, "repeats": rollout_repeats}
    expansions = len(tasks) * 2 * 2 * 2
    for pool in POOL_SIZES:  # the env's default pool, and one that holds a rollout's snapshots
        envs = {mode: SqlEnv(mode, CHECK_LIMITS, pool_size=pool) for mode in ("snapshot", "replay")}
        for env in envs.values():  # warm: in a run one env serves every step
            grow(env, tasks, random_sql_action, (2, 2, 2), 0, 4)
        walls: dict[str, list[float]] = {"snapshot": [], "replay": []}
        totals = {}
        for _ in range(rollout_repeats):  # interleaved, the median kept
            for mode, env in envs.items():
                t = time.perf_counter()
                res = grow(env, tasks, random_sql_action, (2, 2, 2), 0, 4)
                walls[mode].append(time.perf_counter() - t)
                totals[mode] = res.total()
        row: dict[str, Any] = {}
        for mode in ("snapshot", "replay"):
            wall = sorted(walls[mode])[len(walls[mode]) // 2]
            row[mode] = {
                "wall_s": round(wall, 4),
                "ms_per_expansion_amortized": round(1000 * wall / expansions, 4),
                "tool_calls": totals[mode].tool_calls,
                "replayed_tool_calls": totals[mode].replayed_tool_calls,
                "replayed_per_expansion": round(totals[mode].replayed_tool_calls / expansions, 3),
            }
        rollout[f"pool_{pool}"] = row
    rollout.update(rollout[f"pool_{POOL_SIZES[0]}"])  # the default pool's figures at the top level
    return {"depths": depths, "rollout": rollout}


def exactness_part(n_sql: int, n_kv: int) -> dict[str, Any]:
    """Random-tree exactness on the SQL env and the key-value world; ``mismatches`` is their sum."""
    sql_tasks = build_problems(SqlConfig(n_warmup=1, n_train=200, n_eval=1)).tasks("train")
    sql = check_exactness(lambda m: SqlEnv(m, CHECK_LIMITS), sql_tasks, random_sql_action, n_sql, seed=0)
    kv = check_exactness(lambda m: KVEnv(m), kv_tasks(200), random_kv_action, n_kv, seed=0)
    return {
        "sql": sql.to_dict(),
        "kv": kv.to_dict(),
        "trees": sql.trees + kv.trees,
        "mismatches": sql.mismatches + kv.mismatches,
        "leaked_states": sql.leaked_states + kv.leaked_states,
    }


#: The keys of a learning row: ``bench learn``'s, the greedy start beside the greedy end.
ROW_KEYS: tuple[str, ...] = (*LEARN_ROW_KEYS[:11], "em_greedy_start", *LEARN_ROW_KEYS[11:])


def learn_part(
    budgets: list[int], seeds: int, steps: int, prompts_per_step: int, lr: float, eval_prompts: int, log: Any,
    model_dir: Path | None = None,
) -> dict[str, Any]:
    """Chain vs tree training runs on ``--task sql`` (the module docstring's ``rows``) from ``model_dir``
    (default: the cached tiny SQL agent, bootstrapped on first use), one after the other."""
    from treegrpo.tasks.sql.bootstrap import ensure_sql_bootstrapped

    model_dir = Path(model_dir) if model_dir is not None else ensure_sql_bootstrapped()
    regime = Regime("stateful", "", steps, prompts_per_step, lr, steps, eval_prompts, "")
    specs = plan_runs(budgets, list(range(seeds)), [0], expand_modes=("random",), ablation=False)
    rows: list[dict[str, Any]] = []
    eval_start, parts = None, {}  # type: ignore[var-annotated]
    for spec in specs:
        s, full = train_one(spec, "sql", regime, model_dir, eval_start, cache=parts)
        eval_start = s.eval_start  # deterministic: every run of the model shares it
        row = {k: full[k] for k in ROW_KEYS}
        rows.append(row)
        log(
            f"  {spec.key:36s} EM {row['em_start']:.3f} → {row['em_end']:.3f} (greedy {row['em_greedy_end']:.3f}) · "
            f"tools/traj {row['tool_calls_per_traj_end']:.2f} · {row['wall_s']:.0f}s"
        )
    summary = summarize(rows)
    comparisons = {}
    for b in budgets:
        chain = next(k for k, v in summary.items() if v["mode"] == "chain" and v["budget"] == b)
        tree = next(k for k, v in summary.items() if v["mode"] == "tree" and v["budget"] == b)
        comparisons[str(b)] = compare(rows, tree, chain)
    return {"model": str(model_dir), "rows": rows, "summary": summary, "compare": comparisons}


def run_bench(
    out: Path,
    quick: bool = False,
    seeds: int = 2,
    steps: int = 10,
    prompts_per_step: int = 8,
    lr: float = 5e-4,
    eval_prompts: int = 100,
    skip_learn: bool = False,
    log: Any = print,
    model_dir: Path | None = None,
) -> dict[str, Any]:
    """The whole benchmark (module docstring); writes ``out`` (JSON) and ``out`` with ``.png``.
    ``model_dir``: the starting policy of the learning part (default: the cached tiny SQL agent)."""
    from treegrpo.benchmarks.stateful_report import plot, table
    from treegrpo.models.loader import tiny_info

    t0 = time.perf_counter()
    if quick:
        seeds, steps, prompts_per_step, eval_prompts = 1, 2, 2, 8
    repeats, rollout_prompts, n_sql, n_kv = (10, 4, 20, 50) if quick else (200, 32, 1000, 1000)
    log("[bench stateful] cost per expansion: snapshot vs replay")
    cost = cost_part(repeats, rollout_prompts, 1 if quick else 5)
    log(f"[bench stateful] exactness: {n_sql} SQL + {n_kv} key-value random trees")
    exact = exactness_part(n_sql, n_kv)
    learn = None
    if not skip_learn:
        log(f"[bench stateful] learning: chain vs tree at budgets 2, 4 · {seeds} seed(s) · {steps} steps")
        learn = learn_part([2, 4], seeds, steps, prompts_per_step, lr, eval_prompts, log, model_dir)
    command = (
        f"treegrpo bench stateful{' --quick' if quick else ''} --seeds {seeds} --steps {steps} "
        f"--prompts-per-step {prompts_per_step} --lr {lr} --eval-prompts {eval_prompts}"
        f"{' --skip-learn' if skip_learn else ''} --out {out}"
        + ("" if model_dir is None else f"  # learning from {model_dir}")
    )
    result: dict[str, Any] = {
        "bench": "stateful",
        "command": command,
        "commit": source_commit()[0],
        "quick": quick,
        "model": None if learn is None else {"folder": learn["model"], "config_hash": tiny_info(learn["model"]).get("config_hash")},
        "settings": {"seeds": seeds, "steps": steps, "prompts_per_step": prompts_per_step, "lr": lr, "eval_prompts": eval_prompts, "repeats": repeats},
        "cost": cost,
        "exactness": exact,
        "mismatches": exact["mismatches"],
        "learn": learn,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    out = Path(out)
    write_result(out, result, plot)
    for line in table(result):
        log(line)
    log(f"[bench stateful] wrote {out} and {out.with_suffix('.png')} in {result['wall_s']:.0f}s")
    return result


__all__ = ["CHECK_LIMITS", "DEPTHS", "cost_part", "exactness_part", "learn_part", "run_bench"]
