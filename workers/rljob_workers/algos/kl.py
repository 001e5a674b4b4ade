"""Per-token estimators of KL(current || reference) from samples of the current policy.

Schulman's estimators, with ``log_r = ref_logp - logp`` evaluated at the sampled tokens:
k1 = ``-log_r`` (unbiased, can be negative), k2 = ``log_r^2 / 2`` (biased, low variance),
k3 = ``exp(log_r) - 1 - log_r`` (unbiased, always >= 0). Shapes: any, typically ``[B, T]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["KL_ESTIMATORS", "kl_k1", "kl_k2", "kl_k3"]

LOG_RATIO_LIMIT = 20.0


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = ``logp - ref_logp``; ``[B, T]`` -> ``[B, T]``."""
    return logp - ref_logp


def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = ``(logp - ref_logp)^2 / 2``; ``[B, T]`` -> ``[B, T]``."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = ``exp(ref_logp - logp) - (ref_logp - logp) - 1``; ``[B, T]`` -> ``[B, T]``.

    The log-ratio is clamped to ``±LOG_RATIO_LIMIT`` before ``exp`` to avoid overflow.
    """
    log_ratio = torch.clamp(ref_logp - logp, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(log_ratio) - log_ratio - 1.0


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}
