"""Reward terms (issue 28 item 3): math, exact, regex, format, function, http, and their sum.

Aspects under test:
- math: ``\\boxed{}`` (nested braces, fractions, LaTeX), GSM8K ``####`` answers on either side,
  ``<answer>`` tags, thousands separators, units, wrong answers, nothing stated;
- regex, format (tags and patterns), exact; a function term gets the row's columns it names;
- weights add up; a failed term fails the sample (failure value, or NaN and its group out);
- http: a real local server that answers, returns 500s then recovers, sleeps past the timeout,
  returns garbage or the wrong count: scores, retries, failures counted, never a crash;
  requests are batched and the concurrency limit holds.
"""

from __future__ import annotations

import http.server
import json
import math
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from rljob_workers.config import RewardTermConfig, TaskConfig
from rljob_workers.rewards import (
    HttpReward,
    RewardScorer,
    Sample,
    build_reward,
    extract_final_answer,
    math_reward,
)


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("so it is \\boxed{42}.", "42", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
        ("The answer is \\boxed{ 3\\sqrt{2} }", "\\sqrt{18}", 1.0),
        ("\\boxed{1,234}", "1234", 1.0),
        ("She pays $18 in total.\n#### 18", "Janet sells 16 - 3 - 4 = 9 eggs...\n#### 18", 1.0),
        ("#### 17", "#### 18", 0.0),
        ("<answer>7</answer>", "3 + 4 = 7\n#### 7", 1.0),
        ("\\boxed{12 \\text{ apples}}", "12", 1.0),
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
        ("the answer is 42", "42", 0.0),  # nothing boxed, tagged or after ####
        ("\\boxed{}", "0", 0.0),
        ("first \\boxed{3} then \\boxed{5}", "5", 1.0),  # the last one counts
    ],
)
def test_math_reward(response: str, answer: str, reward: float) -> None:
    assert math_reward(response, answer) == reward


def test_final_answer_extraction_prefers_boxed_then_hashes_then_tags() -> None:
    assert extract_final_answer("\\boxed{\\frac{1}{2}} #### 3") == "\\frac{1}{2}"
    assert extract_final_answer("x #### 3\nmore") == "3"
    assert extract_final_answer("<answer> 9 </answer>") == "9"
    assert extract_final_answer("<answer>9") == "9"  # ended inside its tag
    assert extract_final_answer("<answer>") is None
    assert extract_final_answer("nothing") is None


def _terms(*terms: dict[str, Any]) -> TaskConfig:
    return TaskConfig(reward_terms=tuple(RewardTermConfig(**t) for t in terms))


def _score(task: TaskConfig, response: str, answer: str, **extra: Any) -> float:
    return build_reward(task).score_one(Sample(response, answer, extra=extra))


def test_exact_regex_and_format_terms() -> None:
    assert _score(_terms({"type": "exact"}), " 7 ", "7") == 1.0
    assert _score(_terms({"type": "exact"}), "77", "7") == 0.0
    regex = _terms({"type": "regex", "pattern": r"ANSWER:\s*(\d+)"})
    assert _score(regex, "ANSWER: 12", "12") == 1.0
    assert _score(regex, "no answer", "12") == 0.0
    tagged = _terms({"type": "format"})
    assert _score(tagged, "think... <answer>7</answer>", "x") == 1.0
    assert _score(tagged, "<answer></answer>", "x") == 0.0  # empty
    assert _score(tagged, "<answer>1</answer><answer>2</answer>", "x") == 0.0  # two
    custom = _terms({"type": "format", "tag": "final"})
    assert _score(custom, "<final>3</final>", "x") == 1.0
    whole = _terms({"type": "format", "pattern": r"<think>.*</think>\s*\d+"})
    assert _score(whole, "<think>hm</think> 5", "x") == 1.0
    assert _score(whole, "5", "x") == 0.0


def test_weights_add_up() -> None:
    task = _terms({"type": "math", "weight": 1.0}, {"type": "format", "weight": 0.25})
    assert _score(task, "<answer>7</answer>", "#### 7") == 1.25
    assert _score(task, "<answer>8</answer>", "#### 7") == 0.25
    assert _score(task, "7", "#### 7") == 0.0


def length_bonus(response: str, answer: str, difficulty: int, source: str = "x") -> float:
    """A function term naming two of the row's columns (the others are not passed)."""
    return difficulty * 0.5 + (1.0 if source == "gsm8k" else 0.0)


def takes_everything(response: str, answer: str, **row: Any) -> float:
    return float(len(row))


def test_a_function_term_gets_the_row_columns_it_names() -> None:
    named = _terms({"type": "function", "function": f"{__name__}:length_bonus"})
    assert _score(named, "r", "a", difficulty=2, source="gsm8k", other=1) == 2.0
    everything = _terms({"type": "function", "function": f"{__name__}:takes_everything"})
    assert _score(everything, "r", "a", difficulty=2, source="gsm8k", other=1) == 3.0


def test_a_failed_term_fails_the_sample_with_the_failure_value() -> None:
    task = _terms({"type": "function", "function": f"{__name__}:length_bonus"})
    scorer = RewardScorer(build_reward(task), timeout_s=5.0, failure_value=-1.0)
    # the second row lacks the column the function needs: a TypeError, the sample fails
    scores = scorer(["a", "b"], ["x", "y"], [{"difficulty": 1}, {}])
    assert scores == [0.5, -1.0]
    assert scorer.failures == {"timeout": 0, "error": 1}


# --------------------------------------------------------------------------- http


class Verifier(http.server.BaseHTTPRequestHandler):
    """A reward service whose behaviour the test scripts: ``mode`` per request."""

    script: ClassVar[list[str]] = []
    seen: ClassVar[list[int]] = []  # samples per request
    in_flight = 0
    most_in_flight = 0
    lock = threading.Lock()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        samples = body["samples"]
        with Verifier.lock:
            Verifier.seen.append(len(samples))
            Verifier.in_flight += 1
            Verifier.most_in_flight = max(Verifier.most_in_flight, Verifier.in_flight)
            mode = Verifier.script.pop(0) if Verifier.script else "ok"
        try:
            if mode == "500":
                self._send(500, b"overloaded")
            elif mode == "sleep":
                time.sleep(1.5)
                self._send(200, b"{}")
            elif mode == "garbage":
                self._send(200, b"<html>not json</html>")
            elif mode == "short":
                self._send(200, json.dumps({"rewards": [1.0]}).encode())
            elif mode == "nan":
                self._send(200, b'{"rewards": [NaN, 1.0]}')
            else:
                time.sleep(0.05)
                rewards = [1.0 if s["response"] == s["answer"] else 0.0 for s in samples]
                self._send(200, json.dumps({"rewards": rewards}).encode())
        finally:
            with Verifier.lock:
                Verifier.in_flight -= 1

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def verifier() -> Iterator[str]:
    Verifier.script, Verifier.seen = [], []
    Verifier.in_flight = Verifier.most_in_flight = 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Verifier)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/score"
    finally:
        server.shutdown()


def _http_scorer(url: str, **term: Any) -> RewardScorer:
    task = _terms({"type": "http", "url": url, **term})
    return RewardScorer(build_reward(task), timeout_s=30.0)


def test_http_reward_scores_in_batches_within_the_concurrency_limit(verifier: str) -> None:
    scorer = _http_scorer(verifier, batch_size=4, concurrency=2)
    texts = [str(i % 3) for i in range(20)]
    scores = scorer(texts, ["1"] * 20)
    assert scores == [1.0 if t == "1" else 0.0 for t in texts]
    assert Verifier.seen == [4] * 5
    assert Verifier.most_in_flight == 2
    assert scorer.failures == {"timeout": 0, "error": 0}


def test_http_reward_retries_a_500_and_recovers(verifier: str) -> None:
    Verifier.script = ["500", "500"]
    scorer = _http_scorer(verifier, retries=2)
    assert scorer(["a", "b"], ["a", "x"]) == [1.0, 0.0]
    assert scorer.failures["error"] == 0


@pytest.mark.parametrize("mode", ["500", "sleep", "garbage", "short", "nan"])
def test_http_reward_failures_fail_the_samples_and_go_on(verifier: str, mode: str) -> None:
    # a 500 or a timeout is retried (one retry here); an answer that is wrong is not
    Verifier.script = [mode] * (2 if mode in ("500", "sleep") else 1)
    scorer = _http_scorer(verifier, retries=1, timeout_s=0.5)
    scorer.failure_value = 0.0
    scores = scorer(["a", "b"], ["a", "b"])
    assert scores == [0.0, 0.0]
    assert scorer.failures["error"] == 2
    assert not Verifier.script  # retried exactly as said
    # the service is back: the next batch scores
    assert scorer(["a", "b"], ["a", "x"]) == [1.0, 0.0]


def test_http_reward_without_failure_value_leaves_nan(verifier: str) -> None:
    Verifier.script = ["garbage"]
    scorer = _http_scorer(verifier, retries=0)
    scores = scorer(["a"], ["a"])
    assert math.isnan(scores[0])


def test_http_and_local_terms_add_up(verifier: str) -> None:
    task = _terms(
        {"type": "http", "url": verifier, "weight": 2.0}, {"type": "exact", "weight": 0.5}
    )
    scorer = RewardScorer(build_reward(task), timeout_s=30.0)
    assert scorer(["7", "8"], ["7", "7"]) == [2.5, 0.0]


def test_http_reward_sends_the_prompt_answer_and_row(verifier: str) -> None:
    got: list[dict[str, Any]] = []

    class Capture(Verifier):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            got.extend(body["samples"])
            self._send(200, json.dumps({"rewards": [0.5] * len(body["samples"])}).encode())

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Capture)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        term = HttpReward(f"http://127.0.0.1:{server.server_port}/")
        scores = term.score_batch([Sample("r", "a", prompt="p", extra={"tests": ["t"]})])
        assert scores == [0.5]
        assert got == [{"prompt": "p", "response": "r", "answer": "a", "extra": {"tests": ["t"]}}]
    finally:
        server.shutdown()


def test_the_scorer_reports_each_terms_mean_for_the_step_record() -> None:
    """The step records carry ``reward_<term>`` (unweighted means of the samples scored since
    the last record; failed samples left out), so a run shows its format term rising before
    its accuracy. An evaluation's scoring is not counted."""
    task = _terms(
        {"type": "math"},
        {"type": "format", "weight": 0.2},
        {"type": "format", "pattern": r"<answer>.*", "weight": 0.1},
    )
    scorer = RewardScorer(build_reward(task), timeout_s=5.0)
    scorer(["<answer>7</answer>", "<answer>3</answer>"], ["#### 7", "#### 7"])
    scorer(["7", "<answer>7"], ["#### 7", "#### 7"])
    assert scorer.take_terms() == {
        "reward_math": 0.5,
        "reward_format": 0.5,
        "reward_format_2": 0.75,
    }
    assert scorer.take_terms() == {}
    scorer(["<answer>7</answer>"], ["#### 7"], count_terms=False)
    assert scorer.take_terms() == {}
