"""Critic loss for PPO: squared error with the value update clipped around the old values.

Shapes: ``B`` sequences, ``T`` response token positions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rljob_workers.algos.stats import check_same_shape

__all__ = ["clipped_value_loss"]


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float
) -> Tensor:
    """Pessimistic clipped value loss.

    ``v_clip = old + clamp(v - old, -clip, clip)`` and
    ``loss = 0.5 * max((v - R)^2, (v_clip - R)^2)``; the 0.5 makes the gradient ``v - R``.

    Args:
        values: ``[B, T]`` current critic values (differentiable).
        old_values: ``[B, T]`` critic values when the rollout was scored.
        returns: ``[B, T]`` value targets (e.g. from ``compute_gae_advantages``).
        mask: ``[B, T]``.
        clip: maximum change of a value per update, ``> 0``.

    Returns:
        ``[B, T]`` per-token loss, 0 at padded positions.
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    if clip <= 0.0:
        raise ValueError(f"clip must be > 0, got {clip}")
    old_values, returns = old_values.detach(), returns.detach()
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    loss = 0.5 * torch.maximum((values - returns) ** 2, (clipped_values - returns) ** 2)
    return torch.where(mask.to(torch.bool), loss, torch.zeros_like(loss))
