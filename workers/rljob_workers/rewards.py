"""Rewards: weighted terms a response is scored by, and the scorer that runs them.

``spec.task.reward.terms`` is a list of weighted terms, summed (``build_reward``):

- ``math``: the response's final answer (the last ``\\boxed{...}``, else what follows the last
  ``####``, else the last ``<answer>...</answer>``) verified against the reference with
  ``math-verify`` (fractions, LaTeX, equivalent forms); a GSM8K reference ``... #### 42`` counts
  by what follows ``####``. Nothing to extract scores 0.
- ``exact``: the response, trimmed, equals the answer.
- ``regex``: ``pattern`` extracts the answer from the response (its first group, else the whole
  match), compared with the reference.
- ``format``: the response holds its answer in ``<tag>...</tag>`` (default ``answer``), or
  matches ``pattern`` as a whole.
- ``code``: the response's program runs against the row's unit tests in a sandbox
  (``sandbox.py``): a wall-clock and a memory limit, no network, a scratch directory removed
  afterwards. 1 when every test passes.
- ``http``: a verifier or reward-model service scores batches (``HttpReward``).
- ``function``: ``module:function`` called as ``function(response, answer, **extra)`` with the
  row's other columns the function names (all of them if it takes ``**kwargs``).

Without terms the reward is ``spec.task.reward.function`` ``(response, answer) -> float``, else
the built-in exact match with partial credit for the toy tasks.

``RewardScorer`` scores a batch off the generation thread: per-sample terms of all samples run
concurrently, each sample with a wall-clock limit; batched terms (``http``) run beside them. A
term that raises, returns a non-number or runs past the limit makes its sample *failed*: scored
``failure_value`` (None: NaN, and its group is left out of the step), counted by reason, never
fatal to the worker.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import math
import queue
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rljob_workers.config import RewardTermConfig, TaskConfig

__all__ = [
    "REWARD_FAILURE_REASONS",
    "REWARD_FUNCTIONS",
    "HttpReward",
    "RewardScorer",
    "Sample",
    "build_reward",
    "exact_match_reward",
    "extract_final_answer",
    "load_reward_function",
    "math_reward",
    "normalise_response",
]

log = logging.getLogger(__name__)

RewardFunction = Callable[[str, str], float]
PARTIAL_CREDIT = 0.1
_STRIPPED_TOKENS = ("</s>", "<pad>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>")
REWARD_FAILURE_REASONS = ("timeout", "error")
"""Why a sample's reward failed: a term ran past ``task.reward.timeoutSeconds`` or raised."""


@dataclass(frozen=True)
class Sample:
    """What a reward term sees: the response text, the reference answer, the prompt as text and
    the row's other columns."""

    response: str
    answer: str
    prompt: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- text helpers


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

    The response is compared after ``normalise_response`` (trailing end markers and surrounding
    whitespace removed). The 0.1 partial credit rewards a response that starts with the
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


def load_reward_function(path: str) -> Callable[..., Any]:
    """Resolve a function from a built-in name or an import path ``"module:function"``.

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
    function: Any = module
    for part in attribute.split("."):
        if not hasattr(function, part):
            raise ValueError(
                f"reward function {path!r}: module {module_name!r} has no attribute {attribute!r}"
            )
        function = getattr(function, part)
    if not callable(function):
        raise ValueError(f"reward function {path!r}: {attribute!r} is not callable")
    return function  # type: ignore[no-any-return]


_BOXED = "\\boxed"


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind(_BOXED)
    while start != -1:
        i = start + len(_BOXED)
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j].strip()
                j += 1
        start = text.rfind(_BOXED, 0, start)
    return None


_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_UNCLOSED = re.compile(r"<answer>([^<]*)$")


def extract_final_answer(text: str) -> str | None:
    """A response's final answer: the last ``\\boxed{}``, else what follows the last ``####``
    (GSM8K's form), else the last ``<answer>...</answer>`` (or an ``<answer>`` the response
    ended in); None when it states none."""
    boxed = _last_boxed(text)
    if boxed:
        return boxed
    if "####" in text:
        tail = normalise_response(text.rsplit("####", 1)[1]).strip()
        first_line = tail.splitlines()[0].strip() if tail else ""
        if first_line:
            return first_line
    tagged = _TAGGED.findall(text)
    if tagged and tagged[-1].strip():
        return str(tagged[-1]).strip()
    unclosed = _UNCLOSED.search(normalise_response(text))
    if unclosed and unclosed.group(1).strip():  # the response ended inside its answer tag
        return unclosed.group(1).strip()
    return None


def _reference(answer: str) -> str:
    """The reference's final answer: after ``####`` for a GSM8K answer, else the answer."""
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip()
    boxed = _last_boxed(answer)
    return boxed if boxed else answer.strip()


def _plain_number(text: str) -> float | None:
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        return float(cleaned)
    except ValueError:
        return None


def math_reward(response: str, answer: str) -> float:
    """1.0 when the response's final answer equals the reference mathematically, else 0.0
    (``math-verify``: numbers, fractions, LaTeX, sets, equivalent expressions)."""
    predicted = extract_final_answer(response)
    if predicted is None:
        return 0.0
    gold = _reference(answer)
    a, b = _plain_number(predicted), _plain_number(gold)
    if a is not None and b is not None:  # the common case, and no parser needed
        return 1.0 if math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9) else 0.0
    from math_verify import parse, verify  # type: ignore[import-untyped, unused-ignore]

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its timeout notice, per call

    # math-verify times itself out with signals, which only the main thread may set: the
    # scorer's threads run it without (the scorer's own limit holds instead)
    parsed_gold = parse(f"${gold}$", parsing_timeout=None)
    parsed = parse(f"${predicted}$", parsing_timeout=None)
    if not parsed_gold or not parsed:
        return 0.0
    return 1.0 if verify(parsed_gold, parsed, timeout_seconds=None) else 0.0


# --------------------------------------------------------------------------- terms


class Term(Protocol):
    """A per-sample term: ``(sample) -> float``."""

    def __call__(self, sample: Sample) -> float: ...


def _exact(sample: Sample) -> float:
    return 1.0 if normalise_response(sample.response) == sample.answer.strip() else 0.0


def _math(sample: Sample) -> float:
    return math_reward(sample.response, sample.answer)


def _regex(pattern: str) -> Term:
    compiled = re.compile(pattern, re.DOTALL)

    def term(sample: Sample) -> float:
        found = compiled.search(sample.response)
        if found is None:
            return 0.0
        got = found.group(1) if compiled.groups else found.group(0)
        return 1.0 if (got or "").strip() == sample.answer.strip() else 0.0

    return term


def _format(tag: str | None, pattern: str | None) -> Term:
    if pattern is not None:
        whole = re.compile(pattern, re.DOTALL)
        return lambda sample: 1.0 if whole.fullmatch(normalise_response(sample.response)) else 0.0
    name = re.escape(tag or "answer")
    tagged = re.compile(rf"<{name}>(.*?)</{name}>", re.DOTALL)

    def term(sample: Sample) -> float:
        found = tagged.findall(sample.response)
        return 1.0 if len(found) == 1 and found[0].strip() else 0.0

    return term


def _function(path: str) -> Term:
    function = load_reward_function(path)
    parameters = inspect.signature(function).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    named = {n for n, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    named |= set(list(parameters)[2:])  # positional-or-keyword parameters after the first two

    def term(sample: Sample) -> float:
        extra = {k: v for k, v in sample.extra.items() if takes_all or k in named}
        return float(function(sample.response, sample.answer, **extra))

    return term


def _code(config: RewardTermConfig) -> Term:
    from rljob_workers.sandbox import run_tests

    def term(sample: Sample) -> float:
        tests = sample.extra.get(config.tests_field)
        if not isinstance(tests, str | list) or not tests:
            raise ValueError(
                f"reward term code: the row has no {config.tests_field!r} column of tests "
                "(spec.task.reward.terms[].testsField)"
            )
        source = tests if isinstance(tests, str) else "\n".join(map(str, tests))
        result = run_tests(
            extract_code(sample.response),
            source,
            timeout_s=config.timeout_s,
            memory_mib=config.memory_mib,
        )
        return 1.0 if result.passed else 0.0

    return term


_FENCED = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str:
    """The program in a response: its last fenced code block, else the whole response."""
    blocks = _FENCED.findall(response)
    return str(blocks[-1]) if blocks else normalise_response(response)


# --------------------------------------------------------------------------- the http term


class HttpReward:
    """A reward or verifier service: ``POST url`` with ``{"samples": [{"prompt", "response",
    "answer", "extra"}, ...]}``, answered ``{"rewards": [float, ...]}`` in the same order.

    Batches of ``batch_size``, at most ``concurrency`` requests in flight (one limit for the
    whole worker), ``timeout_s`` per request, ``retries`` more attempts on a connection error, a
    5xx or a timeout (with a short backoff). A batch that still fails, or an answer that is not
    one finite number per sample, fails its samples.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 10.0,
        retries: int = 2,
        concurrency: int = 4,
        batch_size: int = 32,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.retries = retries
        self.batch_size = max(1, batch_size)
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self._pool = ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="http-reward")

    def score_batch(self, samples: Sequence[Sample]) -> list[float | BaseException]:
        """One reward per sample, or the exception that failed its batch."""
        chunks = [
            list(samples[i : i + self.batch_size]) for i in range(0, len(samples), self.batch_size)
        ]
        out: list[float | BaseException] = []
        for chunk, future in [(c, self._pool.submit(self._post, c)) for c in chunks]:
            try:
                out += future.result()
            except Exception as exc:  # the service's failure fails these samples
                out += [exc] * len(chunk)
        return out

    def _post(self, samples: Sequence[Sample]) -> list[float]:
        body = json.dumps(
            {
                "samples": [
                    {
                        "prompt": s.prompt,
                        "response": s.response,
                        "answer": s.answer,
                        "extra": _jsonable(s.extra),
                    }
                    for s in samples
                ]
            }
        ).encode()
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(2.0, 0.2 * 2**attempt))
            request = urllib.request.Request(self.url, data=body, headers=self.headers)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    answer = json.loads(response.read().decode())
            except urllib.error.HTTPError as err:
                last = RuntimeError(f"reward service {self.url}: HTTP {err.code}")
                if err.code < 500:
                    break  # the request is wrong: retrying sends the same
                continue
            except (urllib.error.URLError, TimeoutError, OSError) as err:
                last = RuntimeError(f"reward service {self.url}: {err}")
                continue
            except ValueError as err:
                raise RuntimeError(f"reward service {self.url}: the answer is not JSON") from err
            return _rewards_of(answer, len(samples), self.url)
        raise last or RuntimeError(f"reward service {self.url}: no answer")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _jsonable(extra: Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(dict(extra), default=str))  # type: ignore[no-any-return]


def _rewards_of(answer: Any, count: int, url: str) -> list[float]:
    rewards = answer.get("rewards") if isinstance(answer, dict) else None
    if (
        not isinstance(rewards, list)
        or len(rewards) != count
        or not all(
            isinstance(r, int | float) and not isinstance(r, bool) and math.isfinite(r)
            for r in rewards
        )
    ):
        raise RuntimeError(
            f'reward service {url}: expected {{"rewards": [{count} finite numbers]}}, got '
            f"{str(answer)[:120]}"
        )
    return [float(r) for r in rewards]


# --------------------------------------------------------------------------- the reward


@dataclass
class Reward:
    """The weighted terms of a job's reward: per-sample ones and batched (http) ones."""

    per_sample: list[tuple[float, Term]]
    batched: list[tuple[float, HttpReward]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    """The terms' names, per-sample ones first (``math``, ``format``, ``format_2``, ...)."""

    def components(self, sample: Sample) -> list[float]:
        """Each per-sample term's value (unweighted)."""
        return [float(term(sample)) for _, term in self.per_sample]

    def score_one(self, sample: Sample) -> float:
        return self.weigh(self.components(sample))

    def weigh(self, components: Sequence[float]) -> float:
        return sum(w * c for (w, _), c in zip(self.per_sample, components, strict=True))

    def close(self) -> None:
        for _, term in self.batched:
            term.close()


def legacy_reward(function: Callable[[str, str], float]) -> Reward:
    """A ``(response, answer) -> float`` function as the whole reward."""
    return Reward([(1.0, lambda s: float(function(s.response, s.answer)))], names=["task"])


def build_reward(task: TaskConfig) -> Reward:
    """The job's reward from ``task.reward_terms`` (else its function, else exact match)."""
    if not task.reward_terms:
        function = (
            exact_match_reward
            if task.reward_function is None
            else load_reward_function(task.reward_function)
        )
        return legacy_reward(function)
    reward = Reward([])
    batched_names: list[str] = []
    taken: dict[str, int] = {}

    def name_of(kind: str) -> str:
        taken[kind] = taken.get(kind, 0) + 1
        return kind if taken[kind] == 1 else f"{kind}_{taken[kind]}"

    for term in task.reward_terms:
        if term.type == "http":
            assert term.url is not None
            reward.batched.append(
                (
                    term.weight,
                    HttpReward(
                        term.url,
                        timeout_s=term.timeout_s,
                        retries=term.retries,
                        concurrency=term.concurrency,
                        batch_size=term.batch_size,
                    ),
                )
            )
            batched_names.append(name_of("http"))
            continue
        built: Term
        if term.type == "math":
            built = _math
        elif term.type == "exact":
            built = _exact
        elif term.type == "regex":
            assert term.pattern is not None
            built = _regex(term.pattern)
        elif term.type == "format":
            built = _format(term.tag, term.pattern)
        elif term.type == "code":
            built = _code(term)
        else:
            assert term.function is not None
            built = _function(term.function)
        reward.per_sample.append((term.weight, built))
        reward.names.append(name_of(term.type))
    reward.names += batched_names
    return reward


# --------------------------------------------------------------------------- the scorer


class RewardScorer:
    """Scores batches off the generation thread: per-sample terms on ``workers`` daemon
    threads, each sample with a wall-clock limit counted from when it starts; batched terms
    beside them.

    A sample whose term raises, returns a non-number or runs past ``timeout_s`` is failed:
    ``failure_value`` (None: NaN) and counted in ``failures`` (``timeout`` / ``error``). A
    Python thread cannot be killed, so a call past its limit is abandoned to finish in the
    background (a daemon: it never holds the process at exit) and a fresh thread takes its
    place: a hung reward costs the batch its limit once, never the worker its capacity.
    """

    def __init__(
        self,
        reward: Reward | Callable[[str, str], float],
        *,
        timeout_s: float,
        workers: int = 4,
        failure_value: float | None = None,
    ) -> None:
        self.reward = reward  # the setter wraps a function
        self.timeout_s = timeout_s
        self.workers = max(1, workers)
        self.failure_value = failure_value
        self.failures: dict[str, int] = dict.fromkeys(REWARD_FAILURE_REASONS, 0)
        self._term_sums: dict[str, list[float]] = {}

    @property
    def reward(self) -> Reward:
        """The reward scored (setting a ``(response, answer)`` function wraps it)."""
        return self._reward

    @reward.setter
    def reward(self, reward: Reward | Callable[[str, str], float]) -> None:
        self._reward = reward if isinstance(reward, Reward) else legacy_reward(reward)

    def take_terms(self) -> dict[str, float]:
        """Each term's mean value (unweighted) over the samples scored since the last call
        (failed samples left out), as record keys ``reward_<term>``; resets."""
        sums, self._term_sums = self._term_sums, {}
        return {f"reward_{name}": total / count for name, (total, count) in sums.items() if count}

    def _count_term(self, name: str, value: float) -> None:
        if not math.isfinite(value):
            return
        total = self._term_sums.setdefault(name, [0.0, 0.0])
        total[0] += value
        total[1] += 1

    @property
    def failed(self) -> float:
        return math.nan if self.failure_value is None else self.failure_value

    def __call__(
        self,
        texts: Sequence[str],
        answers: Sequence[str],
        extras: Sequence[Mapping[str, Any]] | None = None,
        prompts: Sequence[str] | None = None,
        *,
        count_terms: bool = True,
    ) -> list[float]:
        """One reward per (text, answer); ``failure_value`` (NaN) for a failed sample.
        ``count_terms``: add the terms' values to what ``take_terms`` reports (not for an
        evaluation)."""
        if len(texts) != len(answers):
            raise ValueError(f"{len(texts)} responses for {len(answers)} answers")
        samples = [
            Sample(
                response=text,
                answer=answer,
                prompt=prompts[i] if prompts is not None else "",
                extra=extras[i] if extras is not None else {},
            )
            for i, (text, answer) in enumerate(zip(texts, answers, strict=True))
        ]
        batched: dict[int, list[float | BaseException]] = {}
        threads = []
        for index, (_, term) in enumerate(self.reward.batched):

            def run(index: int = index, term: HttpReward = term) -> None:
                batched[index] = term.score_batch(samples)

            thread = threading.Thread(target=run, name="reward-batch", daemon=True)
            thread.start()
            threads.append(thread)
        scores, parts, failed = self._per_sample(samples)
        for thread in threads:
            thread.join()
        out = []
        per_sample_names = self.reward.names[: len(self.reward.per_sample)]
        batched_names = self.reward.names[len(self.reward.per_sample) :]
        for i, (score, components) in enumerate(zip(scores, parts, strict=True)):
            reason = failed.get(i)
            total = score
            values = list(components)
            for index, (weight, _) in enumerate(self.reward.batched):
                value = batched[index][i]
                if isinstance(value, BaseException):
                    reason = reason or "error"
                    log.warning("the reward service failed on sample %d: %s", i, value)
                else:
                    total += weight * value
                    values.append(value)
            if reason is not None:
                self.failures[reason] += 1
                out.append(self.failed)
                continue
            out.append(total)
            if count_terms:
                for name, value in zip([*per_sample_names, *batched_names], values, strict=False):
                    self._count_term(name, value)
        return out

    def _per_sample(
        self, samples: list[Sample]
    ) -> tuple[list[float], list[list[float]], dict[int, str]]:
        """Per-sample terms of every sample, concurrently: scores, each term's value, and the
        failure reasons."""
        if not self.reward.per_sample:
            return [0.0] * len(samples), [[] for _ in samples], {}
        todo: queue.SimpleQueue[int] = queue.SimpleQueue()
        for index in range(len(samples)):
            todo.put(index)
        state = threading.Condition()
        started: dict[int, float] = {}
        results: dict[int, list[float] | BaseException] = {}
        given_up: set[int] = set()

        def work() -> None:
            while True:
                try:
                    index = todo.get_nowait()
                except queue.Empty:
                    return
                with state:
                    started[index] = time.monotonic()
                outcome: list[float] | BaseException
                try:
                    outcome = self.reward.components(samples[index])
                except Exception as exc:  # a user's reward function: anything can go wrong
                    outcome = exc
                with state:
                    if index in given_up:
                        return  # timed out meanwhile: a replacement thread took over
                    results[index] = outcome
                    state.notify_all()

        def spawn() -> None:
            threading.Thread(target=work, name="reward", daemon=True).start()

        for _ in range(min(self.workers, len(samples))):
            spawn()
        with state:
            while len(results) + len(given_up) < len(samples):
                now = time.monotonic()
                for index, began in started.items():
                    if index in results or index in given_up or now - began <= self.timeout_s:
                        continue
                    given_up.add(index)
                    log.warning(
                        "the reward ran past task.reward.timeoutSeconds (%.3g s) on sample %d",
                        self.timeout_s,
                        index,
                    )
                    spawn()
                state.wait(timeout=min(0.05, self.timeout_s))
        scores = [0.0] * len(samples)
        parts: list[list[float]] = [[] for _ in samples]
        failed = dict.fromkeys(given_up, "timeout")
        for index, outcome in results.items():
            if isinstance(outcome, BaseException):
                failed[index] = "error"
                log.warning("the reward failed on sample %d: %r", index, outcome)
            else:  # a NaN stays NaN: its group is left out, as before
                scores[index] = self.reward.weigh(outcome)
                parts[index] = outcome
        return scores, parts, failed

    def close(self) -> None:
        self.reward.close()
