"""Write the example's questions, held-out questions and demonstrations (deterministic)."""

import json
import random

from tools import PLACES, calculator, lookup


def question(rng: random.Random) -> tuple[str, list[dict], str]:
    """A question, the tool steps that answer it, and its answer."""
    place, fact = rng.choice(sorted(PLACES)), rng.choice(["population", "area"])
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    kind = rng.choice(["calc", "lookup", "both"])
    if kind == "calc":
        expr = f"{a} * {b}" if rng.random() < 0.5 else f"{a} + {b} * {rng.randint(2, 9)}"
        return f"What is {expr}?", [{"tool": "calculator", "arguments": {"expression": expr}}], calculator(expr)
    look = {"tool": "lookup", "arguments": {"place": place, "fact": fact}}
    if kind == "lookup":
        return f"What is the {fact} of {place}?", [look], lookup(place, fact)
    expr = f"{lookup(place, fact)} * {a}"
    steps = [look, {"tool": "calculator", "arguments": {"expression": expr}}]
    return f"What is {a} times the {fact} of {place}?", steps, calculator(expr)


def write(path: str, n: int, seed: int, demos: bool = False) -> None:
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for i in range(n):
            q, steps, answer = question(rng)
            row = {"id": f"{path.split('.')[0]}-{i}", "question": q, "answer": answer}
            if demos:
                row["steps"] = [*steps, {"answer": answer}]
            fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    write("questions.jsonl", 48, seed=0)
    write("eval.jsonl", 24, seed=1)
    write("demos.jsonl", 48, seed=2, demos=True)
