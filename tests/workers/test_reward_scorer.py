"""Rewards scored off the generation thread, with a time limit and failures counted (issue 29
item 4's reward timeouts; issue 28 builds its reward kinds on it).

Aspects under test:
- a batch is scored concurrently, in order, by the user's function;
- a call past ``timeout_s`` scores NaN and counts ``timeout``, and does not hold the batch
  beyond its limit; the next batch has its full capacity back;
- a call that raises or returns a non-number scores NaN and counts ``error``; the worker goes on;
- ``score_groups`` leaves out a group with a failed sample, as it does any non-finite reward.
"""

from __future__ import annotations

import math
import threading
import time

import pytest

from rljob_workers.config import OverlongConfig
from rljob_workers.tasks import RewardScorer, exact_match_reward, score_groups


def test_scorer_scores_a_batch_in_order_and_concurrently():
    running = 0
    peak = 0
    lock = threading.Lock()

    def slow_exact(text: str, answer: str) -> float:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.05)
        with lock:
            running -= 1
        return 1.0 if text == answer else 0.0

    scorer = RewardScorer(slow_exact, timeout_s=5.0, workers=4)
    texts = [str(i % 3) for i in range(12)]
    assert scorer(texts, ["1"] * 12) == [1.0 if t == "1" else 0.0 for t in texts]
    assert peak > 1
    assert scorer.failures == {"timeout": 0, "error": 0}


def test_scorer_gives_up_on_a_hung_call_within_its_limit_and_keeps_capacity():
    release = threading.Event()

    def hangs_on_loop(text: str, answer: str) -> float:
        if text == "loop":
            release.wait(30)  # a verifier stuck in an infinite loop
        return 1.0

    scorer = RewardScorer(hangs_on_loop, timeout_s=0.3, workers=2)
    try:
        started = time.monotonic()
        scores = scorer(["loop", "a", "loop", "b", "c"], ["x"] * 5)
        took = time.monotonic() - started
        assert math.isnan(scores[0]) and math.isnan(scores[2])
        assert scores[1] == scores[3] == scores[4] == 1.0
        assert scorer.failures["timeout"] == 2
        assert took < 3.0  # the limit per call, not the hung call's 30 s
        # the next batch has its workers back (the hung threads were replaced)
        assert scorer(["a", "b"], ["x", "x"]) == [1.0, 1.0]
    finally:
        release.set()


@pytest.mark.parametrize("bad", [ZeroDivisionError("boom"), "not a number"])
def test_scorer_counts_an_error_and_goes_on(bad):
    def flaky(text: str, answer: str):
        if text == "bad":
            if isinstance(bad, Exception):
                raise bad
            return bad
        return exact_match_reward(text, answer)

    scorer = RewardScorer(flaky, timeout_s=5.0)
    scores = scorer(["bad", "7", "3"], ["7", "7", "7"])
    assert math.isnan(scores[0])
    assert scores[1] == 1.0
    assert scorer.failures == {"timeout": 0, "error": 1}


def test_a_failed_reward_leaves_its_group_out_of_the_step():
    def fails_on_x(text: str, answer: str) -> float:
        if text == "x":
            raise RuntimeError("verifier crashed")
        return 1.0

    scorer = RewardScorer(fails_on_x, timeout_s=5.0)
    scored = score_groups(
        scorer, ["a", "x", "b", "c"], ["a"] * 4, [1] * 4, n=2, overlong=OverlongConfig()
    )
    assert scored.valid == [False, True]
    assert scored.invalid_samples == 2
