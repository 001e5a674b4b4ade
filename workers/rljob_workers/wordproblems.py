"""Arithmetic word problems in GSM8K's format, generated locally (no download).

Each row is ``{"question": ..., "answer": "<working>\\n#### <number>"}``, as GSM8K's are, plus a
``level`` column: ``0`` the count is stated in the question (reading it off is the skill),
``1`` one operation on small numbers, ``2`` two operations. The numbers stay small (results
0-9 below level 2) so the tiny CPU model of the example can learn some of them; the format and
the reward path are those of the real dataset, so the same job runs on GSM8K by changing the
dataset path. The example mixes levels 0 and 1.

``python -m rljob_workers.wordproblems OUT.jsonl|OUT.parquet [--rows N] [--seed S]
[--levels 0,1]``
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["generate_problems", "main", "write_problems"]

NAMES = ("Tom", "Ann", "Sam", "Mia", "Ben", "Eva", "Max", "Zoe", "Leo", "Ivy")
ITEMS = ("apples", "pens", "books", "coins", "cards", "shells", "stickers", "marbles")

Problem = Callable[[random.Random], tuple[str, str, int]]


def _stated(rng: random.Random) -> tuple[str, str, int]:
    a = rng.randint(0, 9)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    question = f"{name} puts {a} {item} in a box. How many {item} are in the box?"
    return question, f"The box holds the {a} {item} {name} put in.", a


def _add(rng: random.Random) -> tuple[str, str, int]:
    a = rng.randint(1, 5)
    b = rng.randint(1, 9 - a)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    question = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have?"
    return question, f"{name} has {a} + {b} = {a + b} {item}.", a + b


def _subtract(rng: random.Random) -> tuple[str, str, int]:
    a = rng.randint(2, 9)
    b = rng.randint(1, a - 1)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    question = f"{name} has {a} {item} and gives away {b}. How many {item} are left?"
    return question, f"{name} has {a} - {b} = {a - b} {item} left.", a - b


def _times(rng: random.Random) -> tuple[str, str, int]:
    a = rng.randint(1, 3)
    b = rng.randint(1, 9 // a)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    question = f"{name} buys {a} bags with {b} {item} in each. How many {item} is that?"
    return question, f"{name} has {a} * {b} = {a * b} {item}.", a * b


def _two_steps(rng: random.Random) -> tuple[str, str, int]:
    a = rng.randint(2, 9)
    b = rng.randint(1, a - 1)
    c = rng.randint(1, 9)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    question = (
        f"{name} has {a} {item}, gives away {b}, then finds {c} more. How many {item} does "
        f"{name} have?"
    )
    working = f"{a} - {b} = {a - b}. {a - b} + {c} = {a - b + c}."
    return question, working, a - b + c


LEVELS: dict[int, tuple[Problem, ...]] = {
    0: (_stated,),
    1: (_add, _subtract, _times),
    2: (_two_steps,),
}
EXAMPLE_LEVELS = (0, 1)


def generate_problems(
    rows: int, *, seed: int = 0, levels: tuple[int, ...] = EXAMPLE_LEVELS
) -> list[dict[str, Any]]:
    """``rows`` problems, their levels drawn evenly from ``levels``; the same for the same
    seed."""
    unknown = sorted(set(levels) - set(LEVELS))
    if unknown or not levels:
        raise ValueError(f"levels: {unknown or '()'} not among {sorted(LEVELS)}")
    rng = random.Random(f"wordproblems:{seed}:{','.join(map(str, levels))}")
    out = []
    for _ in range(rows):
        level = rng.choice(levels)
        question, working, result = rng.choice(LEVELS[level])(rng)
        out.append({"question": question, "answer": f"{working}\n#### {result}", "level": level})
    return out


def write_problems(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """Write rows as JSONL, or parquet when the path ends in ``.parquet``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), out)
    else:
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("out", type=Path, help="the file: .jsonl or .parquet")
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--levels", default=",".join(map(str, EXAMPLE_LEVELS)), help="e.g. 0,1 or 2"
    )
    args = parser.parse_args(argv)
    levels = tuple(int(x) for x in args.levels.split(","))
    path = write_problems(args.out, generate_problems(args.rows, seed=args.seed, levels=levels))
    print(f"{path}: {args.rows} problems (levels {args.levels}, seed {args.seed})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
