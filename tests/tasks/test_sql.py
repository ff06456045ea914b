"""The SQL tool and env: the sandbox (authorizer, step limit, size caps, errors as observations),
atomic statements (a statement stopped or failing half-way leaves nothing behind), the reward
(final state and answer), and branch exactness of snapshot / fork / replay on random trees."""

from __future__ import annotations

import pytest

from treegrpo.benchmarks.stateful_exact import check_exactness, expansion_cost, grow, random_sql_action
from treegrpo.tasks.sql.env import SqlEnv
from treegrpo.tasks.sql.problems import SqlConfig, build_problems
from treegrpo.tasks.sql.tool import SqlLimits

TASKS = build_problems(SqlConfig(n_warmup=10, n_train=60, n_eval=10)).tasks("train")


def _db(env: SqlEnv):  # type: ignore[no-untyped-def]
    return env.initial_state(TASKS[0])


def _run(env: SqlEnv, db, sql: str) -> str:  # type: ignore[no-untyped-def]
    (out,) = env.step([TASKS[0]], [f"<sql>{sql}</sql>"], [True], states=[db])
    assert not out.done and out.tool_calls == 1
    return out.observation or ""


@pytest.mark.parametrize(
    "sql",
    [
        "ATTACH DATABASE '/tmp/x.db' AS x",
        "PRAGMA table_info(accounts)",
        "DROP TABLE accounts",
        "CREATE TABLE t(x)",
        "BEGIN",
        "SELECT random()",
        "SELECT load_extension('/tmp/evil')",
        "SELECT last_insert_rowid()",
        "SELECT current_timestamp",
        "VACUUM INTO '/tmp/y.db'",
        "SELECT readfile('/etc/passwd')",
        "SELECT 1; SELECT 2",
        "SELECT hex(zeroblob(1000000))",
        "SELEC nonsense",
    ],
)
def test_sandbox_refuses_with_an_error_observation(sql: str) -> None:
    env = SqlEnv()
    db = _db(env)
    before = db.dump()
    obs = _run(env, db, sql)
    assert obs.startswith("<result>error: ") and db.dump() == before


def test_reads_writes_and_result_cap() -> None:
    env = SqlEnv(limits=SqlLimits(max_rows=2))
    db = _db(env)
    name = TASKS[0].meta["rows"][0][0]
    assert _run(env, db, f"UPDATE accounts SET balance = 5 WHERE name = '{name}'") == "<result>1 row changed</result>"
    assert _run(env, db, f"SELECT balance FROM accounts WHERE name = '{name}'") == "<result>5</result>"
    assert _run(env, db, "SELECT * FROM accounts WHERE name = 'nobody'") == "<result>no rows</result>"
    assert _run(env, db, "SELECT name FROM accounts").endswith("(more rows)</result>")
    assert _run(env, db, "-- only a comment") == "<result>0 rows changed</result>"
    assert _run(env, db, "") == "<result>0 rows changed</result>"


def test_a_statement_stopped_half_way_leaves_no_state_behind() -> None:
    env = SqlEnv(limits=SqlLimits(vm_steps=20_000))
    db = _db(env)
    before = db.dump()
    runaway = "INSERT INTO accounts SELECT 'r' || x, 1 FROM (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c)"
    assert "step limit" in _run(env, db, runaway)
    assert db.dump() == before  # rows inserted before the stop are rolled back
    # a check violation on a later row undoes the earlier rows of the same UPDATE
    assert "CHECK constraint" in _run(env, db, "UPDATE accounts SET balance = balance - (SELECT max(balance) FROM accounts)")
    assert db.dump() == before


def test_reward_needs_the_right_state_and_the_answer() -> None:
    env = SqlEnv()
    task = TASKS[0]
    right, wrong_state = env.initial_state(task), env.initial_state(task)
    for sql in task.meta["solution"]:
        env.step([task], [f"<sql>{sql}</sql>"], [True], states=[right])
    env.step([task], [f"<sql>{task.meta['solution'][-1]}</sql>"], [True], states=[wrong_state])  # the read only
    ans = f"<answer>{task.answers[0]}</answer>"
    (good,) = env.step([task], [ans], [True], states=[right])
    (no_write,) = env.step([task], [ans], [True], states=[wrong_state])
    (bad_answer,) = env.step([task], ["<answer>-1</answer>"], [True], states=[right])
    assert good.reward == 1.0 and good.info["state_ok"]
    assert no_write.reward == 0.0 and not no_write.info["state_ok"]
    assert bad_answer.reward == 0.0
    (refused,) = env.step([task], [f"<sql>{task.meta['solution'][0]}</sql>"], [False], states=[right])
    assert refused.done and refused.reward == 0.0 and refused.tool_calls == 0


def test_every_reference_solution_solves_its_task() -> None:
    env = SqlEnv()
    for task in build_problems(SqlConfig(n_warmup=50, n_train=50, n_eval=50)).tasks("eval"):
        db = env.initial_state(task)
        obs = [env.step([task], [f"<sql>{s}</sql>"], [True], states=[db])[0].observation for s in task.meta["solution"]]
        assert obs[-1] == f"<result>{task.answers[0]}</result>"
        assert env.step([task], [f"<answer>{task.answers[0]}</answer>"], [True], states=[db])[0].reward == 1.0


def test_exactness_on_random_sql_trees() -> None:
    r = check_exactness(
        lambda m: SqlEnv(m, SqlLimits(vm_steps=20_000)), TASKS, random_sql_action, 100, seed=3, batch_prompts=20
    )
    assert r.trees >= 100 and r.mismatches == 0 and r.leaked_states == 0


def test_eptree_style_steps_without_states_start_fresh() -> None:
    env = SqlEnv()
    task = TASKS[0]
    (w,) = env.step([task], [f"<sql>{task.meta['solution'][0]}</sql>"], [True])
    (a,) = env.step([task], [f"<answer>{task.answers[0]}</answer>"], [True])
    assert w.tool_calls == 1 and a.reward == 0.0 and env.open_states == 0  # the write was not kept


def test_replay_books_the_replayed_statements() -> None:
    res = grow(SqlEnv("replay"), TASKS[:4], random_sql_action, (2, 2, 2), 0, 4)
    assert res.total().replayed_tool_calls > 0
    cost = expansion_cost(lambda m: SqlEnv(m), TASKS[0], [f"<sql>{s}</sql>" for s in TASKS[0].meta["solution"]], 5)
    assert cost["replay"]["tool_calls"] == len(TASKS[0].meta["solution"]) and cost["snapshot"]["tool_calls"] == 0
