"""The text ``bench peers --write-docs`` makes from the results: docs/benchmarks.md's tables (one
set from ``benchmarks/results/peers.json``, one from ``peers_long.json``, the long-completion job)
and the README's results row, every figure read from the JSON (a test holds the docs to this text).

Each job is stated with its regime (:func:`job_regime`: prompt tokens, completion tokens on each
side, G, turns, and TRL's CPU path as its rows probed it), and every ratio names what it is against.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from treegrpo.benchmarks.peers_figures import paired_ratio, steps_median
from treegrpo.errors import ConfigError

#: The results files, in ``benchmarks/results/`` under the README's folder.
MAIN_RESULTS, LONG_RESULTS = "peers.json", "peers_long.json"
#: The job run on its own into :data:`LONG_RESULTS`.
LONG_JOB = "long_completion"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "—" if x is None else format(x, fmt)


def _cell(line: dict[str, Any], key: str, fmt: str = ".2f") -> str:
    """``median (min–max)`` over the repeats, or the median alone when they agree or ran once."""
    mid, spread = line.get(key), line["spread"].get(key)
    if spread is None or line["repeats"] < 2 or _num(spread[0], fmt) == _num(spread[1], fmt):
        return _num(mid, fmt)
    return f"{_num(mid, fmt)} ({_num(spread[0], fmt)}–{_num(spread[1], fmt)})"


def _verdict(got: dict[str, Any]) -> str:
    if got.get("ratio") is None:
        return f"not reported: {got.get('refused')}"
    spread = got.get("spread") or [got["ratio"]] * 2
    word = {True: "met", False: "missed", None: ""}[got.get("met")]
    target = f", target {got['target']}: **{word}**" if "target" in got else ""
    if len(got.get("per_repeat") or []) < 2:  # one repeat: no spread to show
        return f"{got['ratio']:.2f}× (one repeat){target}"
    return f"{got['ratio']:.2f}× ({spread[0]:.2f}–{spread[1]:.2f} over repeats){target}"


#: How the docs name each row.
LABELS = {
    "trl": "TRL `GRPOTrainer`", "chain": "treegrpo chain 4", "chain_no_sharing": "treegrpo chain 4, prefix sharing off",
    "chain_no_packing": "treegrpo chain 4, packing off", "tree_2_2_1": "treegrpo Tree-GRPO (2,2,1)",
    "tree_2_2_1_no_sharing": "Tree-GRPO (2,2,1), prefix sharing off", "tree_2_2_1_no_packing": "Tree-GRPO (2,2,1), packing off",
}  # fmt: skip


def job_regime(results: dict[str, Any], job: str) -> dict[str, Any]:
    """What ``job`` was, from its rows: ``prompt_tokens`` (per run, the median over steps 2..K of a
    step's mean prompt length, as the table's figures; then the median over repeats), ``prompt_range``
    (the shortest and longest prompt seen), ``completion`` (each row's mean model tokens per
    trajectory, from the table; ablation rows left out: theirs are their base row's), ``group_size``,
    ``turns`` and ``trl_scores_prompt`` (TRL's fused LM head scored every prompt position: its
    ``lm_head`` probe said not ``compact``; ``None``: no probe)."""
    rows = [r for r in results["rows"] if r["job"] == job]
    first = min(rows, key=lambda r: (r["system"] != "trl", r.get("repeat", 0)))
    runs = [r for r in rows if r["name"] == first["name"]]
    lengths = [[len(p["ids"]) for p in step] for r in runs for step in r["prompts_seen"]]
    per_run = [steps_median([statistics.fmean(len(p["ids"]) for p in step) for step in r["prompts_seen"]]) for r in runs]
    probe = next((r["settings"].get("probes", {}).get("lm_head") for r in rows if r["system"] == "trl"), None)
    spec = results["spec"]
    return {
        "prompt_tokens": statistics.median(x for x in per_run if x is not None),
        "prompt_range": [min(map(min, lengths)), max(map(max, lengths))],
        "completion": {
            t["name"]: t["completion_len_mean"] for t in results["table"] if t["job"] == job and not t.get("ablation")
        },
        "group_size": spec["group_size"],
        "turns": f"up to {spec['max_turns'] + 1} turns" if job == "multi_turn" else "one turn",
        "trl_scores_prompt": None if probe is None else not probe.get("compact", True),
    }


def _regime_line(results: dict[str, Any], job: str) -> str:
    """One sentence: the job's prompts, completions (each row), G and turns, and TRL's CPU path."""
    g = job_regime(results, job)
    lo, hi = g["prompt_range"]
    done = ", ".join(f"{_num(c, '.1f')} ({LABELS.get(n.split('/', 1)[1], n)})" for n, c in g["completion"].items())
    path = (" TRL runs its CPU path: each prompt prefilled and trained G times, no KV kept between calls, its fused "
            "LM head scoring every prompt and completion position." if g["trl_scores_prompt"] else "")  # fmt: skip
    return (f"Prompts of {g['prompt_tokens']:.0f} tokens (a step's mean; {lo}–{hi}); completions of {done} model "
            f"tokens on average; G = {g['group_size']}, {g['turns']}.{path}")  # fmt: skip


def _repeats(n: int) -> str:
    return "one repeat, its rows one after the other" if n == 1 else f"{n} repeats interleaved"


def markdown(results: dict[str, Any], differences: bool = True) -> str:
    """The tables docs/benchmarks.md shows, made from the results alone (a test holds the docs to
    this text): per job its regime and one line per row, then every ratio with its verdict and
    (``differences``) where the two sides still differ."""
    spec = results["spec"]
    out = [
        f"{spec['steps']} steps × {spec['prompts_per_step']} prompts, G = {spec['group_size']}, {spec['max_new_tokens']}-token cap "
        f"per turn, {_repeats(spec['repeats'])} (seed{'s' * (spec['repeats'] > 1)} {', '.join(map(str, results['environment']['seeds']))}), "
        f"{spec['threads'] or 'default'} thread{'s' * (spec['threads'] != 1)} per row, `MALLOC_MMAP_THRESHOLD_={results['environment'].get('MALLOC_MMAP_THRESHOLD_', 'unset')}` "
        f"in every row; medians of steps 2–{spec['steps']}, median (min–max) over repeats; held-out EM greedy on "
        f"{spec['eval_prompts']} questions.",
    ]  # fmt: skip
    head = ("| row | CPU-s per trajectory | rollout + update CPU-s/step | generated tokens/step | completion tokens mean / max "
            "| trajectories per 1k generated | prefill / decode / update positions per step | CPU-ms per position (rollout / update) "
            "| peak RSS GB | CPU/wall per thread | EM before → after (by seed) |")  # fmt: skip
    for job in dict.fromkeys(t["job"] for t in results["table"]):
        out += ["", f"**{job.replace('_', '-')}**. {_regime_line(results, job)}", "", head, "|" + "---|" * 11]
        for t in (t for t in results["table"] if t["job"] == job):
            em = ", ".join(f"{v:.3f}" for v in t["em_after_by_seed"].values())
            out.append(
                f"| {LABELS.get(t['name'].split('/', 1)[1], t['name'])} | {_cell(t, 'cpu_s_per_trajectory')} "
                f"| {_num(t['rollout_cpu_s'], '.1f')} + {_num(t['update_cpu_s'], '.1f')} | {_num(t['generated_tokens'], '.0f')} "
                f"| {_num(t['completion_len_mean'], '.1f')} / {_num(t['completion_len_max'], '.0f')} "
                f"| {_cell(t, 'trajectories_per_1k_tokens', '.1f')} "
                f"| {_num(t['prefill_positions'], '.0f')} / {_num(t['decode_positions'], '.0f')} / {_num(t['update_positions'], '.0f')} "
                f"| {_num(t['rollout_ms_per_position'])} / {_num(t['update_ms_per_position'])} | {_cell(t, 'peak_rss_gb')} "
                f"| {_num(t['cpu_per_wall'])} | {_num(t['em_before'], '.3f')} → {em} |"
            )  # fmt: skip
    checks_ = results["checks"]
    out += ["", "| ratio (paired by repeat) | rows | measured |", "|---|---|---|"]
    jobs = set(results["spec"]["jobs"])
    for key, got in {**checks_["targets"], **checks_["reported"]}.items():
        if got["rows"][0].split("/", 1)[0] not in jobs:  # a target of a job this run did not do
            continue
        out.append(f"| {key} | {' / '.join(got['rows'])}, {got['figure']} | {_verdict(got)} |")
    if not differences:
        return "\n".join(out) + "\n"
    out += ["", "Where the two sides still differ (both jobs, then the multi-turn job's tool loop; the reasons are in the "
            "results, `settings.differences*`):", "", "| setting | TRL | treegrpo |", "|---|---|---|"]  # fmt: skip
    settings = results["settings"]
    for d in [*settings["differences"], *settings.get("differences_multi_turn", [])]:
        out.append(f"| {d['setting']} | {_flat(d['trl'])} | {_flat(d['treegrpo'])} |")
    return "\n".join(out) + "\n"


def _flat(text: str) -> str:
    """A table cell: one line, no pipe."""
    return " ".join(text.split()).replace("|", "\\|")


def _ratio_text(got: dict[str, Any] | None) -> str:
    return "not reported" if got is None or got.get("ratio") is None else f"{got['ratio']:.2f}×"


def readme_row(results: dict[str, Any], long: dict[str, Any] | None = None) -> str:
    """The README's results row, from ``results`` (peers.json) and ``long`` (peers_long.json, if
    measured) alone: each job with its regime, each ratio with what it is against."""
    checks_, rows = results["checks"], results["rows"]
    t = {**checks_["targets"], **checks_["reported"]}
    r = {key: _ratio_text(t.get(key)) for key in t}
    single, multi = job_regime(results, "single_turn"), job_regime(results, "multi_turn")
    update = _ratio_text(paired_ratio(rows, "single_turn/chain_no_packing", "single_turn/trl", "update_cpu_s"))
    per_1k = {t_["name"].split("/", 1)[1]: _num(t_["trajectories_per_1k_tokens"], ".1f")
              for t_ in results["table"] if t_["job"] == "multi_turn"}  # fmt: skip
    text = (
        f"| treegrpo vs TRL `GRPOTrainer` (SmolLM2-135M, {results['spec']['threads'] or 'default'} threads; same jobs, stopping and allocator; TRL on its CPU "
        "path: a prompt prefilled and trained G times, no KV reuse, its fused LM head scoring every prompt position) "
        f"| single-turn, {single['prompt_tokens']:.0f}-token prompts (3 passages), {_gen(single)}-token answers, "
        f"G = {single['group_size']}: our chain {r['single_turn_cpu_per_trajectory']} TRL's CPU-s per trajectory, "
        f"{r['single_turn_peak_rss']} its peak RSS (the prompt computed once per group: with packing off our update "
        f"takes {update} TRL's CPU-s); multi-turn search through TRL's `tools=` ({multi['prompt_tokens']:.0f}-token "
        f"prompts, {_gen(multi)} model tokens per trajectory): trajectories per 1k generated tokens TRL "
        f"{per_1k.get('trl', '—')}, our chain {per_1k.get('chain', '—')}, Tree-GRPO (2,2,1) {per_1k.get('tree_2_2_1', '—')} "
        f"({r['multi_turn_tree_vs_chain_traj_per_1k']} our chain); our chain {r['multi_turn_cpu_per_trajectory']} "
        "TRL's CPU-s per trajectory"
    )
    cmds = f"`{command(results)}`"
    if long is not None:
        g, lt = job_regime(long, LONG_JOB), {**long["checks"]["targets"], **long["checks"]["reported"]}
        text += (
            f"; long completions, where sharing helps least ({g['prompt_tokens']:.0f}-token prompts, {_gen(g)}-token "
            f"completions, one turn, G = {g['group_size']}{_threads(long, results)}): our chain {_ratio_text(lt.get('long_completion_cpu_per_trajectory'))} "
            f"TRL's CPU-s per trajectory, {_ratio_text(lt.get('long_completion_cpu_per_token'))} per generated token"
            + (", one repeat" if long["spec"]["repeats"] == 1 else "")
        )
        cmds += f", `{command(long)}`"
    return f"{text} (medians over repeats; warm-ups and tables: docs/benchmarks.md) | {cmds} |"


def _threads(results: dict[str, Any], main: dict[str, Any]) -> str:
    """``, N threads`` when ``results`` ran on other torch threads than ``main``, else nothing."""
    n = results["spec"]["threads"]
    return "" if n == main["spec"]["threads"] else f", {n or 'default'} thread{'s' * (n != 1)}"


def _gen(regime: dict[str, Any]) -> str:
    """The job's completion length: both sides' means, as ``a–b`` when they differ at that precision."""
    got = sorted({f"{c:.0f}" for c in regime["completion"].values() if c is not None}, key=float)
    return "–".join([got[0], got[-1]] if len(got) > 1 else got) or "—"


def command(results: dict[str, Any], single: str = "runs/peers-single-warm", tools: str = "runs/smol-warm-tools") -> str:
    """The ``bench peers`` command of ``results`` with the docs' folder names (the long-completion
    job: its own ``--model`` as run, ``--jobs`` and ``--out``)."""
    spec = results["spec"]
    if list(spec["jobs"]) == [LONG_JOB]:
        start = f"--model {spec['model']} --jobs {LONG_JOB} --out benchmarks/results/{LONG_RESULTS}"
    else:
        start = f"--model {single} --tools-model {tools}"
    return (
        f"treegrpo bench peers {start} --steps {spec['steps']} --repeats {spec['repeats']} "
        f"--threads {spec['threads']} --eval-prompts {spec['eval_prompts']} --max-new-tokens {spec['max_new_tokens']}"
    )


#: The markers around the generated tables in docs/benchmarks.md: peers.json's, then peers_long.json's.
DOCS_BEGIN = "<!-- bench peers tables: made by `treegrpo bench peers --write-docs` from benchmarks/results/peers.json -->"
DOCS_END = "<!-- end of the bench peers tables -->"
DOCS_LONG_BEGIN = ("<!-- bench peers long-completion tables: made by `treegrpo bench peers --write-docs` from "
                   "benchmarks/results/peers_long.json -->")  # fmt: skip
DOCS_LONG_END = "<!-- end of the bench peers long-completion tables -->"
#: The start of the README's results row (the row is replaced whole).
README_PREFIX = "| treegrpo vs TRL `GRPOTrainer`"


def _replace(docs: Path, text: str, begin: str, end: str, body: str) -> str:
    if begin not in text or end not in text:
        raise ConfigError(f"{docs}: no generated-tables markers ({begin} ... {end}); add them where the tables go")
    head, rest = text.split(begin, 1)
    return f"{head}{begin}\n{body}{end}{rest.split(end, 1)[1]}"


def write_docs(results: dict[str, Any], docs: Path, readme: Path) -> None:
    """Rewrite ``docs``' generated tables and the README's row (starting with :data:`README_PREFIX`)
    from ``results`` and its companion in ``benchmarks/results/`` next to ``readme``: given peers.json,
    peers_long.json when measured; given peers_long.json (its job alone), peers.json. Tables go
    between :data:`DOCS_BEGIN` / :data:`DOCS_END` (and :data:`DOCS_LONG_BEGIN` / :data:`DOCS_LONG_END`);
    a file without its markers or row is an error naming it."""
    folder = readme.parent / "benchmarks" / "results"
    if list(results["spec"]["jobs"]) == [LONG_JOB]:
        main, long = _load(folder / MAIN_RESULTS), results
    else:
        main, long = results, (_load(folder / LONG_RESULTS) if (folder / LONG_RESULTS).is_file() else None)
    text = _replace(docs, docs.read_text(), DOCS_BEGIN, DOCS_END, markdown(main))
    if long is not None:
        text = _replace(docs, text, DOCS_LONG_BEGIN, DOCS_LONG_END, markdown(long, differences=False))
    lines = readme.read_text().splitlines(keepends=True)
    at = [i for i, x in enumerate(lines) if x.startswith(README_PREFIX)]
    if len(at) != 1:
        raise ConfigError(f"{readme}: expected one results row starting with {README_PREFIX!r}, found {len(at)}")
    lines[at[0]] = readme_row(main, long) + "\n"
    docs.write_text(text)
    readme.write_text("".join(lines))


def _load(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read the bench peers results ({e}); run the bench or pass them as --out") from None
