"""Question files: Search-R1 / verl parquet and plain JSONL, read into :class:`~treegrpo.envs.base.Task`.

Parquet (the schema Search-R1's ``scripts/data_process/*.py`` writes and verl reads)::

    data_source   str                      e.g. "nq", "hotpotqa"
    prompt        list of {"role", "content"} chat messages; the user message ends with
                  "Question: {question}\\n" (Search-R1's instruction prefix comes before it)
    ability       str                      e.g. "fact-reasoning"
    reward_model  {"style": "rule", "ground_truth": {"target": [gold answers]}}
    extra_info    {"split": str, "index": int}

The question is taken from the last user message: the text after its last ``Question:`` marker,
or the whole message when there is none (a prompt that is just the question). This rule is for
Search-R1's data only — here and for rows with a ``data_source`` or ``reward_model`` column in a
run of your own tools (:mod:`treegrpo.tasks.custom`); any other ``prompt`` of chat messages is
rendered whole. A top-level
``question`` column (Search-R1 keeps the source dataset's columns) is used when there is no
``prompt``. The task id is ``{data_source}-{extra_info.index}`` (row number without an index).

JSONL: one object per line, ``{"id", "question", "answers": [...]}``; ``answers`` may be a single
string, and Search-R1's raw ``golden_answers`` is accepted in its place.

Any problem raises :class:`DataError` (a :class:`~treegrpo.errors.ConfigError`, shown by the
CLI as one line) naming the file, the row (1-based) and the field.

Built-in sets (:data:`BUILTIN_QUESTION_SETS`) are named instead of a file: ``wiki-vital-qa``
(:mod:`treegrpo.tasks.wikiqa`), with its own train/eval split.

As a run's task family (:data:`DATAFILE`): the file's questions (the last slice held out unless
``--eval-data`` is given), searched with the configured retriever (``--corpus`` in process or a
Search-R1 server at ``--retriever-url``); with no ``--model`` the search world's tiny agent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from treegrpo.envs.base import AgentEnv, Task
from treegrpo.envs.reward_fns import RewardSet
from treegrpo.envs.search import SearchEnv, reward_options
from treegrpo.envs.tool_env import ToolEnv
from treegrpo.errors import ConfigError
from treegrpo.io import jsonl_objects
from treegrpo.models.loader import LoadedModel
from treegrpo.retrieval.base import Retriever, format_passages
from treegrpo.retrieval.factory import make_retriever
from treegrpo.tasks.base import TaskFamily, TaskSource
from treegrpo.tasks.wikiqa import NAME as WIKIQA
from treegrpo.tasks.wikiqa import Split, wiki_vital_qa
from treegrpo.tasks.world.task import starting_model as world_starting_model
from treegrpo.training.config import TrainConfig
from treegrpo.training.warmup import Demo

QUESTION_MARKER = "Question:"
#: Built-in question sets a run names instead of a file: name -> split -> tasks.
BUILTIN_QUESTION_SETS: dict[str, Callable[[Split], list[Task]]] = {WIKIQA: wiki_vital_qa}


class DataError(ConfigError):
    """A question file that cannot be read; the message names the file, row and field."""


def load_tasks(path: str | Path) -> list[Task]:
    """Read a Search-R1/verl parquet file or a JSONL file of ``{id, question, answers}``."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"{p}: no such data file (expected Search-R1 parquet or JSONL {{id, question, answers}})")
    tasks = list(_parquet_tasks(p)) if _is_parquet(p) else list(_jsonl_tasks(p))
    if not tasks:
        raise DataError(f"{p}: holds no questions")
    return _unique_ids(tasks)


def _is_parquet(p: Path) -> bool:
    if p.suffix.lower() in (".parquet", ".pq"):
        return True
    if p.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        return False
    with p.open("rb") as fh:
        return fh.read(4) == b"PAR1"


def extract_question(messages: Any, where: str) -> str:
    """The question inside Search-R1 chat messages (or a plain prompt string)."""
    if isinstance(messages, str):
        content = messages
    else:
        if not isinstance(messages, list | tuple) or not messages:
            raise DataError(f"{where}: field 'prompt' must be a non-empty list of chat messages")
        users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        msg = users[-1] if users else messages[-1]
        if not isinstance(msg, dict) or not isinstance(msg.get("content"), str):
            raise DataError(f"{where}: field 'prompt' messages must be objects with a 'content' string")
        content = msg["content"]
    _head, marker, tail = content.rpartition(QUESTION_MARKER)
    question = (tail if marker else content).strip()
    if not question:
        raise DataError(f"{where}: field 'prompt' holds no question text")
    return question


def _answers(value: Any, where: str, field: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not value:
        raise DataError(f"{where}: field '{field}' must be a non-empty list of answer strings")
    out = []
    for a in value:
        if isinstance(a, bool) or not isinstance(a, str | int | float):
            raise DataError(f"{where}: field '{field}' must hold strings, got {type(a).__name__}")
        if str(a).strip():
            out.append(str(a).strip())
    if not out:
        raise DataError(f"{where}: field '{field}' holds only empty answers")
    return out


def _parquet_tasks(p: Path) -> Iterable[Task]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(p)
    except Exception as e:
        raise DataError(f"{p}: not a readable parquet file ({type(e).__name__}: {e})") from None
    cols = set(table.column_names)
    if "reward_model" not in cols:
        raise DataError(f"{p}: missing column 'reward_model' (Search-R1 schema: reward_model.ground_truth.target)")
    if "prompt" not in cols and "question" not in cols:
        raise DataError(f"{p}: missing column 'prompt' (chat messages holding the question)")
    for i, row in enumerate(table.to_pylist(), 1):
        where = f"{p}: row {i}"
        rm = row.get("reward_model")
        gt = rm.get("ground_truth") if isinstance(rm, dict) else None
        if isinstance(gt, dict):
            target = gt.get("target")
        elif gt is not None:  # some converters store the answers directly
            target = gt
        else:
            raise DataError(f"{where}: field 'reward_model.ground_truth' is missing")
        answers = _answers(target, where, "reward_model.ground_truth.target")
        if row.get("prompt") is not None:
            question = extract_question(row["prompt"], where)
        elif isinstance(row.get("question"), str) and row["question"].strip():
            question = row["question"].strip()
        else:
            raise DataError(f"{where}: field 'prompt' is missing")
        source = str(row.get("data_source") or "")
        extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
        index = extra.get("index") if extra else None
        tid = f"{source or p.stem}-{index if index is not None else i - 1}"
        meta: dict[str, Any] = {"row": i}
        for key in ("ability", "extra_info"):
            if row.get(key) is not None:
                meta[key] = row[key]
        if row.get("prompt") is not None:
            meta["prompt"] = row["prompt"]
        meta["reward_model"] = rm  # Search-R1's form: its question is extracted (reward_fns.given_prompt)
        yield Task(tid, question, answers, data_source=source, meta=meta)


def _jsonl_tasks(p: Path) -> Iterable[Task]:
    for i, where, row in jsonl_objects(p, DataError, "{path}: row {line}", " {id, question, answers}"):
        q = row.get("question")
        if not isinstance(q, str) or not q.strip():
            raise DataError(f"{where}: field 'question' must be a non-empty string")
        if "answers" in row:
            answers = _answers(row["answers"], where, "answers")
        elif "golden_answers" in row:
            answers = _answers(row["golden_answers"], where, "golden_answers")
        else:
            raise DataError(f"{where}: field 'answers' is missing (a list of gold answers)")
        tid = row.get("id")
        meta = {k: v for k, v in row.items() if k not in ("id", "question", "answers", "golden_answers", "data_source")}
        yield Task(
            str(tid) if tid is not None else f"{p.stem}-{i - 1}",
            q.strip(),
            answers,
            data_source=str(row.get("data_source") or ""),
            meta={"row": i, **meta},
        )


def _unique_ids(tasks: list[Task]) -> list[Task]:
    """Task ids become forest ``prompt_id``s: make repeats unique by suffixing the row."""
    seen: set[str] = set()
    for t in tasks:
        if t.id in seen:
            t.id = f"{t.id}#{t.meta.get('row', len(seen))}"
        seen.add(t.id)
    return tasks


def split_tasks(cfg: TrainConfig) -> tuple[list[Task], list[Task]]:
    """The training and held-out questions of ``cfg.data``: a built-in set's own split, ``cfg.eval_data``
    when given, else the file's last slice held out (``max(1, min(eval_prompts, n // 5))`` questions)."""
    if cfg.data in BUILTIN_QUESTION_SETS:  # a built-in set comes with its own held-out split
        tasks = BUILTIN_QUESTION_SETS[cfg.data]("train")
        eval_tasks = load_tasks(cfg.eval_data) if cfg.eval_data else BUILTIN_QUESTION_SETS[cfg.data]("eval")
        return tasks, eval_tasks
    if cfg.eval_data:
        return load_tasks(cfg.data), load_tasks(cfg.eval_data)  # type: ignore[arg-type]
    tasks = load_tasks(cfg.data)  # type: ignore[arg-type]  # hold out the last slice of the data
    k = max(1, min(cfg.eval_prompts, len(tasks) // 5))
    if len(tasks) < 2:
        raise ConfigError(f"{cfg.data}: needs at least 2 questions to hold some out, or pass --eval-data")
    return tasks[:-k], tasks[-k:]


def search_tool(retriever: Retriever, topk: int) -> Callable[[str], str]:
    """``search(query)`` over ``retriever`` as a plain tool: the top ``topk`` passages as Search-R1
    shows them (``Doc i(Title: t) text``, one per line). A failing retriever is the tool's error,
    which the model reads as its result."""

    def search(query: str) -> str:
        """Search the corpus for passages about a query.

        Args:
            query: what to look up, e.g. a name or a short question
        """
        hits = retriever.retrieve([query], topk)[0]
        return format_passages(hits).strip() if hits else "No results."

    return search


def search_env(cfg: TrainConfig, tiny: bool, tokenizer: Any = None) -> AgentEnv:
    """The search env of ``cfg`` over its retriever: Search-R1's tags (:class:`SearchEnv`; the
    prompt template defaults to ``minimal`` for the tiny agent, ``tiny``, and ``search_r1``
    otherwise), or with ``protocol: tools`` the model's own tool calling of :func:`search_tool`
    (a :class:`~treegrpo.envs.tool_env.ToolEnv`)."""
    retriever = make_retriever(corpus=cfg.corpus, url=cfg.retriever_url, allow_offline=cfg.allow_offline_retriever)
    if cfg.protocol == "tools":
        if tiny:
            raise ConfigError("protocol tools needs a chat model with a chat template; the tiny agent speaks the tags")
        return ToolEnv(
            [search_tool(retriever, cfg.topk)], rewards=RewardSet.of(list(cfg.reward), cfg.reward_weights),
            protocol="tools", timeout_s=cfg.tool_timeout_s, tool_concurrency=cfg.tool_concurrency, tokenizer=tokenizer,
            max_result_tokens=cfg.max_obs_tokens,
        )  # fmt: skip
    template = cfg.prompt_template if cfg.prompt_template != "auto" else ("minimal" if tiny else "search_r1")
    return SearchEnv(retriever, topk=cfg.topk, **reward_options(cfg.reward, cfg.reward_weights), prompt_template=template)


def source(cfg: TrainConfig, model: LoadedModel) -> TaskSource:
    """The questions of ``cfg.data`` (:func:`split_tasks`) and a search env over the configured
    retriever (:func:`search_env`)."""
    tasks, eval_tasks = split_tasks(cfg)
    return TaskSource(search_env(cfg, model.is_tiny, model.tokenizer), tasks, eval_tasks)


DATAFILE = TaskFamily("datafile", world_starting_model, source)


def search_demos(tasks: Sequence[Task], env: AgentEnv) -> list[Demo]:
    """One protocol demonstration per question, for a warm-up of any model: search the question
    (a ``wiki-vital-qa`` question: its quoted clue), read the passages, answer with the first gold
    answer. Only questions whose observation contains that answer get a demo (each demo is true
    to what it read); searches are batched into one retriever call. In the native protocol (a
    :class:`ToolEnv` of :func:`search_tool`) the same demos are written as the chat template
    renders the model's turns."""
    if isinstance(env, ToolEnv):
        return _native_search_demos(tasks, env)
    queries = [search_query(t.question) for t in tasks]
    steps = [f"<think> I need to look this up. </think>\n<search> {q} </search>" for q in queries]
    outs = env.step(list(tasks), steps, [True] * len(tasks))
    demos = []
    for task, step, out in zip(tasks, steps, outs, strict=True):
        answer = task.answers[0]
        if out.observation and answer.lower() in out.observation.lower():
            final = f"<think> The passages name it: {answer}. </think>\n<answer> {answer} </answer>"
            demos.append(Demo(task, [(step, out.observation), (final, None)], "correct", 1.0))
    return demos


def _native_search_demos(tasks: Sequence[Task], env: ToolEnv) -> list[Demo]:
    demos = []
    for task in tasks:
        (call,) = env.demo_steps(calls=[("search", {"query": search_query(task.question)})])
        (out,) = env.step([task], [call], [True], messages=[[]])
        answer = task.answers[0]
        if out.kind == "tool" and answer.lower() in (out.observation or "").lower():
            (final,) = env.demo_steps(answer=answer)
            demos.append(Demo(task, [(call, out.observation), (final, None)], "correct", 1.0))
    return demos


def search_query(question: str) -> str:
    """The text worth searching in a question: a quoted clue when there is one, else the question."""
    parts = question.split('"')
    return parts[1].strip() if len(parts) >= 3 and parts[1].strip() else question.strip()
