"""The disaggregated topology: rollout and trainer processes that run asynchronously.

How the roles interact (one trainer group, any number of rollouts that come and go):

- trainer rank 0 hosts the ``ExperienceServer`` (``endpoints.experience_port``) feeding an
  ``ExperienceBuffer`` and the ``WeightServer`` (``endpoints.weights_port``); every trainer rank
  joins one gloo / NCCL group (``endpoints.rendezvous_port``) and trains its shard of each batch
  under DDP with the configured gradient compression (``trainer_worker``);
- each rollout fetches the newest weights (a rollout that joins late starts from the current
  version), generates groups for its shard of the prompts, scores them and streams them
  at-least-once, tagged with a unique id, the policy version that produced them and their
  creation time (``rollout_worker``). It asks the trainer whether it is too far behind and then
  holds back until newer weights arrive;
- the trainer never waits for a particular rollout: it trains as soon as the buffer holds a
  batch of whole groups, drops what is too stale or too old (counted by reason), corrects for the
  remaining staleness (decoupled PPO or truncated importance sampling, behaviour = the rollout's
  log-probs), bumps the policy version and publishes the weights.

The trainer's own accounting (``staleness.StalenessAccounting``) records, for every trajectory
it trained on, how many versions it was behind, so the staleness bound is checked from the
consumer's side.

Where the parts live (no role imports another role, nor this module): the entry points are
``rollout_worker.run_rollout_process`` and ``trainer_worker.run_trainer_process``; the update is
``learner.Learner`` (shared with the colocated actor); the staleness rule and accounting are in
``staleness``, the live control in ``control``, prompts and scoring in ``tasks``. This module
holds the end-of-run report of a disaggregated local run.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rljob_workers.staleness import percentile

__all__ = [
    "format_disaggregated_summary",
    "summarize_disaggregated",
    "write_disaggregated_plots",
]


def _trainer_rows(
    records: Mapping[str, Sequence[Mapping[str, Any]]],
) -> Sequence[Mapping[str, Any]]:
    return records.get("trainer-0", [])


def summarize_disaggregated(records: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """Headline numbers only a disaggregated run has, from trainer-0's and rollouts' records.

    ``staleness_histogram`` (versions behind -> trained trajectories), ``dropped`` by reason,
    ``duplicates`` (redeliveries the trainer de-duplicated), policy-lag percentiles over every
    lag sample, the share of steps the trainer starved and the rollouts' totals.
    """
    rows = _trainer_rows(records)
    histogram: Counter[int] = Counter()
    lags: list[float] = []
    for row in rows:
        for key, count in (row.get("staleness_histogram") or {}).items():
            histogram[int(key)] += int(count)
        lags += [float(v) for v in row.get("lag_samples_ms") or [] if isinstance(v, int | float)]
    last = rows[-1] if rows else {}
    rollouts = {name: rows for name, rows in records.items() if name.startswith("rollout-")}
    return {
        "staleness_histogram": {str(k): v for k, v in sorted(histogram.items())},
        "max_versions": last.get("max_versions"),
        "dropped": dict(last.get("dropped") or {}),
        "duplicates": last.get("duplicates"),
        "starving_steps": sum(1 for row in rows if row.get("starving")),
        "policy_lag_ms_samples": len(lags),
        "policy_lag_ms_median": statistics.median(lags) if lags else None,
        "policy_lag_ms_p95": percentile(lags, 0.95),
        "rollout_batches": {name: len(rows) for name, rows in rollouts.items()},
        "rollout_acked": {name: rows[-1].get("acked") for name, rows in rollouts.items() if rows},
    }


def format_disaggregated_summary(summary: Mapping[str, Any]) -> str:
    """A few report lines: staleness histogram, drops, de-duplication and policy lag."""

    def ms(value: Any) -> str:
        return f"{value:.0f} ms" if isinstance(value, int | float) else "-"

    histogram = ", ".join(f"{k}: {v}" for k, v in summary["staleness_histogram"].items())
    dropped = ", ".join(f"{k} {v}" for k, v in summary["dropped"].items() if v) or "none"
    return "\n".join(
        [
            f"staleness (versions behind: trained trajectories; bound "
            f"{summary['max_versions']}): {histogram or '-'}",
            f"dropped: {dropped}; duplicates de-duplicated: {summary['duplicates']}; "
            f"trainer starved in {summary['starving_steps']} step(s)",
            f"policy lag over {summary['policy_lag_ms_samples']} sample(s): median "
            f"{ms(summary['policy_lag_ms_median'])}, p95 {ms(summary['policy_lag_ms_p95'])}",
        ]
    )


def write_disaggregated_plots(
    records: Mapping[str, Sequence[Mapping[str, Any]]], out_dir: str | Path, *, title: str
) -> list[Path]:
    """Write ``policy_lag_hist.png`` (lag samples) and ``staleness.png`` (versions behind)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize_disaggregated(records)
    lags = [
        float(v)
        for row in _trainer_rows(records)
        for v in row.get("lag_samples_ms") or []
        if isinstance(v, int | float)
    ]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.6), dpi=100)
    axes[0].hist(lags or [0.0], bins=30, color="tab:blue")
    axes[0].set_xlabel("policy lag (ms): optimizer step -> rollout serves the version")
    axes[0].set_ylabel("samples")
    axes[0].set_title(f"policy lag ({len(lags)} samples)")
    histogram = summary["staleness_histogram"]
    axes[1].bar([int(k) for k in histogram], list(histogram.values()), color="tab:orange")
    axes[1].set_xlabel("versions behind at training time")
    axes[1].set_ylabel("trained trajectories")
    axes[1].set_title(f"staleness (bound {summary['max_versions']})")
    figure.suptitle(title)
    figure.tight_layout()
    path = out / "policy_lag_hist.png"
    figure.savefig(path)
    plt.close(figure)
    return [path]
