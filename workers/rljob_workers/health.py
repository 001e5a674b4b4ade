"""A learner's run health: the collapse watch over its steps and the best checkpoint it keeps.

One object serves both learners (the colocated actor and the disaggregated trainer): each step
record goes through ``observe`` (smoothed reward, collapse state, best checkpoint added to it;
a collapse or a recovery logged), each checkpoint is written with ``checkpoint_state`` (ranked by
the smoothed reward, the watch's state inside, so a restarted run keeps it) and read back with
``resumed``.
"""

from __future__ import annotations

import logging
from typing import Any

from rljob_workers.checkpoint import BestCheckpoint, CheckpointState, best_checkpoint
from rljob_workers.collapse import CollapseWatch
from rljob_workers.config import CollapseReport, MismatchReport, WorkerConfig
from rljob_workers.metrics import finite_or_none

log = logging.getLogger(__name__)

WATCH_KEY = "collapse_watch"
"""Where the watch's state lives in a checkpoint's ``extra``."""


class RunHealth:
    """The collapse watch and the best checkpoint of one learner process."""

    def __init__(self, config: WorkerConfig, *, speaks: bool = True) -> None:
        self.watch = CollapseWatch.from_config(config.collapse)
        self.directory = config.checkpoint.dir
        self.keep_best = config.checkpoint.keep_best
        self.speaks = speaks
        self.best: BestCheckpoint | None = None
        self.mismatch: MismatchReport | None = None
        self.saved()

    def observe(self, record: dict[str, Any]) -> None:
        """Add ``reward_smoothed``, ``collapsed``, ``collapse``, ``best_checkpoint``,
        ``best_step``, ``best_reward`` and ``logprob_mismatch`` (the newest one measured, with
        its step) to a step record; log a collapse that starts or ends at it."""
        self._observe_mismatch(record)
        started, ended = self.watch.observe_record(record)
        if self.speaks and started is not None:
            log.warning(
                "policy collapse: %s (kept: best checkpoint %s)",
                started.describe(),
                self.best.path if self.best is not None else "none yet",
            )
        if self.speaks and ended is not None:
            log.info("recovered from the collapse at step %d (%s)", ended.step, ended.metric)
        self.describe_best(record)

    def _observe_mismatch(self, record: dict[str, Any]) -> None:
        values = [
            finite_or_none(record.get(f"logprob_mismatch_{key}"))
            for key in ("mean", "max", "kl", "tokens")
        ]
        if all(value is not None for value in values) and isinstance(record.get("step"), int):
            mean, largest, kl, tokens = (float(v) for v in values if v is not None)
            self.mismatch = MismatchReport(
                step=record["step"], mean=mean, max=largest, kl=kl, tokens=int(tokens)
            )
        record["logprob_mismatch"] = None if self.mismatch is None else self.mismatch.model_dump()

    def describe_best(self, record: dict[str, Any]) -> None:
        """Put the best checkpoint so far into a record."""
        record["best_checkpoint"] = None if self.best is None else str(self.best.path)
        record["best_step"] = None if self.best is None else self.best.step
        record["best_reward"] = None if self.best is None else self.best.score

    def checkpoint_state(
        self, *, step: int, policy_version: int, extra: dict[str, Any], **rest: Any
    ) -> CheckpointState:
        """A checkpoint's state, scored by the smoothed reward, with the watch inside."""
        return CheckpointState(
            step=step,
            policy_version=policy_version,
            extra={**extra, WATCH_KEY: self.watch.state_dict()},
            score=self.watch.score,
            **rest,
        )

    def saved(self) -> None:
        """After a checkpoint was written (and at start): read ``best.json`` again."""
        self.best = best_checkpoint(self.directory) if self.keep_best else None

    def resumed(self, state: CheckpointState) -> None:
        """Continue the watch of the checkpoint a run resumed from."""
        watched = state.extra.get(WATCH_KEY)
        if isinstance(watched, dict):
            self.watch.load_state_dict(watched)


def health_fields(record: dict[str, Any]) -> dict[str, Any]:
    """The ``Progress`` fields of a step record that went through ``RunHealth.observe``."""
    collapse = record.get("collapse")
    best = record.get("best_reward")
    mismatch = record.get("logprob_mismatch")
    return {
        "collapse": None if collapse is None else CollapseReport.model_validate(collapse),
        "best_checkpoint": record.get("best_checkpoint"),
        "best_reward": best if isinstance(best, (int, float)) else None,
        "logprob_mismatch": None
        if not isinstance(mismatch, dict)
        else MismatchReport.model_validate(mismatch),
    }
