"""Algorithms by name, as the worker config spells them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from rljob_workers.algos.advantages import (
    compute_dr_grpo_advantages,
    compute_gae_advantages,
    compute_grpo_advantages,
)
from rljob_workers.algos.policy_loss import (
    decoupled_ppo_policy_loss,
    mis_policy_loss,
    ppo_clip_policy_loss,
    tis_policy_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "POLICY_LOSSES",
    "get_advantage_estimator",
    "get_policy_loss",
]

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, float]]]
"""Signatures differ by the log-probs each needs; see each function's docstring."""

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo-clip": ppo_clip_policy_loss,
    "decoupled-ppo": decoupled_ppo_policy_loss,
    "tis": tis_policy_loss,
    "mis": mis_policy_loss,
}

ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Any]] = {
    "gae": compute_gae_advantages,
    "grpo": compute_grpo_advantages,
    "dr-grpo": compute_dr_grpo_advantages,
}


def _lookup(table: dict[str, Any], kind: str, name: str) -> Any:
    if name not in table:
        valid = ", ".join(sorted(table))
        raise ValueError(f"unknown {kind} {name!r}; valid names: {valid}")
    return table[name]


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name``; ``ValueError`` listing valid names otherwise."""
    loss: PolicyLossFn = _lookup(POLICY_LOSSES, "policy loss", name)
    return loss


def get_advantage_estimator(name: str) -> Callable[..., Any]:
    """The advantage estimator registered as ``name``; ``ValueError`` listing valid names."""
    estimator: Callable[..., Any] = _lookup(ADVANTAGE_ESTIMATORS, "advantage estimator", name)
    return estimator
