"""The prompts a job trains on, and scoring them: built-in toy tasks, datasets, chat templates.

Built-in tasks (every answer is one digit, so a random tiny model hits it with chance ≈ 1/vocab
on the first token and RL has a non-zero signal to climb from):

* ``copy``      — ``"copy:7="`` → ``"7"`` (the default: the easiest to learn, tens of steps on CPU)
* ``successor`` — ``"next:7="`` → ``"8"`` (mod 10, so ``"next:9="`` → ``"0"``)
* ``add-mod10`` — ``"3+4="`` → ``"7"`` (``"8+5="`` → ``"3"``)

A dataset is a JSONL, JSON or parquet file of rows (``datasets.py``: ``spec.task.dataset``, or
the older ``datasetPath``: JSONL of ``{"prompt", "answer"}``). With ``chatTemplate: auto`` a
row's prompt (or its chat messages, after an optional system prompt) goes through the
tokenizer's chat template with the generation prompt added, and the engines get those token ids:
what the trainer learns from are the engine's own prompt and response ids, never re-tokenised
text. Rewards are ``rewards.py``'s.

Both topologies draw their prompts and score their samples here: ``load_task_data`` (prompts,
answers, the rows' other columns and the reward of a job), ``PromptSampler`` (the
checkpointable, reshuffled walk over them) and ``score_groups`` (task reward, DAPO overlong
shaping, and the groups a non-finite or failed reward disqualifies).
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rljob_workers.config import DatasetConfig
from rljob_workers.datasets import DatasetError, Row, load_rows
from rljob_workers.rewards import (  # re-exported: where they were before rewards.py
    PARTIAL_CREDIT,
    REWARD_FAILURE_REASONS,
    REWARD_FUNCTIONS,
    Reward,
    RewardScorer,
    build_reward,
    exact_match_reward,
    load_reward_function,
    normalise_response,
)

if TYPE_CHECKING:
    from rljob_workers.config import OverlongConfig, TaskConfig

__all__ = [
    "PARTIAL_CREDIT",
    "REWARD_FAILURE_REASONS",
    "REWARD_FUNCTIONS",
    "TASKS",
    "DatasetError",
    "GroupScores",
    "PromptSampler",
    "RewardScorer",
    "TaskData",
    "TaskExample",
    "chat_messages",
    "exact_match_reward",
    "format_prompts",
    "generate_examples",
    "load_eval_data",
    "load_examples",
    "load_reward_function",
    "load_task_data",
    "mix_seed",
    "normalise_response",
    "score_groups",
]

log = logging.getLogger(__name__)


DEFAULT_TASK = "copy"


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


# ------------------------------------------------------------------ a job's data and sampling


@dataclass(frozen=True)
class TaskData:
    """The prompts to train on (text, or chat-templated token ids: what the engines get), their
    reference answers, the reward, and per prompt its row's other columns and its text."""

    prompts: Sequence[str | list[int]]
    answers: Sequence[str]
    reward: Reward | Callable[[str, str], float]
    extras: Sequence[Mapping[str, Any]] = ()
    prompt_texts: Sequence[str] = ()

    def extras_of(self, indices: Sequence[int]) -> list[Mapping[str, Any]]:
        return [self.extras[i] if self.extras else {} for i in indices]

    def texts_of(self, indices: Sequence[int]) -> list[str]:
        """The prompts as text (a templated prompt's rendering), for rewards and displays."""
        out = []
        for i in indices:
            if self.prompt_texts:
                out.append(self.prompt_texts[i])
            else:
                prompt = self.prompts[i]
                out.append(prompt if isinstance(prompt, str) else "")
        return out


def load_task_data(task: TaskConfig, *, tokenizer_path: str | None = None) -> TaskData:
    """Prompts, answers, extras and reward of the job's task: a built-in toy task, or a
    dataset (``task.dataset``, or the older ``datasetPath`` JSONL); ``tokenizer_path`` is the
    tokenizer whose chat template ``chatTemplate: auto`` applies.

    Raises ``DatasetError`` naming the field, the file and the fix."""
    if task.dataset is not None or task.dataset_path is not None:
        dataset = task.dataset or DatasetConfig(path=str(task.dataset_path), format="jsonl")
        rows = load_rows(dataset)
    elif task.builtin is not None:
        rows = [
            Row(prompt=e.prompt, answer=e.answer)
            for e in generate_examples(task.builtin, task.num_prompts, seed=task.task_seed)
        ]
    else:
        raise DatasetError("spec.task: set builtin (a toy task) or dataset")
    prompts, texts = format_prompts(
        rows, task.chat_template, task.system_prompt, tokenizer_path=tokenizer_path
    )
    return TaskData(
        prompts=prompts,
        answers=[r.answer for r in rows],
        reward=build_reward(task),
        extras=[r.extra for r in rows],
        prompt_texts=texts,
    )


def load_eval_data(task: TaskConfig, *, tokenizer_path: str | None = None) -> TaskData | None:
    """The held-out rows of ``task.eval``, formatted and scored as the training prompts are
    (None without ``task.eval``)."""
    if task.eval is None:
        return None
    held_out = task.model_copy(
        update={"dataset": task.eval.dataset, "dataset_path": None, "builtin": None}
    )
    try:
        return load_task_data(held_out, tokenizer_path=tokenizer_path)
    except DatasetError as err:  # name the eval dataset's fields, not the training one's
        raise DatasetError(str(err).replace("spec.task.dataset", "spec.task.eval.dataset")) from err


def format_prompts(
    rows: Sequence[Row],
    chat_template: str,
    system_prompt: str | None,
    *,
    tokenizer_path: str | None,
) -> tuple[list[str | list[int]], list[str]]:
    """What the engines get for each row, and its text.

    ``none``: the prompt text (after the system prompt and a blank line, if one is set); a row
    of chat messages needs a template. ``auto``: the token ids of the tokenizer's chat template
    over the messages (the system prompt first, unless the row has its own), with the generation
    prompt added: exactly ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``.
    """
    if chat_template == "none":
        out: list[str | list[int]] = []
        for index, row in enumerate(rows):
            if not isinstance(row.prompt, str):
                raise DatasetError(
                    f"spec.task.chatTemplate: row {index} is a chat (messagesField) and "
                    "chatTemplate is none; set chatTemplate: auto"
                )
            out.append(f"{system_prompt}\n\n{row.prompt}" if system_prompt else row.prompt)
        return out, [str(p) for p in out]
    tokenizer = _chat_tokenizer(tokenizer_path)
    ids: list[str | list[int]] = []
    texts: list[str] = []
    for row in rows:
        messages = chat_messages(row.prompt, system_prompt)
        ids.append(
            [
                int(i)
                for i in tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            ]
        )
        texts.append(
            str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        )
    return ids, texts


def chat_messages(
    prompt: str | Sequence[Mapping[str, str]], system_prompt: str | None
) -> list[dict[str, str]]:
    """A row's prompt as chat messages: the system prompt (unless the row has its own system
    message), then the row's messages, or one user message with its text."""
    messages = (
        [{"role": "user", "content": prompt}]
        if isinstance(prompt, str)
        else [dict(m) for m in prompt]
    )
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _chat_tokenizer(tokenizer_path: str | None) -> Any:
    if tokenizer_path is None:
        raise DatasetError("spec.task.chatTemplate: auto needs the model's tokenizer")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    if not getattr(tokenizer, "chat_template", None):
        raise DatasetError(
            f"spec.task.chatTemplate: auto, but the tokenizer at {tokenizer_path} has no chat "
            "template; set chatTemplate: none for a base model, or use an instruct model's "
            "tokenizer (spec.model.tokenizerPath)"
        )
    return tokenizer


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


def score_groups(
    reward: Callable[..., list[float]],
    texts: Sequence[str],
    answers: Sequence[str],
    lengths: Sequence[int],
    *,
    n: int,
    overlong: OverlongConfig,
    extras: Sequence[Mapping[str, Any]] | None = None,
    prompts: Sequence[str] | None = None,
) -> GroupScores:
    """Score samples laid out as contiguous groups of ``n`` (one answer per sample);
    ``reward`` scores a batch (a ``RewardScorer``: the rows' extras and prompt texts too)."""
    if extras is None and prompts is None:
        scored = reward(texts, answers)
    else:
        scored = reward(texts, answers, extras, prompts)
    rewards = [float(r) for r in scored]
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
