"""Verifiable toy tasks generated locally, and the reward functions that score them.

Built-in tasks (every answer is one digit, so a random tiny model hits it with chance ≈ 1/vocab
on the first token and RL has a non-zero signal to climb from):

* ``copy``      — ``"copy:7="`` → ``"7"`` (the default: the easiest to learn, tens of steps on CPU)
* ``successor`` — ``"next:7="`` → ``"8"`` (mod 10, so ``"next:9="`` → ``"0"``)
* ``add-mod10`` — ``"3+4="`` → ``"7"`` (``"8+5="`` → ``"3"``)

A dataset can also come from a JSONL file with one ``{"prompt": ..., "answer": ...}`` per line.
Rewards are plain functions ``(response_text, answer) -> float``; the default is
``exact_match_reward``, another can be plugged in by import path ``"package.module:function"``.
"""

from __future__ import annotations

import importlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

RewardFunction = Callable[[str, str], float]

DEFAULT_TASK = "copy"
PARTIAL_CREDIT = 0.1
_STRIPPED_TOKENS = ("</s>", "<pad>")


@dataclass(frozen=True)
class TaskExample:
    """One prompt and the reference answer a verifier compares the response against."""

    prompt: str
    answer: str


def _copy_example(rng: random.Random) -> TaskExample:
    digit = rng.randrange(10)
    return TaskExample(prompt=f"copy:{digit}=", answer=str(digit))


def _successor_example(rng: random.Random) -> TaskExample:
    digit = rng.randrange(10)
    return TaskExample(prompt=f"next:{digit}=", answer=str((digit + 1) % 10))


def _add_mod10_example(rng: random.Random) -> TaskExample:
    left, right = rng.randrange(10), rng.randrange(10)
    return TaskExample(prompt=f"{left}+{right}=", answer=str((left + right) % 10))


TASKS: dict[str, Callable[[random.Random], TaskExample]] = {
    "copy": _copy_example,
    "successor": _successor_example,
    "add-mod10": _add_mod10_example,
}


def builtin_task_names() -> list[str]:
    """Names of the built-in tasks, sorted."""
    return sorted(TASKS)


def generate_examples(task: str, num_examples: int, *, seed: int) -> list[TaskExample]:
    """Draw ``num_examples`` examples of the built-in ``task``; the same seed gives the same list.

    Raises ``ValueError`` naming the known tasks when ``task`` is not one of them.
    """
    if task not in TASKS:
        raise ValueError(f"task: unknown built-in task {task!r}; choose one of {sorted(TASKS)}")
    if num_examples < 0:
        raise ValueError(f"num_examples: must be >= 0, got {num_examples}")
    rng = random.Random(f"{task}:{seed}")
    return [TASKS[task](rng) for _ in range(num_examples)]


def load_jsonl_examples(path: str | Path) -> list[TaskExample]:
    """Read ``{"prompt": str, "answer": str}`` objects, one per non-blank line of a JSONL file.

    Errors name the file, the line number and the offending field.
    """
    examples = []
    with Path(path).open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                examples.append(_parse_jsonl_line(line, f"{path}:{number}"))
    return examples


def _parse_jsonl_line(line: str, where: str) -> TaskExample:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error.msg})") from error
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object with 'prompt' and 'answer'")
    for field in ("prompt", "answer"):
        if not isinstance(record.get(field), str):
            raise ValueError(f"{where}: field {field!r} must be a string")
    return TaskExample(prompt=record["prompt"], answer=record["answer"])


def load_examples(source: str, num_examples: int, *, seed: int) -> list[TaskExample]:
    """Return examples from a built-in task name or a JSONL path.

    For a JSONL file, ``num_examples`` examples are drawn from the file with replacement using
    ``seed`` (``num_examples <= 0`` returns the whole file in order).
    """
    if source in TASKS:
        return generate_examples(source, num_examples, seed=seed)
    path = Path(source)
    if not path.is_file():
        raise ValueError(
            f"task: {source!r} is neither a built-in task {sorted(TASKS)} nor a JSONL file"
        )
    examples = load_jsonl_examples(path)
    if num_examples <= 0:
        return examples
    if not examples:
        raise ValueError(f"{path}: holds no examples")
    rng = random.Random(f"{path.name}:{seed}")
    return [rng.choice(examples) for _ in range(num_examples)]


def normalise_response(response_text: str) -> str:
    """Strip end-of-sequence / padding markers and surrounding whitespace from a response."""
    text = response_text.strip()
    stripped = True
    while stripped:
        stripped = False
        for token in _STRIPPED_TOKENS:
            if text.endswith(token):
                text = text.removesuffix(token).rstrip()
                stripped = True
    return text


def exact_match_reward(response_text: str, answer: str) -> float:
    """Score a response: 1.0 for an exact match, 0.1 for a right first character, else 0.0.

    The response is compared after ``normalise_response`` (trailing ``</s>``/``<pad>`` and
    surrounding whitespace removed). The 0.1 partial credit rewards a response that starts with the
    answer's first character but does not stop there (e.g. ``"77"`` or ``"7 ="`` for ``"7"``): a
    random tiny model almost never emits the answer *and then* end-of-sequence, so without it the
    first steps of RL would see no reward at all.
    """
    text = normalise_response(response_text)
    expected = answer.strip()
    if text == expected:
        return 1.0
    if text and expected and text[0] == expected[0]:
        return PARTIAL_CREDIT
    return 0.0


REWARD_FUNCTIONS: dict[str, RewardFunction] = {"exact-match": exact_match_reward}


def load_reward_function(path: str) -> RewardFunction:
    """Resolve a reward function from a built-in name or an import path ``"module:function"``.

    Raises ``ValueError`` whose message names the bad path and what is wrong with it.
    """
    if path in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[path]
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(
            f"reward function {path!r}: expected 'package.module:function' "
            f"or a built-in name {sorted(REWARD_FUNCTIONS)}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"reward function {path!r}: cannot import module {module_name!r} ({error})"
        ) from error
    function = module
    for part in attribute.split("."):
        if not hasattr(function, part):
            raise ValueError(
                f"reward function {path!r}: module {module_name!r} has no attribute {attribute!r}"
            )
        function = getattr(function, part)
    if not callable(function):
        raise ValueError(f"reward function {path!r}: {attribute!r} is not callable")
    reward: RewardFunction = function
    return reward
