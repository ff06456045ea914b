"""A calculator and a lookup tool, and their reward: the user code of the example (docs/tools.md)."""

PLACES = {  # a small made-up atlas: the model must look facts up, it cannot know them
    "Zorbia": {"population": 412, "area": 38}, "Quell": {"population": 96, "area": 12},
    "Marrow": {"population": 1250, "area": 77}, "Tessary": {"population": 58, "area": 9},
    "Vintal": {"population": 730, "area": 41}, "Oskerby": {"population": 204, "area": 26},
    "Pellin": {"population": 881, "area": 53}, "Draxa": {"population": 37, "area": 5},
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression on whole numbers.

    Args:
        expression: the expression, with + - * and parentheses, e.g. (17 + 3) * 4
    """
    if not set(expression) <= set("0123456789+-*() ") or "**" in expression:
        raise ValueError("use whole numbers, + - * and parentheses")
    return str(eval(expression))


def lookup(place: str, fact: str) -> str:
    """Look up a fact about a place.

    Args:
        place: the place's name, e.g. Zorbia
        fact: population or area
    """
    return str(PLACES[place.strip()][fact.strip()])


def reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the final answer is the gold number, else 0.0."""
    return [float(c[-1]["content"].strip() == str(a)) for c, a in zip(completions, answer, strict=True)]
