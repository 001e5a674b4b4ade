"""Advantage estimators: token-level GAE (PPO) and group-relative baselines (GRPO, Dr.GRPO).

Shapes: ``B`` sequences, ``T`` response token positions. Group estimators expect the ``B``
samples laid out as contiguous groups: rows ``[0, G)`` answer prompt 0, ``[G, 2G)`` prompt 1, ...
All outputs are detached: advantages are targets, never differentiated through.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rljob_workers.algos.stats import check_same_shape

__all__ = [
    "broadcast_advantages_to_tokens",
    "compute_dr_grpo_advantages",
    "compute_gae_advantages",
    "compute_grpo_advantages",
    "group_has_signal",
]


def compute_gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the valid (masked) tokens of each sequence.

    ``delta_t = r_t + gamma * V_next - V_t`` and ``A_t = delta_t + gamma * lam * A_next``, where
    "next" is the next *valid* token (masked positions are skipped, so right padding and holes
    both work) and ``V_next = A_next = 0`` after the last valid token. The reward is usually
    non-zero only at the last valid token. Returns are ``A_t + V_t`` (the value targets).
    Whitening is left to the caller (``masked_whiten``).

    Args:
        rewards: ``[B, T]`` per-token rewards.
        values: ``[B, T]`` critic values ``V(s_t)``.
        mask: ``[B, T]``, 1 for response tokens, 0 for padding.
        gamma: discount factor in ``[0, 1]``.
        lam: GAE lambda in ``[0, 1]``; ``lam=1`` gives Monte-Carlo returns minus values.

    Returns:
        ``(advantages [B, T], returns [B, T])``, both 0 at padded positions.
    """
    check_same_shape(rewards=rewards, values=values, mask=mask)
    rewards, values = rewards.detach(), values.detach()
    valid = mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    steps: list[Tensor] = []
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        is_valid = valid[:, t] != 0
        next_value = torch.where(is_valid, values[:, t], next_value)
        next_advantage = torch.where(is_valid, advantage, next_advantage)
        steps.append(torch.where(is_valid, advantage, torch.zeros_like(advantage)))
    advantages = torch.stack(steps[::-1], dim=1)
    returns = torch.where(valid != 0, advantages + values, torch.zeros_like(values))
    return advantages, returns


def _grouped(scores: Tensor, group_size: int) -> Tensor:
    """View ``scores [B]`` as ``[B // group_size, group_size]`` after validating the layout."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [B], got shape {list(scores.shape)}")
    if group_size < 2:
        raise ValueError(
            f"group_size must be >= 2 (a group of one has no baseline), got {group_size}"
        )
    if scores.shape[0] % group_size != 0:
        raise ValueError(
            f"batch size {scores.shape[0]} is not a multiple of group_size {group_size}; "
            "groups must be contiguous and complete"
        )
    return scores.detach().reshape(-1, group_size)


def group_has_signal(scores: Tensor, *, group_size: int) -> Tensor:
    """Per sample: whether its group's scores are not all equal.

    Args:
        scores: ``[B]`` sequence scores in contiguous groups of ``group_size``.

    Returns:
        ``[B]`` bool, identical for all members of a group.
    """
    groups = _grouped(scores, group_size)
    spread = groups.amax(dim=1) != groups.amin(dim=1)
    return spread.repeat_interleave(group_size)


def compute_grpo_advantages(scores: Tensor, *, group_size: int, eps: float = 1e-6) -> Tensor:
    """Group-normalised advantages (GRPO): ``(r - mean_group) / (std_group + eps)``.

    ``std`` is the unbiased (Bessel-corrected) sample standard deviation of the group. A group
    whose scores are all equal gets exactly 0 (no learning signal), the same groups that DAPO
    dynamic sampling drops.

    Args:
        scores: ``[B]`` sequence scores in contiguous groups of ``group_size``.
        group_size: samples per prompt, ``>= 2``.
        eps: added to the standard deviation.

    Returns:
        ``[B]``.
    """
    groups = _grouped(scores, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    normalised = (centred / (groups.std(dim=1, keepdim=True) + eps)).reshape(-1)
    has_signal = group_has_signal(scores, group_size=group_size)
    return torch.where(has_signal, normalised, torch.zeros_like(normalised))


def compute_dr_grpo_advantages(scores: Tensor, *, group_size: int) -> Tensor:
    """Dr.GRPO advantages: ``r - mean_group``, without the division by the group std.

    Args:
        scores: ``[B]`` sequence scores in contiguous groups of ``group_size``.
        group_size: samples per prompt, ``>= 2``.

    Returns:
        ``[B]``; exactly 0 for a group whose scores are all equal.
    """
    groups = _grouped(scores, group_size)
    centred = (groups - groups.mean(dim=1, keepdim=True)).reshape(-1)
    has_signal = group_has_signal(scores, group_size=group_size)
    return torch.where(has_signal, centred, torch.zeros_like(centred))


def broadcast_advantages_to_tokens(advantages: Tensor, mask: Tensor) -> Tensor:
    """Give every valid token of a sequence that sequence's advantage.

    Args:
        advantages: ``[B]`` per-sequence advantages.
        mask: ``[B, T]``.

    Returns:
        ``[B, T]``, 0 at padded positions.
    """
    if advantages.dim() != 1 or mask.dim() != 2 or advantages.shape[0] != mask.shape[0]:
        raise ValueError(
            f"expected advantages [B] and mask [B, T], got {list(advantages.shape)} "
            f"and {list(mask.shape)}"
        )
    expanded = advantages.detach().unsqueeze(1).expand(mask.shape)
    return torch.where(mask.to(torch.bool), expanded, torch.zeros_like(expanded))
