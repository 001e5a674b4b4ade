"""The end-of-run report of a local run: summary numbers, a table and PNG plots.

Input is the per-step records each worker wrote to its JSONL metrics file
(``rljob_workers.metrics``), keyed by process name (``actor-0``, ``trainer-1``, ...).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "REPORT_WINDOW",
    "render_summary_table",
    "summarize_records",
    "write_plots",
]

REPORT_WINDOW = 5
"""Baseline reward = mean of the first this-many steps; final = mean of the last this-many."""


def _values(records: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    values = []
    for record in records:
        value = record.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            values.append(float(value))
    return values


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _percentile(values: Sequence[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))
    return ordered[index]


def summarize_records(
    records: Sequence[Mapping[str, Any]], *, window: int = REPORT_WINDOW
) -> dict[str, Any]:
    """Headline numbers of one process's run.

    Returns a dict with ``steps``, ``reward_baseline`` (mean of the first ``window`` steps),
    ``reward_final`` (last ``window``), ``reward_best``, ``kl_final``, ``entropy_final``,
    ``policy_lag_ms_median`` / ``_p95`` / ``_max``, ``policy_lag_versions_max``,
    ``tokens_per_s_median``, ``step_time_s_median``, ``train_time_s`` (sum of step times),
    ``policy_version``, ``collapses`` (seen by the collapse watch; None without one) and
    ``best_checkpoint`` / ``best_checkpoint_step`` / ``best_checkpoint_reward`` (the checkpoint
    kept as best); a value is None when no step reported it.
    """
    rewards = _values(records, "reward_mean")
    lags = _values(records, "policy_lag_ms")
    lag_versions = _values(records, "policy_lag_versions")
    step_times = _values(records, "step_time_s")
    tokens = _values(records, "tokens_per_s")
    versions = _values(records, "policy_version")
    steps = _values(records, "step")
    return {
        "steps": int(max(steps)) if steps else 0,
        "policy_version": int(max(versions)) if versions else None,
        "reward_baseline": _mean(rewards[:window]),
        "reward_final": _mean(rewards[-window:]),
        "reward_best": max(rewards) if rewards else None,
        "kl_final": _last(records, "kl"),
        "entropy_final": _last(records, "entropy"),
        "policy_lag_ms_median": statistics.median(lags) if lags else None,
        "policy_lag_ms_p95": _percentile(lags, 0.95),
        "policy_lag_ms_max": max(lags) if lags else None,
        "policy_lag_versions_max": max(lag_versions) if lag_versions else None,
        "tokens_per_s_median": statistics.median(tokens) if tokens else None,
        "step_time_s_median": statistics.median(step_times) if step_times else None,
        "train_time_s": sum(step_times) if step_times else None,
        **_health(records),
    }


def _health(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The collapse count and the best checkpoint, from the last record that has them."""
    watched = [r for r in records if "collapsed" in r]
    last = watched[-1] if watched else {}
    collapse = last.get("collapse") or {}
    return {
        "collapses": int(collapse.get("count", 0)) if watched else None,
        "best_checkpoint": last.get("best_checkpoint"),
        "best_checkpoint_step": last.get("best_step"),
        "best_checkpoint_reward": last.get("best_reward"),
    }


def _last(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = _values(records, key)
    return values[-1] if values else None


TABLE_ROWS: tuple[tuple[str, str, str], ...] = (
    ("steps", "steps", "{:.0f}"),
    ("policy version", "policy_version", "{:.0f}"),
    ("reward (first steps)", "reward_baseline", "{:.3f}"),
    ("reward (last steps)", "reward_final", "{:.3f}"),
    ("reward (best step)", "reward_best", "{:.3f}"),
    ("KL (last step)", "kl_final", "{:.4f}"),
    ("entropy (last step)", "entropy_final", "{:.3f}"),
    ("policy lag median (ms)", "policy_lag_ms_median", "{:.2f}"),
    ("policy lag p95 (ms)", "policy_lag_ms_p95", "{:.2f}"),
    ("policy lag max (ms)", "policy_lag_ms_max", "{:.2f}"),
    ("policy lag max (versions)", "policy_lag_versions_max", "{:.0f}"),
    ("collapses (spec.collapse)", "collapses", "{:.0f}"),
    ("best checkpoint (step)", "best_checkpoint_step", "{:.0f}"),
    ("best checkpoint (reward)", "best_checkpoint_reward", "{:.3f}"),
    ("tokens/s median", "tokens_per_s_median", "{:.0f}"),
    ("step time median (s)", "step_time_s_median", "{:.3f}"),
    ("wall time (s)", "wall_time_s", "{:.1f}"),
)


def render_summary_table(summaries: Mapping[str, Mapping[str, Any]], *, title: str) -> Any:
    """A ``rich`` table: one row per headline number, one column per process."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    for name in summaries:
        table.add_column(name, justify="right")
    for label, key, fmt in TABLE_ROWS:
        cells = [shown(summary.get(key), fmt) for summary in summaries.values()]
        if any(cell != "-" for cell in cells):
            table.add_row(label, *cells)
    return table


def shown(value: Any, fmt: str) -> str:
    """``value`` formatted with ``fmt`` (``"{:.3f}"``), or "-" when it is absent or not a finite
    number (a step skipped by dynamic sampling has no lag, KL or entropy)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return fmt.format(value)
    return "-"


def write_plots(
    records: Mapping[str, Sequence[Mapping[str, Any]]], out_dir: str | Path, *, title: str
) -> list[Path]:
    """Write ``reward.png`` and ``policy_lag.png`` (one line per process) into ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = {
        "reward.png": ("reward_mean", "mean reward"),
        "policy_lag.png": ("policy_lag_ms", "policy lag (ms)"),
    }
    written = []
    for filename, (key, label) in plots.items():
        figure, axes = plt.subplots(figsize=(6.4, 3.6), dpi=100)
        for name, rows in records.items():
            points = [
                (float(r["step"]), float(r[key]))
                for r in rows
                if isinstance(r.get(key), int | float) and isinstance(r.get("step"), int)
            ]
            if points:
                xs, ys = zip(*points, strict=True)
                axes.plot(xs, ys, label=name, marker="." if len(points) < 40 else None)
        axes.set_xlabel("step")
        axes.set_ylabel(label)
        axes.set_title(f"{title}: {label}")
        axes.grid(alpha=0.3)
        if len(records) > 1:
            axes.legend()
        figure.tight_layout()
        path = out / filename
        figure.savefig(path)
        plt.close(figure)
        written.append(path)
    return written


HISTORY_LABELS = {
    "reward_mean": "mean reward",
    "kl": "KL",
    "entropy": "entropy (nats)",
    "policy_lag_ms": "policy lag (ms)",
    "tokens_per_s": "tokens/s",
    "step_time_s": "step time (s)",
    "idle_fraction": "idle fraction",
    "advantage_var": "advantage variance",
    "eval_accuracy": "held-out accuracy (pass@1)",
}


def plot_history(
    steps: Sequence[int],
    series: Mapping[str, Sequence[float | None]],
    path: str | Path,
    *,
    title: str,
) -> Path:
    """One PNG of a job's learning curves (``tracking.History``): a panel per curve, the
    steps on x; a curve with no point says so in its panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(series)
    columns = 4
    rows = max(1, math.ceil(len(keys) / columns))
    figure, grid = plt.subplots(rows, columns, figsize=(4.0 * columns, 3.0 * rows), dpi=100)
    axes_list = list(grid.flat) if hasattr(grid, "flat") else [grid]
    for axes, key in zip(axes_list, keys, strict=False):
        points = [
            (float(s), float(v))
            for s, v in zip(steps, series[key], strict=False)
            if v is not None and math.isfinite(v)
        ]
        label = HISTORY_LABELS.get(key, key)
        if points:
            xs, ys = zip(*points, strict=True)
            axes.plot(xs, ys, marker="." if len(points) < 40 else None)
        else:
            axes.text(0.5, 0.5, "no data", ha="center", va="center", transform=axes.transAxes)
        axes.set_title(label)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
    for axes in axes_list[len(keys) :]:
        axes.set_visible(False)
    figure.suptitle(title)
    figure.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    plt.close(figure)
    return out
