"""A synthetic multi-hop world: the embedded default environment.

A seeded, deterministic world of fictional entities whose names are built from syllables, so
nothing about it can be known from pretraining:

- **people** (two-word names) are *born in* a city and *work for* a company;
- **companies** are *based in* a city;
- **cities** lie *in* a country;
- **countries** are *ruled by* a person.

Every entity has one passage (a :class:`~treegrpo.retrieval.base.Doc`, title on the first line of
``contents``, Search-R1's corpus format) that states that entity's own relations, e.g.
``"Bakemo Tiral\\nBakemo Tiral was born in Vorlin and works for Zentaco."``.

Questions name only their first entity and follow a chain of 1, 2 or 3 relations
(``"Who rules the country where Bakemo Tiral was born?"``): hop *k*'s query is the entity that
hop *k-1*'s passage names, so multi-hop questions need one search per hop. Every relation is a
function, so every answer is unique. :func:`build_world` keeps only questions whose gold queries
(the entity names) retrieve the right passage at BM25 top-1, and, for multi-hop questions, whose
answer is neither in the question nor in the top passages of the first search.

Splits ``warmup`` (demonstrations for the supervised warm-up), ``train`` (RL) and ``eval``
(held-out) are disjoint by *start entity*, so they share no question and no first passage.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any, Literal

from treegrpo.envs.base import Task
from treegrpo.errors import ConfigError
from treegrpo.retrieval.base import Doc
from treegrpo.retrieval.bm25 import BM25Retriever

Split = Literal["warmup", "train", "eval"]
SPLITS: tuple[Split, ...] = ("warmup", "train", "eval")
EntityType = Literal["person", "city", "country", "company"]

# Relation name -> (subject type, object type).
RELATIONS: dict[str, tuple[EntityType, EntityType]] = {
    "born_in": ("person", "city"),
    "works_for": ("person", "company"),
    "based_in": ("company", "city"),
    "in_country": ("city", "country"),
    "ruled_by": ("country", "person"),
}

# Relation chains (the question's path from its named entity to the answer) and their phrasings.
QUESTION_TEMPLATES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("born_in",): ("Where was {e} born?", "In which city was {e} born?"),
    ("works_for",): ("Which company does {e} work for?", "Who employs {e}?"),
    ("based_in",): ("Where is {e} based?", "In which city is {e} headquartered?"),
    ("in_country",): ("In which country is {e}?", "Which country is {e} in?"),
    ("ruled_by",): ("Who rules {e}?", "Who is the ruler of {e}?"),
    ("born_in", "in_country"): (
        "In which country was {e} born?",
        "Which country is the birthplace of {e} in?",
    ),
    ("works_for", "based_in"): (
        "Where is the employer of {e} based?",
        "In which city is the company {e} works for headquartered?",
    ),
    ("based_in", "in_country"): ("In which country is {e} based?", "In which country is {e} headquartered?"),
    ("in_country", "ruled_by"): (
        "Who rules the country {e} is in?",
        "Who is the ruler of the country where {e} lies?",
    ),
    ("born_in", "in_country", "ruled_by"): (
        "Who rules the country where {e} was born?",
        "Who is the ruler of the birth country of {e}?",
    ),
    ("works_for", "based_in", "in_country"): (
        "In which country is the employer of {e} based?",
        "In which country is the company {e} works for headquartered?",
    ),
    ("based_in", "in_country", "ruled_by"): (
        "Who rules the country where {e} is based?",
        "Who is the ruler of the country {e} is headquartered in?",
    ),
}

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "tr")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "", "n", "r", "l", "s")
# Real words the syllable generator could produce; never used as names.
_BANNED = frozenset(
    {
        "bone",
        "dare",
        "fine",
        "gone",
        "kite",
        "lime",
        "mole",
        "none",
        "note",
        "pole",
        "rose",
        "sale",
        "tale",
        "vote",
        "zone",
        "dose",
        "more",
        "sure",
        "pure",
        "tune",
        "lane",
        "line",
        "mine",
        "nine",
    }
)


@dataclass(frozen=True)
class WorldConfig:
    """Shape of a synthetic world.

    Attributes:
        seed: everything (names, relations, questions, splits) is a function of the config.
        n_people: people (two-word names); each can start 6 questions (born/works chains, 1-3 hops).
        n_companies: companies (start 1-, 2- and 3-hop questions).
        n_cities: cities (start 1- and 2-hop questions).
        n_countries: countries (start 1-hop questions).
        hop_mix: fractions of 1-, 2- and 3-hop questions in every split.
        n_warmup: questions in the ``warmup`` split (demonstrations).
        n_train: questions in the ``train`` split (RL).
        n_eval: questions in the ``eval`` split (held-out success).
        leak_topk: a multi-hop question is kept only if its answer is absent from the top
            ``leak_topk`` passages of its first gold search (use at least the env's ``topk``).
        name_seed: seed of the entity *names* (default: ``seed``). Worlds that share a name seed
            and sizes have the same names per type but different relations, passages and
            questions (used for extra warm-up demonstrations).
    """

    seed: int = 0
    n_people: int = 300
    n_companies: int = 60
    n_cities: int = 48
    n_countries: int = 12
    hop_mix: tuple[float, float, float] = (0.2, 0.4, 0.4)
    n_warmup: int = 600
    n_train: int = 500
    n_eval: int = 200
    leak_topk: int = 5
    name_seed: int | None = None

    def __post_init__(self) -> None:
        if len(self.hop_mix) != 3 or any(x < 0 for x in self.hop_mix) or sum(self.hop_mix) <= 0:
            raise ValueError(
                f"hop_mix must be three non-negative fractions (1, 2, 3 hops), got {self.hop_mix}"
            )
        for name in ("n_people", "n_companies", "n_cities", "n_countries"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be at least 2, got {getattr(self, name)}")
        for name in ("n_warmup", "n_train", "n_eval"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hop_mix"] = list(self.hop_mix)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorldConfig:
        d = dict(d)
        if "hop_mix" in d:
            d["hop_mix"] = tuple(d["hop_mix"])
        return cls(**d)


PRESETS: dict[str, WorldConfig] = {
    # The default demo world: 420 passages, 600 / 500 / 200 questions.
    "default": WorldConfig(),
    # The shortcut-prone multi-hop regime of ``treegrpo bench learn``: only 2- and 3-hop questions
    # (30 / 70 %), so a starting policy that answers after one search (the default bootstrap's habit)
    # rarely succeeds (sampled success ≈ 5 %), and success hinges on a late choice, to search again
    # instead of answering with the bridge entity. A larger eval split (400) for a less noisy EM.
    "shortcut3": WorldConfig(n_people=600, n_companies=100, hop_mix=(0.0, 0.3, 0.7), n_eval=400),
    # The rare-success regime: 3-hop questions only, so the shortcut-prone starting policy almost
    # never succeeds (sampled success ≈ 3 %): most groups of a small budget carry no signal at all.
    "rare3": WorldConfig(n_people=800, n_companies=120, hop_mix=(0.0, 0.0, 1.0), n_eval=400),
    # A small world for tests and quick experiments.
    "tiny": WorldConfig(
        n_people=60, n_companies=16, n_cities=12, n_countries=6, n_warmup=120, n_train=40, n_eval=30
    ),
}


def get_preset(name: str) -> WorldConfig:
    """The named preset, with a helpful error."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown world preset {name!r}; choose one of {sorted(PRESETS)}") from None


@dataclass(frozen=True)
class Entity:
    """A world entity: its type, unique name, passage id, and its outgoing relations (name -> object)."""

    type: EntityType
    name: str
    doc_id: str
    relations: dict[str, str] = field(default_factory=dict)


def passage_text(e: Entity) -> str:
    """The passage body stating ``e``'s relations (the title is the name)."""
    r = e.relations
    if e.type == "person":
        return f"{e.name} was born in {r['born_in']} and works for {r['works_for']}."
    if e.type == "company":
        return f"{e.name} is a company based in {r['based_in']}."
    if e.type == "city":
        return f"{e.name} is a city in {r['in_country']}."
    return f"{e.name} is a country ruled by {r['ruled_by']}."


class _Namer:
    """Unique syllable words: no two share a word or a BM25 (Snowball) stem."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.words: set[str] = set()
        self.stems: set[str] = set()
        try:
            import Stemmer

            self._stem = Stemmer.Stemmer("english").stemWord
        except ImportError:  # pragma: no cover - PyStemmer is a dependency
            self._stem = lambda w: w
        from bm25s.stopwords import STOPWORDS_EN

        self._stop = set(STOPWORDS_EN)

    def word(self, syllables: int) -> str:
        for _ in range(10_000):
            w = "".join(
                self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS)
                for _ in range(syllables)
            )
            low = w.lower()
            stem = self._stem(low)
            if len(low) < 4 or low in self.words or stem in self.stems or low in self._stop or low in _BANNED:
                continue
            self.words.add(low)
            self.stems.add(stem)
            return w.capitalize()
        raise RuntimeError("ran out of syllable names; use a smaller world")  # pragma: no cover


@dataclass
class World:
    """A built world: entities, the passage corpus, and the question splits.

    Use :func:`build_world`; ``world.corpus`` is searched with
    :class:`~treegrpo.retrieval.bm25.BM25Retriever` (``world.retriever``).
    """

    cfg: WorldConfig
    entities: dict[str, Entity]
    corpus: list[Doc]
    splits: dict[str, list[Task]]
    stats: dict[str, Any] = field(default_factory=dict)

    def tasks(self, split: Split) -> list[Task]:
        """The questions of ``split`` (``warmup``, ``train`` or ``eval``), in a fixed order."""
        if split not in self.splits:
            raise ValueError(f"unknown split {split!r}; choose one of {list(SPLITS)}")
        return list(self.splits[split])

    def texts(self) -> list[str]:
        """Every passage and question (all splits), for training a tokenizer."""
        return [d.contents for d in self.corpus] + [t.question for s in SPLITS for t in self.splits[s]]

    def doc(self, name: str) -> Doc:
        """The passage of the entity called ``name``."""
        return self._docs_by_id[self.entities[name].doc_id]

    def names_in(self, text: str) -> list[str]:
        """Entity names occurring in ``text``, in order of appearance (with repeats)."""
        return self._name_re.findall(text)

    @cached_property
    def _name_re(self) -> re.Pattern[str]:
        names = sorted(self.entities, key=len, reverse=True)
        return re.compile(r"\b(" + "|".join(re.escape(n) for n in names) + r")\b")

    @cached_property
    def _docs_by_id(self) -> dict[str, Doc]:
        return {d.id: d for d in self.corpus}

    @cached_property
    def retriever(self) -> BM25Retriever:
        """A BM25 index over :attr:`corpus` (built once, on first use)."""
        return BM25Retriever(self.corpus)


def _follow(entities: dict[str, Entity], start: str, chain: tuple[str, ...]) -> list[str]:
    """Entities visited from ``start`` along ``chain``: ``[start, hop1, …, answer]``."""
    path = [start]
    for rel in chain:
        path.append(entities[path[-1]].relations[rel])
    return path


def _quotas(n: int, mix: tuple[float, float, float]) -> list[int]:
    """Split ``n`` questions over 1/2/3 hops by ``mix`` (largest remainders)."""
    total = sum(mix)
    raw = [n * m / total for m in mix]
    q = [int(x) for x in raw]
    for i in sorted(range(3), key=lambda i: raw[i] - q[i], reverse=True)[: n - sum(q)]:
        q[i] += 1
    return q


def build_world(cfg: WorldConfig | None = None) -> World:
    """Generate the world of ``cfg`` (default: ``PRESETS["default"]``); deterministic per config.

    Raises:
        ValueError: the world has too few entities to fill the splits with the asked hop mix.
    """
    cfg = cfg or PRESETS["default"]
    name_seed = cfg.seed if cfg.name_seed is None else cfg.name_seed
    name_rng = random.Random(f"treegrpo-world-names-{name_seed}")
    namer = _Namer(name_rng)
    countries = [namer.word(name_rng.choice((2, 3))) for _ in range(cfg.n_countries)]
    cities = [namer.word(2) for _ in range(cfg.n_cities)]
    companies = [namer.word(name_rng.choice((2, 3))) for _ in range(cfg.n_companies)]
    people = [f"{namer.word(2)} {namer.word(name_rng.choice((1, 2)) + 1)}" for _ in range(cfg.n_people)]
    rng = random.Random(f"treegrpo-world-{cfg.seed}")
    for names in (countries, cities, companies, people):
        rng.shuffle(names)  # who is who (and which names come first) depends on the world seed

    # Relations: every city in a country, every country ruled by a distinct person, every company
    # based in a city, every person born in a city and working for a company. Round-robin first so
    # every object is used, then shuffled.
    def spread(objs: list[str], n: int) -> list[str]:
        out = [objs[i % len(objs)] for i in range(n)]
        rng.shuffle(out)
        return out

    entities: dict[str, Entity] = {}
    counter = {"person": 0, "city": 0, "country": 0, "company": 0}

    def add(etype: EntityType, name: str, rels: dict[str, str]) -> None:
        entities[name] = Entity(etype, name, f"{etype}-{counter[etype]}", rels)
        counter[etype] += 1

    for c, k in zip(cities, spread(countries, len(cities)), strict=True):
        add("city", c, {"in_country": k})
    for k, ruler in zip(countries, rng.sample(people, len(countries)), strict=True):
        add("country", k, {"ruled_by": ruler})
    for co, city in zip(companies, spread(cities, len(companies)), strict=True):
        add("company", co, {"based_in": city})
    for p, city, co in zip(people, spread(cities, len(people)), spread(companies, len(people)), strict=True):
        add("person", p, {"born_in": city, "works_for": co})

    corpus = [Doc(e.doc_id, f"{e.name}\n{passage_text(e)}") for e in entities.values()]
    world = World(cfg, entities, corpus, {})

    # Gold queries are entity names: check each retrieves its own passage at top-1, and keep the
    # first search's top passages to reject multi-hop questions answerable from one search.
    names = list(entities)
    hits = world.retriever.retrieve(names, max(1, cfg.leak_topk))
    top1_ok = {n: bool(h) and h[0].doc.id == entities[n].doc_id for n, h in zip(names, hits, strict=True)}
    first_obs = {n: " ".join(x.doc.contents for x in h) for n, h in zip(names, hits, strict=True)}

    candidates: dict[str, list[tuple[str, ...]]] = {}
    dropped = {"retrieval": 0, "leak": 0}
    for name, e in entities.items():
        for chain in QUESTION_TEMPLATES:
            if RELATIONS[chain[0]][0] != e.type:
                continue
            path = _follow(entities, name, chain)
            if not all(top1_ok[q] for q in path[:-1]):
                dropped["retrieval"] += 1
                continue
            answer = path[-1]
            if len(chain) > 1 and (answer in path[:-1] or answer in first_obs[name]):
                dropped["leak"] += 1
                continue
            candidates.setdefault(name, []).append(chain)

    # Splits are disjoint by start entity: eval first, then train, then warmup.
    starts = list(candidates)
    rng.shuffle(starts)
    pool = iter(starts)
    splits: dict[str, list[Task]] = {}
    for split, size in (("eval", cfg.n_eval), ("train", cfg.n_train), ("warmup", cfg.n_warmup)):
        need = _quotas(size, cfg.hop_mix)
        tasks: list[Task] = []
        while sum(need) > 0:
            start = next(pool, None)
            if start is None:
                raise ValueError(
                    f"world too small for the splits: {split!r} still needs {need} questions of 1/2/3 hops; "
                    "raise n_people (or lower the split sizes)"
                )
            chains = list(candidates[start])
            rng.shuffle(chains)
            for chain in chains:
                h = len(chain)
                if need[h - 1] <= 0:
                    continue
                need[h - 1] -= 1
                tasks.append(_make_task(rng, entities, start, chain))
        rng.shuffle(tasks)
        for i, t in enumerate(tasks):
            t.id = f"world{cfg.seed}-{split}-{i:05d}"
        splits[split] = tasks
    world.splits = {s: splits[s] for s in SPLITS}
    world.stats = {
        "entities": {k: v for k, v in counter.items()},
        "passages": len(corpus),
        "candidate_questions": sum(len(v) for v in candidates.values()),
        "dropped_questions": dropped,
        "split_sizes": {s: len(world.splits[s]) for s in SPLITS},
    }
    return world


def _make_task(rng: random.Random, entities: dict[str, Entity], start: str, chain: tuple[str, ...]) -> Task:
    path = _follow(entities, start, chain)
    k = rng.randrange(len(QUESTION_TEMPLATES[chain]))
    question = QUESTION_TEMPLATES[chain][k].format(e=start)
    steps = [
        {"query": path[i], "doc_id": entities[path[i]].doc_id, "relation": rel, "found": path[i + 1]}
        for i, rel in enumerate(chain)
    ]
    meta = {
        "hops": len(chain),
        "relations": list(chain),
        "template": k,
        "start": start,
        "queries": path[:-1],
        "bridges": path[1:-1],
        "chain": steps,
    }
    return Task(id="", question=question, answers=[path[-1]], data_source="world", meta=meta)
