"""The collapse watch (``rljob_workers.collapse``): aspects under test

- a reward that climbs and holds never counts as a collapse, nor does noise smaller than the
  threshold;
- a fall of the smoothed reward by more than rewardDrop below its window best is one collapse,
  at the step it is seen, naming the peak and its step; it stays active (latched) after the peak
  leaves the window, and ends when the reward comes back within rewardDrop / 2 of the peak;
- an entropy collapse (below (1 - fraction) x its best) fires only when entropyDropFraction is
  set; non-finite values are skipped;
- disabled, the watch never fires but still scores (the smoothed reward ranks checkpoints);
- its state survives a checkpoint round trip (a restarted trainer keeps a collapse it saw);
- the rule refuses nonsense (window or smoothing < 1, a drop <= 0, a fraction outside (0, 1)).
"""

from __future__ import annotations

import json
import math

import pytest

from rljob_workers.collapse import CollapseRule, CollapseWatch
from rljob_workers.config import CollapseConfig


def feed(watch: CollapseWatch, rewards: list[float], start: int = 1) -> list[tuple[int, str]]:
    """Feed rewards as steps start, start+1, ...; return (step, 'start'|'end') transitions."""
    seen = []
    for i, reward in enumerate(rewards):
        started, ended = watch.observe(start + i, reward)
        if started is not None:
            seen.append((start + i, "start"))
        if ended is not None:
            seen.append((start + i, "end"))
    return seen


def test_a_reward_that_climbs_and_holds_is_no_collapse() -> None:
    watch = CollapseWatch(CollapseRule(window_steps=20, smooth_steps=5, reward_drop=0.3))
    climb = [min(1.0, 0.01 * i) for i in range(150)]
    noisy = [r + (0.1 if i % 2 else -0.1) for i, r in enumerate(climb)]
    assert feed(watch, noisy) == []
    assert watch.active is None and watch.count == 0 and watch.report() is None
    assert watch.score == pytest.approx(sum(noisy[-5:]) / 5)


def test_a_sharp_fall_is_one_collapse_latched_until_the_reward_recovers() -> None:
    watch = CollapseWatch(CollapseRule(window_steps=10, smooth_steps=3, reward_drop=0.3))
    seen = feed(watch, [0.9] * 20 + [0.1] * 30)
    # smoothed after the fall: (0.9 + 0.9 + 0.1) / 3 = 0.633 (drop 0.267), then 0.367 (drop
    # 0.533 > 0.3) at step 22; the peak (0.9) is the last all-0.9 step, 20
    assert seen == [(22, "start")]
    report = watch.report()
    assert report is not None and report["active"] is True
    assert report["metric"] == "reward" and report["peak_step"] == 20
    assert report["peak"] == pytest.approx(0.9) and report["value"] == pytest.approx(1.1 / 3)
    # 28 steps at 0.1 since: the peak left the 10-step window long ago, still collapsed
    assert watch.active is not None
    # back at 0.8: within 0.15 of 0.9 once the smoothed value reaches 0.75, i.e. all three 0.8
    assert feed(watch, [0.8] * 10, start=51) == [(53, "end")]
    assert watch.count == 1 and watch.active is None
    assert watch.report() == {**report, "active": False, "count": 1}


def test_a_fall_within_the_threshold_is_no_collapse() -> None:
    watch = CollapseWatch(CollapseRule(window_steps=10, smooth_steps=1, reward_drop=0.3))
    assert feed(watch, [0.9] * 10 + [0.65] * 10) == []


def test_a_slow_decline_outside_the_window_is_no_collapse() -> None:
    watch = CollapseWatch(CollapseRule(window_steps=10, smooth_steps=1, reward_drop=0.3))
    assert feed(watch, [1.0 - 0.02 * i for i in range(50)]) == []  # 0.18 per window


def test_entropy_collapse_only_when_watched() -> None:
    entropies = [2.0] * 10 + [0.5] * 10
    off = CollapseWatch(CollapseRule(window_steps=10, smooth_steps=2, reward_drop=0.3))
    on = CollapseWatch(
        CollapseRule(window_steps=10, smooth_steps=2, reward_drop=0.3, entropy_drop_fraction=0.5)
    )
    fired = []
    for i, h in enumerate(entropies, start=1):
        assert off.observe(i, 0.5, h) == (None, None)
        started, _ = on.observe(i, 0.5, h)
        if started is not None:
            fired.append(started)
    (collapse,) = fired
    assert collapse.metric == "entropy" and collapse.step == 12  # (0.5 + 0.5) / 2 < 1.0
    assert collapse.peak == pytest.approx(2.0)


def test_non_finite_values_are_skipped() -> None:
    watch = CollapseWatch(CollapseRule(window_steps=5, smooth_steps=2, reward_drop=0.3))
    assert feed(watch, [0.8, math.nan, 0.8, math.inf, 0.8]) == []
    assert watch.score == pytest.approx(0.8)


def test_disabled_watch_scores_but_never_fires() -> None:
    watch = CollapseWatch.from_config(CollapseConfig(enabled=False, smoothing_steps=2))
    assert feed(watch, [1.0] * 10 + [0.0] * 10) == []
    assert watch.score == 0.0


def test_observe_record_adds_the_fields_the_reporter_sends() -> None:
    watch = CollapseWatch(CollapseRule(window_steps=4, smooth_steps=1, reward_drop=0.3))
    records = [{"step": i + 1, "reward_mean": r} for i, r in enumerate([0.9, 0.9, 0.9, 0.2])]
    for record in records:
        watch.observe_record(record)
    assert [r["collapsed"] for r in records] == [0.0, 0.0, 0.0, 1.0]
    assert records[2]["collapse"] is None
    assert records[3]["collapse"]["active"] is True and records[3]["collapse"]["step"] == 4
    assert records[3]["reward_smoothed"] == pytest.approx(0.2)


def test_state_survives_a_checkpoint_round_trip() -> None:
    rule = CollapseRule(window_steps=10, smooth_steps=3, reward_drop=0.3)
    watch = CollapseWatch(rule)
    feed(watch, [0.9] * 12 + [0.1] * 3)
    assert watch.active is not None
    restored = CollapseWatch(rule)
    restored.load_state_dict(json.loads(json.dumps(watch.state_dict())))
    assert restored.report() == watch.report() and restored.score == watch.score
    # continuing both gives the same transitions: the restored one ends the same collapse
    assert feed(restored, [0.9] * 5, start=16) == feed(watch, [0.9] * 5, start=16)
    assert restored.active is None and restored.count == 1


@pytest.mark.parametrize(
    "rule",
    [
        {"window_steps": 0},
        {"smooth_steps": 0},
        {"reward_drop": 0.0},
        {"reward_drop": -1.0},
        {"entropy_drop_fraction": 1.0},
        {"entropy_drop_fraction": 0.0},
    ],
)
def test_the_rule_refuses_nonsense(rule: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="collapse"):
        CollapseRule(**rule)  # type: ignore[arg-type]


def test_the_run_summary_counts_collapses_and_names_the_best_checkpoint() -> None:
    from rljob_workers.report import summarize_records

    watch = CollapseWatch(CollapseRule(window_steps=4, smooth_steps=1, reward_drop=0.3))
    records = []
    for step, reward in enumerate([0.9, 0.9, 0.1, 0.9, 0.9, 0.1], start=1):
        record = {"step": step, "reward_mean": reward}
        watch.observe_record(record)
        record |= {"best_checkpoint": "/ck/step-00000002", "best_step": 2, "best_reward": 0.9}
        records.append(record)
    summary = summarize_records(records)
    assert summary["collapses"] == 2
    assert (summary["best_checkpoint_step"], summary["best_checkpoint_reward"]) == (2, 0.9)
    assert summarize_records([{"step": 1, "reward_mean": 0.5}])["collapses"] is None
