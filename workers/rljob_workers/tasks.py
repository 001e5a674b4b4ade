"""Verifiable toy tasks generated locally, and the reward functions that score them.

Built-in tasks (every answer is one digit, so a random tiny model hits it with chance ≈ 1/vocab
on the first token and RL has a non-zero signal to climb from):

* ``copy``      — ``"copy:7="`` → ``"7"`` (the default: the easiest to learn, tens of steps on CPU)
* ``successor`` — ``"next:7="`` → ``"8"`` (mod 10, so ``"next:9="`` → ``"0"``)
* ``add-mod10`` — ``"3+4="`` → ``"7"`` (``"8+5="`` → ``"3"``)

A dataset can also come from a JSONL file with one ``{"prompt": ..., "answer": ...}`` per line.
Rewards are plain functions ``(response_text, answer) -> float``; the default is
``exact_match_reward``, another can be plugged in by import path ``"package.module:function"``.

Both topologies draw their prompts and score their samples here: ``load_task_data`` (prompts,
answers and reward of a job), ``PromptSampler`` (the checkpointable, reshuffled walk over them)
and ``score_groups`` (task reward, DAPO overlong shaping, and the groups a non-finite reward
disqualifies). ``RewardScorer`` calls the reward function for a batch concurrently, off the
generation thread, each call with a time limit: a call that raises or runs past it scores NaN
(its group is left out, as any non-finite reward's) and is counted by reason, never fatal.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rljob_workers.config import OverlongConfig, TaskConfig

log = logging.getLogger(__name__)

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


# ------------------------------------------------------------------ a job's data and sampling


@dataclass(frozen=True)
class TaskData:
    """The prompts to train on, their reference answers and the reward function."""

    prompts: Sequence[str]
    answers: Sequence[str]
    reward: RewardFunction


def load_task_data(task: TaskConfig) -> TaskData:
    """Prompts, answers and reward of the job's task (built-in toy task or JSONL dataset)."""
    source = task.dataset_path if task.dataset_path is not None else task.builtin
    if source is None:
        raise ValueError("spec.task: set builtin (a toy task) or datasetPath")
    examples = load_examples(source, task.num_prompts, seed=task.task_seed)
    reward = (
        exact_match_reward
        if task.reward_function is None
        else load_reward_function(task.reward_function)
    )
    return TaskData(
        prompts=[e.prompt for e in examples], answers=[e.answer for e in examples], reward=reward
    )


def mix_seed(*parts: int) -> int:
    """A deterministic 31-bit seed from integers (e.g. ``(seed, step, rank)``)."""
    value = 0x9E3779B1
    for part in parts:
        value = (value * 1_000_003 + part + 0x7F4A7C15) % (2**61 - 1)
    return value % (2**31 - 1)


class PromptSampler:
    """Endless, reshuffled-per-epoch walk over ``size`` prompts; its cursor is checkpointable."""

    def __init__(self, size: int, *, seed: int) -> None:
        if size < 1:
            raise ValueError("spec.task: the task has no prompts")
        self.size = size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        import torch

        generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch, 7919))
        return [int(i) for i in torch.randperm(self.size, generator=generator)]

    def next_indices(self, count: int) -> list[int]:
        """The next ``count`` prompt indices, crossing into a new shuffled epoch as needed."""
        taken: list[int] = []
        while len(taken) < count:
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(count - len(taken), self.size - self.position)
            taken.extend(self._order[self.position : self.position + take])
            self.position += take
        return taken

    def state_dict(self) -> dict[str, int]:
        """The cursor: ``{"epoch", "position"}``."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a cursor saved by ``state_dict``."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)


@dataclass(frozen=True)
class GroupScores:
    """Scores of ``len(rewards) // n`` contiguous groups of ``n`` samples.

    ``rewards`` are the task rewards, ``scores`` what the advantages see (rewards plus DAPO's
    overlong penalty), ``valid[g]`` whether group ``g`` may be trained on: a group with a NaN or
    infinite reward would turn every advantage of the step into NaN, so it is left out.
    """

    rewards: list[float]
    scores: list[float]
    valid: list[bool]

    @property
    def invalid_samples(self) -> int:
        """Samples in groups left out for a non-finite reward."""
        group = len(self.rewards) // max(1, len(self.valid))
        return group * sum(1 for ok in self.valid if not ok)


REWARD_FAILURE_REASONS = ("timeout", "error")
"""Why a reward call scored NaN: it ran past ``task.reward.timeoutSeconds`` or it raised."""


class RewardScorer:
    """Calls a reward function on a batch concurrently (``workers`` daemon threads), each call
    with a wall-clock limit counted from when it starts.

    A call that raises, returns a non-number or runs past ``timeout_s`` scores NaN and is
    counted in ``failures`` (``timeout`` / ``error``). A Python thread cannot be killed, so a
    call past its limit is abandoned to finish in the background (its thread is a daemon: it
    never holds the process at exit) and a fresh thread takes its place: a hung reward costs
    the batch its limit once, never the worker its scoring capacity.
    """

    def __init__(self, reward: RewardFunction, *, timeout_s: float, workers: int = 4) -> None:
        self.reward = reward
        self.timeout_s = timeout_s
        self.workers = max(1, workers)
        self.failures: dict[str, int] = dict.fromkeys(REWARD_FAILURE_REASONS, 0)

    def __call__(self, texts: Sequence[str], answers: Sequence[str]) -> list[float]:
        """One reward per (text, answer); NaN for a failed or timed-out call."""
        if len(texts) != len(answers):
            raise ValueError(f"{len(texts)} responses for {len(answers)} answers")
        todo = queue.SimpleQueue[int]()
        for index in range(len(texts)):
            todo.put(index)
        state = threading.Condition()
        started: dict[int, float] = {}
        results: dict[int, float | BaseException] = {}
        given_up: set[int] = set()

        def work() -> None:
            while True:
                try:
                    index = todo.get_nowait()
                except queue.Empty:
                    return
                with state:
                    started[index] = time.monotonic()
                outcome: float | BaseException
                try:
                    outcome = float(self.reward(texts[index], answers[index]))
                except Exception as exc:  # a user's reward function: anything can go wrong
                    outcome = exc
                with state:
                    if index in given_up:
                        return  # timed out meanwhile: a replacement thread took over
                    results[index] = outcome
                    state.notify_all()

        def spawn() -> None:
            threading.Thread(target=work, name="reward", daemon=True).start()

        for _ in range(min(self.workers, len(texts))):
            spawn()
        with state:
            while len(results) + len(given_up) < len(texts):
                now = time.monotonic()
                for index, began in started.items():
                    if index in results or index in given_up or now - began <= self.timeout_s:
                        continue
                    given_up.add(index)
                    self.failures["timeout"] += 1
                    log.warning(
                        "the reward function ran past task.reward.timeoutSeconds (%.3g s) on "
                        "sample %d: scored NaN",
                        self.timeout_s,
                        index,
                    )
                    spawn()
                state.wait(timeout=min(0.05, self.timeout_s))
        out = [math.nan] * len(texts)
        for index, outcome in results.items():
            if isinstance(outcome, BaseException):
                self.failures["error"] += 1
                log.warning("the reward function failed on sample %d: %r", index, outcome)
            else:
                out[index] = outcome
        return out


def score_groups(
    reward: Callable[[Sequence[str], Sequence[str]], list[float]],
    texts: Sequence[str],
    answers: Sequence[str],
    lengths: Sequence[int],
    *,
    n: int,
    overlong: OverlongConfig,
) -> GroupScores:
    """Score samples laid out as contiguous groups of ``n`` (one answer per sample);
    ``reward`` scores a batch (a ``RewardScorer``)."""
    rewards = [float(r) for r in reward(texts, answers)]
    scores = list(rewards)
    if overlong.enabled:
        import torch

        from rljob_workers.algos import overlong_reward_penalty

        penalty = overlong_reward_penalty(
            torch.tensor(list(lengths)),
            max_len=overlong.max_length,
            cache_len=overlong.cache_length,
        )
        scores = [r + float(p) for r, p in zip(rewards, penalty, strict=True)]
    valid = [all(math.isfinite(s) for s in scores[g : g + n]) for g in range(0, len(scores), n)]
    if not all(valid):
        log.warning(
            "the reward function returned a NaN or infinite value for %d group(s): left out",
            valid.count(False),
        )
    return GroupScores(rewards, scores, valid)
