"""Per-token estimators of KL(current || reference) from samples of the current policy.

Schulman's estimators, with ``log_r = ref_logp - logp`` evaluated at the sampled tokens:
k1 = ``-log_r`` (unbiased, can be negative), k2 = ``log_r^2 / 2`` (biased, low variance),
k3 = ``exp(log_r) - 1 - log_r`` (unbiased, always >= 0). Shapes: any, typically ``[B, T]``.

As a loss term (differentiated through ``logp``, on-policy samples) only k2 and k3 have a useful
expected gradient: k2's is that of KL(current || reference), k3's that of KL(reference ||
current); k1's is zero in expectation (Tang & Munos, 2025), so k1 belongs in the reward as a
detached penalty (``kl_reward_penalty``), where the policy gradient carries it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "KL_ESTIMATORS",
    "KL_VALUE_LIMIT",
    "LOSS_KL_ESTIMATORS",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_reward_penalty",
]

LOG_RATIO_LIMIT = 20.0
KL_VALUE_LIMIT = 10.0
"""k3 per token is clamped to ``[0, KL_VALUE_LIMIT]`` (as verl does): one token far from the
reference would otherwise add up to ``exp(LOG_RATIO_LIMIT)`` ~ 5e8 to the loss."""


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = ``logp - ref_logp``; ``[B, T]`` -> ``[B, T]``."""
    return logp - ref_logp


def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = ``(logp - ref_logp)^2 / 2``; ``[B, T]`` -> ``[B, T]``."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = ``exp(ref_logp - logp) - (ref_logp - logp) - 1``; ``[B, T]`` -> ``[B, T]``.

    The log-ratio is clamped to ``±LOG_RATIO_LIMIT`` before ``exp`` to avoid overflow and the
    value to ``KL_VALUE_LIMIT`` (no gradient beyond it).
    """
    log_ratio = torch.clamp(ref_logp - logp, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, max=KL_VALUE_LIMIT)


def kl_reward_penalty(old_logp: Tensor, ref_logp: Tensor, mask: Tensor, *, coef: float) -> Tensor:
    """Per-token reward penalty ``coef * k1`` for KL in the reward; ``[B, T]`` -> ``[B, T]``.

    Detached (it is a reward, never differentiated), 0 at padded positions. Computed with the
    log-probs of the policy that sampled the tokens, so its expectation is ``coef * KL``.
    """
    penalty = coef * (old_logp.detach() - ref_logp.detach())
    return torch.where(mask.to(torch.bool), penalty, torch.zeros_like(penalty))


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}
LOSS_KL_ESTIMATORS = ("k2", "k3")
"""The estimators whose gradient is right as a loss term; k1 goes into the reward."""
