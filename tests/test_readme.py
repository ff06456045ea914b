"""The README cannot go stale: every code block in it is checked.

- Cheap blocks (every command a ``treegrpo`` subcommand of :data:`CHEAP`) are executed.
- Every other command is checked without running it: each ``treegrpo`` command's subcommands and
  flags must appear in its ``--help`` (and each ``--set key=value`` key must be a ``TrainConfig``
  field), ``python -m pytest``'s flags in pytest's ``--help``, ``pip install``'s extras in
  ``pyproject.toml`` and its pins in ``constraints.txt``, a script or test file it names must exist.
- The ``text`` block (what a run prints) must agree with one run of ``benchmarks/results/default_run.json``,
  and the default run's figure in the README and docs is the spread over all its runs.
- The ``treegrpo`` commands in the README's inline code (the results table) and in the bash blocks
  of ``docs/*.md`` get the same ``--help`` check, and relative links resolve (anchors included).

The main job and the test command are never executed here.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
CHEAP = {"advantages", "plan"}  # treegrpo subcommands that finish in seconds without a model
OPERATORS = {"&&", "||", ";", "|", "&"}
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def code_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced code block."""
    return [(m[1], m[2]) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S)]


def commands(body: str) -> list[list[str]]:
    """The simple commands of a shell block: comments, heredoc bodies and leading ``VAR=value``
    assignments dropped, continuation lines joined, split at ``&&``, ``;``, ``|``, ``&``."""
    lines: list[str] = []
    heredoc: str | None = None
    for line in body.replace("\\\n", " ").splitlines():
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        m = re.search(r"<<-?'?(\w+)'?", line)
        if m:
            heredoc, line = m[1], line[: m.start()]
        lines.append(line)
    out: list[list[str]] = []
    for line in lines:
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        lex.commenters = "#"
        cur: list[str] = []
        redirect = False
        for tok in [*lex, ";"]:
            if tok in OPERATORS:
                while cur and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", cur[0]):
                    cur.pop(0)
                if cur:
                    out.append(cur)
                cur = []
            elif set(tok) <= set("<>"):
                redirect = True  # the next word is the redirection's file
            elif redirect:
                redirect = False
            else:
                cur.append(tok)
    return out


# -- what a program accepts -------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ, COLUMNS="400", NO_COLOR="1", TERM="dumb")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


@functools.cache
def treegrpo_help(path: tuple[str, ...]) -> tuple[frozenset[str], frozenset[str]]:
    """(subcommands, flags) that ``python -m treegrpo *path --help`` lists."""
    res = subprocess.run(
        [sys.executable, "-m", "treegrpo", *path, "--help"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    if res.returncode != 0:
        raise LookupError(f"`treegrpo {' '.join(path)} --help` failed: {res.stderr.strip()[-300:]}")
    subs: set[str] = set()
    flags: set[str] = set()
    box = ""
    for line in ANSI.sub("", res.stdout).splitlines():
        if line.startswith("╭─"):
            box = line
        elif box.startswith("╭─ Commands") and (m := re.match(r"│ (\S+)", line)):
            subs.add(m[1])
        elif m := re.match(r"│\s+(?:\*\s+)?(-[-\w,]+)(?:\s+(-\w)(?=\s))?", line):
            flags.update(f for f in m[1].split(",") if f)
            if m[2]:
                flags.add(m[2])
    if "--help" not in flags:  # the help's layout changed: fail loudly rather than miss flags
        raise LookupError(f"`treegrpo {' '.join(path)} --help`: no option box found in {res.stdout[:300]!r}")
    return frozenset(subs), frozenset(flags)


@functools.cache
def config_keys() -> frozenset[str]:
    from treegrpo.training.config import TrainConfig

    keys = set(TrainConfig.model_fields)
    for field in TrainConfig.model_fields.values():
        alias = field.validation_alias
        keys.update(getattr(alias, "choices", [alias] if isinstance(alias, str) else []))
    return frozenset(k for k in keys if isinstance(k, str))


@functools.cache
def pytest_help() -> str:
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "--help"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def check_treegrpo(args: list[str]) -> list[str]:
    """Problems with ``treegrpo *args``: an unknown subcommand or flag, an unknown ``--set`` key."""
    path: list[str] = []
    while True:
        subs, flags = treegrpo_help(tuple(path))
        if not subs:
            break
        if not args or args[0] not in subs:
            return [f"treegrpo {' '.join(path)}: unknown subcommand {args[:1]} (known: {sorted(subs)})"]
        path.append(args.pop(0))
    where = f"treegrpo {' '.join(path)}"
    problems = [
        f"{where}: no flag {a.split('=')[0]}"
        for a in args
        if a.startswith("-") and a.split("=")[0] not in flags
    ]
    for i, a in enumerate(args[:-1]):
        if a == "--set" and (key := args[i + 1].split("=")[0]) not in config_keys():
            problems.append(f"{where}: --set {key}: not a TrainConfig field")
    return problems


def check_pip(args: list[str], locked: bool) -> list[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = set(pyproject["project"]["optional-dependencies"])
    pins = dict(
        line.split("#", 1)[0].strip().lower().replace("_", "-").split("==", 1)
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    problems = []
    if locked and "constraints.txt" not in [b for a, b in itertools.pairwise(args) if a == "-c"]:
        problems.append(f"pip install without -c constraints.txt: {args}")
    skip = False
    for a in args[1:]:
        if skip:
            skip = False
        elif a == "-c":
            skip = True
        elif a in ("-e", "--no-deps", "-q"):
            continue
        elif a.startswith("-"):
            problems.append(f"pip install: unexpected flag {a}")
        elif a.startswith("."):
            wanted = set(filter(None, re.findall(r"\[(.*)\]", a)[0].split(","))) if "[" in a else set()
            problems += [f"pip install: pyproject has no extra [{e}]" for e in sorted(wanted - extras)]
        elif locked:
            name, _, ver = a.lower().replace("_", "-").partition("==")
            if name not in pins:
                problems.append(f"pip install {a}: constraints.txt does not pin {name}")
            elif ver and pins[name] != ver:
                problems.append(f"pip install {a}: constraints.txt pins {name}=={pins[name]}")
    return problems


def check_command(argv: list[str], locked: bool = True, strict: bool = True) -> list[str]:
    """Problems with one command, checked without running it. ``strict``: an unknown program is a
    problem (the README); otherwise it is left alone (a doc's ``cat``, ``torchrun``'s own flags)."""
    prog, args = Path(argv[0]).name, argv[1:]
    if prog == "treegrpo":
        return check_treegrpo(list(args))
    if "-m" in argv and argv[argv.index("-m") + 1 :][:1] == ["treegrpo"]:
        return check_treegrpo(list(argv[argv.index("-m") + 2 :]))
    if prog == "pip" and args[:1] == ["install"]:
        return check_pip(args, locked)
    if prog.startswith("python") and args[:2] == ["-m", "pytest"]:
        problems = [
            f"pytest: no flag {a}"
            for a in args[2:]
            if a.startswith("-") and not re.search(rf"(?<![\w-]){re.escape(a)}(?![\w-])", pytest_help())
        ]
        return problems + [
            f"pytest: no file {a}" for a in args[2:] if a.startswith("tests/") and not (ROOT / a).exists()
        ]
    if prog == "bash" and args:
        return [] if (ROOT / args[0]).is_file() else [f"bash: no script {args[0]}"]
    return [f"unknown program {prog!r} in a README block"] if strict else []


def readme_blocks() -> list[tuple[str, str]]:
    return code_blocks(README.read_text())


def _is_cheap(cmds: list[list[str]]) -> bool:
    return bool(cmds) and all(c[0] == "treegrpo" and len(c) > 1 and c[1] in CHEAP for c in cmds)


# -- the tests ----------------------------------------------------------------------------------------


def test_the_two_commands_come_first() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 120, f"README.md has {len(lines)} lines (the front door fits 120)"
    head = "\n".join(lines[:30])
    assert "pip install -c constraints.txt -e . && treegrpo train" in head  # the main job
    assert "&& python -m pytest -q" in head  # the test command


@pytest.mark.parametrize("i", range(len(readme_blocks())))
def test_readme_block(i: int) -> None:
    lang, body = readme_blocks()[i]
    if lang == "text":
        check_run_excerpt(body)
        return
    assert lang in ("bash", "sh"), f"README block {i}: language {lang!r} has no check"
    cmds = commands(body)
    assert cmds, f"README block {i} has no command"
    if _is_cheap(cmds):
        for argv in cmds:
            res = subprocess.run(
                [sys.executable, "-m", *argv],
                cwd=ROOT,
                capture_output=True,
                text=True,
                env=_env(),
                timeout=300,
            )
            assert res.returncode == 0 and res.stdout.strip(), (argv, res.stderr[-2000:])
        return
    problems = [p for argv in cmds for p in check_command(argv)]
    assert problems == []


def test_readme_inline_and_docs_commands_exist() -> None:
    inline = re.findall(r"`(treegrpo [^`]+)`", README.read_text())
    cmds = [
        shlex.split(c) for c in inline if not re.search(r"[A-Z]{2,}|\bX\b", c)
    ]  # placeholders (DIR, FILE)
    for doc in [ROOT / "CONTRIBUTING.md", *DOCS]:
        for lang, body in code_blocks(doc.read_text()):
            if lang in ("bash", "sh"):
                cmds += commands(body)
    assert len(cmds) > 20
    problems = [p for argv in cmds for p in check_command(argv, locked=False, strict=False)]
    assert problems == []


DEFAULT_RUN = ROOT / "benchmarks" / "results" / "default_run.json"
#: The run the README's excerpt prints: the headline spread's seed 0 on the CPU's own kernels.
EXCERPT_RUN = (0, "native")


def default_spread() -> dict:
    """The spread of the default run the README shows (``bench default``'s headline)."""
    doc = json.loads(DEFAULT_RUN.read_text())
    return doc["spreads"][doc["headline"]]


def check_run_excerpt(body: str) -> None:
    """The figures of the excerpt are those of one recorded run of the headline spread (seed 0,
    the CPU's own kernels)."""
    spread = default_spread()
    (s,) = [r for r in spread["rows"] if (r["seed"], r["kernels"]) == EXCERPT_RUN]
    start, end = s["start"], s["end"]
    rows = {
        "held-out success, sampled T=1": [f"{start['sampled']:.3f}", f"{end['sampled']:.3f}"],
        "held-out success, greedy": [f"{start['greedy']:.3f}", f"{end['greedy']:.3f}"],
        "tool calls / trajectory (eval, sampled)": [f"{start['tool_calls']:.2f}", f"{end['tool_calls']:.2f}"],
        "trajectories trained": [str(s["trajectories"])],
        "generated tokens": [str(s["generated_tokens"])],
        "trajectories per 1k generated tokens": [f"{s['trajectories_per_1k_tokens']:.2f}"],
        "": ["start", "end"],
        "…": [],
    }
    seen = set()
    for line in body.splitlines():
        if line.startswith(("│", "┃")):
            cells = [c.strip() for c in re.split(r"[│┃]", line)[1:-1]]
            assert cells[0] in rows, f"excerpt row {cells[0]!r}: add how to check it"
            assert [c for c in cells[1:] if c] == rows[cells[0]], line
            seen.add(cells[0])
    assert seen >= {"held-out success, sampled T=1", "held-out success, greedy"}
    assert (
        f"step    0 · held-out success sampled {rows['held-out success, sampled T=1'][0]} · greedy {rows['held-out success, greedy'][0]}"
        in body
    )
    steps = spread["config"]["steps"]
    last = f"step {steps:>4} · "
    assert any(
        x.startswith(last)
        and x.endswith(
            f"held-out sampled {rows['held-out success, sampled T=1'][1]} · greedy {rows['held-out success, greedy'][1]}"
        )
        for x in body.splitlines()
    )
    assert f"· {steps} steps" in body and f"model ~/.cache/treegrpo/models/{s['bootstrap']['model']} ·" in body


def test_the_default_runs_figures_are_the_spread_of_its_runs() -> None:
    """The README's and docs' figure for the default run is the range (and mean ± sd) over every
    run of the recorded spread, computed from ``default_run.json``, not one seed's."""
    from treegrpo.benchmarks.default_run import figure

    spread = default_spread()
    summary, rows = spread["summary"], spread["rows"]
    seeds = sorted({r["seed"] for r in rows})
    kernels = sorted({r["torch_kernels"] for r in rows})
    sampled, greedy = figure(summary), figure(summary, "greedy")
    what = f"{len(rows)} runs: {len(seeds)} seeds × {len(kernels)} CPU kernel sets"
    readme = README.read_text()
    assert f"| default run, tiny agent | held-out success {sampled} sampled, {greedy} greedy ({what}) |" in readme
    assert f"held-out success over {what} ({', '.join(kernels)}):" in readme
    assert f"sampled **{sampled}**, greedy {greedy}" in readme
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    assert f"held-out success {sampled} sampled, {greedy} greedy ({what})" in docs


def test_the_first_run_says_the_bootstrap_takes_minutes() -> None:
    """Before the set-up command, the README says the first run builds the tiny agent and how long
    that took: the range of the recorded clean-cache bootstraps (``bootstrap.wall_s``)."""
    head = "\n".join(README.read_text().splitlines()[:20])
    m = re.search(r"the first run builds the tiny agent[^`]*?takes\s+minutes \((\d+)–(\d+) min", head)
    assert m, "the README's set-up paragraph must say the first-time bootstrap takes minutes"
    built = [r["bootstrap"]["wall_s"] for r in default_spread()["rows"] if r["bootstrap"]["built_by_this_run"]]
    assert built and (int(m[1]), int(m[2])) == (round(min(built) / 60), round(max(built) / 60))


def test_the_docs_say_how_to_run_your_own_env() -> None:
    text = (ROOT / "docs" / "stateful-tools.md").read_text()
    assert "treegrpo train --env " in text and re.search(r"treegrpo\.train\([^)]*env=", text)
    assert "](tools.md)" in text


def test_the_docs_say_what_resume_does_on_a_folder_without_a_run(tmp_path: Path) -> None:
    """docs/configuration.md quotes what ``--resume`` says on a folder with no run (it starts one)
    and on one whose earlier run left no checkpoint (it refuses): the messages the code prints."""
    from treegrpo.errors import ConfigError
    from treegrpo.training.checkpoint import open_checkpoint

    doc = (ROOT / "docs" / "configuration.md").read_text().replace("\n", " ")
    said: list[str] = []
    assert open_checkpoint(tmp_path, say=said.append) is None  # nothing there: a new run begins
    quoted = re.search(r"`(--resume: nothing to resume in OUT[^`]*)`", doc)
    assert quoted and said == [quoted[1].replace("OUT", str(tmp_path))]
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')  # an earlier run, its checkpoint gone
    with pytest.raises(ConfigError) as e:
        open_checkpoint(tmp_path, say=said.append)
    refused = re.search(r"`(cannot resume OUT: [^`…]*)…`", doc)
    assert refused and str(e.value).startswith(refused[1].replace("OUT", str(tmp_path)))


_SLUG_DROP = re.compile(r"[^\w\- ]")


def _anchors(md: str) -> set[str]:
    return {
        _SLUG_DROP.sub("", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.*)$", md, flags=re.M)
    }


def test_relative_links_resolve() -> None:
    problems = []
    for doc in [README, ROOT / "CONTRIBUTING.md", *DOCS]:
        text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                problems.append(f"{doc.name}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                problems.append(f"{doc.name}: {target}: no such heading")
    assert problems == []


# -- the checks can fail ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "block, problem",
    [
        ("treegrpo train --no-such-flag 1", "no flag --no-such-flag"),
        ("treegrpo trian --steps 3", "unknown subcommand"),
        ("treegrpo bench learn --gigpo --task sql --seedz 3", "no flag --seedz"),
        ("treegrpo train --set no_such_field=1", "not a TrainConfig field"),
        ("pip install -c constraints.txt -e '.[test,nosuchextra]'", "no extra [nosuchextra]"),
        ("pip install -e . && treegrpo train", "without -c constraints.txt"),
        ("pip install -c constraints.txt torch==0.0.1", "pins torch=="),
        ("python -m pytest -q --no-such-pytest-flag", "pytest: no flag"),
        ("TREEGRPO_VLLM_TESTS=1 python -m pytest -q tests/test_nothing_here.py", "no file"),
        ("rm -rf runs", "unknown program"),
    ],
)
def test_a_stale_command_is_caught(block: str, problem: str) -> None:
    problems = [p for argv in commands(block) for p in check_command(argv)]
    assert any(problem in p for p in problems), problems


def test_commands_parse_shell() -> None:
    body = "A=1 cmd --x 'a b' && other # note\nthird \\\n  --y &\ncat > f <<'EOF'\nnot: a command\nEOF\nlast"
    assert commands(body) == [["cmd", "--x", "a b"], ["other"], ["third", "--y"], ["cat"], ["last"]]


def test_the_cheap_blocks_print_what_their_comments_say() -> None:
    """The figures in the comments of the README's executed block, hand-derived: both groups of the
    example forest are {1, 0} (mean 0.5, unbiased std sqrt(0.5)), so each leaf gets twice
    ±0.5 / (sqrt(0.5) + 1e-6); a chain budget of 8 is the paper's pair (2,6,1)."""
    body = next(b for _, b in readme_blocks() if "treegrpo advantages" in b)
    assert "+1.414 and -1.414" in body and "(2,6,1)" in body
    run = functools.partial(subprocess.run, cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=300)
    res = run([sys.executable, "-m", "treegrpo", "advantages", "-e", "tree_grpo", "docs/forest-example.json"])
    leaves = {
        n["id"]: n["advantage"] for n in json.loads(res.stdout)["trees"][0]["nodes"] if "advantage" in n
    }
    term = 0.5 / (0.5**0.5 + 1e-6)
    assert leaves == pytest.approx({2: 2 * term, 3: -2 * term}, abs=1e-12)
    assert round(leaves[2], 3) == 1.414
    res = run([sys.executable, "-m", "treegrpo", "plan", "--budget", "8"])
    assert "(M,N,L) = (2,6,1)" in res.stdout, res.stdout
