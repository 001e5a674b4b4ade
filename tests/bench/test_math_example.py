"""bench/math_example.py: the summary of one seed's run from its step records."""

from __future__ import annotations

from bench.math_example import _half_way, summarise


def _records(steps: int) -> list[dict[str, float]]:
    out = []
    for step in range(1, steps + 1):
        record = {
            "step": step,
            "reward_format": min(1.0, step / 20),  # learned by step 20
            "reward_math": min(0.5, step / 200),  # rises later and slower
        }
        if step % 25 == 0:
            record |= {"eval_step": step, "eval_accuracy": step / 300}
        out.append(record)
    return out


def test_the_summary_shows_format_rising_before_accuracy() -> None:
    run = summarise(3, _records(150), rc=0, wall_s=12.0)
    assert run["ok"] and run["steps"] == 150
    assert run["format_first"] < 0.6 and run["format_last"] == 1.0
    assert run["math_last"] > run["math_first"]
    assert run["format_half_step"] < run["math_half_step"]
    assert [s for s, _ in run["eval"]] == [25, 50, 75, 100, 125, 150]


def test_half_way_needs_enough_points() -> None:
    assert _half_way([(1, 1.0)]) is None
    flat = [(s, 0.0) for s in range(1, 40)]
    assert _half_way(flat) == 1  # 0 >= 0 / 2 at once
