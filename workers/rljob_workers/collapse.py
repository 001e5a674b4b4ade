"""The collapse watch: a policy that learned and then falls apart within a few steps.

Long RL runs can climb to a high reward and lose it in one or two steps (a too-large update that
the clip does not stop, an entropy collapse onto one wrong answer). The watch sees every step's
task reward (and, when set, the policy entropy), smooths each over the last ``smooth_steps``
steps and compares the smoothed value with its best over the last ``window_steps`` steps:

* **collapse**: the smoothed reward is more than ``reward_drop`` (absolute, in reward units)
  below that best, or the smoothed entropy is below ``(1 - entropy_drop_fraction)`` × its best;
* **recovery**: the smoothed reward climbs back to within half of ``reward_drop`` of the peak it
  fell from (an entropy collapse: the entropy back above ``(1 - entropy_drop_fraction / 2)`` ×
  its peak).

The state is latched: a run that collapsed and never recovers stays collapsed after its peak
has left the window. The smoothed reward is also the score the checkpoints are ranked by (the
best checkpoint is kept besides the newest ones). Pure: no I/O, no torch.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from rljob_workers.config import CollapseConfig

__all__ = ["Collapse", "CollapseRule", "CollapseWatch"]


@dataclass(frozen=True)
class CollapseRule:
    """When a fall counts as a collapse (``spec.collapse`` rendered into the worker config)."""

    window_steps: int = 20
    smooth_steps: int = 5
    reward_drop: float | None = 0.3
    entropy_drop_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.window_steps < 1 or self.smooth_steps < 1:
            raise ValueError("collapse: windowSteps and smoothingSteps must be >= 1")
        if self.reward_drop is not None and not self.reward_drop > 0:
            raise ValueError(f"collapse.rewardDrop must be > 0, got {self.reward_drop}")
        fraction = self.entropy_drop_fraction
        if fraction is not None and not 0 < fraction < 1:
            raise ValueError(f"collapse.entropyDropFraction must be in (0, 1), got {fraction}")


@dataclass(frozen=True)
class Collapse:
    """One collapse: which signal fell, at which step, from what peak (and its step) to what."""

    metric: str
    step: int
    peak: float
    peak_step: int
    value: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "step": self.step,
            "peak": self.peak,
            "peak_step": self.peak_step,
            "value": self.value,
        }

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> Collapse:
        return cls(
            metric=str(body["metric"]),
            step=int(body["step"]),
            peak=float(body["peak"]),
            peak_step=int(body["peak_step"]),
            value=float(body["value"]),
        )

    def describe(self) -> str:
        return (
            f"{self.metric} fell from {self.peak:.3f} (step {self.peak_step}) to "
            f"{self.value:.3f} at step {self.step}"
        )


class _Smoothed:
    """A signal's mean over the last ``smooth`` finite values, and its recent bests."""

    def __init__(self, smooth: int, window: int) -> None:
        self.raw: deque[float] = deque(maxlen=smooth)
        self.recent: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, step: int, value: float | None) -> float | None:
        if value is None or not math.isfinite(value):
            return self.value
        self.raw.append(float(value))
        smoothed = sum(self.raw) / len(self.raw)
        self.recent.append((step, smoothed))
        return smoothed

    @property
    def value(self) -> float | None:
        return self.recent[-1][1] if self.recent else None

    def best(self) -> tuple[int, float] | None:
        """The step and value of the window's highest smoothed value (the latest on ties)."""
        return max(self.recent, key=lambda sv: (sv[1], sv[0])) if self.recent else None

    def full(self) -> bool:
        return len(self.raw) == self.raw.maxlen


class CollapseWatch:
    """Feed it each step's reward and entropy; it says when a collapse starts and ends."""

    def __init__(self, rule: CollapseRule) -> None:
        self.rule = rule
        self.reward = _Smoothed(rule.smooth_steps, rule.window_steps)
        self.entropy = _Smoothed(rule.smooth_steps, rule.window_steps)
        self.active: Collapse | None = None
        self.last: Collapse | None = None
        self.count = 0

    @classmethod
    def from_config(cls, config: CollapseConfig) -> CollapseWatch:
        """The watch of ``spec.collapse``; disabled, it still scores (it never fires)."""
        return cls(
            CollapseRule(
                window_steps=config.window_steps,
                smooth_steps=config.smoothing_steps,
                reward_drop=config.reward_drop if config.enabled else None,
                entropy_drop_fraction=config.entropy_drop_fraction if config.enabled else None,
            )
        )

    @property
    def score(self) -> float | None:
        """The smoothed reward: what a checkpoint taken now is ranked by."""
        return self.reward.value

    def observe(
        self, step: int, reward: float | None, entropy: float | None = None
    ) -> tuple[Collapse | None, Collapse | None]:
        """Take one step's signals. Returns ``(started, ended)``: the collapse that begins at
        this step, and the one that ends at it (either may be None)."""
        smoothed_reward = self.reward.add(step, reward)
        smoothed_entropy = self.entropy.add(step, entropy)
        if self.active is not None:
            if self._recovered(self.active, smoothed_reward, smoothed_entropy):
                ended, self.active = self.active, None
                return None, ended
            return None, None
        started = self._fall("reward", self.reward, step) or self._fall(
            "entropy", self.entropy, step
        )
        if started is not None:
            self.active = self.last = started
            self.count += 1
        return started, None

    def observe_record(self, record: dict[str, Any]) -> tuple[Collapse | None, Collapse | None]:
        """``observe`` a step record (``step``, ``reward_mean``, ``entropy``) and add to it
        ``reward_smoothed``, ``collapsed`` (1 while collapsed) and ``collapse`` (``report``)."""
        started, ended = self.observe(
            int(record["step"]), record.get("reward_mean"), record.get("entropy")
        )
        record["reward_smoothed"] = self.score
        record["collapsed"] = 0.0 if self.active is None else 1.0
        record["collapse"] = self.report()
        return started, ended

    def report(self) -> dict[str, Any] | None:
        """The newest collapse with ``active`` and ``count`` (None: none yet)."""
        if self.last is None:
            return None
        return {**self.last.as_dict(), "active": self.active is not None, "count": self.count}

    def _fall(self, metric: str, signal: _Smoothed, step: int) -> Collapse | None:
        rule = self.rule
        now, best = signal.value, signal.best()
        if now is None or best is None or not signal.full():
            return None
        peak_step, peak = best
        if metric == "reward":
            fell = rule.reward_drop is not None and peak - now > rule.reward_drop
        else:
            fraction = rule.entropy_drop_fraction
            fell = fraction is not None and peak > 0 and now < (1 - fraction) * peak
        if not fell:
            return None
        return Collapse(metric=metric, step=step, peak=peak, peak_step=peak_step, value=now)

    def _recovered(self, collapse: Collapse, reward: float | None, entropy: float | None) -> bool:
        rule = self.rule
        if collapse.metric == "reward":
            assert rule.reward_drop is not None
            return reward is not None and collapse.peak - reward <= rule.reward_drop / 2
        assert rule.entropy_drop_fraction is not None
        return entropy is not None and entropy >= (1 - rule.entropy_drop_fraction / 2) * (
            collapse.peak
        )

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state, saved in the checkpoint so a restart keeps the watch."""
        return {
            "reward_raw": list(self.reward.raw),
            "reward_recent": [list(sv) for sv in self.reward.recent],
            "entropy_raw": list(self.entropy.raw),
            "entropy_recent": [list(sv) for sv in self.entropy.recent],
            "active": None if self.active is None else self.active.as_dict(),
            "last": None if self.last is None else self.last.as_dict(),
            "count": self.count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for signal, name in ((self.reward, "reward"), (self.entropy, "entropy")):
            signal.raw.clear()
            signal.raw.extend(float(v) for v in state.get(f"{name}_raw", []))
            signal.recent.clear()
            signal.recent.extend((int(s), float(v)) for s, v in state.get(f"{name}_recent", []))
        active = state.get("active")
        self.active = None if active is None else Collapse.from_dict(active)
        last = state.get("last")
        self.last = None if last is None else Collapse.from_dict(last)
        self.count = int(state.get("count", 0))
